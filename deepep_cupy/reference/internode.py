"""NumPy reference model of internode (hierarchical) dispatch/combine.

The GPU path (``deepep_cupy/internode/path.py``) is compared with this module bit-exactly. It models
the contracts (what lands where, in which order, summed in which order), nothing of the kernels.

Conventions (on top of :mod:`deepep_cupy.reference.intranode`'s):

- ``R`` ranks in ``N = R / L`` nodes of ``L`` ranks each; rank ``r`` is local rank ``r % L`` of
  node ``r // L``. Node ``n`` owns experts ``[n*E/N, (n+1)*E/N)`` (those of its ranks).
- Rail: the ranks with one local index, one per node. A token of rank ``(s, l)`` (node ``s``,
  local rank ``l``) that has an expert on node ``n`` crosses to rank ``(n, l)``, its *forwarding
  rank* there, once, whatever the number of its experts on ``n`` (deduplicated per node); the
  block for the own node ``n = s`` is not sent over the network.
- A forwarding rank's tokens go on over NVLink to the ranks of its node that ``is_token_in_rank``
  names (by default, those owning one of the token's experts), carrying their top-k ids made
  rank-local (``e - d*E/R``; -1 with weight 0 for experts of other ranks).
- Receive order is DeepEP's: by source rank (global, ascending), then source token index; the
  handle's ``recv_gbl_rank_prefix_sum`` is the inclusive prefix of the rows from each source.
- Expert counts: per local expert, the sum over the senders of their ``num_tokens_per_expert``
  (what a top-k counts, when it is given), rounded up to ``expert_alignment``.
- Combine: each node sums a token's copies on its ranks (float32, ascending rank order) and rounds
  to x's dtype (the first rounding); those rows go back over the rail, and the owner sums them in
  float32, its biases first, then the nodes in ascending order (the second rounding is the
  caller's: ``reference.round_to_dtype``).
"""

from __future__ import annotations

import numpy as np

from . import intranode as reference

__all__ = [
    "check_topology",
    "node_membership",
    "get_dispatch_layout",
    "dispatch",
    "combine",
    "traffic",
]


def check_topology(num_ranks: int, ranks_per_node: int, num_experts: int) -> int:
    """The node count ``N``; raises ValueError when the ranks or experts do not split into nodes."""
    num_ranks, ranks_per_node, num_experts = int(num_ranks), int(ranks_per_node), int(num_experts)
    if ranks_per_node <= 0 or num_ranks <= 0 or num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the rank count ({num_ranks})")
    if num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the rank count ({num_ranks})")
    return num_ranks // ranks_per_node


def node_membership(topk_idx, num_experts: int, num_nodes: int) -> np.ndarray:
    """bool ``[num_tokens, N]``: whether token ``t`` has at least one expert on node ``n`` (the
    intranode layout's ``is_token_in_rank`` with the nodes as ranks)."""
    return reference.get_dispatch_layout(topk_idx, num_experts, num_nodes)[2]


def get_dispatch_layout(topk_idx, num_experts: int, num_ranks: int, ranks_per_node: int):
    """One rank's layout on an internode Buffer.

    Returns:
        ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [N],
        num_tokens_per_expert int32 [E], is_token_in_rank bool [num_tokens, R])``; the per-node
        counts are the tokens with at least one expert on each node (DeepEP's name).
    """
    num_nodes = check_topology(num_ranks, ranks_per_node, num_experts)
    per_rank, per_expert, in_rank = reference.get_dispatch_layout(topk_idx, num_experts, num_ranks)
    per_node = node_membership(topk_idx, num_experts, num_nodes).sum(axis=0).astype(np.int32)
    return per_rank, per_node, per_expert, in_rank


