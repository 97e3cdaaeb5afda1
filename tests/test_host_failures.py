"""A host that fails during a call: every rank learns of it from the same call, or at once
(CPU, fake hardware: tests/host_fakes.py; the GPU runs are in tests/workers/host_failure_worker.py).

Before a call's first launch a host that cannot allocate its outputs (or is interrupted) still
takes part, only to refuse the call: every rank's verdict names it, nothing moves and the Buffer
stays usable. After its launch, a host that fails gives up on the Buffer: its abort mark, with
what failed, stops the peers' kernels at once.
"""

import sys

import pytest
from host_fakes import FakeMapped, fake_buffer
from test_host_path import CONFIG, H, dispatch, workload

import deepep_cupy as ep
from deepep_cupy.constants import (
    ERROR_HOST_FAILED,
    ERROR_PEER_ABORTED,
    HOST_FAILED_ALLOCATION,
    HOST_FAILED_INTERRUPT,
    HOST_FAILURE_FLAG,
    HOST_FAILURES,
    VERDICT_HOST_FAILED,
)
from deepep_cupy.gpu import slots


class OutOfMemory(MemoryError):
    """Stands for cupy.cuda.memory.OutOfMemoryError / torch.OutOfMemoryError."""


def failing_allocations(lib, failure=None, dtype="bfloat16"):
    """Make ``lib``'s allocations of ``dtype`` (the rows) raise ``failure`` (an out-of-memory error
    by default) until the returned switch is called."""
    failure = OutOfMemory("out of memory allocating 96.79 GiB") if failure is None else failure
    empty = lib.empty
    state = {"on": True}

    def maybe_failing(shape, dtype_name, device_id):
        if state["on"] and dtype_name == dtype:
            raise failure
        return empty(shape, dtype_name, device_id)

    lib.empty = maybe_failing
    return lambda: state.update(on=False)


def verdict_of(rank, code):
    return VERDICT_HOST_FAILED + rank * HOST_FAILURE_FLAG + code


# --- refused before any launch ---------------------------------------------------------------

def test_a_rank_that_cannot_allocate_its_outputs_takes_part_only_to_refuse_the_dispatch(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100,))
    heal = failing_allocations(lib)
    with pytest.raises(OutOfMemory) as info:
        dispatch(buf, workload())
    assert launches.names() == ["notify_dispatch_kernel"]  # the count exchange alone
    p = launches.last("notify_dispatch_kernel")
    assert p["recv_capacity"] == -HOST_FAILED_ALLOCATION and p["report_refusal"] == 0
    assert buf._engine.slots.verdict() == verdict_of(0, HOST_FAILED_ALLOCATION)
    if sys.version_info >= (3, 11):  # exceptions take notes from 3.11 on
        assert any("only to refuse it" in note for note in info.value.__notes__)
    heal()
    assert dispatch(buf, workload())[0].shape == (100, H)  # the Buffer goes on


def test_a_rank_interrupted_while_allocating_refuses_the_dispatch_as_interrupted(monkeypatch):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100,))
    failing_allocations(lib, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        dispatch(buf, workload())
    assert launches.last("notify_dispatch_kernel")["recv_capacity"] == -HOST_FAILED_INTERRUPT
    assert buf._engine.slots.failed is None


def test_a_dispatch_whose_peer_refused_it_raises_peer_failed_naming_the_peer_and_the_failure(monkeypatch):
    buf, launches, _ = fake_buffer(monkeypatch, received=(100,), verdict=verdict_of(1, HOST_FAILED_ALLOCATION))
    with pytest.raises(ep.PeerFailedError, match="host of rank 1 failed .*allocating the call's outputs") as info:
        dispatch(buf, workload())
    assert info.value.peer == 1 and info.value.failure == HOST_FAILURES[HOST_FAILED_ALLOCATION]
    assert len(launches.log) == 1  # refused in its first round: not redone
    launches.verdict = 0
    dispatch(buf, workload())  # nothing moved; the Buffer goes on


def test_a_dispatch_with_num_worst_tokens_that_cannot_allocate_refuses_and_raises_its_own_failure(monkeypatch):
    # Its peers learn of the refusal from their own error records, at their next call; this rank
    # raises what failed, and leaves nothing in its record that its count wait would raise instead.
    buf, launches, lib = fake_buffer(monkeypatch, received=(100,))
    heal = failing_allocations(lib)
    with pytest.raises(OutOfMemory) as info:
        dispatch(buf, workload(), num_worst_tokens=300)
    assert "every other rank raises PeerFailedError at its next call" in str(getattr(info.value, "__notes__", ""))
    p = launches.last("notify_dispatch_kernel")
    assert p["recv_capacity"] == -HOST_FAILED_ALLOCATION and p["report_refusal"] == 0
    assert not buf._engine.slots.values[slots.ERROR_RECORD]
    heal()
    dispatch(buf, workload(), num_worst_tokens=300)


@pytest.mark.parametrize("operation", ["cached dispatch", "combine"])
def test_a_cached_dispatch_or_combine_that_cannot_allocate_launches_its_refusal_with_no_outputs(monkeypatch,
                                                                                                operation):
    buf, launches, lib = fake_buffer(monkeypatch, received=(100,))
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w)
    call = {"cached dispatch": lambda: buf.dispatch(w["x"], handle=handle, config=CONFIG),
            "combine": lambda: buf.combine(recv_x, handle, config=CONFIG)}[operation]
    kernel = {"cached dispatch": "dispatch_kernel<2>", "combine": "combine_kernel<bf16_t, 2>"}[operation]
    heal = failing_allocations(lib)
    with pytest.raises(OutOfMemory):
        call()
    p = launches.last(kernel)
    assert p["check_op"] == -HOST_FAILED_ALLOCATION
    assert p.get("recv_x", p.get("combined_x")) == 0
    heal()
    call()


