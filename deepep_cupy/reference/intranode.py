"""NumPy reference model of intranode dispatch/combine.

This module is the source of truth for the GPU tests: every GPU result (layout, dispatch, combine
and the handle) is compared against what these functions compute, bit-exactly for moved data.
It implements the data contracts of ``DESIGN.md`` ("Data contracts") with plain NumPy and no
knowledge of the kernels' queues beyond what the contracts expose (``send_head`` slots).

Conventions used throughout:

- ``R`` ranks, ``E`` experts (``E % R == 0``, rank ``r`` owns experts ``[r*E/R, (r+1)*E/R)``),
  ``K`` top-k slots per token (``-1`` = no expert), ``C`` channels per rank.
- A rank with ``N`` tokens gives channel ``c`` the contiguous token range
  :func:`channel_task_range` ``(N, C, c)``.
- Receive order on every rank: grouped by source rank (0 first), inside a source by source token
  index ascending.
- BF16 data is stored as ``uint16`` bit patterns, FP8 e4m3 data as ``uint8`` bytes (NumPy has
  neither dtype); dispatch moves rows as raw data, so any dtype works there.
"""

from __future__ import annotations

import numpy as np

from ..constants import FP8_SCALE_BLOCK

__all__ = [
    "channel_task_range",
    "random_routing",
    "get_dispatch_layout",
    "dispatch",
    "handle_of",
    "combine",
    "float32_to_bfloat16_bits",
    "bfloat16_bits_to_float32",
    "round_to_dtype",
    "fp8_e4m3_scaled_random",
]


# ----------------------------------------------------------------------------------------------
# Channels
# ----------------------------------------------------------------------------------------------

