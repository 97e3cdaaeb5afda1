"""The in-process vs mpiexec comparison's recorder (tests/workers/local_gpu_worker.py): each call's
outputs are hashed as the call returns, one hash per call, so that a later call overwriting
outputs that are views of the NVLink buffer cannot change what an earlier call is recorded as."""

import importlib

import numpy as np
import pytest
from _harness import WORKERS


class _Event:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("waited")


class _FakeBuffer:
    """Every call returns the same array (a view of 'the NVLink buffer'), filled with the call's number."""

    def __init__(self):
        self.area = np.zeros(4, np.int32)
        self.calls = 0
        self.log = []

    def dispatch(self, x, handle=None, **kwargs):
        self.calls += 1
        self.area[:] = self.calls
        return self.area, None, None, [], "handle", _Event(self.log)

    def combine(self, x, handle, **kwargs):
        self.calls += 1
        self.area[:] = self.calls
        return self.area, None, _Event(self.log)


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.syspath_prepend(str(WORKERS))
    module = importlib.import_module("local_gpu_worker")
    monkeypatch.setattr(module.gpu_worker, "to_numpy", lambda a: a)  # host arrays: no device to wait for
    return module


def test_each_call_is_hashed_as_it_returns_one_hash_per_call(worker):
    fake = _FakeBuffer()
    recorder = worker.RecordingBuffer(fake)
    recorder.dispatch("x")
    recorder.dispatch("x", handle="handle")
    recorder.combine("x", "handle")
    recorder.dispatch("x", handle="handle")
    calls = recorder.call_hashes()
    assert [(c["call"], c["kind"]) for c in calls] == [(0, "dispatch"), (1, "cached_dispatch"), (2, "combine"),
                                                         (3, "cached_dispatch")]
    expected = [worker.digest([np.full(4, i, np.int32), None, None]) for i in (1, 2)]
    assert [c["hash"] for c in calls[:2]] == expected  # not the last call's values, which overwrote them
    assert len({c["hash"] for c in calls}) == 4
    assert fake.log == ["waited"] * 4  # every call's event waited for before hashing
    assert recorder.call_hashes() == []


class _WorstCaseBuffer:
    """A ``num_worst_tokens`` dispatch: 2 received rows, then padding rows holding ``padding``."""

    def __init__(self, received, padding):
        self.received, self.padding = received, padding

    def dispatch(self, x, handle=None, **kwargs):
        rows = np.full((4, 3), self.padding, np.int32)
        rows[:2] = self.received
        topk = np.full((4, 2), -1, np.int64)
        topk[:2] = 0
        weights = np.full((4, 2), float(self.padding), np.float32)
        weights[:2] = 0.5

        class Handle:
            recv_count = np.array([2], np.int32)

        return (rows, rows[:, :1]), topk, weights, [], Handle(), _Event([])


def _worst_case_hash(worker, received, padding):
    recorder = worker.RecordingBuffer(_WorstCaseBuffer(received, padding))
    recorder.dispatch("x", num_worst_tokens=4)
    return recorder.call_hashes()[0]["hash"]


def test_a_worst_case_dispatch_is_hashed_on_its_defined_rows_only(worker):
    """The padding rows of recv_x, its scales and the weights are unset memory (different under
    mpiexec and in-process); only the received rows and every recv_topk_idx row are compared."""
    assert _worst_case_hash(worker, 7, padding=111) == _worst_case_hash(worker, 7, padding=-5)
    assert _worst_case_hash(worker, 7, padding=111) != _worst_case_hash(worker, 8, padding=111)
