"""The benchmark's workload and byte accounting: DeepEP's byte counts and the routing helpers
shared by the library benchmark and the NCCL baseline (NumPy or CuPy arrays)."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from ..constants import FP8_SCALE_BLOCK

#: FP8 bytes per value relative to BF16: one byte per value plus a float32 scale per 128 values.
FP8_FACTOR = (1.0 + 4.0 / FP8_SCALE_BLOCK) / 2.0

# ----------------------------------------------------------------------------------------------
# Accounting
# ----------------------------------------------------------------------------------------------


def dispatch_bytes(num_recv_tokens: int, hidden: int, dtype: str) -> float:
    """DeepEP's byte count for ``num_recv_tokens`` received rows of ``hidden`` values.

    Args:
        num_recv_tokens: tokens received by the rank.
        hidden: values per token.
        dtype: ``"bf16"`` (2 bytes a value) or ``"fp8"`` (1 byte a value + a float32 per 128).
    Returns:
        Bytes, as a float.
    """
    if dtype == "bf16":
        factor = 1.0
    elif dtype == "fp8":
        factor = FP8_FACTOR
    else:
        raise ValueError(f"dtype: expected 'bf16' or 'fp8', got {dtype!r}")
    return float(num_recv_tokens) * hidden * 2 * factor


def gbps(nbytes: float, seconds: float) -> float:
    """Bytes per second in GB/s (1e9); NaN when ``seconds`` is not positive."""
    if not seconds > 0:
        return float("nan")
    return nbytes / seconds / 1e9


def recv_token_counts(rank_prefix_matrix: Any, rank: int) -> Tuple[int, int]:
    """Tokens ``rank`` receives in total and from other ranks only.

    Args:
        rank_prefix_matrix: ``[R, R]`` int, ``[i, j]`` = tokens ranks ``0..i`` send to rank ``j``.
        rank: the receiving rank.
    Returns:
        ``(total, from_other_ranks)``.
    """
    col = np.asarray(rank_prefix_matrix)[:, rank].astype(np.int64)
    total = int(col[-1])
    own = int(col[rank] - (col[rank - 1] if rank > 0 else 0))
    return total, total - own


def cross_gpu_bytes(rank_prefix_matrix: Any, rank: int, hidden: int, dtype: str) -> float:
    """:func:`dispatch_bytes` of the tokens ``rank`` receives from other ranks only."""
    return dispatch_bytes(recv_token_counts(rank_prefix_matrix, rank)[1], hidden, dtype)


# ----------------------------------------------------------------------------------------------
# Routing helpers (NumPy or CuPy: the array's own module is used)
# ----------------------------------------------------------------------------------------------


def _xp(array: Any):
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def token_rank_mask(topk_idx: Any, num_experts: int, num_ranks: int) -> Any:
    """``is_token_in_rank [N, R] bool``: token ``t`` has at least one expert on rank ``r``.

    Args:
        topk_idx: ``[N, K]`` int, expert ids, ``-1`` = none.
    """
    xp = _xp(topk_idx)
    per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = xp.where(valid, topk_idx // per_rank, num_ranks)  # num_ranks = "nowhere"
    mask = xp.zeros((topk_idx.shape[0], num_ranks + 1), dtype=bool)
    rows = xp.broadcast_to(xp.arange(topk_idx.shape[0])[:, None], topk_idx.shape)
    mask[rows.ravel(), dest.ravel().astype(xp.int64)] = True
    return mask[:, :num_ranks]


def build_send_index(is_token_in_rank: Any) -> Tuple[Any, Any]:
    """The NCCL baseline's index build: send counts and the permutation into rank order.

    Args:
        is_token_in_rank: ``[N, R]`` bool (NumPy or CuPy).
    Returns:
        ``(send_counts, perm)``: ``send_counts [R] int64`` = tokens for each destination;
        ``perm [sum(send_counts)] int64`` = source token of each send row, grouped by destination
        rank (0 first), token index ascending inside a destination; the rows for rank ``r`` are
        ``perm[cumsum[r-1]:cumsum[r]]``.
    """
    xp = _xp(is_token_in_rank)
    num_tokens = is_token_in_rank.shape[0]
    by_rank = is_token_in_rank.T  # [R, N]: flat order is (rank, token)
    send_counts = by_rank.sum(axis=1).astype(xp.int64)
    flat = xp.flatnonzero(by_rank)
    perm = (flat % max(num_tokens, 1)).astype(xp.int64)
    return send_counts, perm


def expected_recv_sources(masks: Sequence[np.ndarray], rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """Source rank and source token index of each row ``rank`` receives, in receive order.

    Args:
        masks: per source rank, its ``is_token_in_rank [N_s, R]``.
    """
    src_rank, src_tok = [], []
    for s, mask in enumerate(masks):
        toks = np.flatnonzero(np.asarray(mask)[:, rank])
        src_rank.append(np.full(toks.shape, s, dtype=np.int64))
        src_tok.append(toks.astype(np.int64))
    return np.concatenate(src_rank), np.concatenate(src_tok)


# ----------------------------------------------------------------------------------------------
# The workload
# ----------------------------------------------------------------------------------------------


def make_workload(reference: Any, args: argparse.Namespace, rank: int, num_tokens: int,
                  with_data: bool = True, with_fp8: bool = True) -> Dict[str, np.ndarray]:
    """One rank's host workload; each part has its own random stream so routing never depends on data."""
    skew = args.skew if args.routing == "skewed" else 0.0
    out = {"topk_idx": reference.random_routing(np.random.default_rng([args.seed, rank, num_tokens, 0]),
                                                num_tokens, args.num_experts, args.num_topk, skew=skew)}
    rng = np.random.default_rng([args.seed, rank, num_tokens, 1])
    out["topk_weights"] = rng.uniform(0.1, 1.0, (num_tokens, args.num_topk)).astype(np.float32)
    if with_data:
        rng = np.random.default_rng([args.seed, rank, num_tokens, 2])
        out["x"] = reference.float32_to_bfloat16_bits(
            rng.standard_normal((num_tokens, args.hidden), dtype=np.float32))
    if with_data and with_fp8:
        x_fp8, scales = reference.fp8_e4m3_scaled_random(
            np.random.default_rng([args.seed, rank, num_tokens, 3]), num_tokens, args.hidden)
        out["x_fp8"], out["x_scales"] = np.asarray(x_fp8), np.asarray(scales, dtype=np.float32)
    return out