def dispatch(xs, topk_idxs, num_experts: int, ranks_per_node: int, *, topk_weights=None, x_scales=None,
             expert_alignment: int = 1, is_token_in_ranks=None, num_tokens_per_experts=None) -> list[dict]:
    """Internode dispatch of all ranks at once.

    Args:
        xs, topk_weights, x_scales, expert_alignment: as for :func:`deepep_cupy.reference.intranode.dispatch`
            (``R`` of each).
        topk_idxs: ``R`` int64 arrays ``[N_r, K]``, or None (a dispatch routed by
            ``is_token_in_ranks`` alone, carrying no top-k).
        num_experts: ``E``, a multiple of ``R``.
        ranks_per_node: ``L``, dividing ``R``.
        is_token_in_ranks: None (routed by the top-k's experts) or ``R`` bool arrays ``[N_r, R]``:
            where each token goes (DeepEP routes by these; the top-k only travels with it).
        num_tokens_per_experts: None (counted from the top-k) or ``R`` int32 arrays ``[E]``: each
            rank's tokens per expert, whose sums over the senders are the receivers' expert counts.

    Returns:
        One dict per rank: the outputs ``recv_x``, ``recv_x_scales``, ``recv_topk_idx``,
        ``recv_topk_weights`` (None without top-k), ``num_recv_tokens_per_expert_list``, in
        DeepEP's receive order (by source rank, then source token index);
        ``recv_gbl_rank_prefix_sum`` (int32 ``[R]``: inclusive prefix of the rows from each source
        rank), ``recv_src`` (int64 ``[rows, 2]``: each row's source rank and token index),
        ``num_tokens`` (the rank's own), the layout's ``num_tokens_per_rdma_rank``, and the
        rail's pieces: ``send_token_idx`` (``N`` int64 arrays: the tokens this rank sends to each
        node, ascending), ``send_counts`` and ``recv_counts`` (``N`` ints: tokens this rank sends
        to each node, and forwards from each node), ``is_token_in_rank`` (its routing).
    """
    num_ranks = len(xs)
    L = int(ranks_per_node)
    num_nodes = check_topology(num_ranks, L, num_experts)
    experts_per_rank = int(num_experts) // num_ranks
    xs = [np.asarray(x) for x in xs]
    trailing, dtype = xs[0].shape[1:], xs[0].dtype
    if topk_idxs is not None:
        if len(topk_idxs) != num_ranks:
            raise ValueError(f"got {len(xs)} xs but {len(topk_idxs)} topk_idxs")
        topk_idxs = [reference._check_topk_idx(t, num_experts) for t in topk_idxs]
    elif topk_weights is not None:
        raise ValueError("topk_weights travel with topk_idxs; got weights without top-k")
    if is_token_in_ranks is None:
        if topk_idxs is None:
            raise ValueError("a dispatch without topk_idxs is routed by is_token_in_ranks; pass them")
        is_token_in_ranks = [reference.get_dispatch_layout(t, num_experts, num_ranks)[2] for t in topk_idxs]
    in_ranks = [np.asarray(a, dtype=bool) for a in is_token_in_ranks]
    if num_tokens_per_experts is None:
        if topk_idxs is None:
            raise ValueError("a dispatch without topk_idxs takes its expert counts from num_tokens_per_experts")
        num_tokens_per_experts = [reference.get_dispatch_layout(t, num_experts, num_ranks)[1] for t in topk_idxs]
    weights = None if topk_weights is None else [np.asarray(w, dtype=np.float32) for w in topk_weights]
    scales = None if x_scales is None else [np.asarray(s, dtype=np.float32) for s in x_scales]
    num_topk = None if topk_idxs is None else topk_idxs[0].shape[1]

    in_nodes = [np.any(a.reshape(a.shape[0], num_nodes, L), axis=2) for a in in_ranks]
    send_idx = [[np.nonzero(in_nodes[r][:, n])[0].astype(np.int64) for n in range(num_nodes)]
                for r in range(num_ranks)]
    results = []
    for d in range(num_ranks):
        node, local = divmod(d, L)
        picks = [np.nonzero(in_ranks[g][:, d])[0].astype(np.int64) for g in range(num_ranks)]
        counts = np.array([len(p) for p in picks], dtype=np.int64)
        result = {
            "recv_x": reference._gather_rows(xs, picks, trailing, dtype),
            "recv_x_scales": None if scales is None else
            reference._gather_rows(scales, picks, scales[0].shape[1:], np.float32),
            "recv_topk_idx": None,
            "recv_topk_weights": None,
            "recv_gbl_rank_prefix_sum": np.cumsum(counts).astype(np.int32),
            "recv_src": np.stack([np.repeat(np.arange(num_ranks, dtype=np.int64), counts),
                                  np.concatenate(picks) if picks else np.zeros(0, np.int64)], axis=1),
            "num_tokens": int(xs[d].shape[0]),
            "num_tokens_per_rdma_rank": in_nodes[d].sum(axis=0).astype(np.int32),
            "send_token_idx": send_idx[d],
            "send_counts": [len(p) for p in send_idx[d]],
            "recv_counts": [len(send_idx[m * L + local][node]) for m in range(num_nodes)],
            "is_token_in_rank": in_ranks[d],
        }
        first = d * experts_per_rank
        if topk_idxs is not None:
            topk = reference._gather_rows(topk_idxs, picks, (num_topk,), np.int64)
            mine = (topk >= first) & (topk < first + experts_per_rank)
            result["recv_topk_idx"] = np.where(mine, topk - first, -1).astype(np.int64)
            if weights is not None:
                w = reference._gather_rows(weights, picks, (num_topk,), np.float32)
                result["recv_topk_weights"] = np.where(mine, w, np.float32(0.0)).astype(np.float32)
        totals = np.sum([np.asarray(c, dtype=np.int64)[first:first + experts_per_rank]
                         for c in num_tokens_per_experts], axis=0)
        result["num_recv_tokens_per_expert_list"] = [int(-(-int(c) // expert_alignment) * expert_alignment)
                                                     for c in totals]
        results.append(result)
    return results


def combine(xs, results, dtype_name: str, *, topk_weights=None, bias=None):
    """Internode combine of all ranks at once: the reverse of :func:`dispatch`.

    Args:
        xs: ``R`` arrays in each rank's receive order (``[rows_r, H]``, rows as dispatched).
        results: what :func:`dispatch` returned.
        dtype_name: x's element type (``'bfloat16'``, ``'float16'`` or ``'float32'``): each node's
            partial sums are rounded to it before they cross back (the first rounding).
        topk_weights: None or ``R`` float32 arrays ``[rows_r, K]`` (no rounding: float32 throughout).
        bias: None or, per rank, a tuple of 0, 1 or 2 arrays ``[N_m, H]``.

    Returns:
        Per rank ``m``: ``(combined_x float32 [N_m, H], combined_topk_weights float32 or None)``.
        A token's node partial is the float32 sum of its copies on the node's ranks, in ascending
        rank order, rounded to x's dtype; row ``t`` is the float32 sum, from 0.0, of the biases in
        order, then of the partials of the nodes ``t`` went to, in ascending node order. Round it
        with :func:`reference.round_to_dtype` to compare with the GPU (the second rounding).
    """
    num_ranks = len(results)
    if len(xs) != num_ranks:
        raise ValueError(f"got {len(xs)} xs for {num_ranks} ranks")
    num_nodes = len(results[0]["send_counts"])
    L = num_ranks // num_nodes
    xs = [reference._as_float32(x) for x in xs]
    ws = None if topk_weights is None else [np.asarray(w, dtype=np.float32) for w in topk_weights]
    out = []
    for m in range(num_ranks):
        num_tokens = results[m]["num_tokens"]
        combined = np.zeros((num_tokens, *xs[0].shape[1:]), dtype=np.float32)
        for b in (() if bias is None else bias[m]):
            b = reference._as_float32(b)
            if b.shape != combined.shape:
                raise ValueError(f"bias of rank {m} has shape {b.shape}, expected {combined.shape}")
            combined = combined + b
        combined_w = None if ws is None else np.zeros((num_tokens, ws[m].shape[1]), dtype=np.float32)
        in_rank = results[m]["is_token_in_rank"]
        for n in range(num_nodes):  # ascending: the summation order is part of the contract
            tokens = results[m]["send_token_idx"][n]
            partial = np.zeros((len(tokens), *combined.shape[1:]), dtype=np.float32)
            partial_w = None if ws is None else np.zeros((len(tokens), ws[m].shape[1]), dtype=np.float32)
            for d in range(n * L, (n + 1) * L):  # the node's ranks, ascending
                here = in_rank[tokens, d]
                rows = _rows_of(results[d], m, tokens[here])
                partial[here] = partial[here] + xs[d][rows]
                if ws is not None and partial_w is not None:
                    partial_w[here] = partial_w[here] + ws[d][rows]
            combined[tokens] = combined[tokens] + reference._as_float32(reference.round_to_dtype(partial, dtype_name))
            if combined_w is not None:
                combined_w[tokens] = combined_w[tokens] + partial_w
        out.append((combined, combined_w))
    return out


def _rows_of(result: dict, source: int, tokens) -> np.ndarray:
    """The rows of ``result`` (one rank's dispatch) holding ``source``'s ``tokens``."""
    src = result["recv_src"]
    start = 0 if source == 0 else int(result["recv_gbl_rank_prefix_sum"][source - 1])
    block = src[start:int(result["recv_gbl_rank_prefix_sum"][source]), 1]
    return start + np.searchsorted(block, tokens)


def traffic(topk_idxs, num_experts: int, num_ranks: int, ranks_per_node: int) -> dict:
    """Rows that cross between nodes, hierarchical and flat, for the routing of all ranks.

    Returns:
        ``{"hierarchical": int, "flat": int, "flat_all_ranks": int, "per_rank_hierarchical": [R],
        "per_rank_flat": [R], "per_rank_flat_all_ranks": [R]}``: ``hierarchical`` counts the (token,
        destination node) pairs with the destination node not the token's (the rows this design sends
        over the network: a row per token per other node); ``flat`` counts the (token, destination rank)
        pairs with the destination rank on another node (what a flat all-to-all that sends each token
        once per rank, like DeepEP's intranode dispatch, puts on the network); ``flat_all_ranks`` counts
        the (token, destination rank) pairs with any other destination rank (all a flat all-to-all
        moves, over NVLink or not). Multiply by the row bytes for bytes.
    """
    num_nodes = check_topology(num_ranks, ranks_per_node, num_experts)
    per_hier, per_flat, per_flat_all = [], [], []
    for r, topk in enumerate(topk_idxs):
        own_node = r // ranks_per_node
        in_node = node_membership(topk, num_experts, num_nodes)
        _, _, in_rank = reference.get_dispatch_layout(topk, num_experts, num_ranks)
        per_hier.append(int(in_node.sum() - in_node[:, own_node].sum()))
        other_node = np.ones(num_ranks, dtype=bool)
        other_node[own_node * ranks_per_node:(own_node + 1) * ranks_per_node] = False
        per_flat.append(int(in_rank[:, other_node].sum()))
        per_flat_all.append(int(in_rank.sum() - in_rank[:, r].sum()))
    return {"hierarchical": sum(per_hier), "flat": sum(per_flat), "flat_all_ranks": sum(per_flat_all),
            "per_rank_hierarchical": per_hier, "per_rank_flat": per_flat, "per_rank_flat_all_ranks": per_flat_all}
