"""The low-latency path's host side on the CPU: sizes, argument checks, launches and outputs.

A :class:`deepep_cupy.low_latency.path.LowLatencyPath` is built over fake device arrays and a fake
buffer (tests/host_fakes.py); launches are recorded, not run. The GPU tests
(tests/test_gpu_low_latency.py) run the same calls against the NumPy model.
"""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
from host_fakes import FakeArray, FakeGroup, FakeLib, FakeMapped, FakeNvlBuffer, FakeOrder, fake_buffer, on_device

import deepep_cupy as ep
from deepep_cupy import constants, tensors
from deepep_cupy.constants import ERROR_BAD_EXPERT_ID, KERNEL_STAGES, LL_DATA_OFFSET, LL_SIGNALS_END
from deepep_cupy.engines import check_settings
from deepep_cupy.gpu import kernels, launch, plan_cache, slots
from deepep_cupy.gpu.slots import HostSlots
from deepep_cupy.intranode.engine import IntranodeEngine
from deepep_cupy.low_latency import path as low_latency
from deepep_cupy.low_latency.engine import LowLatencyEngine
from deepep_cupy.low_latency.path import (
    COMBINE_KERNEL,
    DISPATCH_KERNEL,
    LowLatencyLayout,
    LowLatencyPath,
    get_low_latency_rdma_size_hint,
)

R, E, M, H, K = 2, 8, 16, 512, 3
L = E // R


@pytest.fixture
def path(monkeypatch):
    lib = FakeLib()
    monkeypatch.setitem(tensors._LIBS, FakeArray, lib)
    monkeypatch.setattr(kernels, "get_kernel", lambda name: SimpleNamespace(kernel=SimpleNamespace(ptr=0)))
    log = []
    monkeypatch.setattr(launch, "launch", lambda call, stream: log.append(
        (call.name, stream, {name: getattr(call.params.values, name) for name in call.params.names})))
    num_bytes = get_low_latency_rdma_size_hint(M, H, R, E)
    nvl = FakeNvlBuffer(num_bytes)
    host_slots = HostSlots(0, 5.0, in_process=False, mapped=FakeMapped())
    order = FakeOrder()
    order.shares_gpu = False
    p = LowLatencyPath(peer_table_ptr=0xB0F, local_ptr=nvl.local_ptr, num_bytes=num_bytes, rank=0, num_ranks=R,
                       device_id=0, order=order, slots=host_slots, timeout_s=5.0, num_sms=4,
                       on_device=contextlib.nullcontext(), owner=nvl)
    return SimpleNamespace(path=p, log=log, lib=lib, slots=host_slots, nvl=nvl, order=order)


def inputs(num_tokens=5, hidden=H):
    rng = np.random.default_rng(0)
    x = on_device(rng.integers(0, 1 << 16, size=(num_tokens, hidden), dtype=np.uint16))
    topk = on_device(rng.integers(-1, E, size=(num_tokens, K)).astype(np.int64))
    weights = on_device(rng.random((num_tokens, K), dtype=np.float32))
    return x, topk, weights


# --- sizes ---------------------------------------------------------------------------------------

def test_the_size_hint_holds_the_layout_in_whole_2_mib():
    hint = get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    layout = LowLatencyLayout(128, 7168, 8, 256)
    assert hint % (2 << 20) == 0 and layout.bytes_needed <= hint < layout.bytes_needed + (2 << 20)
    assert LowLatencyLayout(128, 7168, 8, 256, hint).fits
    assert not LowLatencyLayout(129, 7168, 8, 256, hint).fits
    assert ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == hint


def test_the_size_hint_grows_with_tokens_hidden_and_experts_but_not_ranks():
    # Every area is per (expert, source rank, token) or per (expert, token): L * R = E rows of M.
    base = LowLatencyLayout(64, 4096, 4, 64).bytes_needed
    assert LowLatencyLayout(64, 4096, 8, 64).bytes_needed == base
    for bigger in ((128, 4096, 4, 64), (64, 8192, 4, 64), (64, 4096, 4, 128)):
        assert LowLatencyLayout(*bigger).bytes_needed > base
        assert get_low_latency_rdma_size_hint(*bigger) >= LowLatencyLayout(*bigger).bytes_needed


def test_the_size_hint_refuses_experts_not_split_evenly():
    with pytest.raises(ValueError, match="num_experts: expected a multiple of num_ranks=3"):
        get_low_latency_rdma_size_hint(8, 128, 3, 8)
    with pytest.raises(ValueError, match="hidden: expected a positive int"):
        get_low_latency_rdma_size_hint(8, 0, 2, 8)


def test_sizes_may_be_numpy_integers_as_in_the_other_calls(path):
    # As Buffer(...) and the internode path take them: a size read from a NumPy array works.
    sizes = (np.int64(M), np.int32(H), np.int64(R), np.int64(E))
    assert get_low_latency_rdma_size_hint(*sizes) == get_low_latency_rdma_size_hint(M, H, R, E)
    low_latency.clean_arguments(np.int64(M), np.int64(H), np.int64(E))
    x, topk, _ = inputs()
    *_, handle, _, _ = path.path.dispatch(x, topk, np.int64(M), np.int64(E))
    assert (path.log[-1][2]["num_max"], path.log[-1][2]["num_experts"]) == (M, E)
    assert tuple(handle[2:]) == (M, H, E) and all(type(v) is int for v in handle[2:])
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank: expected a positive int, got True"):
        path.path.dispatch(x, topk, True, E)


