"""The scale model's decode step across nodes (issue 48): 128 tokens a rank, EP16 to EP256, on paper.

CPU only (Python + NumPy), like :mod:`deepep_cupy.bench.scale_model`, whose workload, cluster,
routing, pair counts, rates and NCCL transfer cost it reuses. It counts the bytes one rank moves
per decode call in two designs, and models their time from a NIC's rate and latencies::

    python -m deepep_cupy.bench.scale_model --decode                   # 50 GB/s NIC, 8 and 4 GPUs a node
    python -m deepep_cupy.bench.scale_model --decode --nic-gbps 25 100 --nccl-latency-us 10

(a) **This library's planned design (issue 48).** Dispatch: a pack kernel casts the tokens to FP8
and writes, for every other node, a fixed-size block of ``num_max_dispatch_tokens_per_rank`` slots
with its count in the block (a token with experts on a node fills one slot there: dedup per node,
as the normal path); one grouped ``ncclSend``/``ncclRecv`` of those fixed sizes over the rail (the
rank with the same local index on every node), which a CUDA graph captures; then the intranode
NVLink dispatch from the rail receiver to the ranks owning the experts (the own node's tokens take
that stage straight from ``x``). Combine: each owner's rows back over NVLink to the rail receiver,
reduced there to one weighted partial row per (token, node); the fixed-size blocks back over the
rail; the nodes' partials summed on the token's rank. The stages run one after the other.

(b) **DeepEP's low-latency kernels.** One message per (token, selected expert), GPU-initiated RDMA
(IBGDA) straight to the expert's rank: no dedup, no forwarding. Its receive buffer has a region per
local expert, and its test counts ``hidden + hidden / 128 x 4 + 16`` bytes per selection (BF16
``hidden x 2`` in the combine); the published GB/s are those bytes over the time. Messages to the
ranks of the own node go over NVLink (``allow_nvlink_for_low_latency_mode``, on by default: the
published EP8 figure, 98 GB/s of such bytes, is above what a 50 GB/s NIC carries).

Per rank and in expectation, as the scale model; a model, not a measurement: docs/SCALE_MODEL.md,
"Decode across nodes", gives the defaults and why.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from . import scale_model as sm
from .scale_model import Cluster, OpTime, Pairs, Rates, Workload

#: DeepSeek-V3/R1's decode batch in DeepEP's published low-latency table: tokens per rank.
DECODE_TOKENS = 128
#: The decode workload of DeepEP's published figures (the scale model's otherwise).
DECODE_WORKLOAD = Workload(num_tokens=DECODE_TOKENS)
#: DeepEP V1's published low-latency figures (docs/legacy.md of deepseek-ai/DeepEP, "Low-latency
#: kernels with pure RDMA"): H800, one CX7 400 Gb/s NIC per GPU, 128 tokens, hidden 7168, top-8 of
#: 256 experts, FP8 dispatch / BF16 combine; us per call, (dispatch, combine), 8 GPUs a node.
DEEPEP_LL_PUBLISHED: Dict[int, Tuple[float, float]] = {
    8: (77.0, 114.0), 16: (118.0, 195.0), 32: (155.0, 273.0), 64: (173.0, 314.0), 128: (192.0, 369.0),
    256: (194.0, 360.0)}
#: Other published decode figures at EP16, same workload (as issue 48 quotes them): us (dispatch, combine).
OTHERS_PUBLISHED_EP16 = (("pplx-garden", 110.0, 186.0), ("UCCL-EP on EFA", 226.0, 293.0))
#: What travels before a DeepEP low-latency dispatch message's row (an int4: source index and more).
DEEPEP_LL_HEADER_BYTES = 16
#: A per-node block's header in design (a): its count of filled slots, padded to 16 bytes.
BLOCK_HEADER_BYTES = 16
#: The NIC efficiency of the decode tables: DeepEP's published low-latency figures imply 0.84 of a
#: 50 GB/s NIC (:func:`fit_deepep_low_latency`); both designs get it (the same NIC, the same bytes).
DECODE_NIC_EFFICIENCY = 0.84
#: DeepEP's low-latency call, the bytes aside (launch, the last message's flight, the count flags,
#: the receive's copy): the intercept of the same fit, rounded.
DEEPEP_LL_FIXED_US = 20.0


# ------------------------------------------------------------------------------------------------
# Rows: expected, and counted on a sampled routing
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRows:
    """Rows (or messages) one rank moves per call, by where they go.

    ``network``: (token, other node) pairs: the slots design (a) fills over the rail.
    ``own_node``: (token, own node) pairs (design (a)'s NVLink stage reads them from ``x``).
    ``nvlink``: (token, rank) pairs whose rank has another local index than the source: the rows
    design (a)'s NVLink stage pushes from the rail receiver (or from ``x``) to another GPU.
    ``remote_rank``: (token, rank on another node) pairs: one message per (token, rank).
    ``remote_expert``: (token, expert on another node) selections: DeepEP's RDMA messages.
    ``local_expert``: (token, expert on another rank of the own node): DeepEP's NVLink messages.
    """

    network: float
    own_node: float
    nvlink: float
    remote_rank: float
    remote_expert: float
    local_expert: float


def expected_rows(workload: Workload, cluster: Cluster, pairs: Pairs) -> DecodeRows:
    """Rows per rank from the expected pairs per token (routing symmetric over nodes and ranks)."""
    t, k = workload.num_tokens, workload.num_topk
    g, r = cluster.gpus_per_node, cluster.num_ranks
    flow = sm.traffic(workload, cluster, pairs)
    return DecodeRows(network=flow.network_rows, own_node=flow.own_node_rows, nvlink=flow.nvlink_rows,
                      remote_rank=flow.flat_network_rows, remote_expert=t * k * (r - g) / r,
                      local_expert=t * k * (g - 1) / r)


def monte_carlo_rows(topk_idx: np.ndarray, workload: Workload, cluster: Cluster) -> DecodeRows:
    """The same rows counted on a sampled routing: token ``i`` belongs to rank ``i % num_ranks``.

    Means per token times ``workload.num_tokens``; ids of -1 are ignored.
    """
    topk = np.asarray(topk_idx, dtype=np.int64)
    g, r = cluster.gpus_per_node, cluster.num_ranks
    source = np.arange(topk.shape[0]) % r
    valid = topk >= 0
    dest = np.where(valid, topk // (workload.num_experts // r), r)
    hit = np.zeros((topk.shape[0], r + 1), dtype=bool)
    np.put_along_axis(hit, dest, True, axis=1)
    hit = hit[:, :r]
    node_hit = hit.reshape(topk.shape[0], cluster.num_nodes, g).sum(axis=2) > 0
    rank_node, rank_local = np.arange(r) // g, np.arange(r) % g
    same_node = rank_node[None, :] == (source // g)[:, None]
    own = node_hit[np.arange(topk.shape[0]), source // g]
    dest_same_node = valid & (np.minimum(dest, r - 1) // g == (source // g)[:, None])
    per_token = {
        "network": node_hit.sum(axis=1) - own,
        "own_node": own,
        "nvlink": (hit & (rank_local[None, :] != (source % g)[:, None])).sum(axis=1),
        "remote_rank": (hit & ~same_node).sum(axis=1),
        "remote_expert": (valid & ~dest_same_node).sum(axis=1),
        "local_expert": (dest_same_node & (dest != source[:, None])).sum(axis=1),
    }
    return DecodeRows(**{name: float(v.mean()) * workload.num_tokens for name, v in per_token.items()})


def decode_rows(workload: Workload, cluster: Cluster, routing: str, *, samples: int = 16384,
                seed: int = 0) -> DecodeRows:
    """Expected rows for ``routing`` (``"uniform"`` exact, ``"node-limited"`` by the scale model's Monte Carlo)."""
    return expected_rows(workload, cluster, sm.routing_pairs(workload, cluster, routing, samples=samples, seed=seed))


# ------------------------------------------------------------------------------------------------
# Bytes
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeBytes:
    """One op's bytes per rank per call.

    ``needed``: design (a)'s filled slots and block counts over the network. ``sent``: its fixed-size
    blocks, every slot sent. ``deepep``: DeepEP's RDMA messages. ``per_rank``: one message per
    (token, remote rank), DeepEP's message size. ``nvlink`` / ``deepep_nvlink``: the bytes each
    design moves between the GPUs of a node.
    """

    needed: float
    sent: float
    deepep: float
    per_rank: float
    nvlink: float
    deepep_nvlink: float

    @property
    def padding(self) -> float:
        """Bytes sent over bytes needed (1 where nothing crosses)."""
        return self.sent / self.needed if self.needed else 1.0


def slot_bytes(workload: Workload, op: str) -> Tuple[float, float, float]:
    """(design (a)'s slot, its block header, DeepEP's message) in bytes.

    A dispatch slot is the FP8 row with its scales, the source index and the token's top-k ids and
    weights (the rail receiver routes by them and weights the combine's partial row with them):
    the scale model's record. A combine slot is the weighted BF16 partial row alone (its slot is its
    token: the dispatch laid the blocks out). DeepEP's combine message is the BF16 row too.
    """
    if op == "dispatch":
        return (workload.record_bytes("dispatch", "fp8"), BLOCK_HEADER_BYTES,
                workload.row_bytes("fp8") + DEEPEP_LL_HEADER_BYTES)
    if op == "combine":
        return workload.row_bytes("bf16"), 0.0, workload.row_bytes("bf16")
    raise ValueError(f"op: expected 'dispatch' or 'combine', got {op!r}")


def decode_bytes(workload: Workload, cluster: Cluster, rows: DecodeRows, op: str, *,
                 bound: int = 0) -> DecodeBytes:
    """Bytes of ``op``; blocks of ``bound`` slots (``num_max_dispatch_tokens_per_rank``; 0: the tokens)."""
    bound = bound or workload.num_tokens
    if bound < workload.num_tokens:
        raise ValueError(f"bound ({bound}) must hold the {workload.num_tokens} tokens of a rank")
    slot, header, message = slot_bytes(workload, op)
    peers = cluster.num_nodes - 1
    return DecodeBytes(needed=rows.network * slot + peers * header, sent=peers * (header + bound * slot),
                       deepep=rows.remote_expert * message, per_rank=rows.remote_rank * message,
                       nvlink=rows.nvlink * slot, deepep_nvlink=rows.local_expert * message)


# ------------------------------------------------------------------------------------------------
# Times
# ------------------------------------------------------------------------------------------------


def design_time(workload: Workload, cluster: Cluster, rows: DecodeRows, nbytes: DecodeBytes, rates: Rates,
                op: str, *, padded: bool = True) -> OpTime:
    """Design (a)'s stages, one after the other (``padded=False``: blocks sent at their filled size).

    Pack: a launch + reading the BF16 tokens and writing the filled slots. Network: the scale
    model's grouped NCCL send/recv (latency + a per-peer cost + bytes over the NIC). NVLink: the
    intranode kernels' cost fitted from this project's measurements (cached FP8 dispatch, BF16
    combine). Sum: a launch + reading every node's partial row and writing the output.
    """
    remote = cluster.num_nodes > 1
    wire = nbytes.sent if padded else nbytes.needed
    bf16_rows = workload.num_tokens * workload.row_bytes("bf16")
    if op == "dispatch":
        pack = rates.kernel_launch_us + rates.hbm_time_us(bf16_rows + nbytes.needed) if remote else 0.0
        return OpTime(fixed_us=0.0, stages_us={
            "pack": pack, "network": sm.network_us(rates, cluster, wire),
            "nvlink": rates.nvlink("dispatch_cached", "fp8").time_us(nbytes.nvlink)})
    if op == "combine":
        read = (rows.network + rows.own_node) * workload.row_bytes("bf16")
        total = rates.kernel_launch_us + rates.hbm_time_us(read + bf16_rows) if remote else 0.0
        return OpTime(fixed_us=0.0, stages_us={
            "nvlink": rates.nvlink("combine", "bf16").time_us(nbytes.nvlink),
            "network": sm.network_us(rates, cluster, wire), "sum": total})
    raise ValueError(f"op: expected 'dispatch' or 'combine', got {op!r}")


def deepep_time(nbytes: DecodeBytes, rates: Rates, op: str, *, fixed_us: float = DEEPEP_LL_FIXED_US,
                nvlink_gbps: float = 0.0) -> float:
    """DeepEP's low-latency call: its fixed cost + the slower of its RDMA and its NVLink messages.

    ``nvlink_gbps`` 0 takes the rate of this project's intranode kernels (``rates.nvlink``).
    """
    kind, dtype = ("dispatch_cached", "fp8") if op == "dispatch" else ("combine", "bf16")
    nvl = nvlink_gbps or rates.nvlink(kind, dtype).gbps
    return fixed_us + max(rates.nic_time_us(nbytes.deepep), nbytes.deepep_nvlink / (nvl * 1e3))


def fit_deepep_low_latency(workload: Workload = DECODE_WORKLOAD) -> Tuple[float, float]:
    """(fixed us, NIC GB/s reached): a line through DeepEP's published times, EP16 to EP256, dispatch
    and combine, against its RDMA bytes per rank (where its NIC binds: EP8 crosses none)."""
    bytes_, times = [], []
    for ep, published in DEEPEP_LL_PUBLISHED.items():
        cluster = Cluster(ep, 8)
        if cluster.num_nodes == 1:
            continue
        rows = expected_rows(workload, cluster, sm.uniform_pairs(workload, cluster))
        for op, time_us in zip(("dispatch", "combine"), published):
            bytes_.append(decode_bytes(workload, cluster, rows, op).deepep)
            times.append(time_us)
    slope, intercept = np.polyfit(np.array(bytes_), np.array(times), 1)
    return float(intercept), float(1.0 / (slope * 1e3))


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------

OPS = ("dispatch", "combine")


def _pair(a: float, b: float, fmt: str = "{:.2f}") -> str:
    return fmt.format(a) + " / " + fmt.format(b)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def bytes_table(workload: Workload, clusters: Sequence[Cluster], routings: Sequence[str], *, bound: int,
                samples: int, seed: int) -> str:
    """Network MB per rank per call, dispatch / combine: (a) needed and sent, (b), per (token, rank)."""
    header = ["EP", "GPUs/node", "nodes", "routing", "remote (token, node) pairs per token",
              "(a) needed MB", "(a) sent MB: fixed blocks", "padding: sent / needed",
              "(b) DeepEP LL MB: (token, expert)", "one per (token, rank) MB", "(b) / (a) needed",
              "(b) / (a) sent"]
    rows: List[List[str]] = []
    for cluster in clusters:
        for routing in routings:
            counted = decode_rows(workload, cluster, routing, samples=samples, seed=seed)
            d, c = (decode_bytes(workload, cluster, counted, op, bound=bound) for op in OPS)
            rows.append([str(cluster.num_ranks), str(cluster.gpus_per_node), str(cluster.num_nodes), routing,
                         f"{counted.network / workload.num_tokens:.2f}", _pair(d.needed / 1e6, c.needed / 1e6),
                         _pair(d.sent / 1e6, c.sent / 1e6), f"{d.padding:.2f}",
                         _pair(d.deepep / 1e6, c.deepep / 1e6), _pair(d.per_rank / 1e6, c.per_rank / 1e6),
                         _ratio(d.deepep, d.needed), _ratio(d.deepep, d.sent)])
    return sm._markdown(header, rows)


def time_table(workload: Workload, clusters: Sequence[Cluster], rates: Rates, routing: str, *, bound: int,
               samples: int, seed: int, deepep_fixed_us: float) -> str:
    """Per EP and op: design (a)'s stages and totals (fixed blocks, filled size), DeepEP's model, published."""
    header = ["EP", "GPUs/node", "op", "(a) pack / sum", "(a) network", "(a) NVLink", "(a) total: fixed blocks",
              "(a) total: needed bytes only", "(b) DeepEP LL model", "(a) fixed / (b)", "DeepEP V1 published"]
    rows: List[List[str]] = []
    for cluster in clusters:
        counted = decode_rows(workload, cluster, routing, samples=samples, seed=seed)
        published = DEEPEP_LL_PUBLISHED.get(cluster.num_ranks) if cluster.gpus_per_node == 8 else None
        for which, op in enumerate(OPS):
            nbytes = decode_bytes(workload, cluster, counted, op, bound=bound)
            padded = design_time(workload, cluster, counted, nbytes, rates, op)
            needed = design_time(workload, cluster, counted, nbytes, rates, op, padded=False)
            theirs = deepep_time(nbytes, rates, op, fixed_us=deepep_fixed_us)
            side = padded.stages_us.get("pack", padded.stages_us.get("sum", 0.0))
            rows.append([str(cluster.num_ranks), str(cluster.gpus_per_node),
                         "dispatch FP8" if op == "dispatch" else "combine BF16", f"{side:.0f}",
                         f"{padded.stages_us['network']:.0f}", f"{padded.stages_us['nvlink']:.0f}",
                         f"{padded.sequential_us:.0f}", f"{needed.sequential_us:.0f}", f"{theirs:.0f}",
                         f"{padded.sequential_us / theirs:.2f}", f"{published[which]:.0f}" if published else ""])
    return sm._markdown(header, rows)


def anchors_table(workload: Workload, rates: Rates, routing: str, *, bound: int, samples: int, seed: int,
                  deepep_fixed_us: float) -> str:
    """EP16 (8 GPUs a node): every published decode figure of issue 48 beside the two designs' model."""
    cluster = Cluster(16, 8)
    counted = decode_rows(workload, cluster, routing, samples=samples, seed=seed)
    nbytes = [decode_bytes(workload, cluster, counted, op, bound=bound) for op in OPS]
    model = [("(a) this design, fixed blocks (model)",
              [design_time(workload, cluster, counted, b, rates, op).sequential_us for op, b in zip(OPS, nbytes)]),
             ("(b) DeepEP LL (model, this NVLink)",
              [deepep_time(b, rates, op, fixed_us=deepep_fixed_us) for op, b in zip(OPS, nbytes)])]
    published = [("DeepEP V1, H800 + CX7 (published)", list(DEEPEP_LL_PUBLISHED[16]))]
    published += [(f"{name} (published)", [d, c]) for name, d, c in OTHERS_PUBLISHED_EP16]
    return sm._markdown(["EP16, 8 GPUs a node", "dispatch us", "combine us", "step us"],
                        [[name, f"{d:.0f}", f"{c:.0f}", f"{d + c:.0f}"] for name, (d, c) in model + published])


def check_table(*, nic_gbps: float = 50.0, deepep_fixed_us: float = DEEPEP_LL_FIXED_US) -> str:
    """The DeepEP model on DeepEP's testbed (H800 NVLink: its intranode rate, own 1/8 out) against
    its published figures (128 tokens), with the line :func:`fit_deepep_low_latency` draws through them."""
    workload = DECODE_WORKLOAD
    fixed, gbps = fit_deepep_low_latency(workload)
    header = ["EP", "op", "RDMA MB", "NVLink MB", "model: NIC / NVLink us", "model us", "published us",
              "published / model", "NIC GB/s if the rest is the fixed cost"]
    rows: List[List[str]] = []
    rates = Rates(nic_gbps=nic_gbps, nic_efficiency=DECODE_NIC_EFFICIENCY)
    for ep, published in DEEPEP_LL_PUBLISHED.items():
        cluster = Cluster(ep, 8)
        counted = expected_rows(workload, cluster, sm.uniform_pairs(workload, cluster))
        for which, op in enumerate(OPS):
            nbytes = decode_bytes(workload, cluster, counted, op)
            nvl = sm.DEEPEP_V1_H800_INTRANODE[which] * 7 / 8
            model = deepep_time(nbytes, rates, op, fixed_us=deepep_fixed_us, nvlink_gbps=nvl)
            rest = published[which] - deepep_fixed_us
            rows.append([str(ep), "dispatch FP8" if op == "dispatch" else "combine BF16", f"{nbytes.deepep / 1e6:.2f}",
                         f"{nbytes.deepep_nvlink / 1e6:.2f}",
                         _pair(rates.nic_time_us(nbytes.deepep), nbytes.deepep_nvlink / (nvl * 1e3), "{:.0f}"),
                         f"{model:.0f}", f"{published[which]:.0f}", f"{published[which] / model:.2f}",
                         f"{nbytes.deepep / (rest * 1e3):.1f}" if nbytes.deepep else "-"])
    return (sm._markdown(header, rows) + f"\n\nLine through EP16-EP256: {fixed:.1f} us + RDMA bytes / "
            f"{gbps:.1f} GB/s ({gbps / nic_gbps:.3f} of {nic_gbps:g} GB/s).")


# ------------------------------------------------------------------------------------------------
# Command line (through scale_model's parser: ``python -m deepep_cupy.bench.scale_model --decode``)
# ------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The decode flags of scale_model's parser (``--ep``, ``--gpus-per-node``, ``--nic-gbps``,
    ``--nic-efficiency``, ``--nvlink-gbps``, ``--routing``, ``--samples``, ``--seed`` apply too)."""
    p.add_argument("--decode", action="store_true",
                   help="print the decode tables (issue 48: 128 tokens a rank, this design against DeepEP's LL)")
    p.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="decode: tokens per rank")
    p.add_argument("--decode-bound", type=int, default=0,
                   help="decode: num_max_dispatch_tokens_per_rank, the slots of a block (0: the tokens)")
    p.add_argument("--nccl-latency-us", type=float, default=Rates.nccl_launch_us,
                   help="decode: a grouped NCCL send/recv's latency (launch, proxy, flight), us")
    p.add_argument("--deepep-fixed-us", type=float, default=DEEPEP_LL_FIXED_US,
                   help="decode: DeepEP's low-latency call, bytes aside, us")


def render_decode(args: argparse.Namespace) -> str:
    """The decode tables for parsed arguments."""
    workload = Workload(num_tokens=args.decode_tokens)
    clusters = sm._clusters(args.ep, args.gpus_per_node)
    bound = args.decode_bound or workload.num_tokens
    eff = DECODE_NIC_EFFICIENCY if args.nic_efficiency is None else args.nic_efficiency
    common = dict(bound=bound, samples=args.samples, seed=args.seed)
    out = [f"Decode: {workload.num_tokens} tokens/rank, blocks of {bound} slots (num_max_dispatch_tokens_per_rank), "
           f"hidden {workload.hidden}, top-{workload.num_topk} of {workload.num_experts} experts; FP8 dispatch, "
           "BF16 combine; per rank, expected values. A model, not a measurement.", "",
           "Network bytes per rank per call, MB, dispatch / combine:", "",
           bytes_table(workload, clusters, ["uniform", "node-limited"], **common)]
    nvl = "measured H200 kernels" if args.nvlink_gbps is None else f"NVLink {args.nvlink_gbps:g} GB/s"
    for nic in args.nic_gbps:
        rates = Rates(nic_gbps=nic, nic_efficiency=eff, nvlink_gbps=args.nvlink_gbps,
                      nccl_launch_us=args.nccl_latency_us)
        out += ["", f"Decode times in us, NIC {nic:g} GB/s x {eff:g}, NCCL {args.nccl_latency_us:g} us + "
                f"{rates.nccl_per_peer_us:g} us a peer, DeepEP {args.deepep_fixed_us:g} us + bytes, {nvl}, "
                f"{args.routing} routing:", "",
                time_table(workload, clusters, rates, args.routing, deepep_fixed_us=args.deepep_fixed_us, **common)]
        if 16 in args.ep and 8 in args.gpus_per_node:
            out += ["", f"EP16 beside the published figures (NIC {nic:g} GB/s):", "",
                    anchors_table(workload, rates, args.routing, deepep_fixed_us=args.deepep_fixed_us, **common)]
    out += ["", "The DeepEP model against DeepEP V1's published low-latency figures (H800 NVLink, 50 GB/s x "
            f"{DECODE_NIC_EFFICIENCY:g}, {args.deepep_fixed_us:g} us):", "",
            check_table(deepep_fixed_us=args.deepep_fixed_us)]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(sm.main(["--decode", *sys.argv[1:]]))
