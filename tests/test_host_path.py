"""The Buffer's host path, run on the CPU with fake device arrays and a recording launcher.

What a call launches and with which arguments, how plans are reused without weakening the
checks, how a fresh dispatch sizes its outputs, and what comes back (tests/host_fakes.py says
what is faked). The GPU tests check the same calls against the reference on real devices.
"""

import contextlib
import re

import numpy as np
import pytest
from host_fakes import CALLER_STREAM, COMM_STREAM, FakeGroup, fake_buffer, on_device, recording_order

import deepep_cupy as ep
from deepep_cupy.constants import ERROR_PEER_ABORTED, ERROR_TIMEOUT, KERNEL_STAGES, VERDICT_OVER_CAPACITY
from deepep_cupy.gpu import launch, slots
from deepep_cupy.intranode import next_outputs, plans
from deepep_cupy.intranode.capacity import HEADROOM_FRACTION, HEADROOM_ROWS
from deepep_cupy.reference import intranode as ref

R, N, H, K, E = 2, 64, 256, 4, 16
CONFIG = ep.Config(8, 4, 32)
STAGE_IDS = {stage: kernel_id for kernel_id, stage in KERNEL_STAGES.items()}


def workload(num_tokens=N, seed=0, hidden=H):
    rng = np.random.default_rng(seed)
    topk = ref.random_routing(rng, num_tokens, E, K)
    per_rank, per_expert, in_rank = ref.get_dispatch_layout(topk, E, R)
    x = ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32))
    return dict(x=on_device(x), num_tokens_per_rank=on_device(per_rank.astype(np.int32)),
                is_token_in_rank=on_device(in_rank), num_tokens_per_expert=on_device(per_expert.astype(np.int32)),
                topk_idx=on_device(topk), topk_weights=on_device(rng.random((num_tokens, K), dtype=np.float32)))


def dispatch(buf, w, **changes):
    return buf.dispatch(**{**w, "config": CONFIG, **changes})


