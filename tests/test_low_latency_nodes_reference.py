"""The NumPy model of the decode calls across nodes (deepep_cupy/reference/low_latency_nodes.py):
what a rank receives is what one node's calls give it, in the order the node calls make, and the
combine adds one BF16 partial sum per node."""

import numpy as np
import pytest

from deepep_cupy.reference import intranode as ref
from deepep_cupy.reference import low_latency as one_node
from deepep_cupy.reference import low_latency_nodes as nodes

M, H, K = 8, 256, 4


def _inputs(seed, num_ranks, experts_per_rank, counts=None):
    rng = np.random.default_rng(seed)
    E = num_ranks * experts_per_rank
    counts = counts or [int(rng.integers(0, M + 1)) for _ in range(num_ranks)]
    xs = [ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32)) for n in counts]
    topks = [ref.random_routing(rng, n, E, K, drop_fraction=0.2) for n in counts]
    weights = [rng.random((n, K), dtype=np.float32) for n in counts]
    return xs, topks, weights, E


def _run(layout_range, local, source):
    value = int(layout_range[local, source])
    return value >> 32, value & 0xFFFFFFFF


def test_node_routing_keeps_the_node_s_experts_and_drops_the_rest():
    topk = np.array([[0, 5, 6, -1], [11, 3, 4, 7]])
    assert nodes.node_routing(topk, 0, 2, 12).tolist() == [[0, 5, -1, -1], [-1, 3, 4, -1]]
    assert nodes.node_routing(topk, 1, 2, 12).tolist() == [[-1, -1, 0, -1], [5, -1, -1, 1]]


@pytest.mark.parametrize("num_nodes, ranks_per_node", [(2, 1), (2, 2), (4, 1), (2, 4)])
def test_each_source_rank_s_rows_are_those_one_node_receives_from_it(num_nodes, ranks_per_node):
    R = num_nodes * ranks_per_node
    xs, topks, _, E = _inputs(num_nodes * 10 + ranks_per_node, R, 3)
    across = nodes.dispatch(xs, topks, M, E, ranks_per_node)
    flat = one_node.dispatch(xs, topks, M, E)
    for rank in range(R):
        np.testing.assert_array_equal(across[rank]["recv_count"], flat[rank]["recv_count"])
        for local in range(E // R):
            for source in range(R):
                begin, count = _run(across[rank]["layout_range"], local, source)
                flat_begin, flat_count = _run(flat[rank]["layout_range"], local, source)
                assert count == flat_count
                np.testing.assert_array_equal(across[rank]["src_info"][local, begin:begin + count],
                                              flat[rank]["src_info"][local, flat_begin:flat_begin + count])
                np.testing.assert_array_equal(across[rank]["recv_x"][local, begin:begin + count],
                                              flat[rank]["recv_x"][local, flat_begin:flat_begin + count])


def test_rows_come_node_rank_by_node_rank_then_node_by_node():
    # 2 nodes of 2: the rows of a local expert are those of sources 0, 2 (node rank 0), then 1, 3.
    xs, _, _, E = _inputs(7, 4, 2, counts=[M] * 4)
    topks = [np.full((M, K), -1, np.int64) for _ in range(4)]
    for topk in topks:
        topk[:, 0] = 0  # every token reaches expert 0 (rank 0's local expert 0) alone
    result = nodes.dispatch(xs, topks, M, E, 2)[0]
    begins = [_run(result["layout_range"], 0, s)[0] for s in range(4)]
    assert begins == [0, 2 * M, M, 3 * M]


def test_fp8_rows_and_scales_are_one_node_s_cast():
    xs, topks, _, E = _inputs(3, 4, 2)
    across = nodes.dispatch(xs, topks, M, E, 2, use_fp8=True, round_scale=True)
    flat = one_node.dispatch(xs, topks, M, E, use_fp8=True, round_scale=True)
    for rank in range(4):
        for source in range(4):
            begin, count = _run(across[rank]["layout_range"], 1, source)
            flat_begin, _ = _run(flat[rank]["layout_range"], 1, source)
            np.testing.assert_array_equal(across[rank]["scales"][1, begin:begin + count],
                                          flat[rank]["scales"][1, flat_begin:flat_begin + count])


def test_combine_adds_each_node_s_bf16_partial_sum_in_node_order():
    # One token of rank 0 (2 nodes of 1 rank, 1 expert each): weights 1 on expert 0 (node 0) and
    # expert 1 (node 1); rows 1.0 and 2**-9 (below half an ULP of 1 in BF16 once summed in float32).
    xs = [ref.float32_to_bfloat16_bits(np.ones((1, H), np.float32)), np.zeros((0, H), np.uint16)]
    topks = [np.array([[0, 1]]), np.zeros((0, 2), np.int64)]
    weights = [np.ones((1, 2), np.float32), np.zeros((0, 2), np.float32)]
    results = nodes.dispatch(xs, topks, M, 2, 1)
    ys = [np.zeros((1, 2 * M, H), np.uint16) for _ in range(2)]
    ys[0][0, 0] = ref.float32_to_bfloat16_bits(np.full(H, 1.0, np.float32))
    ys[1][0, 0] = ref.float32_to_bfloat16_bits(np.full(H, 2.0 ** -9, np.float32))
    out = nodes.combine(ys, topks, weights, results, 1)[0]
    want = ref.float32_to_bfloat16_bits(np.full((1, H), np.float32(1.0) + np.float32(2.0 ** -9)))
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("num_nodes, ranks_per_node", [(2, 2), (4, 1)])
def test_combine_is_one_node_s_within_a_bf16_rounding_of_each_partial_sum(num_nodes, ranks_per_node):
    R = num_nodes * ranks_per_node
    xs, topks, weights, E = _inputs(11, R, 2)
    across = nodes.dispatch(xs, topks, M, E, ranks_per_node)
    flat = one_node.dispatch(xs, topks, M, E)
    got = nodes.combine([r["recv_x"] for r in across], topks, weights, across, ranks_per_node)
    want = one_node.combine([r["recv_x"] for r in flat], topks, weights, flat)
    for g, w in zip(got, want):
        a, b = ref.bfloat16_bits_to_float32(g), ref.bfloat16_bits_to_float32(w)
        assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -7 + 1e-30)


def test_combine_of_some_ranks_leaves_the_others_none():
    xs, topks, weights, E = _inputs(5, 4, 2)
    results = nodes.dispatch(xs, topks, M, E, 2)
    out = nodes.combine([r["recv_x"] for r in results], topks, weights, results, 2, ranks=[3])
    assert [o is None for o in out] == [True, True, True, False]
    np.testing.assert_array_equal(out[3], nodes.combine([r["recv_x"] for r in results], topks, weights, results,
                                                        2)[3])


def test_a_node_size_that_does_not_divide_the_ranks_is_refused():
    xs, topks, _, E = _inputs(1, 4, 3)
    with pytest.raises(ValueError, match="ranks_per_node"):
        nodes.dispatch(xs, topks, M, E, 3)
