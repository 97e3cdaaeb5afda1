"""A paper model of the internode dispatch and combine at EP16 to EP256 (no GPU: Python + NumPy).

It answers "where would the rail-aligned hierarchical design land at a scale we cannot run?" from
three things: the bytes each stage moves (counted exactly, or by Monte Carlo for node-limited
routing), the rates this project measured on 2 x H200 (NVLink kernels, HBM), and a NIC rate that is
a parameter. ``docs/SCALE_MODEL.md`` explains the model and its assumptions; this prints its tables::

    python -m deepep_cupy.bench.scale_model                  # 50 GB/s NIC, 8 and 4 GPUs a node
    python -m deepep_cupy.bench.scale_model --nic-gbps 25 50 100 --gpus-per-node 8
    python -m deepep_cupy.bench.scale_model --decode         # the decode step (decode_scale.py)

The design modelled (issue 38): dispatch = (1) pack, per destination node, the rows of the tokens
with an expert there (a token crosses the network at most once per node), (2) a fresh dispatch
exchanges the per-node counts on the host (a round trip), then one all-to-all-v over the rail (the
ranks with the same local index on every node, grouped ``ncclSend``/``ncclRecv``), (3) on each node
an intranode NVLink dispatch (this library's kernels) from the rail receiver to the ranks owning the
experts. Combine = intranode combine (one row per token per node), rail all-to-all-v back, sum on
the owner. The first version runs the stages one after the other; the tables also give the time
with the stages overlapped (chunked pipelining).

Everything is per rank and in expectation: routing is symmetric over nodes and ranks, so every rank
sends and receives the same expected bytes (load imbalance is not modelled).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..constants import FP8_SCALE_BLOCK

#: The EP sizes of the tables.
DEFAULT_EP_SIZES = (16, 32, 64, 128, 256)
#: DeepEP's test limits a token to ``min(nodes, 4)`` nodes ("4 node groups").
DEEPEP_NODE_GROUPS = 4

# ------------------------------------------------------------------------------------------------
# What was measured (sources named; docs/SCALE_MODEL.md repeats them)
# ------------------------------------------------------------------------------------------------

#: Loop times (us per call, back to back, CuPy) on 2 x H200 NV18, mpirun, 24 SMs, reference
#: workload, at 4096 and 8192 tokens per rank: README "What a training loop sees", 2026-12-01.
#: The slope between the two gives the NVLink rate the kernels reach, the rest the fixed cost.
MEASURED_LOOP_US = {
    "dispatch_fresh_bf16": (218.0, 401.0),
    "dispatch_fresh_fp8": (135.0, 238.0),
    "dispatch_cached_bf16": (203.0, 380.0),
    "dispatch_cached_fp8": (120.0, 217.0),
    "combine_bf16": (219.0, 407.0),
}
#: The token counts of :data:`MEASURED_LOOP_US`.
MEASURED_TOKENS = (4096, 8192)
#: Ranks of the measurement (2 GPUs, one NVLink peer each).
MEASURED_RANKS = 2
#: HBM copy on H200, read + write counted (README / shared DESIGN.md "Measuring").
HBM_GBPS = 4200.0
#: NVLink, one direction, both GPUs pushing (shared DESIGN.md): the links' rate, for reference.
NVLINK_LINK_GBPS = 335.0

#: DeepEP V1's published internode figures (docs/legacy.md, "Normal kernels with NVLink and RDMA
#: forwarding"): H800, one CX7 400 Gb/s NIC per GPU, 4096 tokens, hidden 7168, top-8 of 256 experts,
#: 4 node groups, FP8 dispatch, BF16 combine; "bottleneck bandwidth" in GB/s (RDMA).
DEEPEP_V1_PUBLISHED = {16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
#: DeepEP V1 intranode on the same H800s (EP8, NVLink, its accounting: own tokens included).
DEEPEP_V1_H800_INTRANODE = (153.0, 158.0)


@dataclass(frozen=True)
class Workload:
    """One rank's tokens and routing shape (the reference workload by default)."""

    num_tokens: int = 4096
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256

    def row_bytes(self, dtype: str) -> float:
        """DeepEP's bytes of one token's row: hidden values (and FP8 scales)."""
        if dtype == "bf16":
            return 2.0 * self.hidden
        if dtype == "fp8":
            return self.hidden * (1.0 + 4.0 / FP8_SCALE_BLOCK)
        raise ValueError(f"dtype: expected 'bf16' or 'fp8', got {dtype!r}")

    def record_bytes(self, op: str, dtype: str) -> float:
        """Bytes one row really moves: the row plus what travels with it.

        A dispatch record also carries top-k ids and weights (4 + 4 bytes each) and the source
        index (4); a combine record its top-k weights (4 each).
        """
        if op == "dispatch":
            return self.row_bytes(dtype) + 8 * self.num_topk + 4
        if op == "combine":
            return self.row_bytes(dtype) + 4 * self.num_topk
        raise ValueError(f"op: expected 'dispatch' or 'combine', got {op!r}")


