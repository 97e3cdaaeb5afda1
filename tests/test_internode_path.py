"""The internode path's host logic and array work, run on the CPU (tests/internode_fakes.py): ranks
as threads, NumPy for CuPy, a thread rail transport and the intranode model as the node's engine;
every result compared bit-exactly with deepep_cupy.reference.internode."""

import re

import numpy as np
import pytest
from host_fakes import on_device
from internode_fakes import make_paths, run_ranks, use_host_arrays
from workers.gpu_worker import draw_rows

from deepep_cupy.errors import PeerFailedError, RankMismatchError
from deepep_cupy.internode import arrays as internode_arrays
from deepep_cupy.internode import path as internode
from deepep_cupy.internode.handle import InternodeHandle
from deepep_cupy.internode.records import RecordLayout
from deepep_cupy.reference import internode as iref
from deepep_cupy.reference import intranode as ref

SHAPES = [(2, 1), (2, 2), (4, 1), (3, 2)]
H = 64


def make_inputs(seed, R, E, K, dtype, *, counts=None, drop=0.0, only_node=None, num_nodes=1):
    rng = np.random.default_rng(seed)
    counts = counts or [int(rng.integers(1, 14)) for _ in range(R)]
    inputs = []
    for r in range(R):
        n = counts[r]
        if only_node is not None:
            epn = E // num_nodes
            topk = only_node * epn + ref.random_routing(rng, n, epn, min(K, epn))
        else:
            topk = ref.random_routing(rng, n, E, K, drop_fraction=drop)
        x, scales = draw_rows(rng, n, 128 * 2 if dtype == "float8_e4m3fn" else H, dtype)
        inputs.append(dict(x=x, scales=scales, topk=topk, weights=rng.random(topk.shape, dtype=np.float32) + 0.5))
    return inputs


