"""The NumPy model of the low-latency dispatch and combine (deepep_cupy/reference/low_latency.py).

Its FP8 rounding is checked against hand-computed e4m3 codes; its layout, counts and combine
against the contract written in its docstring.
"""

import numpy as np
import pytest

from deepep_cupy.reference import low_latency as ll
from deepep_cupy.reference.intranode import bfloat16_bits_to_float32, float32_to_bfloat16_bits


@pytest.mark.parametrize("value, code", [
    (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-1.0, 0xB8), (448.0, 0x7E), (-448.0, 0xFE),
    (2.0 ** -9, 0x01), (2.0 ** -6, 0x08), (7 * 2.0 ** -9, 0x07), (240.0, 0x77), (0.5, 0x30),
])
def test_e4m3_encodes_exact_values(value, code):
    assert ll.float32_to_e4m3_bits(np.float32(value)) == code


@pytest.mark.parametrize("value, code", [
    (1.0625, 0x38),          # halfway between 1 and 1.125: to the even mantissa (1)
    (1.1875, 0x3A),          # halfway between 1.125 and 1.25: to the even mantissa (1.25)
    (1.2, 0x3A),             # nearest is 1.25
    (17.0, 0x58),            # halfway between 16 and 18: to 16
    (0.1, 0x1D),             # 1.6 * 2**-4 -> 1.625 * 2**-4
    (2.0 ** -10, 0x00),      # halfway between 0 and the smallest subnormal: to 0
    (1.5 * 2.0 ** -10, 0x01),
    (3 * 2.0 ** -10, 0x02),  # halfway between subnormals 1 and 2: to 2
    (7.5 * 2.0 ** -9, 0x08), # halfway between the largest subnormal and the smallest normal
    (-2.0 ** -12, 0x80),     # underflows to a signed zero
])
def test_e4m3_rounds_to_nearest_even(value, code):
    assert ll.float32_to_e4m3_bits(np.float32(value)) == code


@pytest.mark.parametrize("value", [449.0, 464.0, 480.0, 1e9, 3.0e38])
def test_e4m3_saturates_to_448(value):
    assert ll.float32_to_e4m3_bits(np.float32(value)) == 0x7E
    assert ll.float32_to_e4m3_bits(np.float32(-value)) == 0xFE


def test_e4m3_nan_is_0x7f():
    assert ll.float32_to_e4m3_bits(np.float32(np.nan)) == 0x7F


def test_every_finite_e4m3_code_decodes_and_encodes_back():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    values = ll.e4m3_bits_to_float32(codes)
    assert values[codes == 0x7E][0] == 448.0 and values[codes == 0x01][0] == 2.0 ** -9
    np.testing.assert_array_equal(ll.float32_to_e4m3_bits(values), codes)


def test_e4m3_rounding_picks_the_nearest_code_on_random_values():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 7, 20000))).astype(np.float32)
    codes = ll.float32_to_e4m3_bits(values)
    grid = ll.e4m3_bits_to_float32(np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8))
    clamped = np.clip(values.astype(np.float64), -448, 448)
    best = np.abs(grid[None, :].astype(np.float64) - clamped[:, None]).min(axis=1)
    got = np.abs(ll.e4m3_bits_to_float32(codes).astype(np.float64) - clamped)
    np.testing.assert_array_equal(got, best)


def test_scales_map_amax_onto_448():
    scale, inv = ll.fp8_scales(np.float32([448.0, 224.0, 1.0]), round_scale=False)
    np.testing.assert_array_equal(scale, np.float32([1.0, 0.5, 1.0 / 448]))
    np.testing.assert_array_equal(inv, np.float32([1.0, 2.0, 448.0]))


def test_scales_are_amax_times_the_float_inverse_of_448_as_deepep_computes_them():
    # DeepEP: scale_inv = amax * kFinfoAmaxInvE4M3 (= 1 / 448.0f), scale = 448.0f / amax.
    rng = np.random.default_rng(3)
    amax = np.abs(rng.standard_normal(4096)).astype(np.float32) + np.float32(1e-3)
    scale, inv = ll.fp8_scales(amax, round_scale=False)
    np.testing.assert_array_equal(scale, amax * (np.float32(1.0) / np.float32(448.0)))
    np.testing.assert_array_equal(inv, np.float32(448.0) / amax)
    # The product and the quotient differ by an ulp for many amax: the model is the product.
    assert (scale != amax / np.float32(448.0)).any()
    assert scale.dtype == np.float32 and ll.FP8_MAX_INV == np.float32(1.0) / np.float32(448.0)


