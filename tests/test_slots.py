"""The host-mapped slot protocol: error records become exceptions, and the wait for the counts
(CPU only: the slots are a NumPy array).

Kernels write ``[code, kernel id, rank, channel, peer, detail]`` into the error record
(kernels/common.cuh); the Buffer reads it at its next call, or right after a call where ranks
share a GPU.
"""

import numpy as np
import pytest
from host_fakes import FakeMapped

import deepep_cupy as ep
from deepep_cupy.constants import (
    ERROR_BUFFER_TOO_SMALL,
    ERROR_DISPATCH_REFUSED,
    ERROR_MISMATCH,
    ERROR_PEER_ABORTED,
    ERROR_TIMEOUT,
    KERNEL_STAGES,
    VERDICT_BUFFER_TOO_SMALL,
    VERDICT_OVER_CAPACITY,
)
from deepep_cupy.gpu import slots
from deepep_cupy.gpu.slots import HostSlots

STAGE_IDS = {stage: kernel_id for kernel_id, stage in KERNEL_STAGES.items()}


def slots_with_record(*record, in_process=False):
    host_slots = HostSlots(0, 5.0, in_process, mapped=FakeMapped())
    host_slots.values[:len(record)] = record
    return host_slots


def test_an_empty_record_raises_nothing():
    slots_with_record().raise_if_failed()


def test_a_settings_disagreement_raises_rank_mismatch_naming_the_rank_that_differs():
    record = slots_with_record(2, STAGE_IDS["combine check"], 0, -1, 1, 2)
    with pytest.raises(ep.RankMismatchError, match="last combine .* between rank 0 and rank 1"):
        record.raise_if_failed()


def test_a_settings_disagreement_leaves_the_buffer_usable():
    record = slots_with_record(2, STAGE_IDS["cached dispatch check"], 1, -1, 1, 2)
    with pytest.raises(ep.RankMismatchError, match="cached dispatch"):
        record.raise_if_failed()
    record.raise_if_failed()  # reported once; nothing was moved, so the next call may go ahead


def test_a_timeout_names_rank_kernel_channel_and_peer():
    record = slots_with_record(1, STAGE_IDS["dispatch receiver"], 0, 3, 1, 17)
    with pytest.raises(ep.DeepEPTimeoutError, match="rank 0: dispatch receiver timed out after 5 s waiting "
                                                    "for rank 1 \\(channel 3") as info:
        record.raise_if_failed()
    assert (info.value.rank, info.value.kernel, info.value.channel, info.value.peer) == (0, "dispatch receiver", 3, 1)


def test_after_a_timeout_the_buffer_stays_unusable():
    record = slots_with_record(1, STAGE_IDS["notify_dispatch"], 0, -1, 1, 1)
    with pytest.raises(ep.DeepEPTimeoutError, match="whole rank"):
        record.raise_if_failed()
    with pytest.raises(ep.DeepEPError, match="unusable"):
        record.raise_if_failed()


def test_a_rank_stopped_by_a_peer_that_gave_up_raises_peer_aborted_naming_that_peer():
    record = slots_with_record(3, STAGE_IDS["notify_dispatch"], 1, -1, 0, 5)
    with pytest.raises(ep.PeerAbortedError, match="rank 1: notify_dispatch stopped \\(whole rank\\) because rank 0 "
                                                  "had given up on this Buffer earlier") as info:
        record.raise_if_failed()
    assert isinstance(info.value, ep.DeepEPTimeoutError)
    assert (info.value.rank, info.value.kernel, info.value.channel, info.value.peer) == (1, "notify_dispatch", None, 0)
    assert "destroy it on every rank (buffer.destroy()) and create a new one on the same communicator" in \
        str(info.value)


def test_after_a_peer_gave_up_the_buffer_stays_unusable():
    record = slots_with_record(3, STAGE_IDS["dispatch receiver"], 1, 2, 0, -1)
    with pytest.raises(ep.PeerAbortedError, match="channel 2"):
        record.raise_if_failed()
    with pytest.raises(ep.DeepEPError, match="unusable: .*rank 0 had given up"):
        record.raise_if_failed()