def test_the_data_areas_follow_the_signals_at_places_only_the_buffer_size_sets():
    num_bytes = get_low_latency_rdma_size_hint(M, H, R, E)
    layout = LowLatencyLayout(M, H, R, E, num_bytes)
    smaller = LowLatencyLayout(M // 2, H // 2, R, E // 2, num_bytes)
    assert LL_SIGNALS_END <= LL_DATA_OFFSET == layout.dispatch_offset
    area = layout.area_bytes
    assert area >= L * R * M * layout.record_bytes and area >= E * M * H * 2 and area % 4096 == 0
    assert (layout.combine_offset, layout.zero_copy_offset) == (LL_DATA_OFFSET + 2 * area, LL_DATA_OFFSET + 4 * area)
    assert layout.zero_copy_offset + layout.zero_copy_bytes <= num_bytes
    for name in ("dispatch_offset", "dispatch_half_bytes", "combine_offset", "combine_half_bytes", "zero_copy_offset"):
        assert getattr(smaller, name) == getattr(layout, name)
    assert layout.record_bytes % 16 == 0 and layout.record_bytes >= H * 2 + 4


# --- dispatch ------------------------------------------------------------------------------------

def test_a_dispatch_is_one_launch_of_both_phases_writing_the_returned_arrays(path):
    x, topk, _ = inputs()
    recv_x, recv_count, handle, event, hook = path.path.dispatch(x, topk, M, E, use_fp8=False)
    assert hook is None and event.event is None
    [(name, stream, params)] = path.log
    assert name == DISPATCH_KERNEL and params["phases"] == 3 and params["fp8_mode"] == 0
    assert recv_x.shape == (L, R * M, H) and recv_x.dtype == np.uint16
    assert recv_count.shape == (L,) and recv_count.dtype == np.int32
    assert handle.src_info.shape == (L, R * M) and handle.src_info.dtype == np.int32
    assert handle.layout_range.shape == (L, R) and handle.layout_range.dtype == np.int64
    assert tuple(handle[2:]) == (M, H, E)
    assert params["recv_x"] == recv_x.ctypes.data and params["recv_count"] == recv_count.ctypes.data
    assert params["src_info"] == handle[0].ctypes.data and params["layout_range"] == handle[1].ctypes.data
    assert params["x"] == x.ctypes.data and params["topk_idx"] == topk.ctypes.data
    assert (params["num_tokens"], params["num_topk"], params["hidden"], params["num_max"]) == (5, K, H, M)
    assert params["buffer_ptrs"] == 0xB0F and params["recv_scales"] == 0
    assert params["cumulative_recv_stats"] == 0 and params["wait_recv_cost_stats"] == 0


@pytest.mark.parametrize("round_scale, use_ue8m0, mode", [(False, False, 1), (True, False, 2), (False, True, 3),
                                                         (True, True, 3)])
def test_fp8_returns_e4m3_rows_and_column_major_scales(path, round_scale, use_ue8m0, mode):
    x, topk, _ = inputs()
    (data, scales), *_ = path.path.dispatch(x, topk, M, E, round_scale=round_scale, use_ue8m0=use_ue8m0)
    params = path.log[-1][2]
    assert params["fp8_mode"] == mode and params["recv_scales"] == scales.ctypes.data
    assert data.shape == (L, R * M, H) and data.dtype == np.uint8
    groups = H // 128 // 4 if use_ue8m0 else H // 128
    assert scales.shape == (L, R * M, groups)
    assert scales.dtype == (np.int32 if use_ue8m0 else np.float32)
    # column-major per expert: the rows of one group are contiguous
    assert scales.strides == (groups * R * M * 4, 4, R * M * 4)


def test_the_statistics_tensors_are_passed_to_the_kernel(path):
    x, topk, _ = inputs()
    cumulative = on_device(np.zeros(L, np.int32))
    wait = on_device(np.zeros(R, np.int64))
    path.path.dispatch(x, topk, M, E, cumulative_local_expert_recv_stats=cumulative,
                       dispatch_wait_recv_cost_stats=wait)
    params = path.log[-1][2]
    assert params["cumulative_recv_stats"] == cumulative.ctypes.data
    assert params["wait_recv_cost_stats"] == wait.ctypes.data


def test_with_a_hook_the_call_sends_and_the_hook_receives_into_the_same_arrays(path):
    x, topk, _ = inputs()
    recv_x, recv_count, handle, _, hook = path.path.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True)
    assert [(n, p["phases"]) for n, _, p in path.log] == [(DISPATCH_KERNEL, 1)]
    hook()
    (_, _, send), (_, _, receive) = path.log
    assert receive["phases"] == 2
    per_call = ("recv_x", "recv_count", "src_info", "layout_range", "x", "topk_idx", "num_tokens")
    assert all(send[k] == receive[k] for k in per_call) and receive["recv_x"] == recv_x.ctypes.data
    with pytest.raises(RuntimeError, match="called already"):
        hook()


def test_the_hooks_receive_is_noted_so_that_destroy_and_clean_wait_for_it(path):
    x, topk, _ = inputs()
    *_, hook = path.path.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True, async_finish=True)
    assert path.order.side_work == []
    hook()
    receive_stream = path.log[-1][1]
    assert path.order.side_work == [receive_stream]