@dataclass(frozen=True)
class Cluster:
    """``num_ranks`` GPUs, ``gpus_per_node`` of them a node, one NIC per GPU (rail-aligned)."""

    num_ranks: int
    gpus_per_node: int = 8

    def __post_init__(self):
        if self.num_ranks <= 0 or self.gpus_per_node <= 0 or self.num_ranks % self.gpus_per_node:
            raise ValueError(f"num_ranks ({self.num_ranks}) must be a positive multiple of "
                             f"gpus_per_node ({self.gpus_per_node})")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.gpus_per_node


# ------------------------------------------------------------------------------------------------
# Routing: expected (token, node) and (token, rank) pairs
# ------------------------------------------------------------------------------------------------


def hit_probability(num_experts: int, num_groups: int, num_topk: int) -> float:
    """Chance that ``num_topk`` distinct experts drawn uniformly include one of a group's experts.

    The experts are split evenly into ``num_groups`` groups (nodes or ranks):
    ``1 - C(E - E/G, k) / C(E, k)``.
    """
    if num_experts % num_groups:
        raise ValueError(f"num_experts ({num_experts}) must split evenly into {num_groups} groups")
    outside = num_experts - num_experts // num_groups
    return 1.0 - math.comb(outside, num_topk) / math.comb(num_experts, num_topk)


@dataclass(frozen=True)
class Pairs:
    """Expected pairs per token: (token, destination node) and (token, destination rank)."""

    node: float
    rank: float


def uniform_pairs(workload: Workload, cluster: Cluster) -> Pairs:
    """Exact expectation under uniform top-k routing."""
    e, k = workload.num_experts, workload.num_topk
    return Pairs(node=cluster.num_nodes * hit_probability(e, cluster.num_nodes, k),
                 rank=cluster.num_ranks * hit_probability(e, cluster.num_ranks, k))


