"""The NumPy model of the LogFMT combine (DeepEP's LogFMT-10): format, rounding, bounds (CPU only).

deepep_cupy/reference/low_latency.py states what kernels/low_latency.cu computes bit for bit (the
GPU worker's logfmt cases compare them); these checks hold the model to DeepEP's format.
"""

import math

import numpy as np
import pytest

from deepep_cupy.reference import low_latency as ll
from deepep_cupy.reference.intranode import bfloat16_bits_to_float32, float32_to_bfloat16_bits


def _bf16(values):
    return float32_to_bfloat16_bits(np.asarray(values, np.float32))


def test_log2_and_exp2_are_close_to_the_true_ones_and_exact_at_powers_of_two():
    x = np.concatenate([np.geomspace(1e-38, 1e4, 20001), [2.0 ** -149, 2.0 ** -130]]).astype(np.float32)
    want = np.log2(x.astype(np.float64))
    err = np.abs(ll.repro_log2(x).astype(np.float64) - want)
    assert (err < 1e-6 + 6e-8 * np.abs(want)).all()  # within about half a float32 ulp of the result
    powers = np.float32(2.0) ** np.arange(-149, 20, dtype=np.float32)
    np.testing.assert_array_equal(ll.repro_log2(powers), np.arange(-149, 20, dtype=np.float32))
    assert ll.repro_log2(np.float32([0.0]))[0] == -np.inf
    y = np.linspace(-140, 1, 40001).astype(np.float32)
    rel = np.abs(ll.repro_exp2(y).astype(np.float64) / np.exp2(y.astype(np.float64)) - 1)
    assert rel[y > -126].max() < 3e-7
    np.testing.assert_array_equal(ll.repro_exp2(np.arange(-149, 10, dtype=np.float32)),
                                  np.float32(2.0) ** np.arange(-149, 10, dtype=np.float32))
    assert ll.repro_exp2(np.float32([-160.0]))[0] == 0.0
    assert ll.repro_log2(np.float32(3.0)).dtype == np.float32 and ll.repro_exp2(np.float32(0.3)).dtype == np.float32