def test_a_hook_of_a_buffer_destroyed_since_its_send_raises_and_launches_nothing(path):
    # Buffer.destroy() closes the path and marks the slots failed: the receive must not run on
    # the freed buffer.
    x, topk, _ = inputs()
    *_, hook = path.path.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True)
    path.path.close()
    path.slots.failed = "the Buffer was destroyed"
    with pytest.raises(ep.DeepEPError, match="Buffer unusable: the Buffer was destroyed"):
        hook()
    assert [p["phases"] for _, _, p in path.log] == [1]


def test_a_hook_raises_what_the_kernels_reported_since_its_send_before_launching(path):
    x, topk, _ = inputs()
    *_, hook = path.path.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True)
    path.slots.values[slots.ERROR_RECORD:slots.ERROR_RECORD + 6] = [ERROR_BAD_EXPERT_ID, 9, 0, -1, -1, 11]
    with pytest.raises(ValueError, match="rank 0 passed expert ids outside"):
        hook()
    assert [p["phases"] for _, _, p in path.log] == [1]


# --- receives owed: the kernels pair a hook with a send by order alone (one counter per op) -----

@pytest.fixture
def sends(path):
    """The path after one dispatch (whose output the combines send back), with :func:`_send`."""
    x, topk, _ = inputs()
    path.recv_x, _, path.handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    del path.log[:]
    return path


def _send(path, op, hook=True):
    """A dispatch or a combine (``op``) with or without a hook; returns the hook (or None)."""
    x, topk, weights = inputs()
    if op == "dispatch":
        return path.path.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=hook)[4]
    return path.path.combine(path.recv_x, topk, weights, path.handle, return_recv_hook=hook)[2]


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_call_without_a_hook_is_refused_while_a_receive_of_its_op_is_owed(sends, op):
    path = sends
    hook = _send(path, op)
    launches = len(path.log)
    with pytest.raises(ValueError, match=f"return_recv_hook=False: a low-latency {op} .* call its hook first"):
        _send(path, op, hook=False)
    assert len(path.log) == launches
    hook()
    _send(path, op, hook=False)
    assert len(path.log) == launches + 2


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_third_send_while_two_receives_of_its_op_are_owed_is_refused(sends, op):
    path = sends
    first, second = _send(path, op), _send(path, op)
    launches = len(path.log)
    with pytest.raises(ValueError, match=f"return_recv_hook=True: two low-latency {op} calls .* call the older "
                                         "hook first"):
        _send(path, op)
    assert len(path.log) == launches
    first()
    third = _send(path, op)
    second()
    third()
    assert [p["phases"] for _, _, p in path.log[launches:]] == [2, 1, 2, 2]


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_hook_called_before_an_older_hook_of_its_op_is_refused_and_stays_callable(sends, op):
    path = sends
    first, second = _send(path, op), _send(path, op)
    launches = len(path.log)
    with pytest.raises(ValueError, match=f"hook: the hook of an earlier low-latency {op} has not been called; "
                                         "call the hooks in the order of their calls"):
        second()
    assert len(path.log) == launches
    first()
    second()
    assert [p["phases"] for _, _, p in path.log[launches:]] == [2, 2]


def test_a_hook_whose_launch_failed_is_still_owed_and_may_be_called_again(sends, monkeypatch):
    path = sends
    hook = _send(path, "dispatch")
    recorded = launch.launch

    def fail(call, stream):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(launch, "launch", fail)
    with pytest.raises(RuntimeError, match="launch failed"):
        hook()
    monkeypatch.setattr(launch, "launch", recorded)
    with pytest.raises(ValueError, match="return_recv_hook=False"):
        _send(path, "dispatch", hook=False)
    hook()
    _send(path, "dispatch", hook=False)
    assert [p["phases"] for _, _, p in path.log] == [1, 2, 3]


def test_clean_forgets_the_receives_owed_and_their_hooks_are_refused(sends, monkeypatch):
    path = sends
    monkeypatch.setattr(launch, "fill_bytes", lambda ptr, byte, num_bytes, stream: None)
    hooks = [_send(path, "dispatch"), _send(path, "combine")]
    launches = len(path.log)
    path.path.clean(lambda: None)
    for hook in hooks:
        with pytest.raises(ValueError, match="hook: clean_low_latency_buffer reset the low-latency calls since "
                                             "this hook's call; make the call again"):
            hook()
    assert len(path.log) == launches
    _send(path, "dispatch", hook=False)
    _send(path, "combine", hook=False)
    assert len(path.log) == launches + 2


def test_the_usual_orders_of_sends_and_hooks_are_accepted(sends):
    # send, hook; two sends then their hooks in order; a combine without hook while a dispatch
    # receive is owed (each op pairs its own sends and receives).
    path = sends
    _send(path, "dispatch")()
    first, second = _send(path, "dispatch"), _send(path, "dispatch")
    first()
    second()
    dispatch_hook = _send(path, "dispatch")
    _send(path, "combine", hook=False)
    dispatch_hook()
    combine_hook = _send(path, "combine")
    _send(path, "dispatch", hook=False)
    combine_hook()
    assert [(n.split("::")[-1], p["phases"]) for n, _, p in path.log] == [
        ("dispatch", 1), ("dispatch", 2), ("dispatch", 1), ("dispatch", 1), ("dispatch", 2), ("dispatch", 2),
        ("dispatch", 1), ("combine", 3), ("dispatch", 2), ("combine", 1), ("dispatch", 3), ("combine", 2)]


