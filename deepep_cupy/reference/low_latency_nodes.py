"""NumPy model of the low-latency (decode) calls across nodes, bit-exact with the kernels.

``R = N * P`` ranks on ``N`` nodes of ``P`` ranks (rank ``n * P + p`` is rank ``p`` of node ``n``);
the other conventions are :mod:`deepep_cupy.reference.low_latency`'s. Every rank's tokens cross to
each node once, to its rail peer there (the rank with the same ``p``), which dispatches them to
that node's experts with the node's own decode calls. So each node runs one node-sized call:

- rank ``p`` of node ``n`` sends, for the tokens of every rank ``n' * P + p`` (``n'`` in node
  order), token ``t`` as its token ``n' * M + t``; its top-k ids are made node ``n``'s (expert
  ``e`` of node ``n`` becomes ``e - n * P * L``, the others -1), rows past a rank's token count
  name no expert. The node's call has ``N * M`` tokens per rank and ``P * L`` experts.
- Dispatch: the node call's ``recv_x``, ``recv_count`` and scales as they are (``[L, R * M, H]``:
  the same shape), so the rows of a local expert come node rank by node rank, and within one by
  ``n' * M + t``: source rank ``n' * P + p`` is one run of them. ``src_info`` is ``t`` and
  ``layout_range[l, s]`` that run of source ``s``, as DeepEP's.
- Combine: each node sums its experts' rows of a token with the node call's combine (into BF16:
  a partial sum), and the token's owner adds its ``N`` partial sums in node order, in float32
  from 0, then rounds to BF16.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from . import low_latency as one_node
from .intranode import bfloat16_bits_to_float32, float32_to_bfloat16_bits

__all__ = ["combine", "dispatch", "node_routing"]


def node_routing(topk_idx, node: int, num_nodes: int, num_experts: int) -> np.ndarray:
    """``topk_idx`` as ``node`` sees it: its experts' node indices, -1 elsewhere."""
    topk = np.asarray(topk_idx, np.int64)
    per_node = num_experts // num_nodes
    mine = (topk >= 0) & (topk // per_node == node)
    return np.where(mine, topk - node * per_node, -1)


def _node_tokens(per_rank: Sequence[np.ndarray], node: int, local: int, ranks_per_node: int, num_max: int,
                 fill) -> np.ndarray:
    """Node ``node``'s rank ``local``'s tokens of its node call: rank ``n * P + local``'s rows at
    ``n * M``, each source padded with ``fill`` to ``M`` rows."""
    num_nodes = len(per_rank) // ranks_per_node
    parts = []
    for n in range(num_nodes):
        rows = np.asarray(per_rank[n * ranks_per_node + local])
        pad = np.full((num_max - rows.shape[0],) + rows.shape[1:], fill, rows.dtype)
        parts.append(np.concatenate([rows, pad]))
    return np.concatenate(parts)


def _node_calls(xs, topk_idxs, num_max: int, num_experts: int, ranks_per_node: int):
    """Per node: every node rank's (x, top-k ids) of the node call."""
    num_nodes = len(xs) // ranks_per_node
    calls = []
    for node in range(num_nodes):
        routed = [node_routing(t, node, num_nodes, num_experts) for t in topk_idxs]
        calls.append([(_node_tokens(xs, node, p, ranks_per_node, num_max, 0),
                       _node_tokens(routed, node, p, ranks_per_node, num_max, -1)) for p in range(ranks_per_node)])
    return calls


def _check_shape(num_ranks: int, num_experts: int, ranks_per_node: int) -> int:
    if ranks_per_node <= 0 or num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node: expected a divisor of {num_ranks} ranks, got {ranks_per_node}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of {num_ranks} ranks, got {num_experts}")
    return num_ranks // ranks_per_node


def dispatch(xs: Sequence[np.ndarray], topk_idxs: Sequence[np.ndarray], num_max_dispatch_tokens_per_rank: int,
             num_experts: int, ranks_per_node: int, *, use_fp8: bool = False, round_scale: bool = False,
             use_ue8m0: bool = False) -> List[dict]:
    """Every rank's results, as :func:`deepep_cupy.reference.low_latency.dispatch` returns them
    (``src_info`` and ``layout_range`` DeepEP's), plus ``node``: the node call's own results
    (what the combine uses)."""
    M = int(num_max_dispatch_tokens_per_rank)
    num_nodes = _check_shape(len(xs), num_experts, ranks_per_node)
    for topk in topk_idxs:
        one_node._check_routing(topk, num_experts)
    L = num_experts // len(xs)
    results = []
    for calls in _node_calls(xs, topk_idxs, M, num_experts, ranks_per_node):
        node_results = one_node.dispatch([x for x, _ in calls], [t for _, t in calls], num_nodes * M,
                                         ranks_per_node * L, use_fp8=use_fp8, round_scale=round_scale,
                                         use_ue8m0=use_ue8m0)
        for result in node_results:
            src, ranges = result["src_info"], result["layout_range"]
            layout_range = np.zeros((L, len(xs)), np.int64)
            for local in range(L):
                for source_node in range(num_nodes):
                    for q in range(ranks_per_node):
                        begin, count = int(ranges[local, q]) >> 32, int(ranges[local, q]) & 0xFFFFFFFF
                        run = src[local, begin:begin + count]
                        first = begin + int(np.searchsorted(run, source_node * M))
                        end = begin + int(np.searchsorted(run, (source_node + 1) * M))
                        layout_range[local, source_node * ranks_per_node + q] = (first << 32) | (end - first)
            results.append(dict(result, src_info=src % M, layout_range=layout_range, node=result))
    return results


def combine(expert_outputs: Sequence[np.ndarray], topk_idxs: Sequence[np.ndarray],
            topk_weights: Sequence[np.ndarray], results: Sequence[dict], ranks_per_node: int,
            ranks: Optional[Sequence[int]] = None, use_logfmt: bool = False) -> List[Optional[np.ndarray]]:
    """Every rank's combine output, BF16 bits ``uint16 [N_r, H]`` (arguments as
    :func:`deepep_cupy.reference.low_latency.combine`'s; ``results`` from :func:`dispatch`)."""
    num_ranks = len(expert_outputs)
    L, _, hidden = expert_outputs[0].shape
    num_experts = L * num_ranks
    num_nodes = _check_shape(num_ranks, num_experts, ranks_per_node)
    M = results[0]["node"]["src_info"].shape[1] // num_ranks
    wanted = range(num_ranks) if ranks is None else ranks
    node_ranks = sorted({rank % ranks_per_node for rank in wanted})  # whose partial sums are needed
    partials = []  # [node][node rank]: [N * M, H] BF16 bits (None where not needed)
    for node in range(num_nodes):
        members = range(node * ranks_per_node, (node + 1) * ranks_per_node)
        routed = [node_routing(t, node, num_nodes, num_experts) for t in topk_idxs]
        weights = [np.asarray(w, np.float32) for w in topk_weights]
        partials.append(one_node.combine(
            [expert_outputs[g] for g in members],
            [_node_tokens(routed, node, p, ranks_per_node, M, -1) for p in range(ranks_per_node)],
            [_node_tokens(weights, node, p, ranks_per_node, M, 0) for p in range(ranks_per_node)],
            [results[g]["node"] for g in members], ranks=node_ranks, use_logfmt=use_logfmt))
    outputs: List[Optional[np.ndarray]] = []
    for rank in range(num_ranks):
        if ranks is not None and rank not in ranks:
            outputs.append(None)
            continue
        node, p = divmod(rank, ranks_per_node)
        n_tokens = np.asarray(topk_idxs[rank]).shape[0]
        acc = np.zeros((n_tokens, hidden), np.float32)
        for source_node in range(num_nodes):
            rows = partials[source_node][p]
            assert rows is not None  # every node rank's partial sums were computed
            part = rows[node * M:node * M + n_tokens]
            acc = (acc + bfloat16_bits_to_float32(part)).astype(np.float32)
        outputs.append(float32_to_bfloat16_bits(acc))
    return outputs
