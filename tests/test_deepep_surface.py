"""DeepEP's intranode surface on the CPU: the names, arguments and input layouts a DeepEP script
uses, run through the real host path with fake device arrays (tests/host_fakes.py). The GPU tests
run a DeepEP-style script end to end (tests/test_gpu_torch_dist.py)."""

import numpy as np
import pytest
from host_fakes import fake_buffer, on_device
from test_host_path import CONFIG, STAGE_IDS, E, H, K, N, dispatch, workload

import deepep_cupy as ep
from deepep_cupy import config
from deepep_cupy.constants import ERROR_DISPATCH_REFUSED, VERDICT_OVER_CAPACITY
from deepep_cupy.reference import intranode as ref


@pytest.fixture
def fake(monkeypatch):
    return fake_buffer(monkeypatch, received=(100,), expert_counts=list(range(E // 2)))


@pytest.fixture
def default_num_sms():
    """Leave Buffer.num_sms as the test found it."""
    saved = list(config.CHOSEN_NUM_SMS)
    yield
    config.CHOSEN_NUM_SMS[:] = saved


# --- constructor -------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, message", [
    (dict(num_rdma_bytes=-1), r"num_rdma_bytes: expected an int >= 0, got -1 \(0: one node"),
    (dict(low_latency_mode=True), "num_rdma_bytes: expected a positive int with low_latency_mode=True"),
    (dict(allow_mnnvl=True), "allow_mnnvl=True: multi-node NVLink"),
    (dict(use_fabric=True), "use_fabric=True: fabric memory handles"),
    (dict(enable_shrink=True), "enable_shrink=True: shrinking the group"),
])
def test_internode_settings_are_refused_before_any_collective(setting, message):
    never_called = object()  # not a group: using it would raise something else
    with pytest.raises(ValueError, match=message):
        ep.Buffer(never_called, 1 << 20, **setting)


def test_deepeps_other_constructor_arguments_are_accepted():
    with pytest.raises(TypeError, match="group: expected a torch.distributed ProcessGroup, an mpi4py communicator"):
        ep.Buffer(object(), 1 << 20, 0, low_latency_mode=False, num_qps_per_rank=12,
                  allow_nvlink_for_low_latency_mode=False, explicitly_destroy=True)


def test_a_buffer_needs_a_group_given_once():
    with pytest.raises(TypeError, match="expected a group"):
        ep.Buffer(num_nvl_bytes=1 << 20)
    with pytest.raises(ValueError, match="got both group and comm"):
        ep.Buffer(object(), 1 << 20, comm=object())


def test_a_buffer_without_nvlink_bytes_says_how_to_size_them():
    with pytest.raises(ValueError, match=r"num_nvl_bytes: expected a positive int, got 0 \(size it with"):
        ep.Buffer(ep.ThreadGroup.create(2)[0])


def test_the_buffer_keeps_the_group_it_was_given(fake):
    buf, _, _ = fake
    assert buf.group is buf._group and buf.group_size == buf.num_ranks == 2
    assert buf.num_rdma_bytes == 0 and buf.low_latency_mode is False


# --- static names ------------------------------------------------------------------------------

def test_default_configs_are_the_recommended_ones_until_set_num_sms(default_num_sms):
    assert ep.Buffer.get_dispatch_config(2) == ep.get_dispatch_config(2)
    assert ep.Buffer.get_combine_config(8) == ep.get_combine_config(8)
    ep.Buffer.set_num_sms(16)
    assert ep.Buffer.num_sms == 16
    got = ep.Buffer.get_dispatch_config(2)
    want = ep.get_dispatch_config(2)
    assert got.num_sms == 16 and got.num_max_nvl_chunked_recv_tokens == want.num_max_nvl_chunked_recv_tokens


@pytest.mark.parametrize("bad", [0, 7, -2, 2.0, True])
def test_set_num_sms_wants_a_positive_even_int(bad, default_num_sms):
    with pytest.raises(ValueError, match="num_sms: expected a positive even int"):
        ep.Buffer.set_num_sms(bad)


def test_calls_without_config_follow_set_num_sms(fake, default_num_sms):
    buf, launches, _ = fake
    w = workload()
    ep.Buffer.set_num_sms(8)
    buf.dispatch(**w)
    assert launches.last("dispatch_kernel<2>")["num_channels"] == ep.Config(8).num_channels


def test_the_small_names_deepep_scripts_touch_exist():
    assert ep.Buffer.is_sm90_compiled() is True
    assert np.dtype(ep.topk_idx_t) == np.int64 if not hasattr(ep.topk_idx_t, "is_floating_point") \
        else str(ep.topk_idx_t) == "torch.int64"
    assert ep.Config(24, 8, 256, 16, 128).get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    assert ep.Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, 2) > 0