def expect_bits(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype.kind == "f":
        got, want = got.view(f"u{got.dtype.itemsize}"), want.view(f"u{want.dtype.itemsize}")
    assert np.array_equal(got, want), what


def run_case(monkeypatch, num_nodes, L, dtype, *, seed=0, counts=None, drop=0.0, only_node=None, worst=0,
             alignment=1, with_bias=True, in_blocks=False):
    use_host_arrays(monkeypatch)
    R = num_nodes * L
    E, K = 4 * R, 3
    inputs = make_inputs(seed, R, E, K, dtype, counts=counts, drop=drop, only_node=only_node, num_nodes=num_nodes)
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, L,
                         topk_weights=[i["weights"] for i in inputs],
                         x_scales=None if inputs[0]["scales"] is None else [i["scales"] for i in inputs],
                         expert_alignment=alignment)
    fp8 = inputs[0]["scales"] is not None
    rng = np.random.default_rng(seed + 1)
    cast = (lambda a: ref.round_to_dtype(a, dtype)) if not fp8 else (lambda a: ref.round_to_dtype(a, "bfloat16"))
    combine_dtype = "bfloat16" if fp8 else dtype
    ys = [cast(rng.standard_normal((len(w["recv_x"]), H), dtype=np.float32)) for w in want]
    yw = [rng.random((len(w["recv_x"]), K), dtype=np.float32) for w in want]
    biases = [(cast(rng.standard_normal((len(i["x"]), H), dtype=np.float32)),) if with_bias else () for i in inputs]
    combined = iref.combine(ys, want, combine_dtype, topk_weights=yw, bias=biases)

    def body(rank, path):
        mine = inputs[rank]
        x = on_device(mine["x"]) if not fp8 else (on_device(mine["x"]), on_device(mine["scales"]))
        topk, weights = on_device(mine["topk"]), on_device(mine["weights"])
        per_rank, per_node, per_expert, in_rank, _ = path.get_dispatch_layout(topk, E)
        w_rank, w_node, w_expert, w_in = iref.get_dispatch_layout(mine["topk"], E, R, L)
        for what, got, expected in (("per_rank", per_rank, w_rank), ("per_node", per_node, w_node),
                                    ("per_expert", per_expert, w_expert), ("in_rank", in_rank, w_in)):
            expect_bits(what, got, expected)
        recv_x, recv_topk, recv_w, experts, handle, _ = path.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, expert_alignment=alignment,
            num_worst_tokens=worst)
        w = want[rank]
        n = len(w["recv_x"])
        rows = worst or n
        got_x = recv_x[0] if fp8 else recv_x
        assert got_x.shape[0] == rows and recv_topk.shape[0] == rows
        expect_bits("recv_x", np.asarray(got_x)[:n], w["recv_x"])
        if fp8:
            expect_bits("recv_x_scales", np.asarray(recv_x[1])[:n], w["recv_x_scales"])
        expect_bits("recv_topk_idx", np.asarray(recv_topk)[:n], w["recv_topk_idx"])
        assert (np.asarray(recv_topk)[n:] == -1).all()
        expect_bits("recv_topk_weights", np.asarray(recv_w)[:n], w["recv_topk_weights"])
        assert experts == ([] if worst else w["num_recv_tokens_per_expert_list"])
        if in_blocks:  # every node gets a block of the group's largest token count
            block = max(len(i["x"]) for i in inputs)
            assert handle.block_tokens == block and handle.send_counts == handle.recv_counts == (block,) * num_nodes
            assert path.last_internode_rows == block * (num_nodes - 1)
            expect_bits("recv_gbl_rank_prefix_sum", handle[6], w["recv_gbl_rank_prefix_sum"])
        else:
            assert handle.send_counts == tuple(w["send_counts"]) and handle.recv_counts == tuple(w["recv_counts"])
            assert path.last_internode_rows == sum(w["send_counts"]) - w["send_counts"][rank // L]

        cached_x, none_topk, _, none_list, same, _ = path.dispatch(x, handle=handle)
        assert none_topk is None and none_list is None and same is handle
        expect_bits("cached recv_x", np.asarray(cached_x[0] if fp8 else cached_x)[:n], w["recv_x"])

        y = np.zeros((rows, H), ys[rank].dtype)
        y[:n] = ys[rank]
        yw_in = np.zeros((rows, K), np.float32)
        yw_in[:n] = yw[rank]
        bias = on_device(biases[rank][0]) if with_bias else None
        out, out_w, _ = path.combine(on_device(y), handle, topk_weights=on_device(yw_in), bias=bias)
        expect_bits("combined_x", out, ref.round_to_dtype(combined[rank][0], combine_dtype))
        expect_bits("combined_topk_weights", out_w, combined[rank][1])
        return True

    assert all(run_ranks(make_paths(num_nodes, L, in_blocks), body))


@pytest.mark.parametrize("num_nodes,L", SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_dispatch_cached_dispatch_and_combine_match_the_node_model(monkeypatch, num_nodes, L, dtype):
    run_case(monkeypatch, num_nodes, L, dtype, seed=num_nodes * 10 + L)


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_top_k_with_minus_one_and_expert_alignment(monkeypatch, num_nodes, L):
    run_case(monkeypatch, num_nodes, L, "bfloat16", seed=3, drop=0.3, alignment=4)


@pytest.mark.parametrize("num_nodes,L", [(2, 2), (4, 1)])
def test_uneven_and_zero_token_counts(monkeypatch, num_nodes, L):
    counts = [0, 7, 1, 0][:num_nodes * L]
    run_case(monkeypatch, num_nodes, L, "bfloat16", seed=4, counts=counts)


@pytest.mark.parametrize("num_nodes,L", [(3, 2), (4, 1)])
def test_every_token_routed_to_one_node(monkeypatch, num_nodes, L):
    run_case(monkeypatch, num_nodes, L, "float32", seed=5, only_node=1)


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_num_worst_tokens_pads_the_outputs_and_combine_takes_as_many_rows(monkeypatch, num_nodes, L):
    run_case(monkeypatch, num_nodes, L, "bfloat16", seed=6, worst=64, with_bias=False)


@pytest.mark.parametrize("num_nodes,L", SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_dispatch_with_num_worst_tokens_in_fixed_size_blocks_matches_the_node_model(monkeypatch, num_nodes, L,
                                                                                      dtype):
    run_case(monkeypatch, num_nodes, L, dtype, seed=7 + num_nodes, worst=64, in_blocks=True)


@pytest.mark.parametrize("num_nodes,L", [(2, 2), (4, 1)])
def test_fixed_size_blocks_carry_uneven_and_zero_token_counts_and_minus_one_ids(monkeypatch, num_nodes, L):
    run_case(monkeypatch, num_nodes, L, "bfloat16", seed=8, counts=[0, 7, 1, 0][:num_nodes * L], drop=0.3,
             alignment=4, worst=32, in_blocks=True)


def test_the_own_nodes_block_is_the_rails_self_entry(monkeypatch):
    use_host_arrays(monkeypatch)
    paths = make_paths(2, 2)
    inputs = make_inputs(7, 4, 16, 2, "float32", only_node=0, num_nodes=2)

    def body(rank, path):
        mine = inputs[rank]
        topk = on_device(mine["topk"])
        per_rank, per_node, per_expert, in_rank, _ = path.get_dispatch_layout(topk, 16)
        path.dispatch(on_device(mine["x"]), num_tokens_per_expert=per_expert, topk_idx=topk)
        return path.transport.calls[-1]

    calls = run_ranks(paths, body)
    for rank, (send_bytes, recv_bytes) in enumerate(calls):
        if rank // 2 == 0:  # node 0 keeps its tokens: nothing for node 1
            assert send_bytes[1] == 0 and send_bytes[0] > 0
        else:
            assert send_bytes[1] == 0 and recv_bytes[1] == 0


def test_rows_arrive_in_deepeps_order_and_the_handle_is_deepeps_tuple(monkeypatch):
    use_host_arrays(monkeypatch)
    num_nodes, L, E = 2, 2, 16
    inputs = make_inputs(12, 4, E, 3, "float32", num_nodes=num_nodes)
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, L)

    def body(rank, path):
        topk = on_device(inputs[rank]["topk"])
        per_rank, per_node, per_expert, in_rank, _ = path.get_dispatch_layout(topk, E)
        recv_x, _, _, _, handle, _ = path.dispatch(on_device(inputs[rank]["x"]), num_tokens_per_rank=per_rank,
                                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                   topk_idx=topk)
        assert isinstance(handle, tuple) and len(handle) == 10
        assert handle[0] is in_rank
        expect_bits("recv_gbl_rank_prefix_sum", handle[-4], want[rank]["recv_gbl_rank_prefix_sum"])
        expect_bits("recv_rdma_rank_prefix_sum", handle[4], np.cumsum(want[rank]["recv_counts"]).astype(np.int32))
        expect_bits("recv_x", recv_x, want[rank]["recv_x"])
        return True

    assert all(run_ranks(make_paths(num_nodes, L), body))


@pytest.mark.parametrize("num_nodes,L", SHAPES)
def test_a_dispatch_without_top_k_is_routed_by_is_token_in_rank_fresh_and_cached(monkeypatch, num_nodes, L):
    use_host_arrays(monkeypatch)
    R = num_nodes * L
    E = 2 * R
    rng = np.random.default_rng(13)
    inputs = make_inputs(13, R, E, 2, "bfloat16", num_nodes=num_nodes)
    in_ranks = [rng.random((len(i["x"]), R)) < 0.4 for i in inputs]
    per_experts = [rng.integers(0, 4, E).astype(np.int32) for _ in range(R)]
    want = iref.dispatch([i["x"] for i in inputs], None, E, L, is_token_in_ranks=in_ranks,
                         num_tokens_per_experts=per_experts)

    def body(rank, path):
        x = on_device(inputs[rank]["x"])
        recv_x, recv_topk, recv_w, experts, handle, _ = path.dispatch(
            x, is_token_in_rank=on_device(in_ranks[rank]), num_tokens_per_expert=on_device(per_experts[rank]))
        assert recv_topk is None and recv_w is None
        assert experts == want[rank]["num_recv_tokens_per_expert_list"]
        expect_bits("recv_x", recv_x, want[rank]["recv_x"])
        cached = path.dispatch(x, handle=handle)[0]
        expect_bits("cached recv_x", cached, want[rank]["recv_x"])
        return True

    assert all(run_ranks(make_paths(num_nodes, L), body))


@pytest.mark.parametrize("num_nodes,L", [(2, 1), (2, 2)])
def test_each_call_launches_one_notify_and_one_kernel_named_for_its_operation(monkeypatch, num_nodes, L):
    # What DeepEP's bench_kineto looks for: one profiler line with "notify" and one with "dispatch"
    # (or "combine") per call, whichever stage writes the outputs.
    use_host_arrays(monkeypatch)
    R, E = num_nodes * L, 4 * num_nodes * L
    inputs = make_inputs(14, R, E, 2, "bfloat16", num_nodes=num_nodes)

    def body(rank, path):
        mine = inputs[rank]
        topk = on_device(mine["topk"])
        per_expert = path.get_dispatch_layout(topk, E)[2]
        recv_x, _, _, _, handle, _ = path.dispatch(on_device(mine["x"]), num_tokens_per_expert=per_expert,
                                                   topk_idx=topk)
        launched = []
        for call in (lambda: path.dispatch(on_device(mine["x"]), handle=handle), lambda: path.combine(recv_x, handle)):
            path.records.launched.clear()
            if path.intranode is not None:
                path.intranode.calls.clear()
            call()
            launched.append(path.records.launched + ([] if path.intranode is None else path.intranode.calls))
        return launched

    for cached, combine in run_ranks(make_paths(num_nodes, L), body):
        if L == 1:
            assert (cached, combine) == (["notify", "dispatch"], ["notify", "combine"])
        else:
            assert (cached, combine) == (["notify", "forward", "cached dispatch"], ["notify", "sum_nodes", "combine"])


def test_deepeps_order_lists_the_node_stage_rows_by_source_rank():
    # 2 nodes x 2 ranks; rows from source ranks 0..3: 1, 2, 3, 4. The node stage puts forwarder 0's
    # (sources 0 and 2) first: rows 0 | 1 1 1 from source 2, then forwarder 1's: 2 2 | 4 4 4 4.
    order = internode_arrays.deepep_order(np.array([1, 2, 3, 4]), 2, 2)
    assert order.tolist() == [0, 4, 5, 1, 2, 3, 6, 7, 8, 9]
    assert internode_arrays.deepep_order(np.array([3, 0, 2]), 3, 1) is None


# --- failures: every rank raises from the same call, and the group stays in step ------------------

def fp32(rows, cols=H):
    return on_device(np.zeros((rows, cols), np.float32))


def run_one_rank_wrong(monkeypatch, changes, shape=(2, 2), call="dispatch"):
    """Every rank calls with good arguments but rank 1 with ``changes``; returns each rank's
    exception and transport calls, then the group's own exchange of each rank's number."""
    use_host_arrays(monkeypatch)
    num_nodes, L = shape
    R = num_nodes * L
    paths = make_paths(num_nodes, L)
    E = 2 * R

    def body(rank, path):
        args = dict(x=fp32(3), topk_idx=on_device(np.zeros((3, 2), np.int64)),
                    num_tokens_per_expert=on_device(np.zeros(E, np.int32)))
        if rank == 1:
            args.update(changes)
        with pytest.raises(Exception) as raised:
            path.dispatch(**args)
        return raised.value, list(path.transport.calls), path.everyone.exchange(rank, rank)

    return run_ranks(paths, body)


@pytest.mark.parametrize("changes, error, message", [
    (dict(topk_idx=None), ValueError, "is_token_in_rank: a dispatch without topk_idx"),
    (dict(num_tokens_per_expert=None), ValueError, "num_tokens_per_expert: required"),
    (dict(num_tokens_per_expert=on_device(np.zeros(7, np.int32))), ValueError, "multiple of the rank count"),
    (dict(topk_idx=on_device(np.zeros((3, 2), np.int32))), TypeError, "topk_idx: expected dtype int64"),
    (dict(topk_idx=on_device(np.zeros((4, 2), np.int64))), ValueError, "topk_idx: expected shape"),
    (dict(topk_weights=on_device(np.zeros((3, 2), np.float16))), TypeError, "topk_weights: expected dtype float32"),
    (dict(topk_idx=on_device(np.full((3, 2), 8, np.int64))), ValueError, r"expert ids out of \[-1, 8\) on rank 1"),
    (dict(is_token_in_rank=on_device(np.zeros((3, 4), np.int32))), TypeError, "is_token_in_rank: expected dtype bool"),
    (dict(x=on_device(np.zeros((3, 3), np.float32))), ValueError, "row bytes must be a multiple of 16"),
    (dict(x=np.zeros((3, 64), np.float32)), TypeError, "x: expected a device array"),
    (dict(x=on_device(np.zeros((3, 128), np.uint8))), ValueError, "FP8 rows need their scales"),
    (dict(expert_alignment=0), ValueError, "expert_alignment"),
    (dict(num_worst_tokens=-1), ValueError, "num_worst_tokens"),
    (dict(expand=True), ValueError, "expand: not available across nodes"),
    (dict(recv_x_in_buffer=True), ValueError, "recv_x_in_buffer: not available across nodes"),
    (dict(config=object()), TypeError, "config: expected deepep_cupy.Config"),
])
def test_a_bad_argument_on_one_rank_makes_every_rank_raise_before_anything_moves(monkeypatch, changes, error,
                                                                                  message):
    outcomes = run_one_rank_wrong(monkeypatch, changes)
    for rank, (exc, calls, gathered) in enumerate(outcomes):
        if rank == 1:
            assert isinstance(exc, error) and re.search(message, str(exc)), exc
        else:
            assert isinstance(exc, PeerFailedError) and exc.peer == 1 and re.search(message, str(exc)), exc
        assert calls == []                       # nothing moved
        assert gathered == [0, 1, 2, 3]          # the group's own exchange is in step


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_settings_that_differ_between_ranks_raise_on_every_rank(monkeypatch, shape):
    outcomes = run_one_rank_wrong(monkeypatch, dict(x=fp32(3, 2 * H)), shape)
    for exc, calls, gathered in outcomes:
        assert isinstance(exc, RankMismatchError) and "disagree" in str(exc)
        assert calls == [] and gathered == list(range(len(outcomes)))


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_too_few_worst_tokens_for_one_rank_raise_on_every_rank_after_the_count_exchange(monkeypatch, shape):
    use_host_arrays(monkeypatch)
    num_nodes, L = shape
    R, E = num_nodes * L, 2 * num_nodes * L
    inputs = make_inputs(15, R, E, 2, "float32", counts=[6] * R, num_nodes=num_nodes)

    def body(rank, path):
        topk = on_device(inputs[rank]["topk"])
        per_expert = path.get_dispatch_layout(topk, E)[2]
        with pytest.raises(ValueError, match="more than num_worst_tokens") as raised:
            path.dispatch(on_device(inputs[rank]["x"]), num_tokens_per_expert=per_expert, topk_idx=topk,
                          num_worst_tokens=1)
        return str(raised.value), path.transport.calls, path.everyone.exchange(rank, -rank)

    outcomes = run_ranks(make_paths(num_nodes, L), body)
    assert len({o[0] for o in outcomes}) == 1                  # the same verdict everywhere
    assert all(o[1] == [] and o[2] == [-r for r in range(R)] for o in outcomes)


@pytest.mark.parametrize("num_nodes", [2, 4])
def test_too_few_worst_tokens_in_blocks_with_one_rank_per_node_raise_on_every_rank_at_the_next_call(monkeypatch,
                                                                                                     num_nodes):
    use_host_arrays(monkeypatch)
    R, E = num_nodes, 2 * num_nodes
    inputs = make_inputs(17, R, E, 2, "float32", counts=[6] * R, only_node=1, num_nodes=num_nodes)
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, 1)
    worst = 4  # node 1 receives every routed token, more than 4

    def body(rank, path):
        x, topk = on_device(inputs[rank]["x"]), on_device(inputs[rank]["topk"])
        per_expert = path.get_dispatch_layout(topk, E)[2]
        recv_x, _, _, _, handle, _ = path.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=topk,
                                                   num_worst_tokens=worst)  # no host wait: nothing raised yet
        kept = np.asarray(recv_x)[:min(worst, len(want[rank]["recv_x"]))]
        expect_bits("the rows kept", kept, want[rank]["recv_x"][:len(kept)])
        with pytest.raises((ValueError, PeerFailedError), match="num_worst_tokens") as raised:
            path.combine(recv_x, handle)
        again = path.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=topk, num_worst_tokens=6 * R)
        path.check_kernel_errors()  # reported once
        return type(raised.value).__name__, np.asarray(again[0]).shape

    outcomes = run_ranks(make_paths(num_nodes, 1, in_blocks=True), body)
    assert [o[0] for o in outcomes] == ["ValueError" if r == 1 else "PeerFailedError" for r in range(R)]
    assert [o[1] for o in outcomes] == [(6 * R, H)] * R


