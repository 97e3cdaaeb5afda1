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
- LogFMT combine (``use_logfmt=True``, DeepEP's LogFMT-10): each row travels as
  :func:`logfmt_encode` writes it and is summed as :func:`logfmt_decode` reads it back (the
  format and rounding are DeepEP's; its log2 / exp2 are :func:`repro_log2` / :func:`repro_exp2`,
  IEEE float32 operations only, which the kernel computes bit for bit).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from ..constants import FP8_AMAX_FLOOR, FP8_E4M3_MAX, FP8_SCALE_BLOCK, UE8M0_PER_INT
from .intranode import _check_topk_idx, bfloat16_bits_to_float32, float32_to_bfloat16_bits

__all__ = ["FP8_MAX", "FP8_MAX_INV", "AMAX_FLOOR", "float32_to_e4m3_bits", "e4m3_bits_to_float32", "fp8_scales",
           "cast_to_fp8", "pack_ue8m0", "unpack_ue8m0", "dispatch", "combine", "expert_row_of", "repro_log2",
           "repro_exp2", "logfmt_unroll", "logfmt_slot_bytes", "logfmt_encode", "logfmt_decode"]

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
# LogFMT (DeepEP's LogFMT-10 combine; kernels/low_latency.cu states the format)

_F32 = np.float32
_LOG2_COEFFS = tuple(_F32(float.fromhex(h)) for h in (  # 2 / ln 2 / k, k = 9, 7, 5, 3, 1
    "0x1.484b14p-2", "0x1.a61762p-2", "0x1.2776c6p-1", "0x1.ec709ep-1", "0x1.715476p+1"))
_EXP2_COEFFS = tuple(_F32(float.fromhex(h)) for h in (  # ln(2)^k / k!, k = 9 .. 1
    "0x1.b5253ep-24", "0x1.62c022p-20", "0x1.ffcbfcp-17", "0x1.430912p-13", "0x1.5d87fep-10", "0x1.3b2ab6p-7",
    "0x1.c6b08ep-5", "0x1.ebfbe0p-3", "0x1.62e430p-1"))
_SQRT2 = _F32(float.fromhex("0x1.6a09e6p+0"))
#: Codes of a LogFMT value: 9 bits (DeepEP's kNumValues = 512), so steps of (log range) / 510.
LOGFMT_MAX_CODE = 511
LOGFMT_LOG_RANGE = _F32(32.0)


def _pow2(exponent) -> np.ndarray:
    """float32 2 ** exponent for integer exponents in [-126, 127] (from the bits)."""
    return ((np.asarray(exponent, np.int64) + 127) << 23).astype(np.int32).view(np.float32)


def repro_log2(x) -> np.ndarray:
    """log2 of float32 ``x >= 0`` (0 -> -inf) as the kernel computes it: exponent and mantissa from
    the bits (subnormals scaled by 2**23), the mantissa into [sqrt(1/2), sqrt(2)], then
    ``2 / ln 2 * atanh(s)``, ``s = (m - 1) / (m + 1)``, by a fixed series; float32 operations only."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.int32).astype(np.int64)
    sub = (bits >> 23) == 0
    scaled = (x * _F32(2.0 ** 23)).view(np.int32).astype(np.int64)
    bits = np.where(sub, scaled, bits)
    e = np.where(sub, -23, 0) + (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).astype(np.int32).view(np.float32)
    big = m > _SQRT2
    m = np.where(big, m * _F32(0.5), m).astype(np.float32)
    e = e + big
    s = (m - _F32(1)) / (m + _F32(1))
    s2 = s * s
    p = np.full_like(s, _LOG2_COEFFS[0])
    for c in _LOG2_COEFFS[1:]:
        p = p * s2 + c
    out = (e.astype(np.float32) + p * s).astype(np.float32)
    return np.where(x == 0, _F32(-np.inf), out).astype(np.float32)


def repro_exp2(y) -> np.ndarray:
    """2 ** float32 ``y`` (finite, < 128) as the kernel computes it: ``y = n + f``, a fixed series
    for ``2 ** f``, then scaled by ``2 ** n`` (below 2**-126 in two products, one rounding)."""
    y = np.asarray(y, dtype=np.float32)
    n = np.floor(y)
    f = (y - n).astype(np.float32)
    p = np.full_like(f, _EXP2_COEFFS[0])
    for c in _EXP2_COEFFS[1:]:
        p = p * f + c
    p = p * f + _F32(1)
    k = np.maximum(n.astype(np.int64), -252)
    normal = p * _pow2(np.maximum(k, -126))
    tiny = (p * _pow2(-126)) * _pow2(np.clip(k + 126, -126, 127))
    return np.where(k >= -126, normal, tiny).astype(np.float32)


def _logfmt_groups(amax, amin):
    """Per 128-channel group: (cast, log_amin, step, step_inv) from its amax and amin (float32)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        log_amax = repro_log2(amax)
        log_amin = np.maximum(repro_log2(amin), (log_amax - LOGFMT_LOG_RANGE).astype(np.float32))
        cast = (log_amax < 0) & (log_amin < log_amax)
        step = ((log_amax - log_amin).astype(np.float32) / _F32(LOGFMT_MAX_CODE - 1)).astype(np.float32)
        step_inv = (_F32(1) / step).astype(np.float32)
    return cast, log_amin, step, step_inv


def logfmt_unroll(hidden: int) -> int:
    """int4 per lane of a LogFMT chunk: 4 (chunks of 1024 channels) if ``hidden % 1024 == 0``, else 2 (512)."""
    return 4 if hidden % 1024 == 0 else 2


def logfmt_slot_bytes(hidden: int) -> int:
    """Bytes of a LogFMT row's slot: the meta words, then at most the BF16 row."""
    return hidden * 2 + hidden // FP8_SCALE_BLOCK * 4


def _logfmt_layout(hidden: int):
    if hidden % 512:
        raise ValueError(f"hidden: LogFMT needs a multiple of 512, got {hidden}")
    unroll = logfmt_unroll(hidden)
    return unroll, 256 * unroll, hidden // (256 * unroll)  # unroll, channels per chunk, chunks


def _bf16_abs(bits: np.ndarray) -> np.ndarray:
    return ((bits.astype(np.uint32) & 0x7FFF) << 16).view(np.float32)


def logfmt_encode(row_bits) -> np.ndarray:
    """One BF16 row (uint16 bits ``[H]``, ``H % 512 == 0``) -> its LogFMT slot (uint8
    ``[logfmt_slot_bytes(H)]``; bytes past the data are 0), as the combine's send writes it."""
    bits = np.ascontiguousarray(row_bits, dtype=np.uint16).reshape(-1)
    hidden = bits.shape[0]
    unroll, chunk, num_chunks = _logfmt_layout(hidden)
    groups = _bf16_abs(bits).reshape(-1, FP8_SCALE_BLOCK)
    amax, amin = groups.max(axis=1), groups.min(axis=1)
    cast, log_amin, step, step_inv = _logfmt_groups(amax, amin)
    meta = (amax.view(np.uint32) >> 16) | (amin.view(np.uint32) & np.uint32(0xFFFF0000))
    out = [meta.astype("<u4").tobytes()]
    groups_per_chunk = chunk // FP8_SCALE_BLOCK
    for c in range(num_chunks):
        part = bits[c * chunk:(c + 1) * chunk]
        g = slice(c * groups_per_chunk, (c + 1) * groups_per_chunk)
        if not cast[g].all():
            out.append(part.astype("<u2").tobytes())
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = ((_F32(1) + repro_exp2(step[g])) * _F32(0.5)).astype(np.float32)
            rounding = (_F32(2) - repro_log2(mean) * step_inv[g]).astype(np.float32)
            fused = (rounding - log_amin[g] * step_inv[g]).astype(np.float32)
            group_of = np.repeat(np.arange(groups_per_chunk), FP8_SCALE_BLOCK)
            level = (repro_log2(_bf16_abs(part)) * step_inv[g][group_of] + fused[group_of]).astype(np.float32)
        codes = np.minimum(np.floor(np.maximum(level, _F32(0))), LOGFMT_MAX_CODE).astype(np.uint32)
        e = codes.reshape(32, unroll // 2, 16)
        signs = (part.astype(np.uint32) >> 15).reshape(32, 8 * unroll)
        lane_signs = (signs << np.arange(8 * unroll, dtype=np.uint32)).sum(axis=1, dtype=np.uint64).astype(np.uint32)
        u = np.uint32
        words = np.zeros((32, unroll // 2, 5), np.uint32)
        words[..., 0] = e[..., 0] | (e[..., 1] << u(9)) | (e[..., 2] << u(18)) | (e[..., 3] << u(27))
        words[..., 1] = (e[..., 3] >> u(5)) | (e[..., 4] << u(4)) | (e[..., 5] << u(13)) | (e[..., 6] << u(22)) | (
            e[..., 7] << u(31))
        words[..., 2] = (e[..., 7] >> u(1)) | (e[..., 8] << u(8)) | (e[..., 9] << u(17)) | (e[..., 10] << u(26))
        words[..., 3] = (e[..., 10] >> u(6)) | (e[..., 11] << u(3)) | (e[..., 12] << u(12)) | (e[..., 13] << u(21)) | (
            e[..., 14] << u(30))
        words[..., 4] = (e[..., 14] >> u(2)) | (e[..., 15] << u(7))
        words[:, 0, 4] |= lane_signs << u(16)
        if unroll == 4:
            words[:, 1, 4] |= lane_signs & u(0xFFFF0000)
        out.append(words.astype("<u4").tobytes())
    data = b"".join(out)
    slot = np.zeros(logfmt_slot_bytes(hidden), np.uint8)
    slot[:len(data)] = np.frombuffer(data, np.uint8)
    return slot


def logfmt_decode(slot, hidden: int) -> np.ndarray:
    """A LogFMT slot -> the float32 values ``[H]`` the combine's receive multiplies by the weights."""
    slot = np.ascontiguousarray(slot, dtype=np.uint8)
    unroll, chunk, num_chunks = _logfmt_layout(hidden)
    num_groups = hidden // FP8_SCALE_BLOCK
    meta = slot[:num_groups * 4].view("<u4").astype(np.uint32)
    amax = (meta << np.uint32(16)).view(np.float32)
    amin = (meta & np.uint32(0xFFFF0000)).view(np.float32)
    cast, log_amin, step, _ = _logfmt_groups(amax, amin)
    groups_per_chunk = chunk // FP8_SCALE_BLOCK
    values = np.empty(hidden, np.float32)
    offset = num_groups * 4
    u = np.uint32
    for c in range(num_chunks):
        g = slice(c * groups_per_chunk, (c + 1) * groups_per_chunk)
        if not cast[g].all():
            raw = slot[offset:offset + chunk * 2].view("<u2").astype(np.uint32)
            values[c * chunk:(c + 1) * chunk] = (raw << u(16)).view(np.float32)
            offset += chunk * 2
            continue
        w = slot[offset:offset + chunk * 10 // 8].view("<u4").astype(np.uint32).reshape(32, unroll // 2, 5)
        offset += chunk * 10 // 8
        concat = np.zeros((32, unroll // 2, 6), np.uint32)
        concat[..., 0] = w[..., 0]
        for q in range(1, 5):
            concat[..., q] = (w[..., q - 1] >> u(32 - q * 5)) | (w[..., q] << u(q * 5))
        concat[..., 5] = w[..., 4] >> u(7)
        j = np.arange(16)
        codes = (concat[..., j // 3] >> (u(9) * (j % 3).astype(np.uint32))) & u(0x1FF)
        signs = (w[..., 4:5] >> u(16) >> j.astype(np.uint32)) & u(1)
        group_of = (c * chunk + np.arange(chunk)) // FP8_SCALE_BLOCK
        codes, signs = codes.reshape(-1), signs.reshape(-1)
        with np.errstate(invalid="ignore"):
            level = ((np.maximum(codes, 1) - 1).astype(np.float32) * step[group_of] + log_amin[group_of])
            decoded = np.where(codes == 0, _F32(0), repro_exp2(np.where(codes == 0, _F32(0), level)))
        values[c * chunk:(c + 1) * chunk] = np.where(signs == 1, -decoded, decoded)
    return values


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
        # BF16 rows carry scales of no columns, so that one copy below serves both formats.
        casts.append(cast_to_fp8(x, round_scale) if use_fp8 else (np.asarray(x), np.zeros((len(x), 0), np.float32)))
    results = []
    for rank in range(num_ranks):
        recv_x = np.zeros((L, num_ranks * M, hidden), np.uint8 if use_fp8 else np.uint16)
        scales = np.zeros((L, num_ranks * M, hidden // FP8_SCALE_BLOCK if use_fp8 else 0), np.float32)
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
                scales[local, row:row + len(tokens)] = source_scales[tokens]
                src_info[local, row:row + len(tokens)] = tokens
                layout_range[local, source] = (row << 32) | len(tokens)
                row += len(tokens)
            recv_count[local] = row
        if use_fp8 and use_ue8m0:
            scales = pack_ue8m0(scales)
        results.append(dict(recv_x=recv_x, scales=scales if use_fp8 else None, recv_count=recv_count, src_info=src_info,
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
            ranks: Optional[Sequence[int]] = None, use_logfmt: bool = False) -> List[Optional[np.ndarray]]:
    """Every rank's low-latency combine output, BF16 bits ``uint16 [N_r, H]``.

    Args:
        expert_outputs: per rank, BF16 bits ``[L, R*M, H]`` (the rows the experts produced, in
            the dispatch's layout).
        topk_idxs, topk_weights: per rank, the dispatch's routing and float32 weights ``[N_r, K]``.
        results: :func:`dispatch`'s results (their ``layout_range`` and ``src_info``).
        ranks: the ranks whose output to compute (default: all; None stands for the others).
        use_logfmt: each row as :func:`logfmt_decode` reads back what :func:`logfmt_encode` wrote.
    """
    num_ranks = len(expert_outputs)
    L, _, hidden = expert_outputs[0].shape
    outputs: List[Optional[np.ndarray]] = []
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
                if use_logfmt:
                    values = logfmt_decode(logfmt_encode(expert_outputs[owner][local, row]), hidden)
                else:
                    values = bfloat16_bits_to_float32(expert_outputs[owner][local, row])
                product = (weights[t, k] * values).astype(np.float32)
                acc[t] = (acc[t] + product).astype(np.float32)
        outputs.append(float32_to_bfloat16_bits(acc))
    return outputs