def test_a_refusal_recorded_by_the_settings_check_raises_peer_failed_and_leaves_the_buffer_usable():
    host = slots.HostSlots(0, 5.0, in_process=False, mapped=FakeMapped())
    host.values[:7] = (ERROR_HOST_FAILED, 6, 0, -1, 1, HOST_FAILED_ALLOCATION, 0)  # stage 6: combine check
    with pytest.raises(ep.PeerFailedError, match="rank 0: the last combine was refused .* rank 1 failed") as info:
        host.raise_if_failed()
    assert info.value.peer == 1 and host.failed is None
    host.raise_if_failed()  # reported once


# --- after the launch: the rank gives up on the Buffer ---------------------------------------

class _Nvl:
    def __init__(self):
        self.marks = []

    def mark_gave_up(self, reason):
        self.marks.append(reason)

    def close(self):
        pass


@pytest.mark.parametrize("failure, code", [(KeyboardInterrupt(), HOST_FAILED_INTERRUPT),
                                           (RuntimeError("a bug"), 2)])
def test_a_host_failing_after_its_dispatch_launched_gives_up_on_the_buffer(monkeypatch, failure, code):
    nvl = _Nvl()
    buf, _, _ = fake_buffer(monkeypatch, received=(100,), nvl=nvl)

    def failing_wait(kernel_done=None):
        raise failure

    monkeypatch.setattr(buf._engine.slots, "wait_for_count", failing_wait)
    with pytest.raises(type(failure)):
        dispatch(buf, workload())
    assert nvl.marks == [code]
    with pytest.raises(ep.DeepEPError, match="Buffer unusable: this rank gave up on it after .*"
                                             + HOST_FAILURES[code].split(" (")[0]):
        dispatch(buf, workload())


def test_an_error_every_rank_raises_does_not_give_up_on_the_buffer(monkeypatch):
    nvl = _Nvl()
    buf, _, _ = fake_buffer(monkeypatch, received=(100,), verdict=2, nvl=nvl)  # settings that differ
    with pytest.raises(ep.RankMismatchError):
        dispatch(buf, workload())
    assert nvl.marks == []


def test_an_interrupt_after_the_call_settled_still_gives_up_on_the_buffer(monkeypatch):
    # The call is done on every rank, but this rank may never come back: its peers must not wait.
    nvl = _Nvl()
    buf, _, _ = fake_buffer(monkeypatch, received=(100,), nvl=nvl)
    w = workload()
    recv_x, _, _, _, handle, _ = dispatch(buf, w)
    monkeypatch.setattr(buf._engine.order, "finish", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        buf.combine(recv_x, handle, config=CONFIG)
    assert nvl.marks == [HOST_FAILED_INTERRUPT]


def test_a_peer_that_gave_up_after_a_host_failure_is_named_with_the_failure():
    host = slots.HostSlots(1, 5.0, in_process=False, mapped=FakeMapped())
    host.values[:7] = (ERROR_PEER_ABORTED, 5, 1, 3, 0, 9, HOST_FAILED_INTERRUPT)  # stage 5: dispatch receiver
    with pytest.raises(ep.PeerAbortedError, match=r"rank 0 had given up on this Buffer earlier \(its host failed "
                                                  r"during a call \(the call was interrupted"):
        host.raise_if_failed()



def test_an_operation_context_is_freed_without_a_garbage_collection():
    # The call span gives up through the NVLink buffer and the slots it holds, not through the
    # Buffer or its context: a reference back would be a cycle keeping a destroyed Buffer's
    # streams and events alive until a garbage collection.
    import gc
    import weakref

    from host_fakes import FakeGroup, FakeOrder

    from deepep_cupy.intranode.context import OperationContext

    ctx = OperationContext(FakeGroup(0, 2), 0, 5.0, 1 << 20)
    ctx.attach(_Nvl(), slots.HostSlots(0, 5.0, in_process=False, mapped=FakeMapped()), FakeOrder(), 0xB0F)
    freed = weakref.ref(ctx)
    gc.disable()
    try:
        del ctx
        assert freed() is None
    finally:
        gc.enable()
