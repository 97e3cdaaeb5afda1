"""How the host turns the kernels' error record into exceptions (CPU only: the record is faked).

The kernels write ``[code, kernel id, rank, channel, peer, detail]`` into host-mapped memory
(kernels/common.cuh); the Buffer reads it at its next call, or right after a call where ranks
share a GPU.
"""

import numpy as np
import pytest

import deepep_cupy as ep
from deepep_cupy.buffer import Buffer


class _FakeMapped:
    def __init__(self):
        self.values = np.zeros(64, dtype=np.int32)

    def free(self):
        pass


def _buffer_with_record(*record):
    buf = Buffer.__new__(Buffer)  # no GPU here: only the host-side bookkeeping is exercised
    buf._nvl = None
    buf._mapped = _FakeMapped()
    buf._failed = None
    buf.rank = 0
    buf.timeout_s = 5.0
    buf._mapped.values[:len(record)] = record
    return buf


def test_an_empty_record_raises_nothing():
    _buffer_with_record()._ensure_usable()


def test_a_settings_disagreement_raises_rank_mismatch_naming_the_rank_that_differs():
    buf = _buffer_with_record(2, 6, 0, -1, 1, 2)  # cached_notify_combine: rank 1 differs from rank 0
    with pytest.raises(ep.RankMismatchError, match="last combine .* between rank 0 and rank 1"):
        buf._ensure_usable()


def test_a_settings_disagreement_leaves_the_buffer_usable():
    buf = _buffer_with_record(2, 3, 1, -1, 1, 2)  # cached_notify_dispatch
    with pytest.raises(ep.RankMismatchError, match="cached dispatch"):
        buf._ensure_usable()
    buf._ensure_usable()  # reported once; nothing was moved, so the next call may go ahead


def test_a_timeout_names_rank_kernel_channel_and_peer():
    buf = _buffer_with_record(1, 5, 0, 3, 1, 17)  # dispatch receiver, channel 3, waiting for rank 1
    with pytest.raises(ep.DeepEPTimeoutError, match="rank 0: dispatch receiver timed out after 5 s waiting "
                                                    "for rank 1 \\(channel 3") as info:
        buf._ensure_usable()
    assert (info.value.rank, info.value.kernel, info.value.channel, info.value.peer) == (0, "dispatch receiver", 3, 1)


def test_after_a_timeout_the_buffer_stays_unusable():
    buf = _buffer_with_record(1, 2, 0, -1, 1, 1)  # notify_dispatch, whole rank
    with pytest.raises(ep.DeepEPTimeoutError, match="whole rank"):
        buf._ensure_usable()
    with pytest.raises(ep.DeepEPError, match="unusable"):
        buf._ensure_usable()


class _Group:
    def __init__(self, in_process):
        self.in_process = in_process


class _KernelDone:
    def __init__(self, mapped, value):
        self.mapped, self.value, self.waited = mapped, value, False

    def synchronize(self):  # the kernel ends and has published the count
        self.waited = True
        self.mapped.values[8] = self.value


def test_in_process_ranks_wait_for_the_counts_on_the_kernel_event_not_by_polling():
    buf = _buffer_with_record()
    buf.group = _Group(in_process=True)
    buf._mapped.values[8] = -1
    done = _KernelDone(buf._mapped, 1234)
    assert buf._wait_mapped(8, done) == 1234 and done.waited


def test_ranks_in_separate_processes_poll_the_counts():
    buf = _buffer_with_record()
    buf.group = _Group(in_process=False)
    buf._mapped.values[8] = 77
    done = _KernelDone(buf._mapped, 1234)
    assert buf._wait_mapped(8, done) == 77 and not done.waited


def test_a_kernel_error_during_the_counts_wait_raises_it():
    buf = _buffer_with_record(1, 2, 0, -1, 1, 1)  # notify_dispatch timed out waiting for rank 1
    buf.group = _Group(in_process=True)
    buf._mapped.values[8] = -1
    with pytest.raises(ep.DeepEPTimeoutError, match="notify_dispatch timed out"):
        buf._wait_mapped(8, _KernelDone(buf._mapped, -1))