def test_repeated_calls_launch_identical_parameters_so_a_captured_call_replays_alike(path):
    # Which half of the buffer a call uses and its epoch are counted on the device, not passed.
    x, topk, weights = inputs()
    first = path.path.dispatch(x, topk, M, E, use_fp8=False)
    path.path.dispatch(x, topk, M, E, use_fp8=False)
    out = on_device(np.zeros((5, H), np.uint16))
    path.path.combine(first[0], topk, weights, first[2], out=out)
    path.path.combine(first[0], topk, weights, first[2], out=out)
    (_, _, a), (_, _, b) = path.log[:2]
    assert {k: v for k, v in a.items() if k not in ("recv_x", "recv_count", "src_info", "layout_range")} == \
        {k: v for k, v in b.items() if k not in ("recv_x", "recv_count", "src_info", "layout_range")}
    assert path.log[2][2] == path.log[3][2]


@pytest.mark.parametrize("change, error, message", [
    (dict(x=on_device(np.zeros((5, H), np.float32))), TypeError, "x: expected dtype bfloat16, got float32"),
    (dict(x=np.zeros((5, H), np.uint16)), TypeError, "x: expected a device array"),
    (dict(topk=on_device(np.zeros((5, K), np.int32))), TypeError, "topk_idx: expected dtype int64"),
    (dict(num_max=4), ValueError, "x: 5 tokens, more than num_max_dispatch_tokens_per_rank=4"),
    (dict(num_experts=7), ValueError, "num_experts: expected a multiple of the rank count 2"),
    (dict(num_max=4096), ValueError, r"num_rdma_bytes: .* need .*get_low_latency_rdma_size_hint\(4096"),
    (dict(x=on_device(np.zeros((5, 200), np.uint16))), ValueError, "x: FP8 casts need hidden a multiple of 128"),
    (dict(x=on_device(np.zeros((5, 384), np.uint16)), use_ue8m0=True), ValueError, "multiple of 512"),
    (dict(x=on_device(np.zeros((5, 100), np.uint16)), use_fp8=False), ValueError, "multiple of 8"),
    (dict(topk=on_device(np.zeros((4, K), np.int64))), ValueError, r"topk_idx: expected one row per token of x \(5\)"),
    (dict(cumulative=on_device(np.zeros(L + 1, np.int32))), ValueError,
     "cumulative_local_expert_recv_stats: expected shape"),
    (dict(cumulative=on_device(np.zeros(L, np.int64))), TypeError,
     "cumulative_local_expert_recv_stats: expected dtype int32"),
    (dict(wait=on_device(np.zeros(R, np.int32))), TypeError, "dispatch_wait_recv_cost_stats: expected dtype int64"),
])
def test_bad_dispatch_arguments_are_refused_before_any_launch(path, change, error, message):
    x, topk, _ = inputs()
    args = dict(x=x, topk=topk, num_max=M, num_experts=E, use_fp8=True, use_ue8m0=False, cumulative=None, wait=None)
    args.update(change)
    with pytest.raises(error, match=message):
        path.path.dispatch(args["x"], args["topk"], args["num_max"], args["num_experts"],
                           cumulative_local_expert_recv_stats=args["cumulative"],
                           dispatch_wait_recv_cost_stats=args["wait"], use_fp8=args["use_fp8"],
                           use_ue8m0=args["use_ue8m0"])
    assert path.log == []


@pytest.mark.parametrize("name, good, short", [
    ("cumulative_local_expert_recv_stats", lambda: on_device(np.zeros(L, np.int32)),
     lambda: on_device(np.zeros(1, np.int32))),
    ("dispatch_wait_recv_cost_stats", lambda: on_device(np.zeros(R, np.int64)),
     lambda: on_device(np.zeros(1, np.int64))),
])
def test_a_statistics_array_shorter_than_the_one_a_kept_plan_checked_is_refused(path, name, good, short):
    # The kernel writes one entry per local expert (per rank): a kept plan must not take a short one.
    x, topk, _ = inputs()
    path.path.dispatch(x, topk, M, E, **{name: good()})
    launches = len(path.log)
    with pytest.raises(ValueError, match=f"{name}: expected shape"):
        path.path.dispatch(x, topk, M, E, **{name: short()})
    assert len(path.log) == launches


def test_a_bad_expert_id_the_kernel_reported_is_raised_by_the_next_call_which_then_works(path):
    x, topk, _ = inputs()
    record = path.slots.values[slots.ERROR_RECORD:slots.ERROR_RECORD + 6]
    record[:] = [ERROR_BAD_EXPERT_ID, 9, 0, -1, -1, 11]
    with pytest.raises(ValueError, match=r"topk_idx: rank 0 passed expert ids outside \[-1, num_experts\) \(such"):
        path.path.dispatch(x, topk, M, E)
    assert path.log == []
    path.path.dispatch(x, topk, M, E)
    assert len(path.log) == 1