def test_check_kernel_errors_tells_of_rows_dropped_by_a_dispatch_in_blocks(monkeypatch):
    use_host_arrays(monkeypatch)
    inputs = make_inputs(18, 2, 4, 2, "float32", counts=[6, 6], only_node=0, num_nodes=2)
    received = len(iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], 4, 1)[0]["recv_x"])

    def body(rank, path):
        x, topk = on_device(inputs[rank]["x"]), on_device(inputs[rank]["topk"])
        path.dispatch(x, num_tokens_per_expert=path.get_dispatch_layout(topk, 4)[2], topk_idx=topk,
                      num_worst_tokens=2)
        if rank == 0:
            with pytest.raises(ValueError, match=f"rank 0 was sent {received} tokens .* num_worst_tokens=2"):
                path.check_kernel_errors()
        path.check_kernel_errors()  # once only
        return True

    assert all(run_ranks(make_paths(2, 1, in_blocks=True), body))


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_a_failure_after_the_count_exchange_raises_on_every_rank_and_the_next_call_works(monkeypatch, shape):
    use_host_arrays(monkeypatch)
    num_nodes, L = shape
    R, E = num_nodes * L, 2 * num_nodes * L
    inputs = make_inputs(16, R, E, 2, "float32", num_nodes=num_nodes)
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, L)
    paths = make_paths(num_nodes, L)
    failing = paths[1]
    real = failing._rail_buffers
    monkeypatch.setattr(failing, "_rail_buffers", lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))

    def body(rank, path):
        topk = on_device(inputs[rank]["topk"])
        per_expert = path.get_dispatch_layout(topk, E)[2]
        args = dict(num_tokens_per_expert=per_expert, topk_idx=topk)
        with pytest.raises(Exception) as raised:
            path.dispatch(on_device(inputs[rank]["x"]), **args)
        in_step = path.everyone.exchange(rank, rank)
        if rank == 1:
            monkeypatch.setattr(path, "_rail_buffers", real)
        path.everyone.exchange(rank, None)
        recv_x = path.dispatch(on_device(inputs[rank]["x"]), **args)[0]
        expect_bits("recv_x after the failure", recv_x, want[rank]["recv_x"])
        return raised.value, in_step

    for rank, (exc, in_step) in enumerate(run_ranks(paths, body)):
        assert isinstance(exc, MemoryError if rank == 1 else PeerFailedError), exc
        assert in_step == list(range(R))


