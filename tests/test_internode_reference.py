"""The NumPy model of internode dispatch/combine against brute-force loops over tokens."""

import numpy as np
import pytest

from deepep_cupy.reference import internode as iref
from deepep_cupy.reference import intranode as ref

SHAPES = [(2, 1), (2, 2), (4, 1), (3, 2), (2, 4)]  # (nodes, ranks per node)


def make(seed, num_nodes, L, *, num_experts_per_rank=3, num_topk=4, hidden=8, counts=None, drop=0.2,
         only_node=None):
    rng = np.random.default_rng(seed)
    R = num_nodes * L
    E = num_experts_per_rank * R
    counts = counts or [int(rng.integers(0, 12)) for _ in range(R)]
    topks, xs, ws = [], [], []
    for r in range(R):
        if only_node is None:
            topk = ref.random_routing(rng, counts[r], E, num_topk, drop_fraction=drop)
        else:
            epn = E // num_nodes
            topk = only_node * epn + ref.random_routing(rng, counts[r], epn, min(num_topk, epn))
        topks.append(topk)
        xs.append(rng.standard_normal((counts[r], hidden)).astype(np.float32))
        ws.append(rng.random(topk.shape, dtype=np.float32))
    return R, E, xs, topks, ws


def brute_dispatch(xs, topks, ws, E, L):
    """Per rank: list of (rows, topk, weights, (owner, token)) in DeepEP's receive order (source
    rank, then source token)."""
    R = len(xs)
    epr = E // R
    out = []
    for j in range(R):
        rows, topk, w, origin = [], [], [], []
        for src in range(R):
            for t in range(len(xs[src])):
                if not any(e >= 0 and e // epr == j for e in topks[src][t]):
                    continue
                rows.append(xs[src][t])
                topk.append([e - j * epr if e >= 0 and e // epr == j else -1 for e in topks[src][t]])
                w.append([wt if e >= 0 and e // epr == j else 0.0 for e, wt in zip(topks[src][t], ws[src][t])])
                origin.append((src, t))
        out.append((rows, topk, w, origin))
    return out


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_dispatch_delivers_each_token_to_the_ranks_of_its_experts_in_the_documented_order(num_nodes, L):
    R, E, xs, topks, ws = make(1, num_nodes, L)
    got = iref.dispatch(xs, topks, E, L, topk_weights=ws)
    want = brute_dispatch(xs, topks, ws, E, L)
    for j in range(R):
        rows, topk, w, _ = want[j]
        K = topks[0].shape[1]
        np.testing.assert_array_equal(got[j]["recv_x"], np.array(rows, np.float32).reshape(-1, 8))
        np.testing.assert_array_equal(got[j]["recv_topk_idx"], np.array(topk, np.int64).reshape(-1, K))
        np.testing.assert_array_equal(got[j]["recv_topk_weights"], np.array(w, np.float32).reshape(-1, K))


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_per_node_counts_and_handle_pieces_match_a_loop_over_tokens(num_nodes, L):
    R, E, xs, topks, ws = make(2, num_nodes, L)
    got = iref.dispatch(xs, topks, E, L, topk_weights=ws)
    epn = E // num_nodes
    for r in range(R):
        sends = [[t for t in range(len(xs[r])) if any(e >= 0 and e // epn == n for e in topks[r][t])]
                 for n in range(num_nodes)]
        assert [len(s) for s in sends] == got[r]["send_counts"]
        assert [list(a) for a in got[r]["send_token_idx"]] == sends
        np.testing.assert_array_equal(got[r]["num_tokens_per_rdma_rank"], [len(s) for s in sends])
        per_rank, per_node, per_expert, in_rank = iref.get_dispatch_layout(topks[r], E, R, L)
        np.testing.assert_array_equal(per_node, [len(s) for s in sends])
        assert per_node.dtype == np.int32
        n, lr = divmod(r, L)
        assert got[r]["recv_counts"] == [got[s * L + lr]["send_counts"][n] for s in range(num_nodes)]


def test_expert_counts_are_the_final_ranks_and_aligned():
    R, E, xs, topks, ws = make(3, 2, 2)
    got = iref.dispatch(xs, topks, E, 2, topk_weights=ws, expert_alignment=4)
    epr = E // R
    for j in range(R):
        counts = [sum(int(np.sum(t == j * epr + e)) for t in topks) for e in range(epr)]
        assert got[j]["num_recv_tokens_per_expert_list"] == [-(-c // 4) * 4 for c in counts]


def test_fp8_scales_travel_with_their_rows():
    rng = np.random.default_rng(4)
    R, L, E = 4, 2, 8
    xs, scales, topks = [], [], []
    for _ in range(R):
        x, s = ref.fp8_e4m3_scaled_random(rng, 6, 256)
        xs.append(x)
        scales.append(s)
        topks.append(ref.random_routing(rng, 6, E, 2))
    got = iref.dispatch(xs, topks, E, L, x_scales=scales)
    want = brute_dispatch(xs, topks, [np.zeros(t.shape, np.float32) for t in topks], E, L)
    for j in range(R):
        origin = want[j][3]
        np.testing.assert_array_equal(got[j]["recv_x"], np.array([xs[s][t] for s, t in origin]).reshape(-1, 256))
        np.testing.assert_array_equal(got[j]["recv_x_scales"],
                                      np.array([scales[s][t] for s, t in origin], np.float32).reshape(-1, 2))


@pytest.mark.parametrize("num_nodes,L", SHAPES)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "float32"])
def test_combine_sums_inside_each_node_rounds_then_sums_the_nodes_in_order(num_nodes, L, dtype_name):
    R, E, xs, topks, ws = make(5, num_nodes, L)
    got = iref.dispatch(xs, topks, E, L, topk_weights=ws)
    want = brute_dispatch(xs, topks, ws, E, L)
    rng = np.random.default_rng(6)

    def cast(a):
        return ref.round_to_dtype(a, dtype_name)

    ys = [cast(rng.standard_normal((len(want[j][0]), 8)).astype(np.float32)) for j in range(R)]
    yw = [rng.random((len(want[j][0]), topks[0].shape[1]), dtype=np.float32) for j in range(R)]
    bias = [(cast(rng.standard_normal((len(xs[m]), 8)).astype(np.float32)),) for m in range(R)]
    combined = iref.combine(ys, got, dtype_name, topk_weights=yw, bias=bias)
    epn = E // num_nodes
    for m in range(R):
        for t in range(len(xs[m])):
            acc = np.float32(0) + ref._as_float32(bias[m][0][t])
            acc_w = np.zeros(topks[0].shape[1], np.float32)
            for n in range(num_nodes):
                partial = np.zeros(8, np.float32)
                partial_w = np.zeros_like(acc_w)
                seen = False
                for j in range(n * L, (n + 1) * L):
                    for row, origin in enumerate(want[j][3]):
                        if origin == (m, t):
                            partial = partial + ref._as_float32(ys[j][row])
                            partial_w = partial_w + yw[j][row]
                            seen = True
                if seen:
                    assert any(e >= 0 and e // epn == n for e in topks[m][t])
                    acc = acc + ref._as_float32(cast(partial))
                    acc_w = acc_w + partial_w
            np.testing.assert_array_equal(combined[m][0][t].view(np.uint32), acc.view(np.uint32))
            np.testing.assert_array_equal(combined[m][1][t], acc_w)


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_rows_are_grouped_by_source_rank_as_the_global_prefix_sum_says(num_nodes, L):
    R, E, xs, topks, ws = make(7, num_nodes, L)
    got = iref.dispatch(xs, topks, E, L, topk_weights=ws)
    want = brute_dispatch(xs, topks, ws, E, L)
    for j in range(R):
        sources = [src for src, _ in want[j][3]]
        assert got[j]["recv_gbl_rank_prefix_sum"].dtype == np.int32
        np.testing.assert_array_equal(got[j]["recv_gbl_rank_prefix_sum"],
                                      np.cumsum([sources.count(g) for g in range(R)]))
        np.testing.assert_array_equal(got[j]["recv_src"].reshape(-1, 2), np.array(want[j][3]).reshape(-1, 2))


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_a_dispatch_without_top_k_is_routed_by_is_token_in_rank_and_counts_the_senders_experts(num_nodes, L):
    R, E, xs, topks, ws = make(11, num_nodes, L)
    rng = np.random.default_rng(12)
    in_ranks = [rng.random((len(x), R)) < 0.3 for x in xs]
    per_experts = [rng.integers(0, 5, E).astype(np.int32) for _ in range(R)]
    got = iref.dispatch(xs, None, E, L, is_token_in_ranks=in_ranks, num_tokens_per_experts=per_experts,
                        expert_alignment=2)
    epr = E // R
    for j in range(R):
        origin = [(src, t) for src in range(R) for t in range(len(xs[src])) if in_ranks[src][t, j]]
        np.testing.assert_array_equal(got[j]["recv_x"], np.array([xs[s][t] for s, t in origin]).reshape(-1, 8))
        assert got[j]["recv_topk_idx"] is None and got[j]["recv_topk_weights"] is None
        counts = sum(p[j * epr:(j + 1) * epr] for p in per_experts)
        assert got[j]["num_recv_tokens_per_expert_list"] == [int(-(-c // 2) * 2) for c in counts]
        assert got[j]["send_counts"] == [int(in_ranks[j][:, n * L:(n + 1) * L].any(axis=1).sum())
                                         for n in range(num_nodes)]


def test_tokens_routed_to_one_node_leave_the_other_nodes_empty():
    R, E, xs, topks, ws = make(8, 3, 2, only_node=1)
    got = iref.dispatch(xs, topks, E, 2, topk_weights=ws)
    for j in range(R):
        if j // 2 != 1:
            assert got[j]["recv_x"].shape == (0, 8)
            assert sum(got[j]["recv_counts"]) == 0
    assert sum(len(got[j]["recv_x"]) for j in (2, 3)) > 0


def test_zero_tokens_everywhere():
    R, E, xs, topks, ws = make(9, 2, 2, counts=[0, 0, 0, 0])
    got = iref.dispatch(xs, topks, E, 2, topk_weights=ws)
    combined = iref.combine([g["recv_x"] for g in got], got, "float32")
    assert all(c[0].shape == (0, 8) for c in combined)


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_traffic_counts_pairs_with_another_node_and_the_flat_pairs(num_nodes, L):
    R, E, xs, topks, ws = make(10, num_nodes, L)
    t = iref.traffic(topks, E, R, L)
    epn, epr = E // num_nodes, E // R
    hier = flat = flat_all = 0
    per_rank_flat_all = [0] * R
    for r in range(R):
        for tok in topks[r]:
            nodes = {e // epn for e in tok if e >= 0}
            ranks = {e // epr for e in tok if e >= 0}
            hier += len(nodes - {r // L})
            flat += sum(1 for d in ranks if d // L != r // L)
            flat_all += len(ranks - {r})
            per_rank_flat_all[r] += len(ranks - {r})
    assert (t["hierarchical"], t["flat"], t["flat_all_ranks"]) == (hier, flat, flat_all)
    assert t["per_rank_flat_all_ranks"] == per_rank_flat_all
    got = iref.dispatch(xs, topks, E, L)
    assert t["hierarchical"] == sum(sum(g["send_counts"]) - g["send_counts"][r // L] for r, g in enumerate(got))
    assert t["hierarchical"] <= t["flat"]


@pytest.mark.parametrize("bad", [dict(num_ranks=4, ranks_per_node=3, num_experts=12),
                                 dict(num_ranks=4, ranks_per_node=2, num_experts=6)])
def test_topologies_that_do_not_split_are_refused(bad):
    with pytest.raises(ValueError):
        iref.check_topology(**bad)