def test_each_error_code_has_its_own_exception():
    errors = {code: slots.kernel_error(np.array([code, 2, 0, -1, 1, 0, 0, 0]), 5.0)
              for code in (ERROR_TIMEOUT, ERROR_MISMATCH, ERROR_PEER_ABORTED)}
    assert [type(e) for e in errors.values()] == [ep.DeepEPTimeoutError, ep.RankMismatchError, ep.PeerAbortedError]
    assert "timed out after 5 s" in str(errors[ERROR_TIMEOUT])
    assert "timed out after" not in str(errors[ERROR_PEER_ABORTED])  # it did not wait out a timeout itself


@pytest.mark.parametrize("stage, operation", [("cached dispatch check", "cached dispatch"),
                                              ("combine check", "combine")])
def test_a_handle_too_large_for_the_buffer_is_reported_once_naming_num_nvl_bytes(stage, operation):
    host_slots = slots_with_record(ERROR_BUFFER_TOO_SMALL, STAGE_IDS[stage], 0, -1, -1, 300)
    with pytest.raises(ValueError, match=f"num_nvl_bytes: the last {operation} was refused on every rank: its "
                                         "handle has a rank send 300 tokens to another"):
        host_slots.raise_if_failed()
    host_slots.raise_if_failed()  # the Buffer stays usable


def test_a_fresh_dispatch_too_large_for_the_buffer_raises_naming_num_nvl_bytes():
    error = slots.verdict_error(VERDICT_BUFFER_TOO_SMALL, 0, 16, ())
    assert isinstance(error, ValueError) and "get_nvl_buffer_size_hint" in str(error)


def test_a_dispatch_whose_host_waits_clears_the_count_and_the_verdict():
    host_slots = slots_with_record()
    host_slots.values[slots.RECV_COUNT], host_slots.values[slots.VERDICT] = 12, 3
    host_slots.start_dispatch()
    assert host_slots.values[slots.RECV_COUNT] == -1 and host_slots.values[slots.VERDICT] == 0


@pytest.mark.parametrize("verdict, error, message", [
    (VERDICT_OVER_CAPACITY, ValueError, "a rank received more tokens than num_worst_tokens"),
    (-2, ValueError, r"rank 1 passed expert ids outside \[-1, num_experts\)"),
    (2, ep.RankMismatchError, "the settings differ between rank 0 and rank 1"),
    (VERDICT_BUFFER_TOO_SMALL, ValueError, "num_nvl_bytes: .*more tokens than a transfer region"),
])
def test_a_refused_dispatch_is_reported_once_by_its_verdict(verdict, error, message):
    host_slots = slots_with_record()
    host_slots.values[:8] = [ERROR_DISPATCH_REFUSED, 2, 0, -1, -1, verdict, 0, 0]
    with pytest.raises(error, match=message):
        host_slots.raise_if_failed()
    host_slots.raise_if_failed()  # the Buffer stays usable


class _KernelDone:
    def __init__(self, host_slots, value):
        self.slots, self.value, self.waited = host_slots, value, False

    def synchronize(self):  # the kernel ends and has published the count
        self.waited = True
        self.slots.values[slots.RECV_COUNT] = self.value


def test_in_process_ranks_wait_for_the_counts_on_the_kernel_event_not_by_polling():
    host_slots = slots_with_record(in_process=True)
    host_slots.values[slots.RECV_COUNT] = -1
    done = _KernelDone(host_slots, 1234)
    assert host_slots.wait_for_count(done) == 1234 and done.waited


def test_ranks_in_separate_processes_poll_the_counts():
    host_slots = slots_with_record()
    host_slots.values[slots.RECV_COUNT] = 77
    done = _KernelDone(host_slots, 1234)
    assert host_slots.wait_for_count(done) == 77 and not done.waited


def test_a_kernel_error_during_the_counts_wait_raises_it():
    host_slots = slots_with_record(1, STAGE_IDS["notify_dispatch"], 0, -1, 1, 1, in_process=True)
    host_slots.values[slots.RECV_COUNT] = -1
    with pytest.raises(ep.DeepEPTimeoutError, match="notify_dispatch timed out"):
        host_slots.wait_for_count(_KernelDone(host_slots, -1))