def test_a_call_that_raises_after_it_began_is_abandoned_on_its_stream(monkeypatch):
    # The dispatch's refusal comes after its GPU work (the routing) was queued, which the next call
    # and destroy() must still come after.
    use_host_arrays(monkeypatch)
    paths = make_paths(2, 1)
    inputs = make_inputs(8, 2, 8, 2, "float32", counts=[3, 3])
    inputs[0]["topk"][1, 1] = 8

    def body(rank, path):
        abandoned = []
        monkeypatch.setattr(path.order, "abandon", abandoned.append)
        topk = on_device(inputs[rank]["topk"])
        with pytest.raises((ValueError, PeerFailedError), match="expert ids out of"):
            path.dispatch(on_device(inputs[rank]["x"]), num_tokens_per_expert=on_device(np.zeros(8, np.int32)),
                          topk_idx=topk, async_finish=True)
        return abandoned, path.order.ptr

    for abandoned, comm_stream in run_ranks(paths, body):
        assert abandoned == [comm_stream]


def test_a_handle_of_another_kind_or_buffer_is_refused(monkeypatch):
    use_host_arrays(monkeypatch)

    def handle(owner, rows=3):
        return InternodeHandle((None,) * 10, owner=owner, num_tokens=3, send_token_idx=None, send_counts=(3, 0),
                               recv_counts=(3, 0), slots=None, intranode=None, num_recv_tokens=rows, order=None,
                               inverse=None, num_worst_tokens=0, num_topk=2)

    def body(rank, path):
        cases = [(lambda: path.dispatch(fp32(3), handle=object()), TypeError, "handle: expected the handle"),
                 (lambda: path.combine(fp32(3), handle(0)), ValueError, "handle: it was made by another Buffer"),
                 (lambda: path.combine(fp32(4), handle(id(path))), ValueError,
                  r"x: expected 3 rows \(the tokens its dispatch received\), got 4"),
                 (lambda: path.dispatch(fp32(5), handle=handle(id(path))), ValueError, "x: expected 3 rows"),
                 (lambda: path.combine(fp32(3), handle(id(path)), bias=fp32(4)), ValueError,
                  r"bias\[0\]: expected shape"),
                 (lambda: path.combine(fp32(3), handle(id(path)), bias=(None, on_device(np.zeros((3, H), np.float16)))),
                  TypeError, r"bias\[1\]: expected dtype float32")]
        for call, error, message in cases:
            with pytest.raises(error, match=message):
                call()
        return path.transport.calls

    assert run_ranks(make_paths(2, 1), body) == [[], []]


