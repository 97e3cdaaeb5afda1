"""Properties of the NumPy reference model (deepep_cupy/reference/intranode.py).

The reference is the source of truth for every GPU test, so its own behaviour is pinned down here,
mostly against brute-force loops written independently of its vectorised code.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

try:
    from deepep_cupy.reference import intranode as ref
except Exception:  # the package __init__ may need CuPy; load the module file on its own
    _path = pathlib.Path(__file__).resolve().parents[1] / "deepep_cupy" / "reference.py"
    _spec = importlib.util.spec_from_file_location("_deepep_cupy_reference", _path)
    ref = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ref)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def make_inputs(seed, tokens_per_rank, num_experts=16, num_topk=4, hidden=32, *, drop_fraction=0.1,
                skew=0.0, dtype=np.uint16):
    """Random per-rank data: payload rows (random bit patterns for integer dtypes), routing and weights."""
    rng = np.random.default_rng(seed)
    xs, idxs, weights = [], [], []
    for n in tokens_per_rank:
        if np.issubdtype(dtype, np.integer):
            x = rng.integers(0, np.iinfo(dtype).max, size=(n, hidden), dtype=dtype, endpoint=True)
        else:
            x = rng.standard_normal((n, hidden)).astype(dtype)
        xs.append(x)
        idxs.append(ref.random_routing(rng, n, num_experts, num_topk, skew=skew, drop_fraction=drop_fraction))
        weights.append(rng.random((n, num_topk), dtype=np.float32) + np.float32(0.5))
    return xs, idxs, weights


def brute_is_token_in_rank(topk_idx, num_experts, num_ranks):
    per = num_experts // num_ranks
    out = np.zeros((topk_idx.shape[0], num_ranks), dtype=bool)
    for t in range(topk_idx.shape[0]):
        for e in topk_idx[t]:
            if e >= 0:
                out[t, e // per] = True
    return out


def channel_of(t, num_tokens, num_channels):
    for c in range(num_channels):
        begin, end = ref.channel_task_range(num_tokens, num_channels, c)
        if begin <= t < end:
            return c
    raise AssertionError(f"token {t} is in no channel")


def source_ranks(results, j):
    rpm = results[j]["rank_prefix_matrix"]
    counts = np.diff(np.concatenate([[0], rpm[:, j].astype(np.int64)]))
    return np.repeat(np.arange(len(results)), counts)


# ----------------------------------------------------------------------------------------------
# channels
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,num_channels", [(0, 4), (3, 8), (10, 4), (17, 5), (4096, 24), (24, 24)])
def test_channel_ranges_partition_tokens_in_order(num_tokens, num_channels):
    ranges = [ref.channel_task_range(num_tokens, num_channels, c) for c in range(num_channels)]
    position = 0
    for begin, end in ranges:
        assert begin == position and begin <= end
        position = end
    assert position == num_tokens


@pytest.mark.parametrize("num_tokens,num_channels", [(3, 8), (10, 4), (17, 5), (4096, 24)])
def test_channel_ranges_have_ceil_size_except_at_the_end(num_tokens, num_channels):
    per = -(-num_tokens // num_channels)
    sizes = [end - begin for begin, end in (ref.channel_task_range(num_tokens, num_channels, c)
                                            for c in range(num_channels))]
    full = [s for s in sizes if s == per]
    assert sizes[:len(full)] == full
    assert all(s < per for s in sizes[len(full):])
    assert sum(1 for s in sizes if 0 < s < per) <= 1


# ----------------------------------------------------------------------------------------------
# random routing
# ----------------------------------------------------------------------------------------------

def test_random_routing_rows_hold_distinct_experts_in_range():
    rng = np.random.default_rng(1)
    idx = ref.random_routing(rng, 2000, 64, 8)
    assert idx.dtype == np.int64 and idx.shape == (2000, 8)
    assert idx.min() >= 0 and idx.max() < 64
    assert all(len(set(row)) == 8 for row in idx.tolist())


def test_random_routing_distinct_even_when_topk_equals_num_experts():
    idx = ref.random_routing(np.random.default_rng(2), 50, 8, 8, skew=3.0)
    assert (np.sort(idx, axis=1) == np.arange(8)).all()


def test_random_routing_drops_entries_with_given_probability():
    idx = ref.random_routing(np.random.default_rng(3), 4000, 64, 8, drop_fraction=0.25)
    dropped = idx == -1
    assert abs(dropped.mean() - 0.25) < 0.02
    kept = idx[~dropped]
    assert kept.min() >= 0 and kept.max() < 64
    assert all(len(set(r)) == len(r) for r in (row[row >= 0].tolist() for row in idx))


def test_random_routing_without_skew_is_roughly_uniform():
    idx = ref.random_routing(np.random.default_rng(4), 8000, 32, 4)
    counts = np.bincount(idx.ravel(), minlength=32)
    expected = 8000 * 4 / 32
    assert np.abs(counts - expected).max() < 0.15 * expected


def test_random_routing_skew_makes_low_experts_more_frequent():
    idx = ref.random_routing(np.random.default_rng(5), 8000, 64, 4, skew=4.0)
    counts = np.bincount(idx.ravel(), minlength=64)
    assert counts[:16].sum() > 2 * counts[48:].sum()
    assert counts[0] > counts[63]


def test_random_routing_accepts_zero_tokens():
    idx = ref.random_routing(np.random.default_rng(6), 0, 16, 4)
    assert idx.shape == (0, 4) and idx.dtype == np.int64


def test_random_routing_is_reproducible_from_the_seed():
    a = ref.random_routing(np.random.default_rng(7), 100, 32, 4, skew=1.0, drop_fraction=0.2)
    b = ref.random_routing(np.random.default_rng(7), 100, 32, 4, skew=1.0, drop_fraction=0.2)
    c = ref.random_routing(np.random.default_rng(8), 100, 32, 4, skew=1.0, drop_fraction=0.2)
    assert (a == b).all() and not (a == c).all()


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------

def test_layout_matches_brute_force():
    rng = np.random.default_rng(10)
    idx = ref.random_routing(rng, 300, 24, 6, skew=2.0, drop_fraction=0.3)
    per_rank, per_expert, in_rank = ref.get_dispatch_layout(idx, 24, 4)
    assert per_rank.dtype == np.int32 and per_expert.dtype == np.int32 and in_rank.dtype == bool
    brute_expert = np.zeros(24, dtype=np.int64)
    for e in idx.ravel():
        if e >= 0:
            brute_expert[e] += 1
    assert (per_expert == brute_expert).all()
    assert (in_rank == brute_is_token_in_rank(idx, 24, 4)).all()


def test_tokens_per_rank_equal_is_token_in_rank_column_sums():
    idx = ref.random_routing(np.random.default_rng(11), 500, 32, 8, drop_fraction=0.5)
    per_rank, _, in_rank = ref.get_dispatch_layout(idx, 32, 8)
    assert (per_rank == in_rank.sum(axis=0)).all()
    assert per_rank.sum() < idx.shape[0] * 8  # tokens with several experts on a rank count once


def test_token_with_no_experts_is_in_no_rank():
    idx = ref.random_routing(np.random.default_rng(12), 20, 16, 4)
    idx[[3, 7]] = -1
    per_rank, per_expert, in_rank = ref.get_dispatch_layout(idx, 16, 2)
    assert not in_rank[[3, 7]].any()
    assert in_rank[[0, 1, 2]].any(axis=1).all()
    assert per_expert.sum() == (idx >= 0).sum()


def test_layout_rejects_expert_out_of_range():
    idx = ref.random_routing(np.random.default_rng(13), 10, 16, 4)
    idx[0, 0] = 16
    with pytest.raises(ValueError):
        ref.get_dispatch_layout(idx, 16, 2)


# ----------------------------------------------------------------------------------------------
# dispatch: counts and matrices
# ----------------------------------------------------------------------------------------------

SIZES = [57, 130, 0, 91]   # four ranks, one with no tokens


@pytest.fixture(scope="module")
def four_ranks():
    xs, idxs, weights = make_inputs(20, SIZES, num_experts=16, num_topk=4, drop_fraction=0.2)
    results = ref.dispatch(xs, idxs, 16, 5, topk_weights=weights)
    return xs, idxs, weights, results


def test_received_count_equals_last_row_of_rank_prefix_matrix(four_ranks):
    _, _, _, results = four_ranks
    for j, res in enumerate(results):
        n = res["rank_prefix_matrix"][-1, j]
        assert res["recv_x"].shape[0] == n == res["recv_src_idx"].shape[0] == res["recv_topk_idx"].shape[0]


def test_rank_prefix_matrix_is_identical_and_an_inclusive_prefix_over_senders(four_ranks):
    _, idxs, _, results = four_ranks
    expected = np.cumsum([brute_is_token_in_rank(i, 16, 4).sum(axis=0) for i in idxs], axis=0)
    for res in results:
        assert res["rank_prefix_matrix"].dtype == np.int32
        assert (res["rank_prefix_matrix"] == expected).all()


def test_layout_fields_are_the_receiving_ranks_own(four_ranks):
    _, idxs, _, results = four_ranks
    for j, res in enumerate(results):
        per_rank, per_expert, in_rank = ref.get_dispatch_layout(idxs[j], 16, 4)
        assert (res["num_tokens_per_rank"] == per_rank).all()
        assert (res["num_tokens_per_expert"] == per_expert).all()
        assert (res["is_token_in_rank"] == in_rank).all()


def test_channel_prefix_matrix_counts_tokens_of_channels_up_to_c(four_ranks):
    _, idxs, _, results = four_ranks
    num_channels = 5
    for j, res in enumerate(results):
        in_rank = brute_is_token_in_rank(idxs[j], 16, 4)
        n = in_rank.shape[0]
        expected = np.zeros((4, num_channels), dtype=np.int64)
        for k in range(4):
            for c in range(num_channels):
                end = ref.channel_task_range(n, num_channels, c)[1]
                expected[k, c] = in_rank[:end, k].sum()
        assert res["channel_prefix_matrix"].dtype == np.int32
        assert (res["channel_prefix_matrix"] == expected).all()


def test_recv_channel_prefix_is_exclusive_shift_of_senders_channel_prefix(four_ranks):
    _, _, _, results = four_ranks
    for j, res in enumerate(results):
        rcpm = res["recv_channel_prefix_matrix"]
        assert rcpm.dtype == np.int32 and rcpm.shape == (4, 5)
        for i in range(4):
            sender_row = results[i]["channel_prefix_matrix"][j]
            assert rcpm[i, 0] == 0
            assert (rcpm[i, 1:] == sender_row[:-1]).all()


def test_recv_channel_prefix_marks_where_each_channels_tokens_start(four_ranks):
    _, _, _, results = four_ranks
    for j, res in enumerate(results):
        sources = source_ranks(results, j)
        for i in range(4):
            block = res["recv_src_idx"][sources == i]
            n_i = results[i]["is_token_in_rank"].shape[0]
            for c in range(5):
                begin = ref.channel_task_range(n_i, 5, c)[0]
                assert res["recv_channel_prefix_matrix"][i, c] == (block < begin).sum()


def test_per_expert_receive_counts_sum_over_sources(four_ranks):
    _, idxs, _, results = four_ranks
    for j, res in enumerate(results):
        counts = res["num_recv_tokens_per_expert_list"]
        assert isinstance(counts, list) and all(type(c) is int for c in counts) and len(counts) == 4
        expected = [sum(int((i == 4 * j + e).sum()) for i in idxs) for e in range(4)]
        assert counts == expected
        assert sum(counts) == (res["recv_topk_idx"] >= 0).sum()


@pytest.mark.parametrize("alignment", [1, 3, 128])
def test_per_expert_receive_counts_round_up_to_alignment(alignment):
    xs, idxs, weights = make_inputs(21, [200, 150], num_experts=8, num_topk=3)
    raw = ref.dispatch(xs, idxs, 8, 3)
    aligned = ref.dispatch(xs, idxs, 8, 3, expert_alignment=alignment)
    for r, a in zip(raw, aligned):
        for n_raw, n_aligned in zip(r["num_recv_tokens_per_expert_list"], a["num_recv_tokens_per_expert_list"]):
            assert n_aligned % alignment == 0
            assert 0 <= n_aligned - n_raw < alignment
        assert (r["recv_x"] == a["recv_x"]).all()


# ----------------------------------------------------------------------------------------------
# dispatch: moved data
# ----------------------------------------------------------------------------------------------

def test_received_rows_are_exact_copies_of_the_named_source_rows(four_ranks):
    xs, _, _, results = four_ranks
    for j, res in enumerate(results):
        sources = source_ranks(results, j)
        assert res["recv_x"].dtype == xs[0].dtype and res["recv_src_idx"].dtype == np.int32
        for row, (i, t) in enumerate(zip(sources, res["recv_src_idx"])):
            assert res["recv_x"][row].tobytes() == xs[i][t].tobytes()


def test_receive_order_is_by_source_rank_then_ascending_token_index(four_ranks):
    _, idxs, _, results = four_ranks
    for j, res in enumerate(results):
        expected = [(i, t) for i in range(4) for t in range(idxs[i].shape[0])
                    if brute_is_token_in_rank(idxs[i], 16, 4)[t, j]]
        got = list(zip(source_ranks(results, j).tolist(), res["recv_src_idx"].tolist()))
        assert got == expected


def test_float_payloads_keep_their_bit_patterns():
    xs, idxs, _ = make_inputs(22, [40, 33], num_experts=4, num_topk=2, dtype=np.float32)
    xs[0][0, :4] = np.array([0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x00000001], dtype=np.uint32).view(np.float32)
    idxs[0][0] = [0, 3]  # token 0 of rank 0 goes to both ranks
    results = ref.dispatch(xs, idxs, 4, 2)
    for res in results:
        assert res["recv_x"].dtype == np.float32
        assert res["recv_x"][0].tobytes() == xs[0][0].tobytes()


def test_recv_topk_idx_is_made_local_and_minus_one_elsewhere(four_ranks):
    _, idxs, _, results = four_ranks
    for j, res in enumerate(results):
        sources = source_ranks(results, j)
        assert res["recv_topk_idx"].dtype == np.int64
        for row, (i, t) in enumerate(zip(sources, res["recv_src_idx"])):
            for k, e in enumerate(idxs[i][t]):
                expected = e - 4 * j if 4 * j <= e < 4 * j + 4 else -1
                assert res["recv_topk_idx"][row, k] == expected


def test_recv_topk_weights_are_kept_where_local_and_zero_elsewhere(four_ranks):
    _, _, weights, results = four_ranks
    for j, res in enumerate(results):
        sources = source_ranks(results, j)
        w = res["recv_topk_weights"]
        assert w.dtype == np.float32
        local = res["recv_topk_idx"] >= 0
        assert (w[~local] == 0.0).all()
        original = np.stack([weights[i][t] for i, t in zip(sources, res["recv_src_idx"])]) if len(sources) else w
        assert (w[local] == original[local]).all()


def test_every_received_token_has_a_local_expert(four_ranks):
    _, _, _, results = four_ranks
    for res in results:
        assert (res["recv_topk_idx"] >= 0).any(axis=1).all()


def test_optional_outputs_are_none_without_weights_or_scales():
    xs, idxs, _ = make_inputs(23, [10, 12], num_experts=4, num_topk=2)
    for res in ref.dispatch(xs, idxs, 4, 2):
        assert res["recv_topk_weights"] is None and res["recv_x_scales"] is None


@pytest.mark.parametrize("scales_2d", [True, False])
def test_x_scales_travel_with_their_rows(scales_2d):
    rng = np.random.default_rng(24)
    sizes = [64, 48, 80]
    xs, scales, idxs = [], [], []
    for n in sizes:
        x, s = ref.fp8_e4m3_scaled_random(rng, n, 256)
        xs.append(x)
        scales.append(s if scales_2d else s[:, 0].copy())
        idxs.append(ref.random_routing(rng, n, 6, 2))
    results = ref.dispatch(xs, idxs, 6, 4, x_scales=scales)
    for j, res in enumerate(results):
        sources = source_ranks(results, j)
        rs = res["recv_x_scales"]
        assert rs.dtype == np.float32 and rs.shape == (len(sources), *scales[0].shape[1:])
        assert res["recv_x"].dtype == np.uint8
        for row, (i, t) in enumerate(zip(sources, res["recv_src_idx"])):
            assert rs[row].tobytes() == scales[i][t].tobytes()


def test_trailing_dimensions_of_rows_are_preserved():
    rng = np.random.default_rng(25)
    xs = [rng.integers(0, 255, size=(n, 3, 16), dtype=np.uint8) for n in (9, 14)]
    idxs = [ref.random_routing(rng, n, 4, 2) for n in (9, 14)]
    for res in ref.dispatch(xs, idxs, 4, 2):
        assert res["recv_x"].shape[1:] == (3, 16)


# ----------------------------------------------------------------------------------------------
# dispatch: send_head and the handle
# ----------------------------------------------------------------------------------------------

def test_send_head_is_minus_one_exactly_where_token_is_not_sent(four_ranks):
    _, _, _, results = four_ranks
    for res in results:
        assert res["send_head"].dtype == np.int32 and res["send_head"].shape == res["is_token_in_rank"].shape
        assert ((res["send_head"] == -1) == ~res["is_token_in_rank"]).all()


def test_send_head_counts_the_earlier_tokens_sent_to_the_same_rank(four_ranks):
    _, _, _, results = four_ranks
    for res in results:
        in_rank = res["is_token_in_rank"]
        for t in range(in_rank.shape[0]):
            for k in range(4):
                if in_rank[t, k]:
                    assert res["send_head"][t, k] == in_rank[:t, k].sum()


def test_send_head_runs_on_across_channels():
    xs, idxs, _ = make_inputs(26, [100, 100], num_experts=2, num_topk=1, drop_fraction=0.0)
    idxs[0][:] = 1  # every token of rank 0 goes to rank 1
    res = ref.dispatch(xs, idxs, 2, 4)[0]
    assert (res["send_head"][:, 1] == np.arange(100)).all()
    assert (res["send_head"][:, 0] == -1).all()


def test_send_head_and_the_rank_prefix_matrix_locate_each_copy(four_ranks):
    """rank_prefix + send_head = row of the copy on the receiver (where combine finds it)."""
    _, _, _, results = four_ranks
    for m, sender in enumerate(results):
        n = sender["is_token_in_rank"].shape[0]
        for t in range(n):
            for r in range(4):
                if not sender["is_token_in_rank"][t, r]:
                    continue
                recv = results[r]
                block = 0 if m == 0 else recv["rank_prefix_matrix"][m - 1, r]
                row = block + sender["send_head"][t, r]
                assert recv["recv_src_idx"][row] == t
                assert source_ranks(results, r)[row] == m


def test_recv_channel_prefix_is_the_send_head_of_each_channels_first_token(four_ranks):
    _, _, _, results = four_ranks
    for m, sender in enumerate(results):
        in_rank = sender["is_token_in_rank"]
        n = in_rank.shape[0]
        for r in range(4):
            for c in range(5):
                begin = ref.channel_task_range(n, 5, c)[0]
                assert results[r]["recv_channel_prefix_matrix"][m, c] == in_rank[:begin, r].sum()


def test_handle_of_returns_the_six_handle_fields_in_order(four_ranks):
    res = four_ranks[3][1]
    names = ["rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
             "recv_src_idx", "is_token_in_rank", "send_head"]
    handle = ref.handle_of(res)
    assert len(handle) == 6
    assert all(h is res[name] for h, name in zip(handle, names))


# ----------------------------------------------------------------------------------------------
# dispatch: edge cases
# ----------------------------------------------------------------------------------------------

def test_rank_with_zero_tokens_sends_nothing_and_has_empty_layout(four_ranks):
    _, _, _, results = four_ranks
    empty = results[2]
    assert empty["is_token_in_rank"].shape == (0, 4) and empty["send_head"].shape == (0, 4)
    assert (empty["channel_prefix_matrix"] == 0).all()
    rpm = empty["rank_prefix_matrix"]
    assert (rpm[2] == rpm[1]).all()
    for j, res in enumerate(results):
        assert (res["recv_channel_prefix_matrix"][2] == 0).all()
        assert 2 not in source_ranks(results, j)


def test_rank_receiving_nothing_gets_empty_outputs_of_the_right_shape():
    xs, idxs, weights = make_inputs(27, [30, 40, 50], num_experts=6, num_topk=2, hidden=24)
    for i in idxs:
        i[i >= 4] = -1      # rank 2 owns experts 4 and 5: nobody routes there
    res = ref.dispatch(xs, idxs, 6, 3, topk_weights=weights)[2]
    assert res["recv_x"].shape == (0, 24) and res["recv_x"].dtype == np.uint16
    assert res["recv_topk_idx"].shape == (0, 2) and res["recv_topk_weights"].shape == (0, 2)
    assert res["recv_src_idx"].shape == (0,)
    assert res["num_recv_tokens_per_expert_list"] == [0, 0]
    assert (res["recv_channel_prefix_matrix"] == 0).all()
    assert res["rank_prefix_matrix"][-1, 2] == 0


def test_more_channels_than_tokens_leaves_trailing_channels_empty():
    xs, idxs, _ = make_inputs(28, [3, 5], num_experts=4, num_topk=2, drop_fraction=0.0)
    results = ref.dispatch(xs, idxs, 4, 8)
    for res in results:
        n = res["is_token_in_rank"].shape[0]
        cpm = res["channel_prefix_matrix"]
        assert (cpm[:, n:] == cpm[:, n - 1:n]).all()
        assert (cpm[:, -1] == res["num_tokens_per_rank"]).all()


def test_rows_with_only_minus_one_are_not_sent():
    xs, idxs, _ = make_inputs(29, [20, 20], num_experts=4, num_topk=2, drop_fraction=0.0)
    idxs[1][5] = -1
    idxs[1][6] = [-1, 2]
    results = ref.dispatch(xs, idxs, 4, 2)
    received_from_1 = [set(res["recv_src_idx"][source_ranks(results, j) == 1].tolist())
                       for j, res in enumerate(results)]
    assert all(5 not in s for s in received_from_1)
    assert 6 in received_from_1[1] and 6 not in received_from_1[0]
    row = np.nonzero((source_ranks(results, 1) == 1) & (results[1]["recv_src_idx"] == 6))[0][0]
    assert results[1]["recv_topk_idx"][row].tolist() == [-1, 0]


def test_single_rank_receives_all_its_routed_tokens():
    xs, idxs, _ = make_inputs(30, [25], num_experts=4, num_topk=2, drop_fraction=0.3)
    res = ref.dispatch(xs, idxs, 4, 3)[0]
    sent = (idxs[0] >= 0).any(axis=1)
    assert (res["recv_src_idx"] == np.nonzero(sent)[0]).all()
    assert (res["recv_x"] == xs[0][sent]).all()


def test_dispatch_rejects_experts_not_divisible_by_ranks():
    xs, idxs, _ = make_inputs(31, [4, 4, 4], num_experts=8, num_topk=2)
    with pytest.raises(ValueError):
        ref.dispatch(xs, idxs, 8, 2)


# ----------------------------------------------------------------------------------------------
# combine
# ----------------------------------------------------------------------------------------------

def small_integer_inputs(seed, sizes, hidden=16, num_experts=16, num_topk=4, drop_fraction=0.2):
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-50, 50, size=(n, hidden)).astype(np.float32) for n in sizes]
    idxs = [ref.random_routing(rng, n, num_experts, num_topk, drop_fraction=drop_fraction) for n in sizes]
    return xs, idxs


def test_combine_of_unchanged_dispatch_output_multiplies_by_number_of_destinations():
    xs, idxs = small_integer_inputs(40, [70, 0, 45, 90])
    results = ref.dispatch(xs, idxs, 16, 6)
    combined = ref.combine([r["recv_x"] for r in results], results)
    for m, (out, w) in enumerate(combined):
        assert out.dtype == np.float32 and out.shape == xs[m].shape and w is None
        fanout = results[m]["is_token_in_rank"].sum(axis=1).astype(np.float32)
        assert (out == xs[m] * fanout[:, None]).all()


def test_combine_gives_zeros_for_tokens_sent_nowhere():
    xs, idxs = small_integer_inputs(41, [30, 30])
    idxs[0][[0, 4, 9]] = -1
    results = ref.dispatch(xs, idxs, 16, 3)
    out = ref.combine([r["recv_x"] + 7 for r in results], results)[0][0]
    assert (out[[0, 4, 9]] == 0).all()
    assert (out[~results[0]["is_token_in_rank"].any(axis=1)] == 0).all()
    assert (np.abs(out[1]) > 0).any()


def manual_combine(xs, results, m, rank_order=None):
    """Literal loop: token by token, rank by rank (ascending by default), float32 additions from 0.0."""
    in_rank = results[m]["is_token_in_rank"]
    out = np.zeros((in_rank.shape[0], xs[0].shape[1]), dtype=np.float32)
    for t in range(in_rank.shape[0]):
        acc = np.zeros(xs[0].shape[1], dtype=np.float32)
        for r in (range(len(results)) if rank_order is None else rank_order):
            if in_rank[t, r]:
                sources = source_ranks(results, r)
                row = np.nonzero((sources == m) & (results[r]["recv_src_idx"] == t))[0][0]
                acc = acc + xs[r][row].astype(np.float32)
        out[t] = acc
    return out


def test_combine_adds_copies_in_ascending_rank_order_in_float32():
    rng = np.random.default_rng(42)
    sizes = [40, 40, 40]
    idxs = [ref.random_routing(rng, n, 6, 4) for n in sizes]
    results = ref.dispatch([rng.integers(0, 256, size=(n, 16), dtype=np.uint8) for n in sizes], idxs, 6, 3)
    # Values of wildly different magnitudes make float32 addition order-dependent.
    xs = [(rng.standard_normal((len(r["recv_src_idx"]), 8)) * 10.0 ** rng.integers(-4, 9, size=(1, 8)))
          .astype(np.float32) for r in results]
    combined = ref.combine(xs, results)
    for m in range(3):
        assert combined[m][0].tobytes() == manual_combine(xs, results, m).tobytes()
    # Sanity: the order matters for this data (descending rank order gives other bits somewhere).
    descending = [manual_combine(xs, results, m, rank_order=[2, 1, 0]) for m in range(3)]
    assert any(combined[m][0].tobytes() != descending[m].tobytes() for m in range(3))


def test_combine_order_matters_on_a_hand_built_case():
    """1 + 1e8 - 1e8 in float32: ascending rank order gives 0, any other order gives 1."""
    rng = np.random.default_rng(47)
    idxs = [np.array([[0, 1, 2]], dtype=np.int64), np.zeros((0, 3), np.int64), np.zeros((0, 3), np.int64)]
    payload = [rng.standard_normal((n, 4)).astype(np.float32) for n in (1, 0, 0)]
    results = ref.dispatch(payload, idxs, 3, 1)
    xs = [np.array([[1.0]], np.float32), np.array([[1e8]], np.float32), np.array([[-1e8]], np.float32)]
    out = ref.combine(xs, results)[0][0]
    assert out[0, 0] == np.float32(0.0)
    xs_swapped = [xs[1], xs[2], xs[0]]
    assert ref.combine(xs_swapped, results)[0][0][0, 0] == np.float32(1.0)


def test_combine_sums_topk_weights_like_the_rows():
    xs, idxs = small_integer_inputs(43, [50, 60, 0], num_experts=12, num_topk=3)
    rng = np.random.default_rng(44)
    weights = [rng.random((n, 3), dtype=np.float32) for n in (50, 60, 0)]
    results = ref.dispatch(xs, idxs, 12, 4, topk_weights=weights)
    recv_w = [r["recv_topk_weights"] for r in results]
    combined = ref.combine([r["recv_x"] for r in results], results, topk_weights=recv_w)
    for m, (_, w) in enumerate(combined):
        assert w.dtype == np.float32 and w.shape == (len(xs[m]), 3)
        # each (token, k) weight is kept on exactly the rank owning its expert, zero elsewhere
        expected = np.where(idxs[m] >= 0, weights[m], 0.0).astype(np.float32)
        assert (w == expected).all()


def test_combine_reads_uint16_as_bfloat16_bits_and_float16_as_values():
    xs, idxs = small_integer_inputs(45, [30, 20])
    results = ref.dispatch(xs, idxs, 16, 2)
    recv_f32 = [r["recv_x"] for r in results]
    from_f32 = ref.combine(recv_f32, results)
    from_bf16 = ref.combine([ref.float32_to_bfloat16_bits(x) for x in recv_f32], results)
    from_f16 = ref.combine([x.astype(np.float16) for x in recv_f32], results)
    for a, b, c in zip(from_f32, from_bf16, from_f16):
        assert (a[0] == b[0]).all() and (a[0] == c[0]).all()
        assert b[0].dtype == np.float32 and c[0].dtype == np.float32


def test_combine_rejects_rows_of_the_wrong_count():
    xs, idxs = small_integer_inputs(46, [10, 10])
    results = ref.dispatch(xs, idxs, 16, 2)
    with pytest.raises(ValueError):
        ref.combine([results[0]["recv_x"][:-1], results[1]["recv_x"]], results)


# ----------------------------------------------------------------------------------------------
# number formats
# ----------------------------------------------------------------------------------------------

def test_bfloat16_bits_round_trip_exactly():
    rng = np.random.default_rng(50)
    bits = rng.integers(0, 0x10000, size=20000, dtype=np.uint32).astype(np.uint16)
    bits = bits[(bits & 0x7FFF) <= 0x7F80]      # everything but NaN patterns
    back = ref.float32_to_bfloat16_bits(ref.bfloat16_bits_to_float32(bits))
    assert back.dtype == np.uint16 and (back == bits).all()


def test_bfloat16_bits_to_float32_puts_bits_in_the_high_half():
    bits = np.array([0x3F80, 0xC000, 0x0001, 0x7F80], dtype=np.uint16)
    f = ref.bfloat16_bits_to_float32(bits)
    assert f.dtype == np.float32
    assert f.view(np.uint32).tolist() == [0x3F800000, 0xC0000000, 0x00010000, 0x7F800000]
    assert f[0] == 1.0 and f[1] == -2.0 and np.isinf(f[3])


@pytest.mark.parametrize("f32_bits,bf16_bits", [
    (0x3F808000, 0x3F80),   # exact half, even below: stays
    (0x3F818000, 0x3F82),   # exact half, odd below: rounds up to even
    (0x3F808001, 0x3F81),   # just above half: up
    (0x3F807FFF, 0x3F80),   # just below half: down
    (0xBF818000, 0xBF82),   # negative half, odd below: away from zero to even
    (0xBF808000, 0xBF80),   # negative half, even below: stays
    (0x7F7FFFFF, 0x7F80),   # largest float32 rounds to infinity
    (0xFF800000, 0xFF80),   # -inf stays -inf
    (0x00008000, 0x0000),   # subnormal half, even: to zero
    (0x80018000, 0x8002),   # negative subnormal half, odd: up to even
])
def test_float32_to_bfloat16_rounds_to_nearest_even(f32_bits, bf16_bits):
    f = np.array([f32_bits], dtype=np.uint32).view(np.float32)
    assert ref.float32_to_bfloat16_bits(f)[0] == bf16_bits


def test_float32_to_bfloat16_maps_every_nan_to_7fff():
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32).view(np.float32)
    assert (ref.float32_to_bfloat16_bits(nans) == 0x7FFF).all()


def test_round_to_dtype_gives_storage_representations():
    rng = np.random.default_rng(51)
    v = rng.standard_normal((4, 33)).astype(np.float32)
    bf = ref.round_to_dtype(v, "bfloat16")
    assert bf.dtype == np.uint16 and (bf == ref.float32_to_bfloat16_bits(v)).all()
    h = ref.round_to_dtype(v, "float16")
    assert h.dtype == np.float16 and (h == v.astype(np.float16)).all()
    f = ref.round_to_dtype(v, "float32")
    assert f.dtype == np.float32 and (f == v).all()
    assert not (ref.bfloat16_bits_to_float32(bf) == v).all()
    with pytest.raises(ValueError):
        ref.round_to_dtype(v, "int8")


def test_fp8_scaled_random_gives_finite_nonzero_bytes_and_positive_scales():
    x, s = ref.fp8_e4m3_scaled_random(np.random.default_rng(52), 300, 512)
    assert x.dtype == np.uint8 and x.shape == (300, 512)
    assert s.dtype == np.float32 and s.shape == (300, 4)
    assert (s > 0).all() and np.isfinite(s).all()
    assert x.any(axis=1).all()
    assert not np.isin(x, [0x7F, 0xFF]).any()
    assert len(np.unique(x)) > 200


def test_fp8_scaled_random_rejects_hidden_not_a_multiple_of_128():
    with pytest.raises(ValueError):
        ref.fp8_e4m3_scaled_random(np.random.default_rng(53), 4, 100)


# ----------------------------------------------------------------------------------------------
# expand: received rows per local expert
# ----------------------------------------------------------------------------------------------

def test_expand_copies_a_row_for_every_entry_naming_the_expert_in_row_then_slot_order():
    rows = np.arange(4 * 2, dtype=np.uint16).reshape(4, 2)
    topk = np.array([[1, 0], [0, -1], [-1, -1], [1, 1]])
    expanded, sources, offsets = ref.expand(rows, topk, 3)
    assert sources.tolist() == [0, 1, 0, 3, 3] and offsets == [0, 2, 5, 5]
    assert (expanded == rows[[0, 1, 0, 3, 3]]).all()


def test_expand_pads_each_group_with_zero_rows_to_the_alignment():
    rows = np.ones((3, 4), np.float32)
    expanded, sources, offsets = ref.expand(rows, np.array([[0], [2], [0]]), 3, expert_alignment=4)
    assert offsets == [0, 4, 4, 8]
    assert sources.tolist() == [0, 2, -1, -1, 1, -1, -1, -1]
    assert (expanded[sources < 0] == 0).all() and (expanded[sources >= 0] == 1).all()


def test_expand_group_sizes_are_the_dispatchs_expert_counts(four_ranks):
    _, _, _, results = four_ranks
    for res in results:
        counts = res["num_recv_tokens_per_expert_list"]
        _, _, offsets = ref.expand(res["recv_x"], res["recv_topk_idx"], len(counts))
        assert np.diff(offsets).tolist() == counts