def test_async_calls_run_on_the_communication_stream_and_their_events_keep_their_arrays(path):
    x, topk, weights = inputs()
    recv_x, _, handle, event, _ = path.path.dispatch(x, topk, M, E, use_fp8=False, async_finish=True)
    combined, combine_event, _ = path.path.combine(recv_x, topk, weights, handle, async_finish=True)
    assert [stream for _, stream, _ in path.log] == [path.path._order.ptr] * 2
    assert event.event is not None and any(a is recv_x for a in event.extra_tensors)
    assert combine_event.event is not None and any(a is combined for a in combine_event.extra_tensors)


def test_outputs_are_allocated_on_the_callers_stream_even_for_async_calls(path, monkeypatch):
    # As DeepEP: an async call's outputs come from the caller's current stream (under
    # torch.cuda.graph, the capturing stream's pool), never from the communication stream's; the
    # event keeps them and tells the allocator of the communication stream.
    def refuse(stream, device_id):
        raise AssertionError("allocated for another stream than the caller's")

    monkeypatch.setattr(path.lib, "allocating_on", refuse)
    finishes = []
    finish = path.order.finish
    monkeypatch.setattr(path.order, "finish", lambda *args: finishes.append(args[6]) or finish(*args))
    x, topk, weights = inputs()
    for async_finish in (True, False):
        for hook in (False, True):
            recv_x, _, handle, event, dispatch_hook = path.path.dispatch(
                x, topk, M, E, use_fp8=True, async_finish=async_finish, return_recv_hook=hook)
            if hook:
                dispatch_hook()
            expert_x = on_device(np.zeros((L, R * M, H), np.uint16))
            _, _, combine_hook = path.path.combine(expert_x, topk, weights, handle, async_finish=async_finish,
                                                   return_recv_hook=hook)
            if hook:
                combine_hook()
    assert finishes and not any(finishes)  # nothing was allocated for the communication stream
    assert len(path.lib.used_on_calls) == 4  # the 4 async calls told the allocator of the comm stream


def test_a_call_whose_launch_fails_is_abandoned_on_its_stream_and_returns_no_hook(path, monkeypatch):
    x, topk, _ = inputs()
    abandoned = []
    monkeypatch.setattr(path.path._order, "abandon", abandoned.append)

    def fail(call, stream):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(launch, "launch", fail)
    with pytest.raises(RuntimeError, match="launch failed"):
        path.path.dispatch(x, topk, M, E, use_fp8=False, return_recv_hook=True)
    assert abandoned == [path.lib.current_stream(0)] and path.lib.current_stream(0) != path.path._order.ptr


def test_the_low_latency_stages_have_names():
    assert [KERNEL_STAGES[i] for i in (9, 10, 11, 12)] == [
        "low-latency dispatch send", "low-latency dispatch receive", "low-latency combine send",
        "low-latency combine receive"]


# --- combine -------------------------------------------------------------------------------------

def test_a_combine_is_one_launch_reading_the_handle_and_writing_the_output(path):
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    combined, event, hook = path.path.combine(recv_x, topk, weights, handle)
    assert hook is None and combined.shape == (5, H) and combined.dtype == np.uint16
    name, _, params = path.log[-1]
    assert name == COMBINE_KERNEL and params["phases"] == 3
    assert params["combined_x"] == combined.ctypes.data and params["x"] == recv_x.ctypes.data
    assert params["src_info"] == handle.src_info.ctypes.data
    assert params["layout_range"] == handle.layout_range.ctypes.data
    assert params["topk_weights"] == weights.ctypes.data and params["num_topk"] == K and params["num_tokens"] == 5


def test_a_combine_writes_into_out_when_given_and_hooks_its_receive(path):
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    out = on_device(np.zeros((5, H), np.uint16))
    combined, _, hook = path.path.combine(recv_x, topk, weights, handle, out=out, return_recv_hook=True)
    assert combined is out and path.log[-1][2]["phases"] == 1
    hook()
    assert path.log[-1][2]["phases"] == 2 and path.log[-1][2]["combined_x"] == out.ctypes.data


def test_a_zero_copy_combine_sends_the_rows_written_into_the_next_combine_buffer(path):
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    area = path.path.next_combine_buffer(handle)
    assert area.shape == (L, R * M, H) and area.dtype == np.uint16
    layout = LowLatencyLayout(M, H, R, E, path.nvl.num_bytes)
    assert area.ctypes.data == path.nvl.local_ptr + layout.zero_copy_offset
    path.path.combine(recv_x, topk, weights, handle, zero_copy=True)
    assert path.log[-1][2]["x"] == area.ctypes.data