def test_get_comm_stream_names_the_communication_stream_without_pytorch(fake, monkeypatch):
    # With PyTorch it is a torch.cuda stream naming the same one (checked by the GPU workers).
    buf, _, _ = fake

    def no_torch(name):
        raise ImportError(f"no {name}")

    monkeypatch.setattr(ep.tensors, "library", no_torch)
    assert buf.get_comm_stream() is buf.comm_stream


# --- dispatch and combine arguments ------------------------------------------------------------

def test_rdma_counts_must_be_absent(fake):
    buf, _, _ = fake
    w = workload()
    with pytest.raises(ValueError, match="num_tokens_per_rdma_rank: expected None"):
        dispatch(buf, w, num_tokens_per_rdma_rank=w["num_tokens_per_rank"])


def test_positional_arguments_follow_deepeps_order(fake):
    buf, launches, _ = fake
    w = workload()
    out = buf.dispatch(w["x"], None, w["num_tokens_per_rank"], None, w["is_token_in_rank"],
                       w["num_tokens_per_expert"], w["topk_idx"], w["topk_weights"], 1, 0, CONFIG)
    assert out[0].shape == (100, H) and launches.names()[-1] == "dispatch_kernel<2>"


def test_column_major_fp8_scales_are_read_with_their_strides(fake):
    buf, launches, _ = fake
    w = workload()
    scales = on_device(np.ones((H // 128, N), np.float32)).T  # DeepEP's x_scales.T.contiguous().T
    assert not scales.flags.c_contiguous
    recv_x = dispatch(buf, w, x=(on_device(np.zeros((N, H), np.uint8)), scales))[0]
    p = launches.last("dispatch_kernel<2, true>")
    assert (p["scale_token_stride"], p["scale_hidden_stride"]) == (1, N) and p["x_scales"] == scales.ctypes.data
    assert recv_x[1].shape == (100, H // 128) and recv_x[1].flags.c_contiguous
    handle = dispatch(buf, w)[4]
    buf.dispatch((on_device(np.zeros((N, H), np.uint8)), scales), handle=handle, config=CONFIG)
    assert launches.last("dispatch_kernel<2, true>")["scale_hidden_stride"] == N


def test_row_major_fp8_scales_keep_their_strides(fake):
    buf, launches, _ = fake
    dispatch(buf, workload(), x=(on_device(np.zeros((N, H), np.uint8)), on_device(np.ones((N, 2), np.float32))))
    p = launches.last("dispatch_kernel<2>")
    assert (p["scale_token_stride"], p["scale_hidden_stride"]) == (2, 1)


def test_worst_case_dispatch_returns_fixed_rows_with_ids_minus_one_past_the_received(fake):
    buf, launches, _ = fake
    w = workload()
    recv_x, recv_topk, recv_w, per_expert, handle, _ = dispatch(buf, w, num_worst_tokens=N * 2)
    assert recv_x.shape == (N * 2, H) and recv_topk.shape == recv_w.shape == (N * 2, K)
    assert per_expert == [] and handle.num_worst_tokens == handle.rows == N * 2
    assert launches.names()[-2:] == ["fill", "dispatch_kernel<2>"]  # the transfer exchanges the counts itself
    fill = launches.last("fill")
    assert (fill["ptr"], fill["byte"], fill["num_bytes"]) == (recv_topk.ctypes.data, 0xFF, N * 2 * K * 8)
    transfer = launches.last("dispatch_kernel<2>")
    assert transfer["exchange"] == 1 and transfer["recv_capacity"] == N * 2
    assert buf.last_dispatch_allocation == "fixed"


def test_worst_case_dispatch_never_waits_for_the_host(monkeypatch):
    buf, launches, _ = fake_buffer(monkeypatch, received=(-1,))  # a host wait for the count would time out
    handle = dispatch(buf, workload(), num_worst_tokens=N * 2)[4]
    assert handle.num_recv_tokens is None


def test_worst_case_dispatch_publishes_its_counts_and_verdict_in_the_handle(fake):
    buf, launches, _ = fake
    handle = dispatch(buf, workload(), num_worst_tokens=N * 2)[4]
    assert handle.recv_count.shape == (1,) and handle.recv_expert_counts.shape == (E // 2,)
    assert handle.recv_count_ptr == handle.recv_count.ctypes.data == handle.verdict_ptr + 4
    assert handle.recv_expert_counts_ptr == handle.recv_expert_counts.ctypes.data
    p = launches.last("dispatch_kernel<2>")
    assert (p["recv_counter"], p["mismatch_flag"], p["recv_expert_counter"], p["report_refusal"]) \
        == (handle.recv_count_ptr, handle.verdict_ptr, handle.recv_expert_counts_ptr, 1)


def test_calls_with_a_worst_case_handle_move_nothing_when_its_dispatch_was_refused(fake):
    buf, launches, _ = fake
    recv_x, _, _, _, handle, _ = dispatch(buf, workload(), num_worst_tokens=N * 2)
    buf.dispatch(workload()["x"], handle=handle, config=CONFIG)
    assert launches.last("dispatch_kernel<2>")["dispatch_verdict"] == handle.verdict_ptr != 0
    buf.combine(recv_x, handle, config=CONFIG)
    assert launches.last("combine_kernel<bf16_t, 2>")["dispatch_verdict"] == handle.verdict_ptr


def test_a_refused_worst_case_dispatch_raises_at_the_next_call_and_leaves_the_buffer_usable(monkeypatch):
    refused = [ERROR_DISPATCH_REFUSED, STAGE_IDS["notify_dispatch"], 0, -1, -1, VERDICT_OVER_CAPACITY]
    buf, _, _ = fake_buffer(monkeypatch, received=(500,), error=refused)
    recv_x, _, _, _, handle, _ = dispatch(buf, workload(), num_worst_tokens=128)
    with pytest.raises(ValueError, match="num_worst_tokens: in an earlier dispatch that the host did not wait for, "
                                         "a rank received more tokens than num_worst_tokens"):
        buf.combine(recv_x, handle, config=CONFIG)
    buf.combine(recv_x, handle, config=CONFIG)


def test_combine_takes_a_worst_case_handles_fixed_rows(fake):
    buf, launches, _ = fake
    recv_x, _, _, _, handle, _ = dispatch(buf, workload(), num_worst_tokens=N * 2)
    buf.combine(recv_x, handle, config=CONFIG)
    with pytest.raises(ValueError, match=r"x: expected 128 rows \(its num_worst_tokens\), got 100"):
        buf.combine(recv_x[:100], handle, config=CONFIG)


def test_a_capture_refuses_a_dispatch_that_waits_for_the_counts(fake):
    buf, launches, _ = fake
    buf._engine.order.capturing = True
    with pytest.raises(ValueError, match="a fresh dispatch without num_worst_tokens makes the host wait"):
        dispatch(buf, workload())
    assert launches.names() == []
    dispatch(buf, workload(), num_worst_tokens=N * 2)


def test_combine_adds_the_biases_it_is_given(fake):
    buf, launches, _ = fake
    recv_x, _, _, _, handle, _ = dispatch(buf, workload())
    b0, b1 = (on_device(np.zeros((N, H), np.uint16)) for _ in range(2))
    buf.combine(recv_x, handle, bias=(b0, b1), config=CONFIG)
    p = launches.last("combine_kernel<bf16_t, 2>")
    assert (p["bias_0"], p["bias_1"]) == (b0.ctypes.data, b1.ctypes.data)
    buf.combine(recv_x, handle, bias=b0, config=CONFIG)
    p = launches.last("combine_kernel<bf16_t, 2>")
    assert (p["bias_0"], p["bias_1"]) == (b0.ctypes.data, 0)
    buf.combine(recv_x, handle, config=CONFIG)
    assert launches.last("combine_kernel<bf16_t, 2>")["bias_0"] == 0


@pytest.mark.parametrize("bias, error, message", [
    (lambda: on_device(np.zeros((N, H), np.float32)), TypeError, r"bias\[0\]: expected dtype bfloat16, got float32"),
    (lambda: on_device(np.zeros((N, H // 2), np.uint16)), ValueError, r"bias\[0\]: expected shape \('\*', 256\)"),
    (lambda: on_device(np.zeros((N - 1, H), np.uint16)), ValueError, r"bias\[0\]: expected 64 rows"),
    (lambda: (None, on_device(np.zeros((N + 1, H), np.uint16))), ValueError, r"bias\[1\]: expected 64 rows"),
    (lambda: (on_device(np.zeros((N, H), np.uint16)),) * 3, ValueError, "bias: expected an array or a pair"),
])
def test_combine_refuses_biases_that_do_not_match_its_output(fake, bias, error, message):
    buf, launches, _ = fake
    recv_x, _, _, _, handle, _ = dispatch(buf, workload())
    launched = len(launches.log)
    with pytest.raises(error, match=message):
        buf.combine(recv_x, handle, bias=bias(), config=CONFIG)
    assert len(launches.log) == launched


# --- the reference's bias ------------------------------------------------------------------------

def test_the_reference_adds_biases_first_then_the_ranks_copies():
    rng = np.random.default_rng(3)
    idxs = [ref.random_routing(rng, 12, 8, 2) for _ in range(2)]
    xs = [rng.standard_normal((12, 16), dtype=np.float32) for _ in range(2)]
    results = ref.dispatch(xs, idxs, 8, 2)
    received = [r["recv_x"] for r in results]
    biases = [tuple(rng.standard_normal((12, 16), dtype=np.float32) for _ in range(2)) for _ in range(2)]
    plain = ref.combine(received, results)
    biased = ref.combine(received, results, bias=biases)
    for m in range(2):
        want = np.zeros((12, 16), np.float32) + biases[m][0] + biases[m][1]
        for r in range(2):
            positions = ref._recv_positions(results, m, r)
            sent = positions >= 0
            want[sent] = want[sent] + received[r][positions[sent]]
        assert np.array_equal(biased[m][0], want)
        assert not np.array_equal(biased[m][0], plain[m][0])