def channel_task_range(num_tokens: int, num_channels: int, channel: int) -> tuple[int, int]:
    """Token range ``[begin, end)`` handled by ``channel`` on a rank with ``num_tokens`` tokens.

    Every channel gets ``ceil(num_tokens / num_channels)`` consecutive tokens; the last channels
    may get fewer, or none (``begin == end``).
    """
    if num_channels <= 0:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    per = -(-num_tokens // num_channels)
    begin = min(per * channel, num_tokens)
    end = min(begin + per, num_tokens)
    return begin, end


def _token_channels(num_tokens: int, num_channels: int) -> np.ndarray:
    """Channel of each token (int64 ``[num_tokens]``), consistent with :func:`channel_task_range`."""
    if num_channels <= 0:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    per = -(-num_tokens // num_channels)
    if per == 0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(num_tokens, dtype=np.int64) // per


# ----------------------------------------------------------------------------------------------
# Routing and layout
# ----------------------------------------------------------------------------------------------

def random_routing(rng, num_tokens, num_experts, num_topk, *, skew=0.0, drop_fraction=0.0) -> np.ndarray:
    """Random top-k routing, int64 ``[num_tokens, num_topk]``.

    Each row holds ``num_topk`` distinct experts in ``[0, num_experts)``, drawn without replacement
    with weights ``exp(-skew * e / num_experts)`` (``skew = 0``: uniform; ``skew > 0``: low-numbered
    experts are "hot"). Afterwards each entry independently becomes ``-1`` with probability
    ``drop_fraction``.
    """
    num_tokens, num_experts, num_topk = int(num_tokens), int(num_experts), int(num_topk)
    if num_tokens < 0 or num_experts <= 0 or num_topk < 0:
        raise ValueError("num_tokens >= 0, num_experts > 0 and num_topk >= 0 are required")
    if num_topk > num_experts:
        raise ValueError(f"num_topk ({num_topk}) exceeds num_experts ({num_experts})")
    if not 0.0 <= drop_fraction <= 1.0:
        raise ValueError(f"drop_fraction must be in [0, 1], got {drop_fraction}")
    # Weighted sampling without replacement via the Gumbel-top-k trick: perturb the log-weights
    # with independent Gumbel noise and keep the k largest keys of each row.
    log_w = -float(skew) * np.arange(num_experts, dtype=np.float64) / num_experts
    keys = log_w[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    topk = np.argsort(-keys, axis=1, kind="stable")[:, :num_topk].astype(np.int64)
    if drop_fraction > 0.0:
        topk[rng.random(topk.shape) < drop_fraction] = -1
    return topk


def _check_topk_idx(topk_idx, num_experts: int) -> np.ndarray:
    topk_idx = np.asarray(topk_idx)
    if topk_idx.ndim != 2:
        raise ValueError(f"topk_idx must be 2-D [num_tokens, num_topk], got shape {topk_idx.shape}")
    if not np.issubdtype(topk_idx.dtype, np.integer):
        raise TypeError(f"topk_idx must be an integer array, got {topk_idx.dtype}")
    topk_idx = topk_idx.astype(np.int64, copy=False)
    if topk_idx.size and (topk_idx.min() < -1 or topk_idx.max() >= num_experts):
        raise ValueError(f"topk_idx has ids outside [-1, {num_experts}): entries must be -1 or in [0, {num_experts})")
    return topk_idx


def get_dispatch_layout(topk_idx, num_experts, num_ranks):
    """Layout of one rank's routing.

    Args:
        topk_idx: int64 ``[N, K]``, ``-1`` = no expert.
        num_experts: ``E``, a multiple of ``num_ranks``.
        num_ranks: ``R``.

    Returns:
        ``(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [N, R])``:
        tokens with at least one expert on rank ``r``; ``(token, k)`` entries equal to ``e``; and
        whether token ``t`` goes to rank ``r``.
    """
    num_experts, num_ranks = int(num_experts), int(num_ranks)
    if num_ranks <= 0 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})")
    topk_idx = _check_topk_idx(topk_idx, num_experts)
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    num_tokens_per_expert = np.bincount(topk_idx[valid], minlength=num_experts).astype(np.int32)
    is_token_in_rank = np.zeros((topk_idx.shape[0], num_ranks), dtype=bool)
    rows, cols = np.nonzero(valid)
    is_token_in_rank[rows, topk_idx[rows, cols] // experts_per_rank] = True
    num_tokens_per_rank = is_token_in_rank.sum(axis=0).astype(np.int32)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def _channel_prefix_matrix(is_token_in_rank: np.ndarray, num_channels: int) -> np.ndarray:
    """Sender-side ``[R, C]`` int32: ``[k, c]`` = tokens of channels ``0..c`` bound for rank ``k``."""
    num_tokens, num_ranks = is_token_in_rank.shape
    channels = _token_channels(num_tokens, num_channels)
    counts = np.zeros((num_ranks, num_channels), dtype=np.int64)
    for k in range(num_ranks):
        counts[k] = np.bincount(channels[is_token_in_rank[:, k]], minlength=num_channels)
    return np.cumsum(counts, axis=1).astype(np.int32)


def _send_head(is_token_in_rank: np.ndarray) -> np.ndarray:
    """``[N, R]`` int32: slot of token ``t`` in rank ``k``'s region for this rank (how many earlier
    tokens of this rank go to ``k``; also the token's row within the block ``k`` receives from this
    rank), or ``-1`` where ``t`` does not go to ``k``."""
    num_tokens, num_ranks = is_token_in_rank.shape
    if num_tokens == 0:
        return np.zeros((0, num_ranks), dtype=np.int32)
    sent = is_token_in_rank.astype(np.int64)
    before = np.cumsum(sent, axis=0) - sent
    return np.where(is_token_in_rank, before, -1).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------

def _gather_rows(arrays, index_lists, trailing_shape, dtype):
    parts = [np.asarray(a)[idx] for a, idx in zip(arrays, index_lists)]
    if not parts:
        return np.zeros((0, *trailing_shape), dtype=dtype)
    return np.concatenate(parts, axis=0)


def dispatch(xs, topk_idxs, num_experts, num_channels, *, topk_weights=None, x_scales=None,
             expert_alignment=1) -> list[dict]:
    """Dispatch of all ranks at once.

    Args:
        xs: ``R`` arrays, ``xs[r]`` of shape ``[N_r, ...]`` (same dtype and trailing shape on all
            ranks); rows are copied exactly.
        topk_idxs: ``R`` int64 arrays ``[N_r, K]``.
        num_experts: ``E``, a multiple of ``R``.
        num_channels: ``C``, channels per rank.
        topk_weights: ``None`` or ``R`` float32 arrays ``[N_r, K]``.
        x_scales: ``None`` or ``R`` float32 arrays ``[N_r, S]`` or ``[N_r]``.
        expert_alignment: per-expert receive counts are rounded up to a multiple of this.

    Returns:
        One dict per receiving rank ``j`` with keys ``recv_x``, ``recv_x_scales``,
        ``recv_topk_idx``, ``recv_topk_weights``, ``num_recv_tokens_per_expert_list``,
        ``rank_prefix_matrix``, ``channel_prefix_matrix``, ``recv_channel_prefix_matrix``,
        ``recv_src_idx``, ``is_token_in_rank``, ``num_tokens_per_rank``,
        ``num_tokens_per_expert`` and ``send_head`` (see ``DESIGN.md``, "Data contracts").
    """
    num_ranks = len(xs)
    num_experts, num_channels, expert_alignment = int(num_experts), int(num_channels), int(expert_alignment)
    if num_ranks == 0:
        raise ValueError("at least one rank is required")
    if len(topk_idxs) != num_ranks:
        raise ValueError(f"got {len(xs)} xs but {len(topk_idxs)} topk_idxs")
    if num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the rank count ({num_ranks})")
    if num_channels <= 0:
        raise ValueError(f"num_channels must be positive, got {num_channels}")
    if expert_alignment <= 0:
        raise ValueError(f"expert_alignment must be positive, got {expert_alignment}")
    xs = [np.asarray(x) for x in xs]
    if any(x.ndim < 1 for x in xs):
        raise ValueError("every xs[r] must have a token dimension")
    dtype, trailing = xs[0].dtype, xs[0].shape[1:]
    for r, x in enumerate(xs):
        if x.dtype != dtype or x.shape[1:] != trailing:
            raise ValueError(f"xs[{r}] has dtype/shape {x.dtype}{x.shape}, expected {dtype}[N, {trailing}]")
    topk_idxs = [_check_topk_idx(t, num_experts) for t in topk_idxs]
    num_topk = topk_idxs[0].shape[1]
    for r in range(num_ranks):
        if topk_idxs[r].shape != (xs[r].shape[0], num_topk):
            raise ValueError(f"topk_idxs[{r}] has shape {topk_idxs[r].shape}, expected {(xs[r].shape[0], num_topk)}")
    if topk_weights is not None:
        if len(topk_weights) != num_ranks:
            raise ValueError("topk_weights must have one array per rank")
        topk_weights = [np.asarray(w, dtype=np.float32) for w in topk_weights]
        for r in range(num_ranks):
            if topk_weights[r].shape != topk_idxs[r].shape:
                raise ValueError(f"topk_weights[{r}] shape {topk_weights[r].shape} != topk_idx shape")
    if x_scales is not None:
        if len(x_scales) != num_ranks:
            raise ValueError("x_scales must have one array per rank")
        x_scales = [np.asarray(s, dtype=np.float32) for s in x_scales]
        scale_trailing = x_scales[0].shape[1:]
        for r in range(num_ranks):
            s = x_scales[r]
            if s.ndim not in (1, 2) or s.shape[0] != xs[r].shape[0] or s.shape[1:] != scale_trailing:
                raise ValueError(f"x_scales[{r}] has shape {s.shape}, expected [{xs[r].shape[0]}, S] or [N]")

    experts_per_rank = num_experts // num_ranks

    # Per-sender layout and sender-side matrices.
    layouts = [get_dispatch_layout(t, num_experts, num_ranks) for t in topk_idxs]
    channel_prefix = [_channel_prefix_matrix(in_rank, num_channels) for _, _, in_rank in layouts]
    send_heads = [_send_head(in_rank) for _, _, in_rank in layouts]

    # rank_prefix_matrix[i, k]: tokens ranks 0..i send to rank k.
    per_rank = np.stack([counts for counts, _, _ in layouts]).astype(np.int64)  # [sender, receiver]
    rank_prefix_matrix = np.cumsum(per_rank, axis=0).astype(np.int32)

    results = []
    for j in range(num_ranks):
        # Tokens of each source i bound for j, ascending: this is the receive order.
        src_tokens = [np.nonzero(layouts[i][2][:, j])[0] for i in range(num_ranks)]
        recv_x = _gather_rows(xs, src_tokens, trailing, dtype)
        recv_src_idx = (np.concatenate(src_tokens) if src_tokens else np.zeros(0, np.int64)).astype(np.int32)

        recv_topk_idx = _gather_rows(topk_idxs, src_tokens, (num_topk,), np.int64)
        first_local = j * experts_per_rank
        is_local = (recv_topk_idx >= first_local) & (recv_topk_idx < first_local + experts_per_rank)
        recv_topk_idx = np.where(is_local, recv_topk_idx - first_local, -1).astype(np.int64)

        recv_topk_weights = None
        if topk_weights is not None:
            w = _gather_rows(topk_weights, src_tokens, (num_topk,), np.float32)
            recv_topk_weights = np.where(is_local, w, np.float32(0.0)).astype(np.float32)

        recv_x_scales = None
        if x_scales is not None:
            recv_x_scales = _gather_rows(x_scales, src_tokens, x_scales[0].shape[1:], np.float32).astype(np.float32)

        num_recv_per_expert = []
        for e in range(experts_per_rank):
            total = sum(int(layouts[i][1][first_local + e]) for i in range(num_ranks))
            num_recv_per_expert.append(-(-total // expert_alignment) * expert_alignment)

        # recv_channel_prefix_matrix[i, c]: start of channel c's tokens in the block from i
        # (exclusive prefix of i's channel_prefix_matrix row j).
        recv_channel_prefix = np.zeros((num_ranks, num_channels), dtype=np.int32)
        for i in range(num_ranks):
            recv_channel_prefix[i, 1:] = channel_prefix[i][j, :-1]

        results.append({
            "recv_x": recv_x,
            "recv_x_scales": recv_x_scales,
            "recv_topk_idx": recv_topk_idx,
            "recv_topk_weights": recv_topk_weights,
            "num_recv_tokens_per_expert_list": num_recv_per_expert,
            "rank_prefix_matrix": rank_prefix_matrix.copy(),
            "channel_prefix_matrix": channel_prefix[j],
            "recv_channel_prefix_matrix": recv_channel_prefix,
            "recv_src_idx": recv_src_idx,
            "is_token_in_rank": layouts[j][2],
            "num_tokens_per_rank": layouts[j][0],
            "num_tokens_per_expert": layouts[j][1],
            "send_head": send_heads[j],
        })
    return results


def expand(rows, recv_topk_idx, num_local_experts: int, expert_alignment: int = 1):
    """One rank's received rows regrouped per local expert (``dispatch(..., expand=True)``).

    Group ``e`` holds, for every top-k entry ``(i, k)`` naming local expert ``e`` (in the order of
    ``i`` then ``k``), a copy of ``rows[i]``, then zero rows up to a multiple of
    ``expert_alignment``; the groups follow each other in expert order.

    Returns:
        ``(expanded rows, expanded_rows int32 (the received row each copies, -1 for padding),
        expert_offsets list of num_local_experts + 1 ints)``.
    """
    rows = np.asarray(rows)
    topk = np.asarray(recv_topk_idx)
    parts, sources, offsets = [], [], [0]
    for e in range(num_local_experts):
        hits = np.nonzero(topk == e)[0]  # row-major: i, then k
        padded = -(-len(hits) // expert_alignment) * expert_alignment
        padding = np.zeros((padded - len(hits), *rows.shape[1:]), dtype=rows.dtype)
        parts += [rows[hits], padding]
        sources += [hits.astype(np.int32), np.full(padded - len(hits), -1, np.int32)]
        offsets.append(offsets[-1] + padded)
    if not parts:
        return np.zeros((0, *rows.shape[1:]), rows.dtype), np.zeros(0, np.int32), offsets
    return np.concatenate(parts), np.concatenate(sources), offsets


def handle_of(result: dict) -> tuple:
    """DeepEP's handle for one rank: ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``."""
    return (result["rank_prefix_matrix"], result["channel_prefix_matrix"],
            result["recv_channel_prefix_matrix"], result["recv_src_idx"],
            result["is_token_in_rank"], result["send_head"])


# ----------------------------------------------------------------------------------------------
# Combine
# ----------------------------------------------------------------------------------------------

def _as_float32(a) -> np.ndarray:
    """Float data as float32; ``uint16`` is read as bfloat16 bit patterns."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return bfloat16_bits_to_float32(a)
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"combine expects float data (or uint16 bfloat16 bits), got {a.dtype}")
    return a.astype(np.float32)


def _recv_positions(results, source: int, dest: int) -> np.ndarray:
    """Row, in ``dest``'s receive order, of each of ``source``'s tokens sent to ``dest``
    (int64 ``[N_source]``, ``-1`` where the token was not sent there)."""
    sent = results[source]["is_token_in_rank"][:, dest]
    block_start = 0 if source == 0 else int(results[dest]["rank_prefix_matrix"][source - 1, dest])
    ordinal = np.cumsum(sent, dtype=np.int64) - sent
    return np.where(sent, block_start + ordinal, -1)


def combine(xs, results, *, topk_weights=None, bias=None) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Combine of all ranks at once: the reverse of :func:`dispatch`.

    Args:
        xs: ``R`` arrays ``[N_recv_r, H]`` in rank ``r``'s receive order; any float dtype (converted
            with ``astype(np.float32)``), or ``uint16`` read as bfloat16 bits.
        results: the list returned by :func:`dispatch` (its handles are used).
        topk_weights: ``None`` or ``R`` float32 arrays ``[N_recv_r, K]``.
        bias: ``None`` or, per rank ``m``, a tuple of 0, 1 or 2 arrays ``[N_m, H]`` (read like
            ``xs``) added to rank ``m``'s combined rows.

    Returns:
        Per original rank ``m``: ``(combined_x float32 [N_m, H], combined_topk_weights float32
        [N_m, K] or None)``. Row ``t`` is the float32 sum, starting from 0.0, of rank ``m``'s
        biases in order, then of the copies of ``(m, t)`` held by the ranks ``r = 0..R-1`` with
        ``is_token_in_rank[t, r]``, in ascending order; tokens sent nowhere give their bias (zeros
        without). The top-k weights get no bias.
    """
    num_ranks = len(results)
    if len(xs) != num_ranks:
        raise ValueError(f"got {len(xs)} xs for {num_ranks} ranks")
    xs = [_as_float32(x) for x in xs]
    trailing = xs[0].shape[1:]
    for r in range(num_ranks):
        n_recv = results[r]["recv_src_idx"].shape[0]
        if xs[r].shape != (n_recv, *trailing):
            raise ValueError(f"xs[{r}] has shape {xs[r].shape}, expected {(n_recv, *trailing)}")
    if topk_weights is not None:
        if len(topk_weights) != num_ranks:
            raise ValueError("topk_weights must have one array per rank")
        topk_weights = [np.asarray(w).astype(np.float32) for w in topk_weights]
        num_topk = topk_weights[0].shape[1]
        for r in range(num_ranks):
            n_recv = results[r]["recv_src_idx"].shape[0]
            if topk_weights[r].shape != (n_recv, num_topk):
                raise ValueError(f"topk_weights[{r}] has shape {topk_weights[r].shape}, expected {(n_recv, num_topk)}")

    out = []
    for m in range(num_ranks):
        num_tokens = results[m]["is_token_in_rank"].shape[0]
        combined_x = np.zeros((num_tokens, *trailing), dtype=np.float32)
        for b in (() if bias is None else bias[m]):
            b = _as_float32(b)
            if b.shape != combined_x.shape:
                raise ValueError(f"bias of rank {m} has shape {b.shape}, expected {combined_x.shape}")
            combined_x = combined_x + b
        combined_w = None if topk_weights is None else np.zeros((num_tokens, num_topk), dtype=np.float32)
        for r in range(num_ranks):  # ascending: the summation order is part of the contract
            pos = _recv_positions(results, m, r)
            sent = pos >= 0
            rows = pos[sent]
            combined_x[sent] = combined_x[sent] + xs[r][rows]
            if combined_w is not None:
                combined_w[sent] = combined_w[sent] + topk_weights[r][rows]
        out.append((combined_x, combined_w))
    return out


# ----------------------------------------------------------------------------------------------
# Number formats
# ----------------------------------------------------------------------------------------------

def float32_to_bfloat16_bits(a) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest, ties to even; NaN -> 0x7FFF."""
    a = np.asarray(a, dtype=np.float32)
    u = np.ascontiguousarray(a.reshape(-1)).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds to nearest-even. uint32 arithmetic cannot
    # overflow for non-NaN inputs (the largest magnitude, 0xFF7FFFFF, rounds to 0xFF80 = -inf).
    rounded = u + np.uint32(0x7FFF)
    rounded += (u >> np.uint32(16)) & np.uint32(1)
    rounded >>= np.uint32(16)
    bits = rounded.astype(np.uint16)
    bits[np.isnan(a.reshape(-1))] = 0x7FFF
    return bits.reshape(a.shape)


def bfloat16_bits_to_float32(b) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact: the bits become the high half)."""
    b = np.asarray(b)
    if b.dtype != np.uint16:
        raise TypeError(f"bfloat16 bits must be uint16, got {b.dtype}")
    wide = np.ascontiguousarray(b.reshape(-1)).astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32).reshape(b.shape)


def round_to_dtype(values_f32, dtype_name) -> np.ndarray:
    """Round float32 values to a storage dtype: ``'bfloat16'`` -> uint16 bits, ``'float16'`` ->
    float16, ``'float32'`` -> float32. Used to compare combine outputs bit-exactly."""
    values = np.asarray(values_f32, dtype=np.float32)
    if dtype_name == "bfloat16":
        return float32_to_bfloat16_bits(values)
    if dtype_name == "float16":
        return values.astype(np.float16)
    if dtype_name == "float32":
        return values
    raise ValueError(f"unknown dtype name {dtype_name!r} (expected 'bfloat16', 'float16' or 'float32')")


def fp8_e4m3_scaled_random(rng, num_tokens, hidden):
    """Random FP8 e4m3 payload and scales.

    Returns:
        ``(x_bytes uint8 [N, H], scales float32 [N, H // 128])``. Bytes are finite e4m3 patterns
        (never the NaN codes 0x7F/0xFF) and no row is all zero; scales are positive.
    """
    num_tokens, hidden = int(num_tokens), int(hidden)
    if hidden <= 0 or hidden % FP8_SCALE_BLOCK != 0:
        raise ValueError(f"hidden must be a positive multiple of 128 for FP8, got {hidden}")
    # 254 finite codes: 0x00..0x7E and 0x80..0xFE.
    x = rng.integers(0, 254, size=(num_tokens, hidden), dtype=np.uint8)
    x += (x >= 127).view(np.uint8)               # skip 0x7F
    if num_tokens:
        x[:, 0] = rng.integers(1, 127, size=num_tokens, dtype=np.uint8)
    scales = rng.uniform(0.25, 4.0, size=(num_tokens, hidden // FP8_SCALE_BLOCK)).astype(np.float32)
    return x, scales
