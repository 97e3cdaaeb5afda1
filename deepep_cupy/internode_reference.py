"""NumPy reference model of internode (hierarchical) dispatch/combine.

The GPU path (``deepep_cupy/internode.py``) is compared with this module bit-exactly. It is built
on the intranode model (:mod:`deepep_cupy.reference`), which it runs once per node for the NVLink
stage, and models nothing of the kernels beyond the contracts.

Conventions (on top of :mod:`deepep_cupy.reference`'s):

- ``R`` ranks in ``N = R / L`` nodes of ``L`` ranks each; rank ``r`` is local rank ``r % L`` of
  node ``r // L``. Node ``n`` owns experts ``[n*E/N, (n+1)*E/N)`` (those of its ranks).
- Rail: the ranks with one local index, one per node. A token of rank ``(s, l)`` (node ``s``,
  local rank ``l``) that has an expert on node ``n`` crosses to rank ``(n, l)``, its *forwarding
  rank* there, once, whatever the number of its experts on ``n`` (deduplicated per node); the
  block for the own node ``n = s`` is not sent over the network.
- A forwarding rank's tokens, in *forwarding order* (source node ascending, then source token
  index ascending), are the input of an intranode dispatch on its node (the intranode model with
  ``L`` ranks and ``E/N`` experts) with top-k ids made node-local (``e - n*E/N``; ids of other
  nodes become -1 with weight 0). Its outputs are the internode dispatch's: receive order on a
  rank is by forwarding local rank, then source node, then source token index.
- Combine: the intranode combine on each node gives each forwarding rank the node's partial sum
  of each forwarded token (float32, rounded to x's dtype: the first rounding); those rows go back
  over the rail, and the owner sums them in float32, its biases first, then the nodes in
  ascending order (the second rounding is the caller's: ``reference.round_to_dtype``).
"""

from __future__ import annotations

import numpy as np

from . import reference

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


def dispatch(xs, topk_idxs, num_experts: int, ranks_per_node: int, num_channels: int, *, topk_weights=None,
             x_scales=None, expert_alignment: int = 1) -> list[dict]:
    """Internode dispatch of all ranks at once.

    Args:
        xs, topk_idxs, topk_weights, x_scales, expert_alignment: as for
            :func:`deepep_cupy.reference.dispatch` (``R`` of each).
        num_experts: ``E``, a multiple of ``R``.
        ranks_per_node: ``L``, dividing ``R``.
        num_channels: channels of the intranode stage's dispatch config.

    Returns:
        One dict per rank with the outputs ``recv_x``, ``recv_x_scales``, ``recv_topk_idx``,
        ``recv_topk_weights``, ``num_recv_tokens_per_expert_list`` (receive order: forwarding
        local rank, source node, source token), ``num_tokens`` (the rank's own), the layout
        ``num_tokens_per_rdma_rank``, and the
        handle's pieces: ``send_token_idx`` (``N`` int64 arrays: the tokens this rank sends to
        each node, ascending), ``send_counts`` and ``recv_counts`` (``N`` ints: tokens sent to /
        forwarded from each node), ``forwarded`` (the intranode stage's inputs: ``x``,
        ``x_scales``, ``topk_idx`` node-local, ``topk_weights``) and ``intranode`` (the intranode
        model's result dict for this rank, its handle included).
    """
    num_ranks = len(xs)
    L = int(ranks_per_node)
    num_nodes = check_topology(num_ranks, L, num_experts)
    if len(topk_idxs) != num_ranks:
        raise ValueError(f"got {len(xs)} xs but {len(topk_idxs)} topk_idxs")
    experts_per_node = int(num_experts) // num_nodes
    xs = [np.asarray(x) for x in xs]
    topk_idxs = [reference._check_topk_idx(t, num_experts) for t in topk_idxs]
    trailing, dtype = xs[0].shape[1:], xs[0].dtype
    num_topk = topk_idxs[0].shape[1]
    weights = None if topk_weights is None else [np.asarray(w, dtype=np.float32) for w in topk_weights]
    scales = None if x_scales is None else [np.asarray(s, dtype=np.float32) for s in x_scales]

    in_nodes = [node_membership(t, num_experts, num_nodes) for t in topk_idxs]
    send_idx = [[np.nonzero(in_nodes[r][:, n])[0].astype(np.int64) for n in range(num_nodes)]
                for r in range(num_ranks)]

    forwarded = []
    for f in range(num_ranks):
        n, local = divmod(f, L)
        sources = [s * L + local for s in range(num_nodes)]
        picks = [send_idx[src][n] for src in sources]
        topk = reference._gather_rows([topk_idxs[s] for s in sources], picks, (num_topk,), np.int64)
        local = (topk >= n * experts_per_node) & (topk < (n + 1) * experts_per_node)
        fw = {
            "x": reference._gather_rows([xs[s] for s in sources], picks, trailing, dtype),
            "x_scales": None if scales is None else
            reference._gather_rows([scales[s] for s in sources], picks, scales[0].shape[1:], np.float32),
            "topk_idx": np.where(local, topk - n * experts_per_node, -1).astype(np.int64),
            "topk_weights": None if weights is None else np.where(
                local, reference._gather_rows([weights[s] for s in sources], picks, (num_topk,), np.float32),
                np.float32(0.0)).astype(np.float32),
            "recv_counts": [len(p) for p in picks],
        }
        forwarded.append(fw)

    results = [None] * num_ranks
    for n in range(num_nodes):
        members = range(n * L, (n + 1) * L)
        inner = reference.dispatch(
            [forwarded[f]["x"] for f in members], [forwarded[f]["topk_idx"] for f in members], experts_per_node,
            num_channels, topk_weights=None if weights is None else [forwarded[f]["topk_weights"] for f in members],
            x_scales=None if scales is None else [forwarded[f]["x_scales"] for f in members],
            expert_alignment=expert_alignment)
        for local, f in enumerate(members):
            fw = forwarded[f]
            results[f] = {
                "recv_x": inner[local]["recv_x"],
                "recv_x_scales": inner[local]["recv_x_scales"],
                "recv_topk_idx": inner[local]["recv_topk_idx"],
                "recv_topk_weights": inner[local]["recv_topk_weights"],
                "num_recv_tokens_per_expert_list": inner[local]["num_recv_tokens_per_expert_list"],
                "num_tokens": int(topk_idxs[f].shape[0]),
                "num_tokens_per_rdma_rank": in_nodes[f].sum(axis=0).astype(np.int32),
                "send_token_idx": send_idx[f],
                "send_counts": [len(p) for p in send_idx[f]],
                "recv_counts": fw["recv_counts"],
                "forwarded": {k: fw[k] for k in ("x", "x_scales", "topk_idx", "topk_weights")},
                "intranode": inner[local],
                "intranode_results": inner,
            }
    return results