def test_round_scale_takes_the_exponent_of_the_product():
    # ceil(log2(amax * (1 / 448))), read from the bits of the float32 product.
    rng = np.random.default_rng(4)
    amax = (np.abs(rng.standard_normal(4096)) * 100).astype(np.float32) + np.float32(1e-3)
    amax[:3] = np.float32([448.0, 896.0, 1.0])
    scale, inv = ll.fp8_scales(amax, round_scale=True)
    product = (amax * ll.FP8_MAX_INV).astype(np.float32)
    bits = product.view(np.int32).astype(np.int64)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    np.testing.assert_array_equal(scale, np.ldexp(np.float32(1.0), exponent).astype(np.float32))
    np.testing.assert_array_equal(inv, np.ldexp(np.float32(1.0), -exponent).astype(np.float32))


def test_amax_is_floored_at_1e_4():
    scale, inv = ll.fp8_scales(np.float32([0.0, 1e-6]), round_scale=False)
    assert (scale == np.float32(1e-4) * (np.float32(1) / np.float32(448))).all()
    assert (inv == np.float32(448) / np.float32(1e-4)).all()


def test_round_scale_rounds_up_to_a_power_of_two():
    scale, inv = ll.fp8_scales(np.float32([448.0, 449.0, 224.0, 300.0, 0.0]), round_scale=True)
    np.testing.assert_array_equal(scale[:4], np.float32([1.0, 2.0, 0.5, 1.0]))
    np.testing.assert_array_equal(inv[:4], np.float32([1.0, 0.5, 2.0, 1.0]))
    # 1e-4 / 448 ~ 2.2e-7: between 2**-23 and 2**-22
    assert scale[4] == np.float32(2.0 ** -22) and inv[4] == np.float32(2.0 ** 22)


def test_ue8m0_packs_exponent_bytes_little_endian():
    packed = ll.pack_ue8m0(np.float32([[1.0, 2.0, 0.5, 4.0, 2.0 ** -21, 1.0, 1.0, 1.0]]))
    assert packed.dtype == np.int32 and packed.shape == (1, 2)
    words = packed.view(np.uint32)
    assert words[0, 0] == 127 | 128 << 8 | 126 << 16 | 129 << 24
    assert words[0, 1] == (127 - 21) | 127 << 8 | 127 << 16 | 127 << 24
    np.testing.assert_array_equal(ll.unpack_ue8m0(packed), [[1.0, 2.0, 0.5, 4.0, 2.0 ** -21, 1, 1, 1]])


def _bf16(values):
    return float32_to_bfloat16_bits(np.asarray(values, np.float32))


def test_cast_of_a_constant_group_gives_448_and_amax_over_448():
    x = _bf16(np.full((1, 256), 3.0))
    x[0, 128:] = _bf16(np.full(128, -0.5))
    data, scales = ll.cast_to_fp8(x)
    assert (data[0, :128] == 0x7E).all() and (data[0, 128:] == 0xFE).all()
    np.testing.assert_array_equal(scales, [[np.float32(3.0) * ll.FP8_MAX_INV, np.float32(0.5) * ll.FP8_MAX_INV]])


def test_cast_multiplies_by_the_inverse_scale():
    rng = np.random.default_rng(1)
    x = _bf16(rng.standard_normal((4, 384)))
    for round_scale in (False, True):
        data, scales = ll.cast_to_fp8(x, round_scale)
        groups = bfloat16_bits_to_float32(x).reshape(4, 3, 128)
        _, inv = ll.fp8_scales(np.abs(groups).max(axis=2), round_scale)
        expected = ll.float32_to_e4m3_bits((groups * inv[:, :, None]).astype(np.float32)).reshape(4, 384)
        np.testing.assert_array_equal(data, expected)
        decoded = ll.e4m3_bits_to_float32(data).reshape(4, 3, 128) * scales[:, :, None]
        np.testing.assert_allclose(decoded, groups, rtol=0.07, atol=1e-6)


def test_cast_refuses_hidden_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="hidden"):
        ll.cast_to_fp8(np.zeros((1, 200), np.uint16))


def _routing():
    # 2 ranks, 4 experts (2 per rank), M = 4
    topk = [np.array([[0, 2], [3, -1], [0, -1]]), np.array([[2, 0], [-1, -1], [1, 2], [0, 3]])]
    xs = [_bf16(np.arange(n * 128).reshape(n, 128) % 7 + 10 * (r + 1)) for r, n in enumerate((3, 4))]
    return xs, topk


