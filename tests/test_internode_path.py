"""The internode path's host logic and array work, run on the CPU (tests/internode_fakes.py): ranks
as threads, NumPy for CuPy, a thread rail transport and the intranode model as the node's engine;
every result compared bit-exactly with deepep_cupy.internode_reference."""

import numpy as np
import pytest
from host_fakes import on_device
from internode_fakes import make_paths, run_ranks, use_host_arrays
from workers.gpu_worker import draw_rows

from deepep_cupy import internode
from deepep_cupy import internode_reference as iref
from deepep_cupy import reference as ref

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
             alignment=1, with_bias=True):
    use_host_arrays(monkeypatch)
    R = num_nodes * L
    E, K = 4 * R, 3
    inputs = make_inputs(seed, R, E, K, dtype, counts=counts, drop=drop, only_node=only_node, num_nodes=num_nodes)
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, L, 4,
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

    assert all(run_ranks(make_paths(num_nodes, L), body))


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


def test_the_own_nodes_block_never_crosses_the_rail(monkeypatch):
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
        if rank // 2 == 0:  # node 0 keeps its tokens
            assert sum(send_bytes) == 0
        assert send_bytes[rank // 2] == 0 and recv_bytes[rank // 2] == 0


def test_expert_ids_out_of_range_raise_on_the_rank_and_its_rail_peers_before_anything_moves(monkeypatch):
    use_host_arrays(monkeypatch)
    paths = make_paths(2, 1)
    inputs = make_inputs(8, 2, 8, 2, "float32", counts=[3, 3])
    inputs[1]["topk"][0, 0] = 8

    def body(rank, path):
        mine = inputs[rank]
        topk = on_device(mine["topk"])
        with pytest.raises(ValueError, match="topk_idx: expert ids out of"):
            path.dispatch(on_device(mine["x"]), num_tokens_per_expert=on_device(np.zeros(8, np.int32)), topk_idx=topk)
        return path.transport.calls

    assert run_ranks(paths, body) == [[], []]


def test_expert_ids_out_of_range_on_one_rank_raise_on_every_rank_of_every_node(monkeypatch):
    use_host_arrays(monkeypatch)
    paths = make_paths(2, 2)
    inputs = make_inputs(9, 4, 16, 2, "bfloat16", counts=[3, 4, 5, 6])
    inputs[1]["topk"][2, 1] = 16  # rank 1 (node 0, rail 1)

    def body(rank, path):
        mine = inputs[rank]
        with pytest.raises(ValueError) as raised:
            path.dispatch(on_device(mine["x"]), num_tokens_per_expert=on_device(np.zeros(16, np.int32)),
                          topk_idx=on_device(mine["topk"]), topk_weights=on_device(mine["weights"]))
        return str(raised.value), path.transport.calls

    outcomes = run_ranks(paths, body)
    assert [o[1] for o in outcomes][1::2] == [[], []]  # rail 1 moved nothing
    assert "expert ids out of [-1, 16) on this rank" in outcomes[1][0]
    assert "a rank of this rail" in outcomes[3][0]
    assert all("topk_idx" in o[0] for o in outcomes)  # rail 0 learns it in its nodes' intranode stage


def test_a_call_that_raises_after_it_began_is_abandoned_on_its_stream(monkeypatch):
    # The layout before it finishes as usual; the dispatch's refusal comes after its GPU work
    # was queued, which the next call and destroy() must still come after.
    use_host_arrays(monkeypatch)
    paths = make_paths(2, 1)
    inputs = make_inputs(8, 2, 8, 2, "float32", counts=[3, 3])
    inputs[0]["topk"][1, 1] = 8

    def body(rank, path):
        abandoned = []
        monkeypatch.setattr(path.order, "abandon", abandoned.append)
        topk = on_device(inputs[rank]["topk"])
        per_expert = path.get_dispatch_layout(topk, 8, async_finish=True)[2]
        with pytest.raises(ValueError, match="topk_idx: expert ids out of"):
            path.dispatch(on_device(inputs[rank]["x"]), num_tokens_per_expert=per_expert, topk_idx=topk,
                          async_finish=True)
        return abandoned, path.order.ptr

    for abandoned, comm_stream in run_ranks(paths, body):
        assert abandoned == [comm_stream]


# --- argument checks (before anything moves) ---------------------------------------------------

@pytest.fixture
def path(monkeypatch):
    use_host_arrays(monkeypatch)
    return make_paths(2, 1)[0]


def fp32(rows, cols=H):
    return on_device(np.zeros((rows, cols), np.float32))


@pytest.mark.parametrize("changes, error, message", [
    (dict(topk_idx=None), ValueError, "topk_idx: an internode dispatch routes tokens"),
    (dict(num_tokens_per_expert=None), ValueError, "num_tokens_per_expert: required"),
    (dict(num_tokens_per_expert=on_device(np.zeros(7, np.int32))), ValueError, "multiple of the rank count"),
    (dict(topk_idx=on_device(np.zeros((3, 2), np.int32))), TypeError, "topk_idx: expected dtype int64"),
    (dict(topk_idx=on_device(np.zeros((4, 2), np.int64))), ValueError, "topk_idx: expected shape"),
    (dict(topk_weights=on_device(np.zeros((3, 2), np.float16))), TypeError, "topk_weights: expected dtype float32"),
    (dict(num_tokens_per_rdma_rank=on_device(np.zeros(3, np.int32))), ValueError, "num_tokens_per_rdma_rank"),
    (dict(x=on_device(np.zeros((3, 3), np.float32))), ValueError, "multiple of 16 bytes"),
    (dict(x=on_device(np.zeros((3, 128), np.uint8))), ValueError, "FP8 rows need their scales"),
    (dict(expert_alignment=0), ValueError, "expert_alignment"),
    (dict(num_worst_tokens=-1), ValueError, "num_worst_tokens"),
    (dict(expand=True), ValueError, "expand: not available across nodes"),
    (dict(recv_x_in_buffer=True), ValueError, "recv_x_in_buffer: not available across nodes"),
    (dict(config=object()), TypeError, "config: expected deepep_cupy.Config"),
])
def test_bad_dispatch_arguments_are_refused_before_anything_moves(path, changes, error, message):
    args = dict(x=fp32(3), topk_idx=on_device(np.zeros((3, 2), np.int64)),
                num_tokens_per_expert=on_device(np.zeros(8, np.int32)))
    args.update(changes)
    with pytest.raises(error, match=message):
        path.dispatch(**args)
    assert path.transport.calls == []


def test_a_handle_of_another_kind_or_buffer_is_refused(path):
    with pytest.raises(TypeError, match="handle: expected the handle returned by Buffer.dispatch"):
        path.dispatch(fp32(3), handle=object())
    other = internode.InternodeHandle(owner=0, num_tokens=3, send_token_idx=None, send_counts=(3, 0),
                                      recv_counts=(3, 0), intranode=None, num_recv_tokens=3, num_worst_tokens=0,
                                      num_topk=2)
    with pytest.raises(ValueError, match="handle: it was made by another Buffer"):
        path.combine(fp32(3), other)
    mine = internode.InternodeHandle(id(path), 3, None, (3, 0), (3, 0), None, 3, 0, 2)
    with pytest.raises(ValueError, match=r"x: expected 3 rows \(the tokens its dispatch received\), got 4"):
        path.combine(fp32(4), mine)
    with pytest.raises(ValueError, match="x: expected 3 rows"):
        path.dispatch(fp32(5), handle=mine)
    with pytest.raises(ValueError, match=r"bias\[0\]: expected shape"):
        path.combine(fp32(3), mine, bias=fp32(4))
    with pytest.raises(TypeError, match=r"bias\[1\]: expected dtype float32"):
        path.combine(fp32(3), mine, bias=(None, on_device(np.zeros((3, H), np.float16))))


def test_the_layout_refuses_an_expert_count_that_does_not_split_over_the_ranks(path):
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the rank count"):
        path.get_dispatch_layout(on_device(np.zeros((3, 2), np.int64)), 7)


def test_a_path_needs_an_engine_exactly_with_several_ranks_per_node(path):
    with pytest.raises(ValueError, match="intranode: expected an engine exactly when"):
        internode.InternodePath(path.topology, path.transport, 0, object(), path.order)


def test_records_are_padded_to_16_bytes():
    full = internode.RecordLayout(14336, 0, 8, 8)
    assert (full.bytes, full.scales_off, full.topk_off, full.weights_off) == (14336 + 96, 14336, 14336, 14336 + 64)
    assert internode.RecordLayout(7168, 224, 8).bytes == 7168 + 224 + 64
    assert internode.RecordLayout(7168, 4).bytes == 7168 + 16


def test_a_part_of_a_single_record_is_copied_to_an_aligned_address(monkeypatch):
    # One forwarded record's part is contiguous already; at offset 1408 + 44 its int64 view would
    # sit 4 bytes off alignment (a misaligned-address fault on the GPU: soak seed 44).
    use_host_arrays(monkeypatch)
    layout = internode.RecordLayout(1408, 44, 6, 6)
    topk = np.arange(6, dtype=np.int64).reshape(1, 6)
    records = layout.pack(None, np.zeros((1, 1408), np.uint8), np.ones((1, 11), np.float32), topk,
                          np.full((1, 6), 0.5, np.float32))
    assert layout.topk_off % 8 == 4
    part = layout.part(records, layout.topk_off, 8 * 6, np.int64, (1, 6))
    assert part.ctypes.data % 8 == 0
    assert np.array_equal(part, topk)


@pytest.mark.parametrize("worst, reads", [(0, 2), (64, 1)])
def test_a_fresh_dispatch_with_one_rank_per_node_reads_the_device_once_per_host_decision(monkeypatch, worst, reads):
    # The per-node counts (and the verdict on the ids) reach the host in one copy, the expert
    # counts in another (none with num_worst_tokens); nothing else waits for the device: no
    # nonzero, bincount or boolean mask, whose sizes CuPy reads back with a host sync.
    use_host_arrays(monkeypatch)
    numpy_as_cupy = internode._cupy()
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
    monkeypatch.setattr(internode, "_cupy", lambda: counting)
    inputs = make_inputs(11, 2, 8, 3, "bfloat16", drop=0.2)

    def body(rank, path):
        mine = inputs[rank]
        topk = on_device(mine["topk"])
        per_expert = path.get_dispatch_layout(topk, 8)[2]
        path.dispatch(on_device(mine["x"]), num_tokens_per_expert=per_expert, topk_idx=topk,
                      topk_weights=on_device(mine["weights"]), num_worst_tokens=worst)
        return True

    assert all(run_ranks(make_paths(2, 1), body))
    assert all(s == "asnumpy" for s in syncs) and len(syncs) == 2 * reads