def test_the_zero_copy_areas_alternate_per_combine_call_so_two_can_be_in_flight(path):
    # DeepEP's halves alternate per call: combine B's rows are written while combine A's send (async,
    # or before its hook) may still read A's, so they never share memory.
    x, topk, weights = inputs()
    layout = LowLatencyLayout(M, H, R, E, path.nvl.num_bytes)
    handle = path.path.dispatch(x, topk, M, E, use_fp8=False)[2]
    expert_x = on_device(np.zeros((L, R * M, H), np.uint16))
    sent_from, hooks = [], []
    for call in range(5):
        area = path.path.next_combine_buffer(handle)
        assert area.ctypes.data == path.nvl.local_ptr + layout.zero_copy_offset_of(call)
        assert path.path.next_combine_buffer(handle) is area  # asking twice changes nothing
        zero_copy = call != 2  # a combine without zero-copy counts as a call too
        *_, hook = path.path.combine(expert_x, topk, weights, handle, zero_copy=zero_copy, async_finish=call == 0,
                                     return_recv_hook=call in (3, 4))
        hooks.append(hook)
        sent_from.append(path.log[-1][2]["x"] if zero_copy else None)
    hooks[3]()
    hooks[4]()
    first, second = (path.nvl.local_ptr + layout.zero_copy_offset_of(i) for i in (0, 1))
    assert sent_from == [first, second, None, second, first]
    assert second - first == layout.area_bytes >= layout.zero_copy_bytes
    assert layout.zero_copy_offset_of(1) + layout.zero_copy_bytes <= path.nvl.num_bytes


def test_a_combine_whose_launch_fails_does_not_advance_the_zero_copy_area(path, monkeypatch):
    x, topk, weights = inputs()
    handle = path.path.dispatch(x, topk, M, E, use_fp8=False)[2]
    area = path.path.next_combine_buffer(handle)

    def fail(call, stream):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(launch, "launch", fail)
    with pytest.raises(RuntimeError, match="launch failed"):
        path.path.combine(on_device(np.zeros((L, R * M, H), np.uint16)), topk, weights, handle, zero_copy=True)
    assert path.path.next_combine_buffer(handle) is area


def test_the_next_combine_buffer_is_one_view_for_every_handle_of_the_same_sizes(path):
    x, topk, _ = inputs()
    first = path.path.dispatch(x, topk, M, E, use_fp8=False)[2]
    second = path.path.dispatch(x[:3], topk[:3], M, E, use_fp8=False)[2]
    assert path.path.next_combine_buffer(first) is path.path.next_combine_buffer(second)
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the rank count"):
        path.path.next_combine_buffer(first._replace(num_experts=E + 1))


@pytest.mark.parametrize("change, error, message", [
    (dict(handle=(1, 2, 3)), TypeError, "handle: expected the handle returned by low_latency_dispatch"),
    (dict(x=on_device(np.zeros((L, R * M, H + 8), np.uint16))), ValueError, "x: expected shape"),
    (dict(x=on_device(np.zeros((L, R * M, H), np.float32))), TypeError, "x: expected dtype bfloat16"),
    (dict(weights=on_device(np.zeros((5, K), np.float64))), TypeError, "topk_weights: expected dtype float32"),
    (dict(weights=on_device(np.zeros((4, K), np.float32))), ValueError, "topk_weights/out: expected 5 rows"),
    (dict(out=on_device(np.zeros((5, H), np.float32))), TypeError, "out: expected dtype bfloat16"),
])
def test_bad_combine_arguments_are_refused_before_any_launch(path, change, error, message):
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    args = dict(x=recv_x, topk=topk, weights=weights, handle=handle, use_logfmt=False, out=None)
    args.update(change)
    launches = len(path.log)
    with pytest.raises(error, match=message):
        path.path.combine(args["x"], args["topk"], args["weights"], args["handle"], use_logfmt=args["use_logfmt"],
                          out=args["out"])
    assert len(path.log) == launches