def test_the_layout_refuses_an_expert_count_that_does_not_split_over_the_ranks(monkeypatch):
    use_host_arrays(monkeypatch)
    path = make_paths(2, 1)[0]
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the rank count"):
        path.get_dispatch_layout(on_device(np.zeros((3, 2), np.int64)), 7)


def test_a_path_needs_an_engine_exactly_with_several_ranks_per_node(monkeypatch):
    use_host_arrays(monkeypatch)
    path = make_paths(2, 1)[0]
    with pytest.raises(ValueError, match="intranode: expected an engine exactly when"):
        internode.InternodePath(path.topology, path.transport, 0, object(), path.order, records=None, vote=None,
                                block_kernels=None)


def test_records_are_padded_to_16_bytes():
    full = RecordLayout(14336, 0, 8, 8)
    assert (full.bytes, full.scales_off, full.topk_off, full.weights_off) == (14336 + 96, 14336, 14336, 14336 + 64)
    assert RecordLayout(7168, 224, 8).bytes == 7168 + 224 + 64
    assert RecordLayout(7168, 4).bytes == 7168 + 16
    assert RecordLayout(64, 0, 3, 3, 4).in_rank_off == 64 + 24 + 12


def test_top_k_ids_in_a_record_are_8_byte_aligned_after_one_scale_per_token():
    one_scale = RecordLayout(80, 4, 6, 6)  # FP8 rows of 80 bytes with a per-token scale
    assert one_scale.topk_off == 88 and one_scale.weights_off == 88 + 48 and one_scale.bytes == 160