def node_limited_routing(rng: np.random.Generator, num_tokens: int, num_experts: int, num_nodes: int,
                         num_node_groups: int, num_topk: int) -> np.ndarray:
    """DeepEP's internode test routing, in NumPy: ``[num_tokens, num_topk]`` expert ids.

    Scores ``|randn| + 1``; a node's score is its best expert's; the ``num_node_groups`` best nodes
    are kept, the other nodes' experts masked to 0; the token takes the ``num_topk`` best experts
    left (DeepSeek-V3's node-limited routing with nodes as the groups).
    """
    if num_experts % num_nodes:
        raise ValueError(f"num_experts ({num_experts}) must split evenly into {num_nodes} nodes")
    if not 1 <= num_node_groups <= num_nodes:
        raise ValueError(f"num_node_groups must be in [1, {num_nodes}], got {num_node_groups}")
    if num_topk > num_node_groups * (num_experts // num_nodes):
        raise ValueError(f"num_topk ({num_topk}) exceeds the experts of {num_node_groups} nodes")
    scores = np.abs(rng.standard_normal((num_tokens, num_experts))) + 1.0
    node_scores = scores.reshape(num_tokens, num_nodes, -1).max(axis=2)
    kept_nodes = np.argpartition(-node_scores, num_node_groups - 1, axis=1)[:, :num_node_groups]
    mask = np.zeros((num_tokens, num_nodes), dtype=bool)
    np.put_along_axis(mask, kept_nodes, True, axis=1)
    masked = scores * np.repeat(mask, num_experts // num_nodes, axis=1)
    return np.argpartition(-masked, num_topk - 1, axis=1)[:, :num_topk].astype(np.int64)


def distinct_groups_per_token(topk_idx: np.ndarray, num_experts: int, num_groups: int) -> np.ndarray:
    """Per token, how many of ``num_groups`` even groups of experts its top-k ids touch (-1 ignored)."""
    topk_idx = np.asarray(topk_idx, dtype=np.int64)
    hit = np.zeros((topk_idx.shape[0], num_groups + 1), dtype=bool)
    group = np.where(topk_idx >= 0, topk_idx // (num_experts // num_groups), num_groups)
    np.put_along_axis(hit, group, True, axis=1)
    return hit[:, :num_groups].sum(axis=1)


def monte_carlo_pairs(topk_idx: np.ndarray, num_experts: int, cluster: Cluster) -> Pairs:
    """Mean pairs per token of a sampled routing."""
    return Pairs(node=float(distinct_groups_per_token(topk_idx, num_experts, cluster.num_nodes).mean()),
                 rank=float(distinct_groups_per_token(topk_idx, num_experts, cluster.num_ranks).mean()))


def routing_pairs(workload: Workload, cluster: Cluster, routing: str, *, samples: int = 16384,
                  seed: int = 0) -> Pairs:
    """Expected pairs per token for ``routing``.

    ``"uniform"``: exact. ``"node-limited"``: DeepEP's test routing with ``min(nodes, 4)`` node groups,
    by Monte Carlo over ``samples`` tokens (a fixed seed, so the tables are reproducible).
    """
    if routing == "uniform":
        return uniform_pairs(workload, cluster)
    if routing == "node-limited":
        groups = min(cluster.num_nodes, DEEPEP_NODE_GROUPS)
        if groups == cluster.num_nodes:
            return uniform_pairs(workload, cluster)  # no node is ever masked: uniform routing
        rng = np.random.default_rng([seed, cluster.num_ranks, cluster.gpus_per_node])
        topk = node_limited_routing(rng, samples, workload.num_experts, cluster.num_nodes, groups,
                                    workload.num_topk)
        return monte_carlo_pairs(topk, workload.num_experts, cluster)
    raise ValueError(f"routing: expected 'uniform' or 'node-limited', got {routing!r}")


# ------------------------------------------------------------------------------------------------
# Traffic: rows per rank per stage
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Rows one rank moves per call, by where they go (expected values; multiply by record bytes).

    ``network_rows``: (token, other node) pairs, what this design and DeepEP V1 send over the NIC.
    ``logical_rows``: (token, node) pairs with the own node, what DeepEP's test counts as RDMA bytes.
    ``flat_network_rows``: (token, rank on another node) pairs: a flat all-to-all without dedup.
    ``flat_nvlink_rows``: (token, other rank on this node) pairs of the flat all-to-all.
    ``nvlink_rows``: rows the NVLink stage pushes from a rail receiver to another local rank.
    ``own_node_rows``: (token, own node) pairs (read from ``x`` by the NVLink stage, no network).
    """

    network_rows: float
    logical_rows: float
    flat_network_rows: float
    flat_nvlink_rows: float
    nvlink_rows: float
    own_node_rows: float


def traffic(workload: Workload, cluster: Cluster, pairs: Pairs) -> Traffic:
    """Rows per rank, from the expected pairs per token.

    By symmetry every node (and rank) is equally likely to be hit, so a token's pairs with other
    nodes are ``(N - 1) / N`` of its node pairs. A rank receives, in all, as many (token, rank) rows
    as it sends; the NVLink stage delivers each of them from the rail receiver that has the source's
    local index, which is the destination itself for ``1 / G`` of them.
    """
    t, n, g, r = workload.num_tokens, cluster.num_nodes, cluster.gpus_per_node, cluster.num_ranks
    return Traffic(
        network_rows=t * pairs.node * (n - 1) / n,
        logical_rows=t * pairs.node,
        flat_network_rows=t * pairs.rank * (r - g) / r,
        flat_nvlink_rows=t * pairs.rank * (g - 1) / r,
        nvlink_rows=t * pairs.rank * (g - 1) / g,
        own_node_rows=t * pairs.node / n,
    )


# ------------------------------------------------------------------------------------------------
# Rates and fixed costs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelCost:
    """An NVLink kernel's time: ``fixed_us + cross-GPU bytes / gbps``."""

    gbps: float
    fixed_us: float

    def time_us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes / (self.gbps * 1e3)


def fit_measured_kernel(key: str, workload: Workload = Workload()) -> KernelCost:
    """:class:`KernelCost` of a measured op from its loop times at two token counts.

    At 2 ranks each token crosses to the other GPU with probability ``hit(E, 2, k)``, so the
    extra tokens' cross-GPU bytes over the extra time is the rate the kernel reaches; what is left
    of the smaller run's time is its fixed cost (launch, count exchange, barriers).
    """
    (t0, t1), (n0, n1) = MEASURED_LOOP_US[key], MEASURED_TOKENS
    op, dtype = ("combine", "bf16") if key.startswith("combine") else ("dispatch", key.rsplit("_", 1)[1])
    per_token = hit_probability(workload.num_experts, MEASURED_RANKS, workload.num_topk) * workload.row_bytes(dtype)
    rate = (n1 - n0) * per_token / ((t1 - t0) * 1e3)
    return KernelCost(gbps=rate, fixed_us=t0 - n0 * per_token / (rate * 1e3))


@dataclass(frozen=True)
class Rates:
    """Every rate and fixed cost the model uses (defaults: see docs/SCALE_MODEL.md, "Assumptions").

    ``nic_gbps``: NIC line rate per GPU, GB/s each way (400 Gb/s = 50).
    ``nic_efficiency``: fraction of it a large NCCL send/recv reaches.
    ``nvlink_gbps``: ``None`` takes the intranode kernels' rates as measured (:meth:`nvlink`, per op
    and dtype); a number replaces their rate, their fixed costs kept (an H800's: ~134).
    ``hbm_gbps``: a copy kernel's HBM traffic (read + write).
    ``host_round_trip_us``: GPU -> host counts and the wait for them (fresh dispatch only).
    ``count_exchange_us_per_step``: one step of the small all-to-all of node counts over the rail
    (``ceil(log2 nodes)`` steps, Bruck-like), on top of the round trip.
    ``nccl_launch_us``: a grouped ``ncclSend``/``ncclRecv`` launch and its proxy's start.
    ``nccl_per_peer_us``: per rail peer posted in the group.
    ``kernel_launch_us``: a pack or sum kernel's launch.
    ``chunk_overhead_us``: what each extra piece of a chunked pipeline costs (its NCCL group call
    and the signal between the stages), beyond its bytes.
    """

    nic_gbps: float = 50.0
    nic_efficiency: float = 0.9
    nvlink_gbps: Optional[float] = None
    hbm_gbps: float = HBM_GBPS
    host_round_trip_us: float = 25.0
    count_exchange_us_per_step: float = 5.0
    nccl_launch_us: float = 20.0
    nccl_per_peer_us: float = 1.0
    kernel_launch_us: float = 8.0
    chunk_overhead_us: float = 10.0

    def nvlink(self, kind: str, dtype: str) -> KernelCost:
        key = "combine_bf16" if kind == "combine" else f"{kind}_{dtype}"
        cost = fit_measured_kernel(key)
        return cost if self.nvlink_gbps is None else replace(cost, gbps=self.nvlink_gbps)

    def nic_time_us(self, nbytes: float) -> float:
        return nbytes / (self.nic_gbps * self.nic_efficiency * 1e3)

    def hbm_time_us(self, nbytes: float) -> float:
        return nbytes / (self.hbm_gbps * 1e3)


# ------------------------------------------------------------------------------------------------
# Stage times
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpTime:
    """One op's stage times (us), and its totals.

    ``fixed_us`` is the part no pipelining hides (the count round trip); ``stages_us`` are the
    stages that chunked pipelining could overlap, each of them on its own engine (HBM, NIC, NVLink).
    """

    fixed_us: float
    stages_us: Dict[str, float]

    @property
    def sequential_us(self) -> float:
        return self.fixed_us + sum(self.stages_us.values())

    @property
    def overlapped_us(self) -> float:
        """Perfect overlap: the slowest stage alone."""
        return self.fixed_us + max(self.stages_us.values())

    def chunked_us(self, chunks: int, per_chunk_us: float) -> float:
        """``chunks`` pieces in a pipeline: the slowest stage, a piece of each other one to fill and
        drain the pipe, and a launch per extra piece."""
        slowest = max(self.stages_us.values())
        rest = sum(self.stages_us.values()) - slowest
        return self.fixed_us + slowest + rest / chunks + (chunks - 1) * per_chunk_us


def network_us(rates: Rates, cluster: Cluster, nbytes: float) -> float:
    """One grouped send/recv over the rail (nothing when the cluster is one node)."""
    peers = cluster.num_nodes - 1
    if peers == 0:
        return 0.0
    return rates.nccl_launch_us + peers * rates.nccl_per_peer_us + rates.nic_time_us(nbytes)


def dispatch_time(workload: Workload, cluster: Cluster, flow: Traffic, rates: Rates, dtype: str, *,
                  cached: bool) -> OpTime:
    """The hierarchical dispatch: pack, (counts), rail all-to-all-v, intranode NVLink dispatch."""
    record = workload.record_bytes("dispatch", dtype)
    fixed = 0.0
    if not cached and cluster.num_nodes > 1:
        fixed = rates.host_round_trip_us + math.ceil(math.log2(cluster.num_nodes)) * rates.count_exchange_us_per_step
    pack = 0.0
    if flow.network_rows:
        pack = rates.kernel_launch_us + rates.hbm_time_us(2 * flow.network_rows * record)
    kind = "dispatch_cached" if cached else "dispatch_fresh"
    return OpTime(fixed_us=fixed, stages_us={
        "pack": pack,
        "network": network_us(rates, cluster, flow.network_rows * record),
        "nvlink": rates.nvlink(kind, dtype).time_us(flow.nvlink_rows * record),
    })


def combine_time(workload: Workload, cluster: Cluster, flow: Traffic, rates: Rates) -> OpTime:
    """The hierarchical combine: intranode combine, rail all-to-all-v back, sum on the owner."""
    record = workload.record_bytes("combine", "bf16")
    total = 0.0
    if flow.network_rows:
        # Read every node's partial row of each token (the own node's included), write one.
        read = (flow.network_rows + flow.own_node_rows) * record
        total = rates.kernel_launch_us + rates.hbm_time_us(read + workload.num_tokens * record)
    return OpTime(fixed_us=0.0, stages_us={
        "nvlink": rates.nvlink("combine", "bf16").time_us(flow.nvlink_rows * record),
        "network": network_us(rates, cluster, flow.network_rows * record),
        "sum": total,
    })


def flat_all_to_all_us(workload: Workload, cluster: Cluster, flow: Traffic, rates: Rates, dtype: str) -> float:
    """A flat all-to-all-v (Megatron's ``all_to_all_single``), transfer only, no dedup.

    NCCL moves the network and NVLink parts at once; the network part is the bound at every EP
    here. Rows are bare (no top-k ids travel with them).
    """
    row = workload.row_bytes(dtype)
    nvl = rates.nvlink("dispatch_cached", dtype)
    return rates.nccl_launch_us + cluster.num_ranks * rates.nccl_per_peer_us + max(
        rates.nic_time_us(flow.flat_network_rows * row), flow.flat_nvlink_rows * row / (nvl.gbps * 1e3))


def deepep_v1_time(workload: Workload, flow: Traffic, *, op: str, nic_gbps: float, nvlink_gbps: float,
                   fixed_us: float = 0.0) -> float:
    """DeepEP V1's internode kernels as a bandwidth bound: RDMA and NVLink forwarding pipelined, so
    the slower of the two (the NIC at its line rate, the forwarders' pushes at ``nvlink_gbps``)."""
    dtype = "fp8" if op == "dispatch" else "bf16"
    row = workload.row_bytes(dtype)
    return fixed_us + max(flow.network_rows * row / (nic_gbps * 1e3), flow.nvlink_rows * row / (nvlink_gbps * 1e3))


def deepep_gbps(workload: Workload, flow: Traffic, dtype: str, time_us: float) -> float:
    """DeepEP's "bottleneck bandwidth (RDMA)": its test's RDMA bytes over the time.

    The test counts every (token, node) pair, the own node's included (those never touch the NIC),
    times hidden x 2 bytes (x (1 + 4/128) / 2 for FP8).
    """
    return flow.logical_rows * workload.row_bytes(dtype) / (time_us * 1e3)


def nic_gbps_used(workload: Workload, flow: Traffic, dtype: str, time_us: float) -> float:
    """Bytes that really cross the network per rank over the time (row bytes only, as DeepEP's)."""
    return flow.network_rows * workload.row_bytes(dtype) / (time_us * 1e3)


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _clusters(ep_sizes: Sequence[int], gpus_per_node: Sequence[int]) -> List[Cluster]:
    return [Cluster(ep, g) for g in gpus_per_node for ep in ep_sizes if ep % g == 0 and ep >= g]


def bytes_table(workload: Workload, clusters: Sequence[Cluster], routings: Sequence[str], *,
                samples: int, seed: int) -> str:
    """Pairs per token and MB per rank crossing the network: this design (= DeepEP V1) vs flat."""
    header = ["EP", "GPUs/node", "nodes", "routing", "(token, node) pairs", "of them remote",
              "flat: remote (token, rank)", "network MB/rank, BF16: ours = DeepEP V1", "flat a2a MB",
              "flat / ours", "NVLink stage MB"]
    rows = []
    row = workload.row_bytes("bf16")
    for cluster in clusters:
        for routing in routings:
            flow = traffic(workload, cluster, routing_pairs(workload, cluster, routing, samples=samples, seed=seed))
            t = workload.num_tokens
            rows.append([str(cluster.num_ranks), str(cluster.gpus_per_node), str(cluster.num_nodes), routing,
                         f"{flow.logical_rows / t:.2f}", f"{flow.network_rows / t:.2f}",
                         f"{flow.flat_network_rows / t:.2f}", f"{flow.network_rows * row / 1e6:.0f}",
                         f"{flow.flat_network_rows * row / 1e6:.0f}",
                         f"{flow.flat_network_rows / flow.network_rows:.2f}" if flow.network_rows else "-",
                         f"{flow.nvlink_rows * row / 1e6:.0f}"])
    return _markdown(header, rows)


def time_table(workload: Workload, clusters: Sequence[Cluster], rates: Rates, routing: str, *, samples: int,
               seed: int, chunks: int = 4) -> str:
    """Per EP: FP8 dispatch (cached, as DeepEP's figures) and BF16 combine, stage by stage."""
    header = ["EP", "GPUs/node", "op", "pack / sum", "network", "NVLink", "sequential", f"{chunks} chunks",
              "overlapped", "DeepEP-style GB/s: seq / overlapped", "NIC GB/s used (seq)", "flat a2a",
              "DeepEP V1 published"]
    rows = []
    for cluster in clusters:
        flow = traffic(workload, cluster, routing_pairs(workload, cluster, routing, samples=samples, seed=seed))
        published = DEEPEP_V1_PUBLISHED.get(cluster.num_ranks) if cluster.gpus_per_node == 8 else None
        # (name, dtype, times, index into DeepEP's published pair or None, flat all-to-all shown)
        ops = [("dispatch FP8", "fp8", dispatch_time(workload, cluster, flow, rates, "fp8", cached=True), 0, True),
               ("fresh dispatch FP8", "fp8", dispatch_time(workload, cluster, flow, rates, "fp8", cached=False),
                None, False),
               ("combine BF16", "bf16", combine_time(workload, cluster, flow, rates), 1, True)]
        for name, dtype, op, which, with_flat in ops:
            side = op.stages_us.get("pack", op.stages_us.get("sum", 0.0))
            seq, ovl = op.sequential_us, op.overlapped_us
            flat = flat_all_to_all_us(workload, cluster, flow, rates, dtype) if with_flat else None
            rows.append([
                str(cluster.num_ranks), str(cluster.gpus_per_node),
                name + (f" (+{op.fixed_us:.0f} counts)" if op.fixed_us else ""),
                f"{side:.0f}", f"{op.stages_us['network']:.0f}", f"{op.stages_us['nvlink']:.0f}",
                f"{seq:.0f}", f"{op.chunked_us(chunks, rates.chunk_overhead_us):.0f}", f"{ovl:.0f}",
                f"{deepep_gbps(workload, flow, dtype, seq):.0f} / {deepep_gbps(workload, flow, dtype, ovl):.0f}",
                f"{nic_gbps_used(workload, flow, dtype, seq):.0f}",
                f"{flat:.0f}" if flat is not None else "",
                f"{published[which]:.0f}" if published and which is not None else "",
            ])
    return _markdown(header, rows)


def deepep_check_table(workload: Workload, *, samples: int, seed: int, nic_gbps: float = 50.0) -> str:
    """The bandwidth bound applied to DeepEP V1 on its own testbed (H800: its intranode NVLink rate,
    own tokens taken out), next to what it published: how close a bound comes, and which side binds."""
    header = ["EP", "op", "network MB", "NVLink MB", "bound: NIC / NVLink us", "bound GB/s (DeepEP-style)",
              "published", "published / bound", "NIC GB/s at the published rate"]
    rows = []
    for ep in sorted(DEEPEP_V1_PUBLISHED):
        cluster = Cluster(ep, 8)
        flow = traffic(workload, cluster, routing_pairs(workload, cluster, "node-limited", samples=samples, seed=seed))
        for which, (op, dtype) in enumerate((("dispatch", "fp8"), ("combine", "bf16"))):
            nvl = DEEPEP_V1_H800_INTRANODE[which] * 7 / 8  # its accounting counts the own 1/8
            row = workload.row_bytes(dtype)
            t_nic, t_nvl = flow.network_rows * row / (nic_gbps * 1e3), flow.nvlink_rows * row / (nvl * 1e3)
            bound = deepep_gbps(workload, flow, dtype, max(t_nic, t_nvl))
            published = DEEPEP_V1_PUBLISHED[ep][which]
            time_published = flow.logical_rows * row / (published * 1e3)
            rows.append([str(ep), f"{op} {dtype.upper()}", f"{flow.network_rows * row / 1e6:.0f}",
                         f"{flow.nvlink_rows * row / 1e6:.0f}", f"{t_nic:.0f} / {t_nvl:.0f}", f"{bound:.0f}",
                         f"{published:.0f}", f"{published / bound:.2f}",
                         f"{nic_gbps_used(workload, flow, dtype, time_published):.0f}"])
    return _markdown(header, rows)


def measured_table() -> str:
    """The NVLink kernel costs fitted from the measured loop times."""
    rows = []
    for key, (t0, t1) in MEASURED_LOOP_US.items():
        cost = fit_measured_kernel(key)
        rows.append([key, f"{t0:.0f} / {t1:.0f}", f"{cost.gbps:.0f}", f"{cost.fixed_us:.0f}"])
    return _markdown(["op (2 x H200, 24 SMs)", "loop us at 4096 / 8192 tokens", "GB/s (cross-GPU)", "fixed us"],
                     rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepep_cupy.bench.scale_model", description=__doc__.split("\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=list(DEFAULT_EP_SIZES), help="EP sizes (ranks)")
    p.add_argument("--gpus-per-node", type=int, nargs="+", default=[8, 4])
    p.add_argument("--nic-gbps", type=float, nargs="+", default=[50.0],
                   help="NIC rate per GPU, GB/s each way (400 Gb/s = 50)")
    p.add_argument("--nic-efficiency", type=float, default=None, help="default: 0.9, with --decode 0.84")
    p.add_argument("--nvlink-gbps", type=float, default=None,
                   help="override the measured NVLink kernel rate (H800 as DeepEP measured it: ~134)")
    p.add_argument("--routing", choices=["node-limited", "uniform"], default="node-limited",
                   help="routing of the time tables (the bytes table shows both)")
    p.add_argument("--chunks", type=int, default=4, help="pipeline pieces of the chunked column")
    p.add_argument("--samples", type=int, default=16384, help="Monte Carlo tokens per EP (node-limited)")
    p.add_argument("--seed", type=int, default=0)
    from .decode_scale import add_arguments  # decode_scale imports this module: here, not at the top
    add_arguments(p)
    return p


def render(args: argparse.Namespace) -> str:
    workload = Workload()
    clusters = _clusters(args.ep, args.gpus_per_node)
    out = [f"Workload: {workload.num_tokens} tokens/rank, hidden {workload.hidden}, top-{workload.num_topk} "
           f"of {workload.num_experts} experts; per rank, expected values.", "",
           "NVLink kernels, fitted from the measured loop times:", "", measured_table(), "",
           "Pairs per token and bytes per rank:", "",
           bytes_table(workload, clusters, ["uniform", "node-limited"], samples=args.samples, seed=args.seed)]
    for nic in args.nic_gbps:
        rates = Rates(nic_gbps=nic, nic_efficiency=args.nic_efficiency or Rates.nic_efficiency,
                      nvlink_gbps=args.nvlink_gbps)
        nvl = "measured H200 kernels" if args.nvlink_gbps is None else f"NVLink {args.nvlink_gbps:g} GB/s"
        out += ["", f"Times in us, NIC {nic:g} GB/s x {rates.nic_efficiency:g}, {nvl}, {args.routing} routing:", "",
                time_table(workload, clusters, rates, args.routing, samples=args.samples, seed=args.seed,
                           chunks=args.chunks)]
    out += ["", "DeepEP V1's published figures against the same bandwidth bound (H800, 50 GB/s NIC):", "",
            deepep_check_table(workload, samples=args.samples, seed=args.seed)]
    return "\n".join(out)


def _print_to_a_reader_that_may_stop(text: str) -> None:
    """Print ``text``; a reader that stopped early (``| head``) ends the output, not the program.

    After a BrokenPipeError stdout is pointed at /dev/null, so that the interpreter's own flush at
    exit does not raise again (the recipe of Python's ``signal`` documentation, SIGPIPE)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print the tables; 0 also when the reader stopped early: it has the lines it asked for."""
    args = build_parser().parse_args(argv)
    from .decode_scale import render_decode  # decode_scale imports this module: here, not at the top
    _print_to_a_reader_that_may_stop(render_decode(args) if args.decode else render(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