def test_a_logfmt_combine_launches_with_its_unroll_and_its_slots_and_bf16_ones_without(path):
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    path.path.combine(recv_x, topk, weights, handle)
    path.path.combine(recv_x, topk, weights, handle, use_logfmt=True)
    bf16, logfmt = (entry[2] for entry in path.log[-2:])
    assert (bf16["logfmt_unroll"], bf16["slot_bytes"]) == (0, H * 2)
    # H = 512: chunks of 512 channels (unroll 2); one (amax, amin) word per 128 channels before the row
    assert (logfmt["logfmt_unroll"], logfmt["slot_bytes"]) == (2, H * 2 + H // 128 * 4)
    assert low_latency.logfmt_unroll(7168) == 4 and low_latency.logfmt_unroll(2560) == 2
    layout = LowLatencyLayout(M, H, R, E, path.nvl.num_bytes)
    assert layout.combine_half_bytes >= E * M * layout.logfmt_slot_bytes  # the size hint counts the meta


@pytest.mark.parametrize("hidden, zero_copy, message", [
    (H, True, "use_logfmt=True with zero_copy=True"),
    (256, False, "LogFMT needs hidden a multiple of 512, got 256"),
])
def test_a_logfmt_combine_refuses_zero_copy_and_hidden_not_a_multiple_of_512(path, hidden, zero_copy, message):
    x, topk, weights = inputs(hidden=hidden)
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    launches = len(path.log)
    with pytest.raises(ValueError, match=message):
        path.path.combine(recv_x, topk, weights, handle, use_logfmt=True, zero_copy=zero_copy)
    assert len(path.log) == launches


def test_a_handle_whose_arrays_differ_from_those_a_kept_plan_checked_is_refused(path):
    # The handle's arrays are part of the kind of a combine: a handle of other shapes (another
    # Buffer's, or a made-up one) with the same sizes is checked anew, not launched on a kept plan.
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    path.path.combine(recv_x, topk, weights, handle)
    launches = len(path.log)
    other = handle._replace(src_info=on_device(np.zeros((L, R * M + 1), np.int32)))
    with pytest.raises(ValueError, match="handle.src_info: expected shape"):
        path.path.combine(recv_x, topk, weights, other)
    other = handle._replace(layout_range=on_device(np.zeros((L, R), np.int32)))
    with pytest.raises(TypeError, match="handle.layout_range: expected dtype int64"):
        path.path.combine(recv_x, topk, weights, other)
    other = handle._replace(src_info=on_device(np.zeros((L + 1, R * M), np.int32)))
    with pytest.raises(ValueError, match=f"handle: expected src_info and layout_range of {L} rows"):
        path.path.combine(recv_x, topk, weights, other)
    assert len(path.log) == launches


def test_a_combine_x_with_fewer_experts_than_a_kept_plan_checked_is_refused(path):
    # x's axis 0 (one block of rows per local expert) is read by the kernel: recv_x[:1] must not
    # reuse the plan made for the whole of it.
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    path.path.combine(recv_x, topk, weights, handle)
    launches = len(path.log)
    with pytest.raises(ValueError, match="x: expected shape"):
        path.path.combine(recv_x[:1], topk, weights, handle)
    assert len(path.log) == launches


# --- the Buffer's surface -----------------------------------------------------------------------

def test_a_buffer_without_low_latency_mode_refuses_the_low_latency_calls(monkeypatch):
    buf, _, _ = fake_buffer(monkeypatch)
    x, topk, _ = inputs()
    with pytest.raises(ep.BufferKindError, match=r"not available on this intranode Buffer; create it as Buffer\("):
        buf.low_latency_dispatch(x, topk, M, E)
    with pytest.raises(ValueError, match="low_latency_mode"):
        buf.clean_low_latency_buffer(M, H, E)


def test_a_low_latency_buffer_without_nvlink_bytes_refuses_the_normal_calls():
    engine = IntranodeEngine(FakeGroup(0, 2), 0, 5.0, 0, True)
    with pytest.raises(ValueError, match="dispatch: this Buffer has no NVLink buffer"):
        engine.config(None, "dispatch")


def test_a_low_latency_buffer_takes_zero_nvlink_bytes_and_positive_rdma_bytes():
    check_settings(0, 5.0, low_latency_mode=True)
    with pytest.raises(ValueError, match="num_rdma_bytes: expected a positive int with low_latency_mode=True"):
        ep.Buffer(object(), 0, 0, low_latency_mode=True)


class _GroupOfTwo(FakeGroup):
    """Rank 0 of two on one host, whose peer reports ``peer``'s settings in place of its own."""

    def __init__(self, **peer):
        super().__init__(0, 2)
        self.peer = peer

    def host_name(self):
        return "node"

    def allgather(self, obj):
        return [obj, dict(obj, bus="0000:02:00.0", **self.peer)]


def _checked_group(group, num_nvl_bytes, num_rdma_bytes):
    engine = IntranodeEngine(group, num_nvl_bytes, 5.0, 0, True)
    cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(deviceGetPCIBusId=lambda d: "0000:01:00.0")))
    engine.check_group(cupy, num_rdma_bytes)


def test_ranks_that_disagree_on_the_low_latency_buffer_size_are_refused():
    # Each rank's low-latency layout (where the halves and areas lie) comes from its own size.
    size = get_low_latency_rdma_size_hint(M, H, R, E)
    _checked_group(_GroupOfTwo(), 0, size)
    with pytest.raises(ep.RankMismatchError, match=rf"num_rdma_bytes: ranks disagree, got \[{size}, {2 * size}\]"):
        _checked_group(_GroupOfTwo(rdma_bytes=2 * size), 0, size)
    with pytest.raises(ep.RankMismatchError, match=r"num_nvl_bytes: ranks disagree, got \[1024, 2048\]"):
        _checked_group(_GroupOfTwo(nvl_bytes=2048), 1024, size)


def test_the_module_names_are_exported():
    assert low_latency.get_low_latency_rdma_size_hint is get_low_latency_rdma_size_hint
    assert {"LowLatencyPath", "LowLatencyHandle", "get_low_latency_rdma_size_hint"} <= set(low_latency.__all__)


def test_plans_are_kept_per_kind_of_arguments_and_forgotten_past_a_bound(path, monkeypatch):
    x, topk, _ = inputs()
    path.path.dispatch(x, topk, M, E)
    path.path.dispatch(x, topk, M, E)
    assert len(path.path._dispatch_plans) == 1
    monkeypatch.setattr(plan_cache, "MAX_PLANS", 1)
    path.path.dispatch(x, topk, M, E, use_fp8=False)
    assert len(path.path._dispatch_plans) == 1 and len(path.log) == 3


# --- shrink mode (DeepEP's enable_shrink), wait statistics, the local buffer -----------------------

@pytest.fixture
def shrink_path(path):
    path.path.enable_shrink = True
    return path


def test_calls_carry_the_shrink_flag_to_the_kernels(path, shrink_path):
    x, topk, weights = inputs()
    for shrink in (True, False):
        path.path.enable_shrink = shrink
        path.path._dispatch_plans.clear()
        path.path._combine_plans.clear()
        recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
        path.path.combine(recv_x, topk, weights, handle)
        assert [entry[2]["shrink"] for entry in path.log[-2:]] == [int(shrink)] * 2