def test_dispatch_packs_rows_by_source_rank_then_token():
    xs, topk = _routing()
    results = ll.dispatch(xs, topk, 4, 4)
    rank0 = results[0]
    # expert 0 gets rank 0's tokens 0, 2 then rank 1's tokens 0, 3; expert 1 rank 1's token 2
    np.testing.assert_array_equal(rank0["recv_count"], [4, 1])
    np.testing.assert_array_equal(rank0["src_info"][0, :4], [0, 2, 0, 3])
    np.testing.assert_array_equal(rank0["layout_range"][0], [(0 << 32) | 2, (2 << 32) | 2])
    np.testing.assert_array_equal(rank0["layout_range"][1], [0, (0 << 32) | 1])
    np.testing.assert_array_equal(rank0["recv_x"][0, :4], [xs[0][0], xs[0][2], xs[1][0], xs[1][3]])
    assert rank0["recv_x"].shape == (2, 8, 128) and rank0["scales"] is None
    rank1 = results[1]
    np.testing.assert_array_equal(rank1["recv_count"], [3, 2])  # expert 2: r0 t0, r1 t0, r1 t2
    np.testing.assert_array_equal(rank1["src_info"][0, :3], [0, 0, 2])


def test_dispatch_fp8_gives_scales_per_row_and_ue8m0_words():
    xs, topk = _routing()
    xs = [np.concatenate([x] * 4, axis=1) for x in xs]  # hidden 512
    plain = ll.dispatch(xs, topk, 4, 4, use_fp8=True)
    packed = ll.dispatch(xs, topk, 4, 4, use_fp8=True, use_ue8m0=True)
    rounded = ll.dispatch(xs, topk, 4, 4, use_fp8=True, round_scale=True)
    data, scales = ll.cast_to_fp8(xs[1])
    np.testing.assert_array_equal(plain[0]["recv_x"][1, 0], data[2])
    np.testing.assert_array_equal(plain[0]["scales"][1, 0], scales[2])
    assert packed[0]["scales"].shape == (2, 8, 1) and packed[0]["scales"].dtype == np.int32
    np.testing.assert_array_equal(ll.unpack_ue8m0(packed[0]["scales"]), rounded[0]["scales"])
    np.testing.assert_array_equal(packed[0]["recv_x"], rounded[0]["recv_x"])


def test_dispatch_refuses_more_tokens_than_the_maximum_and_repeated_experts():
    xs, topk = _routing()
    with pytest.raises(ValueError, match="at most 3"):
        ll.dispatch(xs, topk, 3, 4)
    with pytest.raises(ValueError, match="twice"):
        ll.dispatch(xs, [topk[0], np.array([[0, 0], [-1, -1], [1, 2], [0, 3]])], 4, 4)
    with pytest.raises(ValueError, match="outside"):
        ll.dispatch(xs, [topk[0], np.array([[4, 0], [-1, -1], [1, 2], [0, 3]])], 4, 4)


def test_dispatch_checks_routing_as_the_intranode_reference_does():
    # The shape, dtype and range checks are reference.py's (one place), the repeated-expert one its own.
    xs, topk = _routing()
    with pytest.raises(TypeError, match="topk_idx must be an integer array"):
        ll.dispatch(xs, [topk[0], np.asarray(topk[1], np.float64)], 4, 4)
    with pytest.raises(ValueError, match=r"topk_idx must be 2-D"):
        ll.dispatch(xs, [topk[0], np.asarray(topk[1])[:, 0]], 4, 4)


def test_combine_sums_weighted_rows_in_topk_order_in_float32():
    xs, topk = _routing()
    results = ll.dispatch(xs, topk, 4, 4)
    rng = np.random.default_rng(2)
    outputs = [_bf16(rng.standard_normal((2, 8, 128))) for _ in range(2)]
    weights = [rng.random(t.shape).astype(np.float32) for t in topk]
    combined = ll.combine(outputs, topk, weights, results)
    # rank 1, token 3: experts 0 (rank 0 row 3) then 3 (rank 1 local 1, row 1)
    row_a = bfloat16_bits_to_float32(outputs[0][0, 3])
    row_b = bfloat16_bits_to_float32(outputs[1][1, 1])
    expected = (weights[1][3, 0] * row_a).astype(np.float32) + (weights[1][3, 1] * row_b).astype(np.float32)
    np.testing.assert_array_equal(combined[1][3], _bf16(expected))
    assert (combined[1][1] == 0).all()  # no expert: zeros
    assert combined[0].shape == (3, 128) and combined[0].dtype == np.uint16


def test_combine_with_unit_weights_of_dispatched_rows_gives_the_tokens_back_times_their_expert_count():
    xs, topk = _routing()
    results = ll.dispatch(xs, topk, 4, 4)
    outputs = [r["recv_x"] for r in results]
    weights = [np.ones(t.shape, np.float32) for t in topk]
    combined = ll.combine(outputs, topk, weights, results)
    for x, t, c in zip(xs, topk, combined):
        count = (t >= 0).sum(axis=1).astype(np.float32)[:, None]
        np.testing.assert_array_equal(c, _bf16(bfloat16_bits_to_float32(x) * count))