@pytest.fixture
def fake(monkeypatch):
    return fake_buffer(monkeypatch, received=(100,), expert_counts=list(range(E // R)))


# --- what is launched ------------------------------------------------------------------------

def test_a_first_dispatch_learns_its_count_in_a_round_that_moves_nothing_then_allocates_exactly(fake):
    buf, launches, lib = fake
    dispatch(buf, workload())
    assert launches.names() == ["dispatch_kernel<2>", "dispatch_kernel<2>"]
    assert [p["recv_capacity"] for _, p in launches.log] == [0, 100]
    assert [p["exchange"] for _, p in launches.log] == [1, 1]
    assert buf.last_dispatch_allocation == "exact" and buf.last_dispatch_rows_allocated == 100


def test_every_operation_sets_every_kernel_parameter(fake):
    # KernelCall refuses a binding that leaves a parameter unset: make every kind of call.
    buf, launches, _ = fake
    w = workload()
    buf.get_dispatch_layout(w["topk_idx"], E)
    recv_x, _, recv_w, _, handle, _ = dispatch(buf, w)
    dispatch(buf, w, topk_idx=None, topk_weights=None)
    dispatch(buf, w, topk_weights=None)
    fp8 = (on_device(np.zeros((N, H), np.uint8)), on_device(np.ones((N, H // 128), np.float32)))
    dispatch(buf, w, x=fp8)
    buf.dispatch(w["x"], handle=handle, config=CONFIG)
    buf.dispatch(fp8, handle=handle, config=CONFIG)
    buf.combine(recv_x, handle, topk_weights=recv_w, config=CONFIG)
    buf.combine(recv_x, handle, config=CONFIG)
    assert set(launches.names()) == {"dispatch_layout_kernel", "dispatch_kernel<2>", "combine_kernel<bf16_t, 2>"}
    buf._engine.ctx.exchange_in_transfer = False  # in-process ranks make the count exchange in notify_dispatch
    dispatch(buf, w)
    assert "notify_dispatch_kernel" in launches.names()


def test_the_transfer_reads_the_callers_arrays_and_writes_the_returned_ones(fake):
    buf, launches, _ = fake
    w = workload()
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, w)
    p = launches.last("dispatch_kernel<2>")
    assert p["x"] == w["x"].ctypes.data and p["topk_idx"] == w["topk_idx"].ctypes.data
    assert p["is_token_in_rank"] == w["is_token_in_rank"].ctypes.data
    assert p["recv_x"] == recv_x.ctypes.data and p["recv_topk_idx"] == recv_topk.ctypes.data
    assert p["recv_topk_weights"] == recv_w.ctypes.data
    assert p["send_head"] == handle[5].ctypes.data and p["recv_src_idx"] == handle[3].ctypes.data
    assert p["rank_prefix_matrix"] == handle[0].ctypes.data
    assert p["buffer_ptrs"] == 0xB0F and p["num_tokens"] == N and p["hidden_int4"] == H * 2 // 16


def test_a_dispatch_of_a_rank_with_a_process_of_its_own_is_one_launch_exchanging_counts_for_its_host(fake):
    buf, launches, _ = fake
    w = workload()
    for rounds in (2, 1):  # exactly (its count learned first), then allocated ahead
        before = len(launches.log)
        dispatch(buf, w)
        assert launches.names()[before:] == ["dispatch_kernel<2>"] * rounds
        transfer = launches.last("dispatch_kernel<2>")
        assert transfer["recv_counter"] == buf._engine.slots.device_ptr(slots.RECV_COUNT)
        assert transfer["exchange"] == 1 and transfer["check_op"] == 0


def test_in_process_ranks_exchange_counts_in_notify_dispatch_launched_before_the_transfer(fake):
    buf, launches, _ = fake
    buf._engine.ctx.exchange_in_transfer = False  # as for ranks that are threads of one process
    w = workload()
    for rounds in (2, 1):
        before = len(launches.log)
        dispatch(buf, w)
        assert launches.names()[before:] == ["notify_dispatch_kernel", "dispatch_kernel<2>"] * rounds
        notify, transfer = launches.last("notify_dispatch_kernel"), launches.last("dispatch_kernel<2>")
        assert notify["recv_counter"] == buf._engine.slots.device_ptr(slots.RECV_COUNT)
        assert transfer["exchange"] == transfer["check_op"] == 0


def test_a_cached_dispatch_is_one_launch_that_checks_its_settings_and_moves_no_topk(fake):
    buf, launches, _ = fake
    w = workload()
    handle = dispatch(buf, w)[4]
    before = len(launches.log)
    buf.dispatch(w["x"], handle=handle, config=CONFIG)
    assert launches.names()[before:] == ["dispatch_kernel<2>"]
    p = launches.last("dispatch_kernel<2>")
    assert p["check_op"] == plans.OP_CACHED_DISPATCH and p["row_bytes"] == H * 2 and p["zero_count"] > 0
    assert p["topk_idx"] == p["recv_topk_idx"] == p["send_head"] == p["recv_channel_prefix_matrix"] == 0
    assert p["channel_prefix_matrix"] == handle[1].ctypes.data


def test_combine_checks_the_handles_routing_then_reduces_through_its_send_head(fake):
    buf, launches, _ = fake
    w = workload()
    recv_x, _, recv_w, _, handle, _ = dispatch(buf, w)
    before = len(launches.log)
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=CONFIG)
    assert launches.names()[before:] == ["combine_kernel<bf16_t, 2>"]
    main = launches.last("combine_kernel<bf16_t, 2>")
    assert main["check_op"] == plans.OP_COMBINE and main["zero_count"] > 0
    assert main["rank_prefix_matrix"] == handle[0].ctypes.data and main["send_head"] == handle[5].ctypes.data
    assert main["region_tokens"] > 0
    assert combined.shape == (N, H) and combined.dtype == np.uint16 and combined_w.shape == (N, K)


def test_from_12_sms_a_combine_pushes_with_more_blocks_than_its_dispatch(monkeypatch):
    config = ep.Config(16, 4, 32)
    buf, launches, _ = fake_buffer(monkeypatch, num_nvl_bytes=ep.get_nvl_buffer_size_hint(H * 2, R, config),
                                   received=(100,), expert_counts=list(range(E // R)))
    recv_x, _, _, _, handle, _ = dispatch(buf, workload(), config=config)
    buf.combine(recv_x, handle, config=config)
    # 5 dispatch sender blocks make the handle's 120 channels; 7 of the combine's 16 blocks push them back.
    assert launches.last("dispatch_kernel<2>")["num_senders"] == 5
    main = launches.last("combine_kernel<bf16_t, 2>")
    assert main["num_channels"] == handle.num_channels == 5 * 24 and main["num_senders"] == 7


def test_repeated_calls_launch_the_same_parameters_so_a_captured_call_replays_in_step(fake):
    # Barrier numbers and notify areas advance on the device (kernels/call_check.cuh, CallCounters):
    # nothing the host would have to advance per call is baked into a launch.
    buf, launches, _ = fake
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w)
    for _ in range(2):
        buf.dispatch(w["x"], handle=handle, config=CONFIG)
        buf.combine(recv_x, handle, config=CONFIG)
    outputs = ("recv_x", "recv_x_scales", "combined_x", "combined_topk_weights")  # allocated per call
    cached = [{k: v for k, v in p.items() if k not in outputs} for name, p in launches.log
              if name == "dispatch_kernel<2>"][-2:]
    combine = [{k: v for k, v in p.items() if k not in outputs} for name, p in launches.log
               if name == "combine_kernel<bf16_t, 2>"]
    assert cached[0] == cached[1] and combine[0] == combine[1]
    assert not {"epoch", "notify_off"} & set(cached[0])


# --- what comes back -------------------------------------------------------------------------

def test_outputs_have_the_received_row_count_and_the_callers_types(fake):
    buf, _, lib = fake
    w = workload()
    dispatch(buf, w)  # the second call allocates ahead and returns views
    recv_x, recv_topk, recv_w, per_expert, handle, event = dispatch(buf, w)
    assert recv_x.shape == (100, H) and recv_x.dtype == np.uint16
    assert recv_topk.shape == (100, K) and recv_topk.dtype == np.int64
    assert recv_w.shape == (100, K) and recv_w.dtype == np.float32
    assert per_expert == list(range(E // R))
    assert all(type(a).__name__ == "FakeArray" for a in (recv_x, recv_topk, recv_w))
    assert event.event is None


def test_the_handle_unpacks_like_deepeps_tuple(fake):
    buf, _, _ = fake
    w = workload()
    handle = dispatch(buf, w)[4]
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle
    C = CONFIG.num_channels
    assert rank_prefix.shape == (R, R) and channel_prefix.shape == recv_channel_prefix.shape == (R, C)
    assert recv_src_idx.shape == (100,) and send_head.shape == (N, R)
    assert in_rank is w["is_token_in_rank"] and len(handle) == 6 and handle[0] is rank_prefix
    assert all(a.dtype == np.int32 for a in (rank_prefix, channel_prefix, recv_src_idx, send_head))


def test_fp8_returns_rows_and_scales_of_the_received_tokens(fake):
    buf, _, _ = fake
    w = workload()
    fp8 = (on_device(np.zeros((N, H), np.uint8)), on_device(np.ones((N, H // 128), np.float32)))
    recv_x = dispatch(buf, w, x=fp8)[0]
    assert isinstance(recv_x, tuple) and recv_x[0].shape == (100, H) and recv_x[1].shape == (100, H // 128)
    per_token = (fp8[0], on_device(np.ones(N, np.float32)))
    assert dispatch(buf, w, x=per_token)[0][1].shape == (100,)


def _byte_range(array):
    start = array.ctypes.data
    return start, start + array.nbytes


@pytest.mark.parametrize("x_kind", ["bf16", "fp8", "fp8 per token"])
def test_a_dispatch_allocated_ahead_makes_two_allocations_and_carves_its_small_outputs_from_the_handles(
        monkeypatch, x_kind):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100, 90))
    w = workload()
    if x_kind != "bf16":
        scales = np.ones((N, H // 128) if x_kind == "fp8" else (N,), np.float32)
        w["x"] = (on_device(np.zeros((N, H), np.uint8)), on_device(scales))
    dispatch(buf, w)
    del lib.allocations[:]
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, w)
    assert buf.last_dispatch_allocation == "ahead"
    rows = int(100 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    # The handle's words (its ints, then top-k ids, weights and scales of `rows` rows), and recv_x;
    # then the same for the next call (see the tests of prepared outputs below).
    assert [dtype for _, dtype in lib.allocations] == ["int64", "bfloat16" if x_kind == "bf16" else "float8_e4m3fn"] * 2
    recv_rows, recv_scales = recv_x if x_kind != "bf16" else (recv_x, None)
    assert recv_rows.shape == (90, H) and recv_rows.base is not None and recv_rows.flags.c_contiguous
    assert recv_topk.shape == (90, K) and recv_topk.dtype == np.int64
    assert recv_w.shape == (90, K) and recv_w.dtype == np.float32
    small = [recv_topk, recv_w] + ([] if recv_scales is None else [recv_scales])
    if recv_scales is not None:
        assert recv_scales.dtype == np.float32
        assert recv_scales.shape == ((90, H // 128) if x_kind == "fp8" else (90,))
    assert all(a.flags.c_contiguous and np.shares_memory(a, handle.block) for a in small)
    assert not np.shares_memory(recv_rows, handle.block)
    # The transfer wrote where the views are, into regions of `rows` rows that overlap neither each
    # other nor the handle's ints, inside the allocation.
    p = launches.last("dispatch_kernel<2>")
    assert (p["recv_topk_idx"], p["recv_topk_weights"]) == (recv_topk.ctypes.data, recv_w.ctypes.data)
    assert p["recv_x"] == recv_rows.ctypes.data
    block_start, block_end = _byte_range(handle.block)
    regions = [(p["recv_src_idx"], p["recv_src_idx"] + 4 * rows),
               (p["recv_topk_idx"], p["recv_topk_idx"] + 8 * K * rows),
               (p["recv_topk_weights"], p["recv_topk_weights"] + 4 * K * rows)]
    if recv_scales is not None:
        assert p["recv_x_scales"] == recv_scales.ctypes.data
        regions.append((p["recv_x_scales"], p["recv_x_scales"] + recv_scales[0].size * 4 * rows))
    assert all(start % 8 == 0 for start, _ in regions[1:2]) and all(start % 4 == 0 for start, _ in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(regions, regions[1:]))
    assert block_start < regions[0][0] and regions[-1][1] <= block_end
    # The handle's own arrays are still int32 views of its allocation.
    assert handle[3].shape == (90,) and handle[3].ctypes.data == p["recv_src_idx"] and handle[3].dtype == np.int32
    assert handle[0].ctypes.data == block_start and handle[5].dtype == np.int32


def test_a_library_that_does_not_carve_allocates_and_trims_each_output(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100, 90))
    monkeypatch.setattr(type(lib), "carves_outputs", False)
    w = workload()
    dispatch(buf, w)
    del lib.allocations[:]
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, w)
    assert buf.last_dispatch_allocation == "ahead"
    assert [dtype for _, dtype in lib.allocations] == ["int64", "bfloat16", "int64", "float32"] * 2  # and the next's
    assert recv_x.shape == (90, H) and recv_topk.shape == (90, K) and recv_w.shape == (90, K)
    assert not any(np.shares_memory(a, handle.block) for a in (recv_x, recv_topk, recv_w))
    p = launches.last("dispatch_kernel<2>")
    assert (p["recv_topk_idx"], p["recv_topk_weights"]) == (recv_topk.ctypes.data, recv_w.ctypes.data)


def test_a_dispatch_without_top_k_carves_nothing(monkeypatch):
    buf, _, lib = fake_buffer(monkeypatch, received=(100, 90))
    w = workload()
    dispatch(buf, w, topk_idx=None, topk_weights=None)
    del lib.allocations[:]
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, w, topk_idx=None, topk_weights=None)
    assert recv_topk is None and recv_w is None and recv_x.shape == (90, H)
    assert len(lib.allocations) == 2 * 2  # its own and the next call's


def test_the_layout_returns_counts_and_membership(fake):
    buf, launches, _ = fake
    w = workload()
    per_rank, none, per_expert, in_rank, _ = buf.get_dispatch_layout(w["topk_idx"], E)
    assert none is None and per_rank.shape == (R,) and per_expert.shape == (E,) and in_rank.shape == (N, R)
    assert in_rank.dtype == np.bool_ and launches.last("dispatch_layout_kernel")["num_tokens"] == N


def test_an_async_call_returns_an_event_and_keeps_its_arrays(fake):
    buf, _, lib = fake
    out = dispatch(buf, workload(), async_finish=True)
    assert out[-1].event is not None and len(out[-1].extra_tensors) > 0
    assert lib.used_on_calls


# --- plans: checks run once per kind of arguments, and still catch every bad call -------------

def test_calls_with_arguments_of_the_same_kinds_are_checked_once(fake, monkeypatch):
    buf, _, _ = fake
    checked = []
    original = plans.check_fresh_dispatch
    monkeypatch.setattr(plans, "check_fresh_dispatch", lambda *a: checked.append(1) or original(*a))
    for seed in range(3):
        dispatch(buf, workload(seed=seed))
    assert len(checked) == 1
    dispatch(buf, workload(num_tokens=32))  # another token count: same kinds of arguments
    assert len(checked) == 1
    dispatch(buf, workload(hidden=512))     # another row size: a new kind
    assert len(checked) == 2


def test_rows_that_disagree_are_refused_after_a_plan_exists(fake):
    buf, _, _ = fake
    w = workload()
    dispatch(buf, w)
    with pytest.raises(ValueError, match=r"is_token_in_rank: expected shape \(64, 2\), got \(32, 2\)"):
        dispatch(buf, w, is_token_in_rank=on_device(np.zeros((32, R), bool)))
    with pytest.raises(ValueError, match=r"topk_weights: expected shape \(64, 4\), got \(63, 4\)"):
        dispatch(buf, w, topk_weights=on_device(np.zeros((63, K), np.float32)))


def test_a_wrong_dtype_is_refused_after_a_plan_exists(fake):
    buf, _, _ = fake
    w = workload()
    dispatch(buf, w)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16 or float16 or float32, got float64"):
        dispatch(buf, w, x=on_device(np.zeros((N, H), np.float64)))
    with pytest.raises(TypeError, match="topk_idx: expected dtype int64, got int32"):
        dispatch(buf, w, topk_idx=on_device(w["topk_idx"].astype(np.int32)))


def test_a_non_contiguous_x_is_refused(fake):
    buf, _, _ = fake
    w = workload(hidden=2 * H)
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        dispatch(buf, w, x=w["x"][:, ::2])


def test_rows_that_are_no_whole_16_byte_pieces_are_refused_by_dispatch_and_combine(fake):
    buf, launches, _ = fake
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w)
    before = len(launches.log)
    odd_rows = on_device(np.zeros((N, 1004), np.uint16))  # 2008 bytes
    with pytest.raises(ValueError, match="x: row bytes must be a multiple of 16, got hidden 1004 x 2 B = 2008 B"):
        dispatch(buf, w, x=odd_rows)
    with pytest.raises(ValueError, match="x: row bytes must be a multiple of 16, got hidden 1004 x 2 B = 2008 B"):
        buf.combine(on_device(np.zeros((recv_x.shape[0], 1004), np.uint16)), handle, config=CONFIG)
    assert len(launches.log) == before


def test_an_array_on_another_gpu_is_refused(fake):
    buf, _, _ = fake
    w = workload()
    dispatch(buf, w)
    with pytest.raises(ValueError, match=r"num_tokens_per_rank: expected an array on GPU 0 \(the Buffer's\)"):
        dispatch(buf, w, num_tokens_per_rank=on_device(np.zeros(R, np.int32), device_id=1))


def test_host_memory_is_refused(fake):
    buf, _, _ = fake
    w = workload()
    with pytest.raises(TypeError, match="topk_idx: expected a device array .* NumPy array on the host"):
        buf.get_dispatch_layout(np.asarray(w["topk_idx"]), E)
    with pytest.raises(TypeError, match="x: expected a CuPy array or a PyTorch CUDA tensor, got list"):
        dispatch(buf, w, x=[1, 2])


def test_a_failed_check_launches_nothing_and_leaves_the_buffer_usable(fake):
    buf, launches, _ = fake
    w = workload()
    with pytest.raises(ValueError, match="topk_weights: given without topk_idx"):
        dispatch(buf, w, topk_idx=None)
    assert launches.log == []
    dispatch(buf, w)


# --- sizing a fresh dispatch's outputs ahead of its counts -----------------------------------

def test_the_first_dispatch_learns_its_count_before_it_allocates(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(180,))
    dispatch(buf, workload())
    assert buf.last_dispatch_allocation == "exact"
    assert [p["recv_capacity"] for _, p in launches.log] == [0, 180]
    assert [shape for shape, _ in lib.allocations if len(shape) == 2 and shape[1] == H] == [(0, H), (180, H)]


def test_the_next_dispatch_allocates_ahead_from_the_last_count(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(180, 170))
    dispatch(buf, workload())
    dispatch(buf, workload())
    rows = int(180 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert buf.last_dispatch_allocation == "ahead" and buf.last_dispatch_rows_allocated == rows
    assert launches.last("dispatch_kernel<2>")["recv_capacity"] == rows
    assert (rows, H) in [shape for shape, _ in lib.allocations]


def test_a_dispatch_that_outgrows_its_guess_is_redone_with_exact_sizes(monkeypatch):
    buf, launches, _ = fake_buffer(monkeypatch, received=(10, 400, 390))
    dispatch(buf, workload())
    recv_x = dispatch(buf, workload())[0]
    assert buf.last_dispatch_allocation == "retried" and recv_x.shape == (400, H)
    guess = int(10 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert [p["recv_capacity"] for _, p in launches.log[2:]] == [guess, 400]
    assert buf.last_dispatch_rows_allocated == 400  # the most of its rounds
    dispatch(buf, workload())  # the retried call's count is the next guess
    rows = int(400 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert launches.last("dispatch_kernel<2>")["recv_capacity"] == rows


def test_without_allocate_ahead_every_dispatch_waits_for_the_counts(monkeypatch):
    buf, launches, _ = fake_buffer(monkeypatch, allocate_ahead=False, received=(180, 170))
    dispatch(buf, workload())
    dispatch(buf, workload())
    assert buf.last_dispatch_allocation == "exact"
    assert [p["recv_capacity"] for _, p in launches.log] == [0, 180, 0, 170]


# --- the next call's outputs, allocated while a call waits for its counts ---------------------

def steady(monkeypatch, received=(100,), **options):
    """A fake Buffer after two dispatches of ``workload()``: the second, like the first, allocated
    the third's outputs. Returns ``(buffer, launches, lib, launches so far, allocations so far)``."""
    buf, launches, lib = fake_buffer(monkeypatch, received=received, **options)
    dispatch(buf, workload())
    dispatch(buf, workload())
    return buf, launches, lib, len(launches.log), len(lib.allocations)


def test_the_outputs_prepared_for_the_next_call_hold_no_more_rows_than_a_rank_can_receive(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100,))
    dispatch(buf, workload())
    plan = next(p for p in buf._engine.dispatch_path._ctx.plans.values() if p.notify is not None)
    most = 120  # the guess (100 rows with headroom) is capped here, and the prepared rows with it
    for key, value in list(buf._engine.dispatch_path._ctx.plans.items()):
        if value is plan:
            buf._engine.dispatch_path._ctx.plans[key] = plan._replace(most_recv_rows=most)
    dispatch(buf, workload())
    dispatch(buf, workload())  # like the one before: it prepares the next call's outputs
    assert buf.last_dispatch_rows_allocated == most
    assert buf._engine.dispatch_path._next_outputs.ready.rows == most < next_outputs.prepared_rows(most)


def test_a_dispatch_like_the_last_one_allocates_the_next_ones_outputs(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100,))
    dispatch(buf, workload())
    assert buf._engine.dispatch_path._next_outputs.ready is None  # the first has no count to size them from
    dispatch(buf, workload())
    ready = buf._engine.dispatch_path._next_outputs.ready
    assert not buf._engine.dispatch_path._next_outputs.over_limit
    rows_ahead = int(100 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert ready.rows == next_outputs.prepared_rows(rows_ahead) > rows_ahead
    assert lib.allocations[-1] == ((ready.rows, H), "bfloat16") and ready.pointers[0] == ready.outputs[0].ctypes.data


def test_the_outputs_prepared_over_a_steady_loop_keep_their_size(monkeypatch):
    # Sized from each call's guess, not from the rows the call was handed (an eighth more already).
    buf, _, _, _, _ = steady(monkeypatch)
    first = buf._engine.dispatch_path._next_outputs.ready.rows
    for _ in range(4):
        dispatch(buf, workload())
        assert buf._engine.dispatch_path._next_outputs.ready.rows == first


def test_a_dispatch_with_its_outputs_ready_is_one_launch_writing_them(monkeypatch):
    buf, launches, lib, launched, allocated = steady(monkeypatch)
    ready = buf._engine.dispatch_path._next_outputs.ready
    w = workload()
    recv_x, recv_topk, _, _, handle, _ = dispatch(buf, w)
    assert launches.names()[launched:] == ["dispatch_kernel<2>"]
    p = launches.last("dispatch_kernel<2>")
    assert p["exchange"] == 1 and p["recv_capacity"] == ready.rows
    assert p["recv_x"] == ready.pointers[0] == recv_x.ctypes.data and handle is ready.handle
    assert handle[4] is w["is_token_in_rank"] and handle.in_rank_ptr == p["is_token_in_rank"]
    assert p["recv_topk_idx"] == ready.pointers[2] == recv_topk.ctypes.data
    assert recv_x.shape == (100, H) and buf.last_dispatch_allocation == "ahead"
    assert len(lib.allocations) - allocated == 2  # only the next call's


def test_in_process_ranks_move_tokens_into_ready_outputs_behind_notify_dispatch(monkeypatch):
    buf, launches, lib, launched, _ = steady(monkeypatch)
    buf._engine.ctx.exchange_in_transfer = False  # as for ranks that are threads of one process
    ready = buf._engine.dispatch_path._next_outputs.ready
    recv_x = dispatch(buf, workload())[0]
    assert launches.names()[launched:] == ["notify_dispatch_kernel", "dispatch_kernel<2>"]
    assert launches.last("dispatch_kernel<2>")["recv_x"] == ready.pointers[0] == recv_x.ctypes.data


def test_a_dispatch_with_another_token_count_neither_uses_nor_prepares_outputs(monkeypatch):
    buf, launches, lib, launched, allocated = steady(monkeypatch)
    dispatch(buf, workload(num_tokens=N // 2))
    assert launches.names()[launched:] == ["dispatch_kernel<2>"]
    assert len(lib.allocations) - allocated == 2 and buf._engine.dispatch_path._next_outputs.ready is None


@pytest.mark.parametrize("change", [dict(allocate_on_comm_stream=True), dict(topk_weights=None)])
def test_outputs_ready_for_another_stream_or_plan_are_not_used(monkeypatch, change):
    buf, launches, _, launched, _ = steady(monkeypatch)
    ready = buf._engine.dispatch_path._next_outputs.ready
    recv_x = dispatch(buf, workload(), **change)[0]
    assert launches.names()[launched:] == ["dispatch_kernel<2>"]
    assert recv_x.ctypes.data != ready.pointers[0]


def test_dispatches_alternating_between_two_plans_prepare_nothing(monkeypatch):
    buf, launches, lib, launched, _ = steady(monkeypatch)
    for _ in range(2):
        dispatch(buf, workload(), topk_weights=None)
        assert buf._engine.dispatch_path._next_outputs.ready is None
        dispatch(buf, workload())
        assert buf._engine.dispatch_path._next_outputs.ready is None
    assert launches.names()[launched:] == ["dispatch_kernel<2>"] * 4


def test_outputs_above_the_byte_limit_are_not_prepared(monkeypatch):
    monkeypatch.setattr(next_outputs, "MAX_BYTES", 1 << 10)
    buf, launches, _, launched, _ = steady(monkeypatch)
    assert buf._engine.dispatch_path._next_outputs.ready is None and buf._engine.dispatch_path._next_outputs.over_limit
    dispatch(buf, workload())
    assert launches.names()[launched:] == ["dispatch_kernel<2>"]


def test_a_dispatch_outgrowing_its_ready_outputs_is_redone_with_exact_sizes(monkeypatch):
    buf, launches, _, launched, _ = steady(monkeypatch, received=(100, 100, 400))
    recv_x = dispatch(buf, workload())[0]
    assert launches.names()[launched:] == ["dispatch_kernel<2>", "dispatch_kernel<2>"]
    assert launches.last("dispatch_kernel<2>")["recv_capacity"] == 400
    assert buf.last_dispatch_allocation == "retried" and recv_x.shape == (400, H)


def test_destroy_lets_go_of_ready_outputs(monkeypatch):
    buf, _, _, _, _ = steady(monkeypatch)
    buf._engine.release()
    assert buf._engine.dispatch_path._next_outputs.ready is None


def test_destroy_forgets_that_outputs_were_over_the_byte_limit(monkeypatch):
    monkeypatch.setattr(next_outputs, "MAX_BYTES", 1 << 10)
    buf, _, _, _, _ = steady(monkeypatch)
    assert buf._engine.dispatch_path._next_outputs.over_limit
    buf._engine.release()
    assert not buf._engine.dispatch_path._next_outputs.over_limit


# --- verdicts of the count exchange ----------------------------------------------------------

def test_settings_that_differ_between_ranks_raise_rank_mismatch(monkeypatch):
    buf, launches, _ = fake_buffer(monkeypatch, verdict=2)
    with pytest.raises(ep.RankMismatchError, match="between rank 0 and rank 1"):
        dispatch(buf, workload())
    launches.verdict = 0
    dispatch(buf, workload())  # nothing was moved; the Buffer goes on


def test_expert_ids_out_of_range_are_named_on_the_rank_that_passed_them(monkeypatch):
    buf, _, _ = fake_buffer(monkeypatch, verdict=-1)
    w = workload()
    w["topk_idx"][3, 1] = E + 5
    with pytest.raises(ValueError, match=rf"rank 0 passed expert ids outside \[-1, {E}\): values such as \[{E + 5}\]"):
        dispatch(buf, w)


def test_over_capacity_is_not_an_error(monkeypatch):
    assert VERDICT_OVER_CAPACITY > 0
    buf, _, _ = fake_buffer(monkeypatch, received=(50, 5000))
    dispatch(buf, workload())
    assert dispatch(buf, workload())[0].shape == (5000, H)


# --- handles ---------------------------------------------------------------------------------

def test_a_handle_is_only_valid_on_its_buffer(monkeypatch):
    buf, _, _ = fake_buffer(monkeypatch)
    other, _, _ = fake_buffer(monkeypatch)
    w = workload()
    handle = dispatch(buf, w)[4]
    with pytest.raises(ValueError, match="handle: it was made by another Buffer"):
        other.dispatch(w["x"], handle=handle, config=CONFIG)
    with pytest.raises(TypeError, match="handle: expected the handle returned by Buffer.dispatch, got tuple"):
        buf.dispatch(w["x"], handle=tuple(handle), config=CONFIG)


def test_cached_dispatch_needs_the_handles_token_count_and_channels(fake):
    buf, _, _ = fake
    w = workload()
    handle = dispatch(buf, w)[4]
    with pytest.raises(ValueError, match="x: the handle routes 64 tokens, got 32"):
        buf.dispatch(workload(num_tokens=32)["x"], handle=handle, config=CONFIG)
    with pytest.raises(ValueError, match="config: the handle was made with another num_sms .*num_sms=24"):
        buf.dispatch(w["x"], handle=handle, config=ep.Config(24, 4, 32))


def test_combine_needs_one_row_per_received_token(fake):
    buf, _, _ = fake
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w)
    with pytest.raises(ValueError, match=r"x: expected 100 rows \(the tokens its dispatch received\), got 99"):
        buf.combine(recv_x[:99], handle, config=CONFIG)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16 or float16 or float32, got float8_e4m3fn"):
        buf.combine(on_device(np.zeros((100, H), np.uint8)), handle, config=CONFIG)


# --- failures of the count exchange, and destroy after them -----------------------------------

def _record(code, stage, rank, peer):
    """An error record as the kernels write it (kernels/common.cuh), for a whole-rank stage."""
    return (code, STAGE_IDS[stage], rank, -1, peer, 7)


def test_a_dispatch_whose_exchange_failed_after_the_count_was_published_raises(monkeypatch):
    # The count was published, and then a kernel recorded a timeout (the transfer launched behind it).
    buf, _, _ = fake_buffer(monkeypatch, received=(100,), error=_record(ERROR_TIMEOUT, "notify_dispatch", 0, 1))
    with pytest.raises(ep.DeepEPTimeoutError, match="rank 0: notify_dispatch timed out"):
        dispatch(buf, workload())
    with pytest.raises(ep.DeepEPError, match="Buffer unusable"):
        dispatch(buf, workload())


def test_a_late_ranks_dispatch_raises_that_a_peer_gave_up(monkeypatch):
    # Rank 1 comes after rank 0 timed out: its first barrier sees rank 0's abort mark, so no count.
    buf, _, _ = fake_buffer(monkeypatch, rank=1, received=(-1,),
                            error=_record(ERROR_PEER_ABORTED, "notify_dispatch", 1, 0))
    with pytest.raises(ep.PeerAbortedError, match="rank 1: notify_dispatch stopped .* rank 0 had given up") as info:
        dispatch(buf, workload())
    assert info.value.peer == 0


def _timeline_with_count_waits(monkeypatch, **launch_script):
    """A fake Buffer recording its launches, stream-order calls and count waits in one timeline."""
    timeline = []
    buf, launches, lib = fake_buffer(monkeypatch, order=recording_order(timeline), timeline=timeline,
                                     **launch_script)
    wait_for_count = buf._engine.slots.wait_for_count

    def recorded_wait(kernel_done=None):
        timeline.append(("count wait",))
        return wait_for_count(kernel_done)

    buf._engine.slots.wait_for_count = recorded_wait
    return buf, timeline


def test_a_dispatch_allocating_ahead_is_handed_over_before_its_host_waits_for_the_count(monkeypatch):
    # Its last kernel is queued: the event recording the call's end goes in while the exchange runs.
    buf, timeline = _timeline_with_count_waits(monkeypatch, received=(100,), expert_counts=list(range(E // R)))
    w = workload()
    dispatch(buf, w)
    timeline.clear()
    dispatch(buf, w)
    assert buf.last_dispatch_allocation == "ahead"
    names = [entry[0] for entry in timeline]
    assert names.index("record") > max(i for i, name in enumerate(names) if name == "launch")
    assert names.index("record") < names.index("count wait"), timeline


def test_an_expanding_dispatch_launching_after_its_count_is_handed_over_after_it(monkeypatch):
    buf, timeline = _timeline_with_count_waits(monkeypatch, received=(100,), expert_counts=[4] * (E // R))
    w = workload()
    dispatch(buf, w)
    timeline.clear()
    dispatch(buf, w, expand=True)
    names = [entry[0] for entry in timeline]
    assert names.index("count wait") < names.index("record"), timeline
    assert max(i for i, name in enumerate(names) if name == "launch") < names.index("record")


def test_destroy_after_a_failed_dispatch_waits_for_the_kernels_it_launched(monkeypatch):
    timeline = []
    buf, launches, _ = fake_buffer(monkeypatch, order=recording_order(timeline), received=(100, -1),
                                   timeline=timeline)
    w = workload()
    dispatch(buf, w)  # the next one allocates ahead: its transfer is launched before the count
    launches.error = _record(ERROR_TIMEOUT, "notify_dispatch", 0, 1)
    with pytest.raises(ep.DeepEPTimeoutError):
        dispatch(buf, w)
    last_launch = max(i for i, entry in enumerate(timeline) if entry[0] == "launch")
    assert timeline[last_launch] == ("launch", "dispatch_kernel<2>", CALLER_STREAM)
    records = [i for i, entry in enumerate(timeline) if entry[0] == "record" and entry[2] == CALLER_STREAM]
    assert records and records[-1] > last_launch, "no event recorded behind the failed call's kernels"
    event = timeline[records[-1]][1]
    timeline.clear()
    buf.destroy()  # raises nothing, waits on that event (and the comm stream), nothing device-wide
    assert ("event sync", event) in timeline and ("stream sync", COMM_STREAM) in timeline
    assert all(entry[0] in ("event sync", "stream sync") for entry in timeline), timeline
    with pytest.raises(ep.DeepEPError, match="destroyed"):
        dispatch(buf, w)


@pytest.mark.parametrize("operation", ["layout", "cached dispatch", "combine"])
def test_an_operation_that_raises_after_ordering_its_call_leaves_later_calls_behind_it(monkeypatch, operation):
    timeline = []
    buf, _, _ = fake_buffer(monkeypatch, order=recording_order(timeline), received=(100,), timeline=timeline)
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w)
    call = {"layout": lambda: buf.get_dispatch_layout(w["topk_idx"], E),
            "cached dispatch": lambda: buf.dispatch(w["x"], handle=handle, config=CONFIG),
            "combine": lambda: buf.combine(recv_x, handle, config=CONFIG)}[operation]
    call()  # plans made, so that the next call fails in its launch, not in its checks

    def failing_launch(kernel_call, stream_ptr):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(launch, "launch", failing_launch)
    timeline.clear()
    with pytest.raises(RuntimeError, match="launch failed"):
        call()
    assert timeline and timeline[-1][0] == "record" and timeline[-1][2] == CALLER_STREAM, timeline


# --- expand ----------------------------------------------------------------------------------

def test_an_expanding_dispatch_regroups_the_received_rows_per_local_expert(fake):
    buf, launches, _ = fake
    recv_x, recv_topk, _, per_expert, handle, _ = dispatch(buf, workload(), expand=True)
    assert launches.names()[-2:] == ["dispatch_kernel<2>", "expand_kernel"]
    expand = launches.last("expand_kernel")
    total = sum(range(E // R))
    assert recv_x.shape == (total, H) and handle.expanded_rows.shape == (total,)
    assert handle.expert_offsets == [0, *np.cumsum(range(E // R)).tolist()]
    assert recv_topk.shape == (100, K) and handle.num_recv_tokens == 100  # top-k stays per received token
    assert expand["expanded_x"] == recv_x.ctypes.data and expand["recv_topk_idx"] == recv_topk.ctypes.data
    assert expand["num_recv"] == 100 and expand["num_local_experts"] == E // R


def test_an_expanding_fp8_dispatch_regroups_the_scales_too(fake):
    buf, launches, _ = fake
    fp8 = (on_device(np.zeros((N, H), np.uint8)), on_device(np.ones((N, H // 128), np.float32)))
    (rows, scales), *_ = dispatch(buf, workload(), x=fp8, expand=True)
    assert rows.shape == (sum(range(E // R)), H) and scales.shape == (rows.shape[0], H // 128)
    assert launches.last("expand_kernel")["expanded_scales"] == scales.ctypes.data


@pytest.mark.parametrize("changes, message", [
    (dict(num_worst_tokens=300), "expand: .*num_worst_tokens"),
    (dict(topk_idx=None, topk_weights=None), "expand: .*pass topk_idx"),
])
def test_expand_needs_top_k_and_the_host_counts(fake, changes, message):
    buf, launches, _ = fake
    with pytest.raises(ValueError, match=message):
        dispatch(buf, workload(), expand=True, **changes)
    assert "expand_kernel" not in launches.names()


def test_a_cached_dispatch_does_not_expand(fake):
    buf, _, _ = fake
    w = workload()
    handle = dispatch(buf, w)[4]
    with pytest.raises(ValueError, match="expand: a cached dispatch"):
        buf.dispatch(w["x"], handle=handle, config=CONFIG, expand=True)


# --- recv_x_in_buffer ------------------------------------------------------------------------

def in_place_buffer(monkeypatch):
    """A fake Buffer whose NVLink buffer is host memory, sized for the workload with rows in place."""
    nvl_bytes = ep.get_nvl_buffer_size_hint(H * 2, R, CONFIG, num_topk=K, num_max_tokens_per_rank=N,
                                            recv_x_in_buffer=True)
    return fake_buffer(monkeypatch, num_nvl_bytes=nvl_bytes, nvl_memory=True, received=(100,),
                       expert_counts=list(range(E // R)))


@pytest.fixture
def in_place(monkeypatch):
    return in_place_buffer(monkeypatch)


def inside(buf, array):
    return buf._engine.nvl.local_ptr <= array.ctypes.data < buf._engine.nvl.local_ptr + buf._engine.nvl.num_bytes


@contextlib.contextmanager
def refused_before_any_launch(launches, match):
    """The block raises ValueError matching ``match`` and launches nothing."""
    before = len(launches.log)
    with pytest.raises(ValueError, match=match):
        yield
    assert len(launches.log) == before


def test_recv_x_in_buffer_returns_views_of_the_nvlink_buffer_written_by_every_block(in_place):
    buf, launches, lib = in_place
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, workload(), recv_x_in_buffer=True)
    assert launches.names() == ["dispatch_kernel<2, false, true>"] * 2  # its count learned, then the rows
    p = launches.last("dispatch_kernel<2, false, true>")
    assert p["num_senders"] == CONFIG.num_sms and p["num_channels"] == CONFIG.num_channels == handle.num_channels
    assert recv_x.shape == (100, H) and recv_topk.shape == recv_w.shape == (100, K)
    assert all(inside(buf, a) for a in (recv_x, recv_topk, recv_w))
    assert p["recv_x"] == p["recv_topk_idx"] == p["recv_topk_weights"] == 0  # the kernel takes none in place
    assert not any(shape == (100, H) for shape, _ in lib.allocations), "recv_x was allocated"


def test_a_dispatch_with_rows_in_place_allocating_ahead_is_one_launch_making_the_count_exchange(in_place):
    buf, launches, _ = in_place
    w = workload()
    dispatch(buf, w, recv_x_in_buffer=True)
    before = len(launches.log)
    recv_x, _, _, _, handle, _ = dispatch(buf, w, recv_x_in_buffer=True)
    assert buf.last_dispatch_allocation == "ahead"
    assert launches.names()[before:] == ["dispatch_kernel<2, false, true>"]
    p = launches.last("dispatch_kernel<2, false, true>")
    assert p["exchange"] == 1 and p["report_refusal"] == 0 and p["check_op"] == 0
    assert p["recv_counter"] == buf._engine.slots.device_ptr(slots.RECV_COUNT)
    assert p["mismatch_flag"] == buf._engine.slots.device_ptr(slots.VERDICT)
    assert p["recv_expert_counter"] == buf._engine.slots.device_ptr(slots.EXPERT_COUNTS)
    # The guess, but no more rows than the areas hold (a rank never receives more: capacity.py).
    most_rows = R * handle.rows_in_buffer.region_tokens
    assert p["recv_capacity"] == min(int(100 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS, most_rows)
    assert p["rank_prefix_matrix"] == handle[0].ctypes.data and inside(buf, recv_x)


def test_a_dispatch_allocates_its_outputs_before_its_count_exchange(fake):
    # So that a host that cannot allocate them can still take part in the exchange, to refuse the
    # call on every rank (see the refusal tests below).
    buf, launches, _ = fake
    w = workload()
    dispatch(buf, w)
    before = len(launches.log)
    recv_x = dispatch(buf, w, topk_weights=None)[0]  # another plan: nothing prepared for it
    assert buf.last_dispatch_allocation == "ahead"
    assert launches.names()[before:] == ["dispatch_kernel<2>"]
    p = launches.last("dispatch_kernel<2>")
    assert p["exchange"] == 1 and p["recv_x"] == recv_x.ctypes.data


def test_in_process_ranks_with_rows_in_place_exchange_the_counts_in_notify_dispatch(monkeypatch):
    monkeypatch.setattr(FakeGroup, "in_process", True)
    monkeypatch.setattr(FakeGroup, "ranks_on_device", lambda self, device_id: 1, raising=False)
    buf, launches, _ = in_place_buffer(monkeypatch)
    w = workload()
    dispatch(buf, w, recv_x_in_buffer=True)
    before = len(launches.log)
    dispatch(buf, w, recv_x_in_buffer=True)
    assert buf.last_dispatch_allocation == "ahead"
    assert launches.names()[before:] == ["notify_dispatch_kernel", "dispatch_kernel<2, false, true>"]


def test_from_16_sms_an_in_place_dispatch_writes_its_own_rows_on_blocks_of_their_own(monkeypatch):
    config = ep.Config(24, 4, 32)
    nvl_bytes = ep.get_nvl_buffer_size_hint(H * 2, R, config, num_topk=K, num_max_tokens_per_rank=N,
                                            recv_x_in_buffer=True)
    buf, launches, _ = fake_buffer(monkeypatch, num_nvl_bytes=nvl_bytes, nvl_memory=True, received=(100,),
                                   expert_counts=list(range(E // R)))
    w = workload()
    handle = dispatch(buf, w, config=config, recv_x_in_buffer=True)[4]
    buf.dispatch(w["x"], handle=handle, config=config, recv_x_in_buffer=True)
    *fresh, cached = [params for name, params in launches.log if name == "dispatch_kernel<2, false, true>"]
    # num_senders: the blocks that push to the peers; the 8 before them write this rank's rows.
    assert [p["num_senders"] for p in fresh] == [24 - 8] * 2 and cached["num_senders"] == 24 - 8


def test_a_cached_dispatch_with_recv_x_in_buffer_checks_that_setting_across_ranks(in_place):
    buf, launches, _ = in_place
    w = workload()
    handle = dispatch(buf, w)[4]
    recv_x = buf.dispatch(w["x"], handle=handle, config=CONFIG, recv_x_in_buffer=True)[0]
    assert launches.names()[-1] == "dispatch_kernel<2, false, true>" and inside(buf, recv_x)
    assert launches.last("dispatch_kernel<2, false, true>")["check_op"] == plans.OP_CACHED_DISPATCH


def copy_of(array):
    return on_device(np.array(array))


# Each call passes one output of a dispatch with rows in place (a view of the NVLink buffer) back
# in; ``out`` is that dispatch's result, ``w`` its workload.
BUFFER_INPUTS = {
    # (recv_x itself is x in place: see the combine in place below; a view from its second row on is not)
    "combine x": ("x", lambda buf, w, out: buf.combine(out[0][1:], out[4], config=CONFIG)),
    "combine topk_weights": ("topk_weights", lambda buf, w, out: buf.combine(
        copy_of(out[0]), out[4], topk_weights=out[2], config=CONFIG)),
    "combine bias": ("bias[1]", lambda buf, w, out: buf.combine(
        copy_of(out[0]), out[4], bias=(None, out[0][:N]), config=CONFIG)),
    "dispatch x": ("x", lambda buf, w, out: dispatch(buf, {**w, "x": out[0][:N]})),
    "dispatch topk_idx": ("topk_idx", lambda buf, w, out: dispatch(buf, {**w, "topk_idx": out[1][:N]})),
    "dispatch topk_weights": ("topk_weights", lambda buf, w, out: dispatch(buf, {**w, "topk_weights": out[2][:N]})),
}


@pytest.mark.parametrize("case", BUFFER_INPUTS)
def test_an_array_argument_that_lies_in_the_nvlink_buffer_is_refused_by_name(in_place, case):
    buf, launches, _ = in_place
    arg, call = BUFFER_INPUTS[case]
    w = workload()
    out = dispatch(buf, w, recv_x_in_buffer=True)
    with refused_before_any_launch(launches, "^" + re.escape(f"{arg}: lies in this Buffer's NVLink buffer")):
        call(buf, w, out)


def test_copies_of_the_outputs_of_a_dispatch_with_rows_in_place_are_accepted(in_place):
    buf, launches, _ = in_place
    w = workload()
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, w, recv_x_in_buffer=True)
    before = len(launches.log)
    buf.combine(copy_of(recv_x), handle, topk_weights=copy_of(recv_w), config=CONFIG)
    dispatch(buf, {**w, "topk_idx": copy_of(recv_topk[:N])})
    assert launches.names()[before:] == ["combine_kernel<bf16_t, 2>", "dispatch_kernel<2>"]


def test_a_combine_of_recv_x_overwritten_in_place_reads_every_ranks_rows_where_they_lie(in_place):
    buf, launches, _ = in_place
    recv_x, _, recv_w, _, handle, _ = dispatch(buf, workload(), recv_x_in_buffer=True)
    lay = handle.rows_in_buffer
    buf.combine(recv_x, handle, topk_weights=recv_w, config=CONFIG)
    p = launches.last("combine_kernel<bf16_t, 2, true>")
    assert p["num_senders"] == 0 and p["check_op"] == plans.OP_COMBINE_IN_PLACE and p["zero_count"] == 0
    assert buf._engine.nvl.local_ptr + p["x_off"] == recv_x.ctypes.data == buf._engine.nvl.local_ptr + lay.x_off
    assert buf._engine.nvl.local_ptr + p["topk_weights_off"] == recv_w.ctypes.data


def test_a_combine_of_a_copy_still_sends_its_rows(in_place):
    buf, launches, _ = in_place
    recv_x, _, _, _, handle, _ = dispatch(buf, workload(), recv_x_in_buffer=True)
    buf.combine(copy_of(recv_x), handle, config=CONFIG)
    assert launches.names()[-1] == "combine_kernel<bf16_t, 2>"
    assert launches.last("combine_kernel<bf16_t, 2>")["check_op"] == plans.OP_COMBINE


def test_with_x_in_place_topk_weights_from_elsewhere_are_refused(in_place):
    buf, launches, _ = in_place
    recv_x, _, recv_w, _, handle, _ = dispatch(buf, workload(), recv_x_in_buffer=True)
    with refused_before_any_launch(launches, "^topk_weights: with x in place"):
        buf.combine(recv_x, handle, topk_weights=copy_of(recv_w), config=CONFIG)


def test_recv_x_in_place_is_refused_with_the_handle_of_a_dispatch_that_copied_its_rows(in_place):
    buf, launches, _ = in_place
    w = workload()
    recv_x = dispatch(buf, w, recv_x_in_buffer=True)[0]
    copying_handle = dispatch(buf, w)[4]
    with refused_before_any_launch(launches, "^x: lies in this Buffer's NVLink buffer"):
        buf.combine(recv_x, copying_handle, config=CONFIG)


def test_a_cached_dispatch_in_place_leaves_rows_a_combine_reads_in_place(in_place):
    buf, launches, _ = in_place
    w = workload()
    handle = dispatch(buf, w)[4]  # its rows were copied out, not left in place
    recv_x = buf.dispatch(w["x"], handle=handle, config=CONFIG, recv_x_in_buffer=True)[0]
    buf.combine(recv_x, handle, config=CONFIG)
    assert launches.names()[-1] == "combine_kernel<bf16_t, 2, true>"


@pytest.mark.parametrize("later", ["dispatch", "combine that sends"])
def test_rows_in_place_overwritten_by_a_later_call_are_refused(in_place, later):
    buf, launches, _ = in_place
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w, recv_x_in_buffer=True)
    if later == "dispatch":
        dispatch(buf, w)
    else:
        buf.combine(copy_of(recv_x), handle, config=CONFIG)
    with refused_before_any_launch(launches, "^x: lies where this handle's dispatch put recv_x, but a later"):
        buf.combine(recv_x, handle, config=CONFIG)


def test_rows_in_place_wider_than_the_area_that_holds_them_are_refused(in_place):
    buf, launches, _ = in_place
    fp8 = (on_device(np.zeros((N, H), np.uint8)), on_device(np.ones((N, H // 128), np.float32)))
    lay = dispatch(buf, {**workload(), "x": fp8}, recv_x_in_buffer=True)[4].rows_in_buffer
    rows = (lay.src_idx_off - lay.x_off) // (2 * H) + 1  # BF16 rows over the FP8 rows' area
    handle = dispatch(buf, {**workload(), "x": fp8}, recv_x_in_buffer=True, num_worst_tokens=rows)[4]
    x = buf._engine.nvl.memory[lay.x_off:lay.x_off + rows * 2 * H].view(np.uint16).reshape(rows, H)
    with refused_before_any_launch(launches, f"^x: {rows} rows of {2 * H} bytes in place overrun"):
        buf.combine(x, handle, config=CONFIG)


def test_recv_x_in_buffer_must_be_a_bool(in_place):
    buf, _, _ = in_place
    with pytest.raises(TypeError, match="recv_x_in_buffer: expected a bool"):
        dispatch(buf, workload(), recv_x_in_buffer="yes")


def test_num_worst_tokens_beyond_the_rows_the_buffer_holds_is_refused_with_recv_x_in_buffer(in_place):
    buf, launches, _ = in_place
    rows = plans.check_fresh_dispatch(buf._engine.ctx.checks, *[workload()[k] for k in (
        "x", "num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert", "topk_idx", "topk_weights")],
        1, CONFIG, True).layout.rows
    with pytest.raises(ValueError, match=f"asks for {rows + 1} received rows, more than the {rows}"):
        dispatch(buf, workload(), recv_x_in_buffer=True, num_worst_tokens=rows + 1)
    assert launches.log == []
    recv_x = dispatch(buf, workload(), recv_x_in_buffer=True, num_worst_tokens=rows)[0]
    assert recv_x.shape == (rows, H) and inside(buf, recv_x)


def test_an_in_place_dispatch_allocated_ahead_allocates_only_its_handle_and_views_the_exact_rows(in_place):
    buf, launches, lib = in_place
    w = workload()
    dispatch(buf, w, recv_x_in_buffer=True)  # the first waits for its counts
    before = len(lib.allocations)
    recv_x, recv_topk, recv_w, _, handle, _ = dispatch(buf, w, recv_x_in_buffer=True)
    assert buf.last_dispatch_allocation == "ahead"
    assert [dtype for _, dtype in lib.allocations[before:]] == ["int64"] * 2  # the handle's block, and the next's
    p = launches.last("dispatch_kernel<2, false, true>")
    assert p["recv_x"] == p["recv_topk_idx"] == p["recv_topk_weights"] == 0  # the kernel takes none in place
    assert recv_x.shape == (100, H) and recv_topk.shape == recv_w.shape == (100, K)
    assert all(inside(buf, a) for a in (recv_x, recv_topk, recv_w)) and handle.num_recv_tokens == 100