def test_a_shrink_mode_clean_uses_the_masked_device_barrier_and_keeps_the_mask(shrink_path, monkeypatch):
    path = shrink_path
    fills = []
    monkeypatch.setattr(launch, "fill_bytes", lambda ptr, byte, num_bytes, stream: fills.append(
        (ptr - path.nvl.local_ptr, num_bytes)))
    host_barriers = []
    path.path.clean(lambda: host_barriers.append(1))
    assert host_barriers == []  # no host collective: a rank that stopped calling holds up no one
    assert [name for name, _, _ in path.log] == [low_latency.BARRIER_KERNEL] * 2
    assert all(entry[2]["num_ranks"] == R and entry[2]["rank"] == 0 for entry in path.log)
    cleared = [(start, start + n) for start, n in fills]
    mask = (constants.LL_MASK_INT * 4, (constants.LL_SYNC_INT + constants.MAX_RANKS) * 4)
    assert cleared == [(constants.LL_CALLS_INT * 4, mask[0]), (mask[1], LL_DATA_OFFSET)]


def test_a_clean_without_shrink_clears_between_host_barriers(path, monkeypatch):
    fills = []
    monkeypatch.setattr(launch, "fill_bytes", lambda ptr, byte, num_bytes, stream: fills.append(num_bytes))
    host_barriers = []
    path.path.clean(lambda: host_barriers.append(1))
    assert host_barriers == [1, 1] and path.log == [] and len(fills) == 2


def test_the_mask_calls_need_shrink_mode_and_check_their_arguments(path, shrink_path):
    path.path.enable_shrink = False
    status = on_device(np.zeros(R, np.int32))
    for call in (lambda: path.path.update_mask(1, True), lambda: path.path.query_mask(status),
                 path.path.clean_mask):
        with pytest.raises(ValueError, match="enable_shrink: the mask calls need a Buffer made with enable_shrink"):
            call()
    path.path.enable_shrink = True
    with pytest.raises(ValueError, match="rank_to_mask: expected a rank below 2, got 2"):
        path.path.update_mask(2, True)
    with pytest.raises(ValueError, match="mask_status: expected shape"):
        path.path.query_mask(on_device(np.zeros(R + 1, np.int32)))
    with pytest.raises(TypeError, match="mask_status: expected dtype int32"):
        path.path.query_mask(on_device(np.zeros(R, np.int64)))


def test_the_combine_wait_statistics_are_checked_and_passed_to_the_kernel(path):
    x, topk, weights = inputs()
    recv_x, _, handle, _, _ = path.path.dispatch(x, topk, M, E, use_fp8=False)
    stats = on_device(np.zeros(R, np.int64))
    path.path.combine(recv_x, topk, weights, handle, combine_wait_recv_cost_stats=stats)
    assert path.log[-1][2]["wait_recv_cost_stats"] == stats.ctypes.data
    path.path.combine(recv_x, topk, weights, handle)
    assert path.log[-1][2]["wait_recv_cost_stats"] == 0
    with pytest.raises(ValueError, match="combine_wait_recv_cost_stats: expected shape"):
        path.path.combine(recv_x, topk, weights, handle,
                          combine_wait_recv_cost_stats=on_device(np.zeros(R + 1, np.int64)))


def test_the_local_buffer_tensor_is_a_view_of_the_buffer_from_a_byte_offset(path, monkeypatch):
    monkeypatch.setattr(tensors, "library", lambda name: path.lib)
    flat = low_latency.local_buffer_tensor(path.path, np.int32)
    assert flat.dtype == np.int32 and flat.shape == (path.nvl.num_bytes // 4,)
    assert flat.ctypes.data == path.nvl.local_ptr
    part = low_latency.local_buffer_tensor(path.path, np.float32, (4, 8), offset=64)
    assert part.shape == (4, 8) and part.ctypes.data == path.nvl.local_ptr + 64
    part[...] = 1.5
    assert (path.nvl.memory[64:64 + 128].view(np.float32) == 1.5).all()
    with pytest.raises(ValueError, match="size: .* elements, more than"):
        low_latency.local_buffer_tensor(path.path, np.float32, path.nvl.num_bytes, offset=0)
    with pytest.raises(ValueError, match="use_rdma_buffer: this Buffer has no such buffer"):
        low_latency.local_buffer_tensor(None, np.float32)


def test_enable_shrink_is_accepted_with_low_latency_mode_only():
    # DeepEP's shrink mode is a low-latency feature: refused before any collective without it.
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup"):
        ep.Buffer(object(), 0, 1 << 20, low_latency_mode=True, enable_shrink=True)
    with pytest.raises(ValueError, match="enable_shrink=True"):
        ep.Buffer(object(), 1 << 20, enable_shrink=True)


def test_a_released_low_latency_engine_refuses_the_decode_calls_as_a_destroyed_buffer(path):
    engine = LowLatencyEngine(SimpleNamespace(release=lambda: None), path.path, lambda: None)
    engine.release()
    assert engine.path is None
    x, topk, _ = inputs()
    for call in (lambda: engine.low_latency_dispatch(x, topk, M, E), engine.low_latency_clean_mask_buffer,
                 lambda: engine.clean_low_latency_buffer(M, H, E)):
        with pytest.raises(ep.DeepEPError, match="Buffer unusable: the Buffer was destroyed"):
            call()
    assert path.log == []