@pytest.mark.parametrize("hidden, unroll", [(512, 2), (1536, 2), (2048, 4), (7168, 4)])
def test_the_slot_is_the_meta_then_the_chunks_as_deepep_lays_them_out(hidden, unroll):
    assert ll.logfmt_unroll(hidden) == unroll
    rng = np.random.default_rng(hidden)
    row = _bf16(rng.standard_normal(hidden) * 0.05)  # every group below 1: every chunk cast
    slot = ll.logfmt_encode(row)
    assert slot.shape == (ll.logfmt_slot_bytes(hidden),) == (hidden * 2 + hidden // 128 * 4,)
    meta = slot[:hidden // 32].view("<u4")
    values = bfloat16_bits_to_float32(row).reshape(-1, 128)
    np.testing.assert_array_equal(meta & 0xFFFF, _bf16(np.abs(values).max(axis=1)))
    np.testing.assert_array_equal(meta >> 16, _bf16(np.abs(values).min(axis=1)))
    # 10 bits a value: the data end at meta + hidden * 10 / 8; the rest of the slot is 0
    end = hidden // 32 + hidden * 10 // 8
    assert not slot[end:].any()
    assert ll.logfmt_encode(_bf16(np.full(hidden, 2.0)))[hidden // 32:].view("<u2").tolist() == _bf16(
        np.full(hidden, 2.0)).tolist()  # amax >= 1: every chunk BF16, as it is


def test_five_words_hold_sixteen_9_bit_codes_then_the_16_signs_in_the_upper_half():
    # DeepEP's packing (logfmt_encode / decode_and_accumulate): the 5 words are one 160-bit little-endian
    # field, code j at bits 9j..9j+8 and the sign of value j at bit 144 + j. Checked here independently.
    rng = np.random.default_rng(7)
    hidden = 512  # unroll 2: lane l owns 16 values, one 5-word unit
    row = _bf16(rng.standard_normal(hidden) * 0.1)
    row[3] |= 0x8000
    slot = ll.logfmt_encode(row)
    words = slot[hidden // 32:hidden // 32 + 640].view("<u4").reshape(32, 5)
    values = bfloat16_bits_to_float32(row)
    decoded = ll.logfmt_decode(slot, hidden)
    for lane in range(32):
        field = sum(int(w) << (32 * i) for i, w in enumerate(words[lane]))
        codes = [(field >> (9 * j)) & 0x1FF for j in range(16)]
        signs = [(field >> (144 + j)) & 1 for j in range(16)]
        lane_values = values[lane * 16:(lane + 1) * 16]
        assert signs == [int(np.signbit(v)) for v in lane_values]
        assert all((c == 0) == (d == 0) for c, d in zip(codes, decoded[lane * 16:(lane + 1) * 16]))


def test_a_chunk_with_one_group_at_or_above_1_travels_as_bf16_whole():
    hidden = 2048  # two chunks of 1024 channels (8 groups each)
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(hidden) * 0.05).astype(np.float32)
    values[1024 + 5 * 128 + 7] = 1.0  # group 13: amax 1, so chunk 1 stays BF16
    row = _bf16(values)
    slot = ll.logfmt_encode(row)
    decoded = ll.logfmt_decode(slot, hidden)
    np.testing.assert_array_equal(decoded[1024:], bfloat16_bits_to_float32(row)[1024:])
    assert (decoded[:1024] != bfloat16_bits_to_float32(row)[:1024]).any()
    meta = hidden // 32
    raw = slot[meta + 1280:meta + 1280 + 2048].view("<u2")
    np.testing.assert_array_equal(raw, row[1024:])


def test_decoding_rounds_to_the_nearest_level_in_linear_scale_within_half_a_step():
    rng = np.random.default_rng(11)
    hidden = 1024
    for scale in (0.3, 0.01, 1e-6):
        values = (rng.standard_normal(hidden) * scale).astype(np.float32)
        row = _bf16(values)
        exact = bfloat16_bits_to_float32(row).astype(np.float64)
        decoded = ll.logfmt_decode(ll.logfmt_encode(row), hidden).astype(np.float64)
        groups = np.abs(exact).reshape(-1, 128)
        log_amax = np.log2(groups.max(axis=1))
        log_amin = np.maximum(np.log2(np.where(groups.min(axis=1) > 0, groups.min(axis=1), 1e-300)), log_amax - 32)
        step = np.repeat((log_amax - log_amin) / 510, 128)
        big = np.abs(exact) >= np.repeat(2.0 ** log_amin, 128)
        rel = np.abs(decoded - exact) / np.abs(exact)
        # the nearest of two levels a factor 2**step apart is within (2**step - 1) / 2 of the value, plus the
        # float32 error of log2 / exp2
        assert (rel[big] <= (2.0 ** step[big] - 1) / 2 * 1.01 + 1e-5).all()
        assert (np.sign(decoded) * np.sign(exact) >= 0).all()


def test_zeros_decode_to_zero_and_a_zero_group_travels_as_bf16():
    hidden = 512
    values = np.zeros(hidden, np.float32)
    values[128:256] = np.linspace(-0.5, 0.5, 128)  # one zero value in a cast group (amin 0)
    row = _bf16(values)
    decoded = ll.logfmt_decode(ll.logfmt_encode(row), hidden)
    assert (decoded[values == 0] == 0).all()
    _, log_amin, step, _ = ll._logfmt_groups(np.float32([0.5]), np.float32([0.0]))
    assert log_amin[0] == -33.0 and math.isclose(step[0], 32 / 510, rel_tol=1e-6)


def test_the_logfmt_combine_sums_the_decoded_rows_with_their_weights():
    rng = np.random.default_rng(5)
    R, E, M, hidden, K = 2, 4, 8, 1024, 2
    xs = [_bf16(rng.standard_normal((M, hidden))) for _ in range(R)]
    topks = [np.stack([rng.permutation(E)[:K] for _ in range(M)]).astype(np.int64) for _ in range(R)]
    weights = [rng.random((M, K), dtype=np.float32) for _ in range(R)]
    results = ll.dispatch(xs, topks, M, E)
    ys = [_bf16(rng.standard_normal((E // R, R * M, hidden)) * 0.02) for _ in range(R)]
    plain = ll.combine(ys, topks, weights, results)
    logfmt = ll.combine(ys, topks, weights, results, use_logfmt=True)
    for rank in range(R):
        want = np.zeros((M, hidden), np.float32)
        for t in range(M):
            for k in range(K):
                owner, local = divmod(int(topks[rank][t, k]), E // R)
                row = ll.expert_row_of(results[owner], local, rank, t)
                decoded = ll.logfmt_decode(ll.logfmt_encode(ys[owner][local, row]), hidden)
                want[t] = want[t] + weights[rank][t, k] * decoded
        np.testing.assert_array_equal(logfmt[rank], float32_to_bfloat16_bits(want))
        assert (logfmt[rank] != plain[rank]).any()
        close = np.abs(bfloat16_bits_to_float32(logfmt[rank]) - bfloat16_bits_to_float32(plain[rank]))
        assert close.max() <= 0.03 * np.abs(bfloat16_bits_to_float32(plain[rank])).max()


def test_logfmt_needs_hidden_a_multiple_of_512():
    with pytest.raises(ValueError, match="LogFMT needs a multiple of 512, got 384"):
        ll.logfmt_encode(np.zeros(384, np.uint16))
