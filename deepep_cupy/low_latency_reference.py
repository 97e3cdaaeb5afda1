"""NumPy model of the low-latency (decode) dispatch and combine, bit-exact with the kernels.

The source of truth for the GPU tests of ``kernels/low_latency.cu``: layout, counts, the FP8 cast
(scales, power-of-two rounding, UE8M0 packing) and the weighted combine. Pure NumPy.

Conventions (DeepEP's low-latency API, with a deterministic receive order):

- ``R`` ranks, ``E`` experts, ``L = E / R`` local experts per rank (rank ``r`` owns
  ``[r*L, (r+1)*L)``), ``M = num_max_dispatch_tokens_per_rank``, ``H = hidden``, ``K`` top-k slots
  (``-1`` = none). A token names an expert at most once.
- Dispatch sends token ``t`` of rank ``s`` once per expert ``e`` of its top-k row. On the owner of
  ``e`` it lands in ``recv_x[e % L]``, whose rows are packed: the tokens from rank 0 first, then
  rank 1, ...; inside a source rank by source token index ascending. ``recv_count[l]`` rows are
  valid; the rest of the ``R * M`` rows are unspecified.
- ``src_info[l, row]`` (int32) = the source token index of the row; ``layout_range[l, s]`` (int64)
  = ``(first row of source s) << 32 | rows from source s``.
- FP8 cast, per token and per 128-channel group ``g`` (the values are the BF16 ones, exactly as
  float32)::

      amax  = max(max |x| over the group, 1e-4f)
      scale = amax * (1 / 448)               (float32 product, round to nearest even, by the
                                              float32 constant 1 / 448, as DeepEP computes it)
      inv   = 448 / amax                     (float32 division, round to nearest even)
      with round_scale (implied by use_ue8m0):
          e     = ceil(log2(amax * (1 / 448)))  (exactly, from the float's exponent and mantissa bits)
          scale = 2 ** e
          inv   = 2 ** -e
      data  = e4m3 of (x * inv)              (float32 product; then round to nearest even to the
                                              e4m3 grid, saturating to +-448, sign kept for zero)

  ``scales[l, row, g]`` = ``scale`` (float32), or with ``use_ue8m0`` the biased exponent byte of
  ``scale`` (``scale = 2 ** (byte - 127)``), four groups per int32, group ``4i + j`` in byte ``j``
  (little-endian), so ``[..., H // 512]`` int32.
- Combine: ``out[t] = bf16(sum over k in order, topk_idx[t, k] != -1, of float32(w[t, k]) *
  float32(row of (t, topk_idx[t, k])))``, each product and each sum rounded to float32 (no fused
  multiply-add), starting from 0.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from .constants import FP8_AMAX_FLOOR, FP8_E4M3_MAX, FP8_SCALE_BLOCK, UE8M0_PER_INT
from .reference import _check_topk_idx, bfloat16_bits_to_float32, float32_to_bfloat16_bits

__all__ = ["FP8_MAX", "FP8_MAX_INV", "AMAX_FLOOR", "float32_to_e4m3_bits", "e4m3_bits_to_float32", "fp8_scales", "cast_to_fp8",
           "pack_ue8m0", "unpack_ue8m0", "dispatch", "combine", "expert_row_of"]

#: The largest finite e4m3 value; scales map a group's amax onto it.
FP8_MAX = np.float32(FP8_E4M3_MAX)
#: The smallest amax a scale is computed from (a group of zeros gets scale 1e-4 * (1 / 448)).
AMAX_FLOOR = np.float32(FP8_AMAX_FLOOR)
#: The float32 constant scales are computed with (DeepEP's ``kFinfoAmaxInvE4M3 = 1 / 448.0f``).
FP8_MAX_INV = np.float32(1) / FP8_MAX


# ---------------------------------------------------------------------------------------------
# Number formats

def float32_to_e4m3_bits(values) -> np.ndarray:
    """float32 -> FP8 e4m3 (``float8_e4m3fn``) bytes: round to nearest, ties to even, saturating
    to +-448 (``cvt.rn.satfinite.e4m3x2.f32``); the sign of zero is kept; NaN -> 0x7F."""
    v = np.asarray(values, dtype=np.float32)
    flat = v.reshape(-1).astype(np.float64)  # exact; every step below is exact in float64
    sign = np.signbit(flat)
    mag = np.minimum(np.abs(flat), FP8_E4M3_MAX)
    nan = np.isnan(flat)
    mag[nan] = 0.0
    _, exponent = np.frexp(mag)  # mag = m * 2**exponent, m in [0.5, 1): floor(log2 mag) = exponent - 1
    quantum_exp = np.maximum(exponent - 1, -6) - 3  # 3 mantissa bits; subnormals share 2**-9
    quantum = np.ldexp(1.0, quantum_exp)
    rounded = np.round(mag / quantum) * quantum  # numpy rounds half to even
    rounded = np.minimum(rounded, FP8_E4M3_MAX)
    _, r_exp = np.frexp(rounded)
    r_floor = r_exp - 1
    normal = rounded >= 2.0 ** -6
    sub_bits = np.round(rounded / 2.0 ** -9).astype(np.int64)  # 0..8 (8 is the smallest normal, 0x08)
    mant = np.round((rounded / np.ldexp(1.0, r_floor) - 1.0) * 8).astype(np.int64)
    normal_bits = ((r_floor + 7) << 3) | mant
    bits = np.where(normal, normal_bits, sub_bits)
    bits = bits | (sign.astype(np.int64) << 7)
    bits[nan] = 0x7F
    return bits.astype(np.uint8).reshape(v.shape)


def e4m3_bits_to_float32(bits) -> np.ndarray:
    """FP8 e4m3 bytes -> float32 (exact); 0x7F / 0xFF -> NaN."""
    b = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp_field = (b >> 3) & 0xF
    mant = b & 0x7
    value = np.where(exp_field == 0, mant * 2.0 ** -9, (1.0 + mant / 8.0) * np.ldexp(1.0, exp_field - 7))
    value = sign * value
    value[(b & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


def _power_of_two_ceil_exponent(scale: np.ndarray) -> np.ndarray:
    """``ceil(log2(scale))`` of positive normal float32 values, from their bits."""
    bits = np.ascontiguousarray(scale, dtype=np.float32).view(np.int32).astype(np.int64)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0)


def fp8_scales(amax, round_scale: bool):
    """``(scale, inv)`` float32 of groups whose largest magnitude is ``amax`` (before the floor),
    as DeepEP's ``calculate_fp8_scales`` computes them: ``scale`` (what is returned) is
    ``amax * (1 / 448)``, not ``amax / 448`` (they differ by an ulp for some amax)."""
    amax = np.maximum(np.asarray(amax, dtype=np.float32), AMAX_FLOOR)
    scale = (amax * FP8_MAX_INV).astype(np.float32)
    if not round_scale:
        return scale, (FP8_MAX / amax).astype(np.float32)
    exponent = _power_of_two_ceil_exponent(scale)
    scale = ((exponent + 127) << 23).astype(np.int32).view(np.float32)
    inv = ((127 - exponent) << 23).astype(np.int32).view(np.float32)
    return scale, inv


def cast_to_fp8(x_bits, round_scale: bool = False):
    """BF16 rows (uint16 bits ``[N, H]``, ``H % 128 == 0``) -> ``(e4m3 bytes [N, H], float32 scales
    [N, H // 128])`` as the dispatch kernel casts them."""
    x_bits = np.asarray(x_bits)
    n, hidden = x_bits.shape
    if hidden % FP8_SCALE_BLOCK:
        raise ValueError(f"hidden: expected a multiple of {FP8_SCALE_BLOCK} for FP8, got {hidden}")
    x = bfloat16_bits_to_float32(x_bits).reshape(n, hidden // FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
    amax = np.abs(x).max(axis=2) if n else np.zeros((0, hidden // FP8_SCALE_BLOCK), np.float32)
    scale, inv = fp8_scales(amax, round_scale)
    data = float32_to_e4m3_bits((x * inv[:, :, None]).astype(np.float32))
    return data.reshape(n, hidden), scale


def pack_ue8m0(scales) -> np.ndarray:
    """Power-of-two float32 scales ``[..., G]`` (``G % 4 == 0``) -> int32 ``[..., G // 4]``:
    each scale's biased exponent byte, group ``4i + j`` in byte ``j`` of int ``i``."""
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if scales.shape[-1] % UE8M0_PER_INT:
        raise ValueError(f"scales: expected a multiple of {UE8M0_PER_INT} groups, got {scales.shape[-1]}")
    exponent_bytes = ((scales.view(np.int32) >> 23) & 0xFF).astype(np.uint8)
    return np.ascontiguousarray(exponent_bytes).view(np.int32)


def unpack_ue8m0(packed) -> np.ndarray:
    """int32 ``[..., G // 4]`` UE8M0 words -> the float32 scales ``[..., G]`` they encode."""
    exponent_bytes = np.ascontiguousarray(packed, dtype=np.int32).view(np.uint8).astype(np.int32)
    return (exponent_bytes << 23).view(np.float32)


# ---------------------------------------------------------------------------------------------
# Dispatch and combine

def _check_routing(topk_idx, num_experts: int) -> np.ndarray:
    """``topk_idx`` checked as the intranode model checks it, and naming each expert at most once."""
    topk_idx = _check_topk_idx(topk_idx, num_experts)
    for t, row in enumerate(topk_idx):
        named = row[row >= 0]
        if len(set(named.tolist())) != len(named):
            raise ValueError(f"topk_idx: token {t} names an expert twice: {row.tolist()}")
    return topk_idx


def dispatch(xs: Sequence[np.ndarray], topk_idxs: Sequence[np.ndarray], num_max_dispatch_tokens_per_rank: int,
             num_experts: int, *, use_fp8: bool = False, round_scale: bool = False,
             use_ue8m0: bool = False) -> List[dict]:
    """Every rank's low-latency dispatch results.

    Args:
        xs: per rank, BF16 bits ``uint16 [N_r, H]``.
        topk_idxs: per rank, int ``[N_r, K]`` (-1 = none).
        use_fp8, round_scale, use_ue8m0: as ``Buffer.low_latency_dispatch`` (ue8m0 implies round_scale).

    Returns:
        Per rank a dict: ``recv_x`` (uint16 ``[L, R*M, H]``, or uint8 with FP8), ``scales`` (FP8
        only: float32 ``[L, R*M, H // 128]`` in logical row-major order, or int32
        ``[L, R*M, H // 512]`` with ue8m0), ``recv_count`` int32 ``[L]``, ``src_info`` int32
        ``[L, R*M]``, ``layout_range`` int64 ``[L, R]``. Rows at or past ``recv_count`` are 0
        (the kernels leave them unwritten: compare only the valid ones).
    """
    num_ranks = len(xs)
    M = int(num_max_dispatch_tokens_per_rank)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of {num_ranks} ranks, got {num_experts}")
    L = num_experts // num_ranks
    hidden = xs[0].shape[1]
    round_scale = round_scale or use_ue8m0
    topks = [_check_routing(topk, num_experts) for topk in topk_idxs]
    casts = []
    for x, topk in zip(xs, topks):
        if x.shape[0] != topk.shape[0] or x.shape[0] > M:
            raise ValueError(f"x: expected as many rows as topk_idx, at most {M}; got {x.shape[0]}, {topk.shape[0]}")
        casts.append(cast_to_fp8(x, round_scale) if use_fp8 else (np.asarray(x), None))
    results = []
    for rank in range(num_ranks):
        recv_x = np.zeros((L, num_ranks * M, hidden), np.uint8 if use_fp8 else np.uint16)
        scales = np.zeros((L, num_ranks * M, hidden // FP8_SCALE_BLOCK), np.float32) if use_fp8 else None
        recv_count = np.zeros(L, np.int32)
        src_info = np.zeros((L, num_ranks * M), np.int32)
        layout_range = np.zeros((L, num_ranks), np.int64)
        for local in range(L):
            expert = rank * L + local
            row = 0
            for source in range(num_ranks):
                tokens = np.nonzero((topks[source] == expert).any(axis=1))[0]
                data, source_scales = casts[source]
                recv_x[local, row:row + len(tokens)] = data[tokens]
                if use_fp8:
                    scales[local, row:row + len(tokens)] = source_scales[tokens]
                src_info[local, row:row + len(tokens)] = tokens
                layout_range[local, source] = (row << 32) | len(tokens)
                row += len(tokens)
            recv_count[local] = row
        if use_fp8 and use_ue8m0:
            scales = pack_ue8m0(scales)
        results.append(dict(recv_x=recv_x, scales=scales, recv_count=recv_count, src_info=src_info,
                            layout_range=layout_range))
    return results


def expert_row_of(result: dict, local_expert: int, source: int, token: int) -> int:
    """The row of ``recv_x[local_expert]`` on the expert's owner that holds ``token`` of ``source``."""
    begin = int(result["layout_range"][local_expert, source]) >> 32
    count = int(result["layout_range"][local_expert, source]) & 0xFFFFFFFF
    rows = np.nonzero(result["src_info"][local_expert, begin:begin + count] == token)[0]
    if len(rows) != 1:
        raise ValueError(f"token {token} of rank {source} was not dispatched to local expert {local_expert}")
    return begin + int(rows[0])


def combine(expert_outputs: Sequence[np.ndarray], topk_idxs: Sequence[np.ndarray],
            topk_weights: Sequence[np.ndarray], results: Sequence[dict],
            ranks: Optional[Sequence[int]] = None) -> List[Optional[np.ndarray]]:
    """Every rank's low-latency combine output, BF16 bits ``uint16 [N_r, H]``.

    Args:
        expert_outputs: per rank, BF16 bits ``[L, R*M, H]`` (the rows the experts produced, in
            the dispatch's layout).
        topk_idxs, topk_weights: per rank, the dispatch's routing and float32 weights ``[N_r, K]``.
        results: :func:`dispatch`'s results (their ``layout_range`` and ``src_info``).
        ranks: the ranks whose output to compute (default: all; None stands for the others).
    """
    num_ranks = len(expert_outputs)
    L, _, hidden = expert_outputs[0].shape
    outputs = []
    for rank in range(num_ranks):
        if ranks is not None and rank not in ranks:
            outputs.append(None)
            continue
        topk = np.asarray(topk_idxs[rank])
        weights = np.asarray(topk_weights[rank], dtype=np.float32)
        n = topk.shape[0]
        acc = np.zeros((n, hidden), np.float32)
        for t in range(n):
            for k in range(topk.shape[1]):
                expert = int(topk[t, k])
                if expert < 0:
                    continue
                owner, local = divmod(expert, L)
                row = expert_row_of(results[owner], local, rank, t)
                values = bfloat16_bits_to_float32(expert_outputs[owner][local, row])
                product = (weights[t, k] * values).astype(np.float32)
                acc[t] = (acc[t] + product).astype(np.float32)
        outputs.append(float32_to_bfloat16_bits(acc))
    return outputs