def test_a_fresh_dispatch_reads_the_device_once(monkeypatch):
    # The counts per node, rank and expert (and the verdict on the ids) reach the host in one
    # copy; nothing else waits for the device: no nonzero, bincount or boolean mask, whose sizes
    # CuPy reads back with a host sync.
    use_host_arrays(monkeypatch)
    numpy_as_cupy = internode_arrays.cupy_module()
    syncs = []

    class Counting(type(numpy_as_cupy)):
        def asnumpy(self, a):
            syncs.append("asnumpy")
            return np.asarray(a)

        def __getattr__(self, name):
            if name in ("nonzero", "flatnonzero", "bincount", "unique", "argwhere"):
                syncs.append(name)
            return getattr(np, name)

    counting = Counting()
    monkeypatch.setattr(internode_arrays, "cupy_module", lambda: counting)
    inputs = make_inputs(11, 2, 8, 3, "bfloat16", drop=0.2)

    def body(rank, path):
        mine = inputs[rank]
        topk = on_device(mine["topk"])
        per_expert = path.get_dispatch_layout(topk, 8)[2]
        path.dispatch(on_device(mine["x"]), num_tokens_per_expert=per_expert, topk_idx=topk,
                      topk_weights=on_device(mine["weights"]), num_worst_tokens=64)
        return True

    assert all(run_ranks(make_paths(2, 1), body))
    assert syncs == ["asnumpy", "asnumpy"]


