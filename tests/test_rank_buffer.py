"""The worker loops' Buffer of one rank (tests/workers/local_gpu_worker.py ``RankBuffer``): replaced
after a case that failed anywhere, destroyed at the end, and on an exception the other ranks
released before the destroy (whose barrier they would otherwise wait in)."""

import importlib

import pytest
from _harness import WORKERS


class _FakeBuffer:
    def __init__(self, number, log):
        self.number, self.log = number, log

    def destroy(self):
        self.log.append(("destroy", self.number))


class _FakeGroup:
    def __init__(self, log):
        self.log = log

    def abort(self, message):
        self.log.append(("abort", message))


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.syspath_prepend(str(WORKERS))
    return importlib.import_module("local_gpu_worker")


def _made(log):
    made = []

    def make():
        made.append(_FakeBuffer(len(made), log))
        return made[-1]

    return made, make


def test_a_case_failed_on_any_rank_replaces_the_buffer_and_a_passed_one_keeps_it(worker):
    log = []
    made, make = _made(log)
    with worker.RankBuffer(_FakeGroup(log), make) as rank_buf:
        assert rank_buf.renew_unless(True) is False
        assert rank_buf.buf is made[0] and log == []
        assert rank_buf.renew_unless(False) is True
        assert rank_buf.buf is made[1] and log == [("destroy", 0)]
    assert log == [("destroy", 0), ("destroy", 1)]


def test_a_run_that_raises_releases_the_other_ranks_before_destroying_the_buffer(worker):
    log = []
    _, make = _made(log)
    with pytest.raises(KeyError):
        with worker.RankBuffer(_FakeGroup(log), make):
            raise KeyError("lost")
    assert log == [("abort", "failed: KeyError: 'lost'"), ("destroy", 0)]


def test_a_group_without_abort_still_gets_its_buffer_destroyed(worker):
    log = []
    _, make = _made(log)
    with pytest.raises(RuntimeError):
        with worker.RankBuffer(object(), make):
            raise RuntimeError("stop")
    assert log == [("destroy", 0)]
