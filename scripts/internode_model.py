"""A model of internode dispatch time at EP16..EP256, printed as the table of docs/INTERNODE_MODEL.md.

Rows come from simulated routing (DeepSeek-V3's: top-k experts inside the top node groups by each
node's best score), counted with deepep_cupy.internode_reference; times from byte counts over
rates: the NIC (``--nic-gbps``), the NVLink stage at the intranode dispatch's measured
cross-GPU rate (README, "Performance": 264 GB/s on 2 x H200), the HBM passes of packing and
unpacking, and a fixed host cost per call. CPU only.

    python scripts/internode_model.py [--nic-gbps 50] [--tokens 4096] [--sample-tokens 256]
"""

import argparse

import numpy as np

from deepep_cupy import internode_reference as iref

ROW_BYTES = 7168 * 2                  # BF16 hidden 7168
RECORD_BYTES = ROW_BYTES + 8 * 8 + 4 * 8  # + top-8 ids and weights (a 16-byte multiple already)


def grouped_routing(rng, num_tokens, num_experts, num_topk, num_nodes, num_groups):
    scores = rng.random((num_tokens, num_experts)) + 1.0
    best = scores.reshape(num_tokens, num_nodes, -1).max(axis=2)
    groups = np.argsort(-best, axis=1)[:, :num_groups]
    allowed = np.zeros((num_tokens, num_nodes), dtype=bool)
    np.put_along_axis(allowed, groups, True, axis=1)
    masked = np.where(np.repeat(allowed, num_experts // num_nodes, axis=1), scores, -np.inf)
    return np.argsort(-masked, axis=1)[:, :num_topk].astype(np.int64)


def per_token_rows(num_ranks, ranks_per_node, num_experts, num_topk, num_groups, tokens, seed=0):
    """Mean rows per token: to other nodes (this design), to all its nodes (DeepEP's RDMA count),
    flat to ranks of other nodes, per (token, expert) to other nodes, and NVLink copies at the
    destination nodes (local ranks taking the token, the forwarding rank excluded)."""
    rng = np.random.default_rng(seed)
    N, L = num_ranks // ranks_per_node, ranks_per_node
    epr = num_experts // num_ranks
    topks = [grouped_routing(rng, tokens, num_experts, num_topk, N, min(num_groups, N)) for _ in range(num_ranks)]
    t = iref.traffic(topks, num_experts, num_ranks, L)
    all_nodes = nvlink = per_expert = 0
    for r, topk in enumerate(topks):
        ranks = topk // epr
        nodes = ranks // L
        all_nodes += sum(len(set(row)) for row in nodes)
        per_expert += int((nodes != r // L).sum())
        for row in ranks:
            for n in set(row // L):
                local = {int(d) % L for d in row if d // L == n}
                nvlink += len(local - {r % L})
    total = num_ranks * tokens
    return dict(hier=t["hierarchical"] / total, all_nodes=all_nodes / total, flat=t["flat"] / total,
                per_expert=per_expert / total, nvlink=nvlink / total)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nic-gbps", type=float, default=50.0, help="per GPU (400 Gb/s = 50 GB/s)")
    p.add_argument("--nvlink-gbps", type=float, default=264.0, help="intranode cross-GPU rate, measured")
    p.add_argument("--hbm-gbps", type=float, default=2500.0, help="CuPy gathers and copies, effective")
    p.add_argument("--host-us", type=float, default=300.0, help="host per call: syncs, count exchange, Python")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--sample-tokens", type=int, default=256, help="tokens per rank simulated")
    args = p.parse_args()
    print("| EP | nodes | rows/token to other nodes (this) | flat per rank | per expert | NVLink copies | "
          "net ms | NVLink ms | pack ms | total ms | DeepEP-metric GB/s | overlapped GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ep_size in (16, 32, 64, 128, 256):
        rows = per_token_rows(ep_size, 8, 256, 8, 4, args.sample_tokens)
        T = args.tokens
        t_net = rows["hier"] * T * RECORD_BYTES / (args.nic_gbps * 1e9)
        t_nvl = rows["nvlink"] * T * ROW_BYTES / (args.nvlink_gbps * 1e9)
        # pack: gather + write records; unpack: concatenate + field copies: about 4 passes of the records
        t_pack = 4 * rows["all_nodes"] * T * RECORD_BYTES / (args.hbm_gbps * 1e9)
        t_host = args.host_us * 1e-6
        total = t_net + t_nvl + t_pack + t_host
        overlapped = max(t_net, t_nvl) + t_host
        deepep_bytes = rows["all_nodes"] * T * ROW_BYTES
        print(f"| {ep_size} | {ep_size // 8} | {rows['hier']:.2f} | {rows['flat']:.2f} | {rows['per_expert']:.2f} | "
              f"{rows['nvlink']:.2f} | {t_net * 1e3:.2f} | {t_nvl * 1e3:.2f} | {t_pack * 1e3:.2f} | "
              f"{total * 1e3:.2f} | {deepep_bytes / total / 1e9:.0f} | {deepep_bytes / overlapped / 1e9:.0f} |")


if __name__ == "__main__":
    main()