@pytest.mark.parametrize("op", ["fresh dispatch", "cached dispatch", "combine"])
def test_a_call_inside_a_graph_capture_is_refused_on_every_rank_before_anything_moves(monkeypatch, op):
    use_host_arrays(monkeypatch)
    paths = make_paths(2, 2)
    inputs = make_inputs(8, 4, 8, 2, "float32", counts=[3, 3, 3, 3])

    def body(rank, path):
        x, topk, per_expert = on_device(inputs[rank]["x"]), on_device(inputs[rank]["topk"]), on_device(
            np.zeros(8, np.int32))
        recv_x, _, _, _, handle, _ = path.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=topk)
        calls = {"fresh dispatch": lambda: path.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=topk),
                 "cached dispatch": lambda: path.dispatch(x, handle=handle),
                 "combine": lambda: path.combine(recv_x, handle)}
        path.order.capturing = rank == 1  # one rank capturing is enough: every rank raises
        with pytest.raises((ValueError, PeerFailedError), match="cannot be captured in a CUDA graph"):
            calls[op]()
        path.order.capturing = False
        return path.combine(recv_x, handle)[0].shape  # the next call works

    assert [shape[0] for shape in run_ranks(paths, body)] == [3, 3, 3, 3]


@pytest.mark.parametrize("num_nodes,L", [(2, 1), (2, 2)])
def test_a_call_in_fixed_size_blocks_may_be_captured_and_reads_the_device_never(monkeypatch, num_nodes, L):
    use_host_arrays(monkeypatch)
    R = num_nodes * L
    inputs = make_inputs(9, R, 4 * R, 2, "float32", counts=[5] * R)
    syncs = []
    monkeypatch.setattr(internode_arrays.cupy_module(), "asnumpy", lambda a: syncs.append("asnumpy") or np.asarray(a),
                        raising=False)

    def body(rank, path):
        path.order.capturing = True
        x, topk = on_device(inputs[rank]["x"]), on_device(inputs[rank]["topk"])
        per_rank, _, per_expert, in_rank, _ = path.get_dispatch_layout(topk, 4 * R)
        recv_x, _, recv_w, _, handle, _ = path.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                        num_tokens_per_expert=per_expert, topk_idx=topk,
                                                        num_worst_tokens=5 * R)
        cached = path.dispatch(x, handle=handle)[0]
        out = path.combine(recv_x, handle)[0]
        return handle.block_tokens, np.asarray(cached).shape, np.asarray(out).shape

    assert run_ranks(make_paths(num_nodes, L, in_blocks=True), body) == [(5, (5 * R, H), (5, H))] * R
    assert syncs == []


def test_a_capture_over_a_transport_that_waits_on_the_host_is_refused_naming_it(monkeypatch):
    use_host_arrays(monkeypatch)
    inputs = make_inputs(10, 2, 8, 2, "float32", counts=[3, 3])

    def body(rank, path):
        path.order.capturing = True
        x, topk = on_device(inputs[rank]["x"]), on_device(inputs[rank]["topk"])
        with pytest.raises(ValueError, match="'threads' rail transport waits on the host"):
            path.dispatch(x, num_tokens_per_expert=on_device(np.zeros(8, np.int32)), topk_idx=topk,
                          num_worst_tokens=6)
        return True

    paths = make_paths(2, 1)
    for path in paths:
        path.transport.capturable = False
    assert all(run_ranks(paths, body))