def combine(xs, results, dtype_name: str, *, topk_weights=None, bias=None):
    """Internode combine of all ranks at once: the reverse of :func:`dispatch`.

    Args:
        xs: ``R`` arrays in each rank's receive order (read like :func:`reference.combine`'s).
        results: what :func:`dispatch` returned.
        dtype_name: x's element type (``'bfloat16'``, ``'float16'`` or ``'float32'``): each node's
            partial sums are rounded to it before they cross back (the first rounding).
        topk_weights: None or ``R`` float32 arrays ``[N_recv_r, K]`` (no rounding: float32 throughout).
        bias: None or, per rank, a tuple of 0, 1 or 2 arrays ``[N_m, H]``.

    Returns:
        Per rank ``m``: ``(combined_x float32 [N_m, H], combined_topk_weights float32 or None)``:
        row ``t`` is the float32 sum, from 0.0, of the biases in order, then of the partial rows
        of the nodes ``t`` went to, in ascending node order. Round it with
        :func:`reference.round_to_dtype` to compare with the GPU (the second rounding).
    """
    num_ranks = len(results)
    if len(xs) != num_ranks:
        raise ValueError(f"got {len(xs)} xs for {num_ranks} ranks")
    num_nodes = len(results[0]["send_counts"])
    L = num_ranks // num_nodes
    partial = [None] * num_ranks
    for n in range(num_nodes):
        members = list(range(n * L, (n + 1) * L))
        inner = results[members[0]]["intranode_results"]
        sums = reference.combine([xs[f] for f in members], inner,
                                 topk_weights=None if topk_weights is None else [topk_weights[f] for f in members])
        for local, f in enumerate(members):
            rows, w = sums[local]
            rounded = reference._as_float32(reference.round_to_dtype(rows, dtype_name))
            partial[f] = (rounded, w)

    out = []
    for m in range(num_ranks):
        s, local = divmod(m, L)
        num_tokens = results[m]["num_tokens"]
        trailing = partial[m][0].shape[1:]
        combined = np.zeros((num_tokens, *trailing), dtype=np.float32)
        for b in (() if bias is None else bias[m]):
            b = reference._as_float32(b)
            if b.shape != combined.shape:
                raise ValueError(f"bias of rank {m} has shape {b.shape}, expected {combined.shape}")
            combined = combined + b
        combined_w = None
        if topk_weights is not None:
            combined_w = np.zeros((num_tokens, np.asarray(topk_weights[m]).shape[1]), dtype=np.float32)
        for n in range(num_nodes):  # ascending: the summation order is part of the contract
            f = n * L + local
            start = sum(results[f]["recv_counts"][:s])
            count = results[f]["recv_counts"][s]
            tokens = results[m]["send_token_idx"][n]
            assert len(tokens) == count
            rows, w = partial[f]
            combined[tokens] = combined[tokens] + rows[start:start + count]
            if combined_w is not None:
                combined_w[tokens] = combined_w[tokens] + w[start:start + count]
        out.append((combined, combined_w))
    return out


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