@pytest.mark.parametrize("in_process", [False, True])
def test_a_count_published_before_the_exchange_failed_raises_the_failure(in_process):
    # notify_dispatch publishes the count between its two barriers; the second one then failed.
    host_slots = slots_with_record(1, STAGE_IDS["notify_dispatch"], 0, -1, 1, 2, in_process=in_process)
    host_slots.values[slots.RECV_COUNT] = 40
    with pytest.raises(ep.DeepEPTimeoutError, match="notify_dispatch timed out"):
        host_slots.wait_for_count(_KernelDone(host_slots, 40))
    with pytest.raises(ep.DeepEPError, match="unusable"):
        host_slots.raise_if_failed()


def test_a_wait_that_outlasts_the_timeout_raises_and_marks_the_buffer_failed():
    host_slots = HostSlots(0, 0.01, False, mapped=FakeMapped())
    host_slots.values[slots.RECV_COUNT] = -1
    with pytest.raises(ep.DeepEPTimeoutError, match="waited 0.01 s on the host"):
        host_slots.wait_for_count()
    with pytest.raises(ep.DeepEPError, match="unusable"):
        host_slots.raise_if_failed()


def test_verdicts_become_errors_that_name_the_rank():
    assert slots.verdict_error(0, 0, 16, ()) is None
    assert slots.verdict_error(VERDICT_OVER_CAPACITY, 0, 16, ()) is None
    error = slots.verdict_error(-2, 0, 16, (), None)
    assert isinstance(error, ValueError) and "rank 1 passed expert ids outside [-1, 16)" in str(error)
    error = slots.verdict_error(2, 0, 16, np.arange(7))
    assert isinstance(error, ep.RankMismatchError) and "rank 0 and rank 1" in str(error)


# ---------------------------------------------------------------------------------------------
# A node's group under a Buffer across nodes names its ranks by their Buffer ranks

NODE_1_OF_2x2 = (2, 3)


def test_a_node_groups_timeout_names_the_buffer_ranks_of_rank_and_peer():
    host_slots = HostSlots(1, 5.0, False, mapped=FakeMapped(), names=NODE_1_OF_2x2)
    host_slots.values[:6] = (1, STAGE_IDS["low-latency dispatch receive"], 1, -1, 0, 4)
    with pytest.raises(ep.DeepEPTimeoutError, match="rank 3: low-latency dispatch receive timed out after 5 s "
                                                    "waiting for rank 2 ") as info:
        host_slots.raise_if_failed()
    assert (info.value.rank, info.value.peer) == (3, 2)
    with pytest.raises(ep.DeepEPError, match="^rank 3: Buffer unusable"):
        host_slots.raise_if_failed()


def test_a_rail_exchange_record_names_its_peer_on_another_node_as_recorded():
    host_slots = HostSlots(0, 5.0, False, mapped=FakeMapped(), names=NODE_1_OF_2x2)
    host_slots.values[:6] = (1, STAGE_IDS["rail block exchange"], 0, -1, 0, 1)
    with pytest.raises(ep.DeepEPTimeoutError, match="rank 2: rail block exchange timed out .* waiting for rank 0 "):
        host_slots.raise_if_failed()


def test_a_node_groups_settings_disagreement_names_the_buffer_ranks():
    host_slots = HostSlots(1, 5.0, False, mapped=FakeMapped(), names=NODE_1_OF_2x2)
    host_slots.values[:6] = (2, STAGE_IDS["combine check"], 1, -1, 1, 2)
    with pytest.raises(ep.RankMismatchError, match="rank 3: the last combine .* between rank 2 and rank 3"):
        host_slots.raise_if_failed()


def test_a_node_groups_verdicts_name_the_buffer_ranks():
    error = slots.verdict_error(-2, 0, 16, (), None, names=NODE_1_OF_2x2)
    assert "topk_idx: rank 3 passed expert ids" in str(error)
    error = slots.verdict_error(2, 0, 16, np.arange(7), names=NODE_1_OF_2x2)
    assert str(error).startswith("rank 2: dispatch settings differ between rank 2 and rank 3")
    error = slots.refused_dispatch_error(2, 3, names=NODE_1_OF_2x2)
    assert "between rank 2 and rank 3" in str(error)
