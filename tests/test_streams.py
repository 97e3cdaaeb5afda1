"""Which stream a call runs on and how calls are ordered (CPU only: a recording CUDA runtime).

The rules are deepep_cupy/gpu/streams.py's: a plain synchronous call runs on the caller's stream; an
asynchronous one, one after ``previous_event`` or one allocating on the communication stream runs
there, ordered by events; a call never overlaps the Buffer's previous call.
"""

from types import SimpleNamespace

import pytest
from host_fakes import COMM_STREAM, recording_order

from deepep_cupy.events import EventOverlap

COMM, CALLER, OTHER = COMM_STREAM, 200, 300


class Lib:
    def __init__(self):
        self.used = []

    def used_on(self, arrays, stream_ptr, device_id):
        self.used.append(stream_ptr)


def make_order(shares_gpu=False):
    log = []
    return recording_order(log, shares_gpu), log


def call(order, caller=CALLER, previous=None, async_finish=False, on_comm=False, lib=None):
    lib = lib or Lib()
    run_on = order.begin(caller, previous, async_finish or on_comm, rank=0)
    event = order.finish(caller, run_on, lib, async_finish, ("x",), ("out",), on_comm)
    return run_on, event


def test_a_synchronous_call_runs_on_the_callers_stream_with_one_event_record():
    order, log = make_order()
    run_on, event = call(order)
    assert run_on == CALLER and event.event is None
    assert log == [("record", order._last_done.ptr, CALLER)]


def test_an_asynchronous_call_runs_on_the_comm_stream_after_the_caller():
    order, log = make_order()
    run_on, event = call(order, async_finish=True)
    caller_done = order._caller_done.ptr
    assert run_on == COMM and event.event is not None
    assert log[:2] == [("record", caller_done, CALLER), ("wait", COMM, caller_done)]
    assert log[2] == ("record", event.event.ptr, COMM)


def test_a_previous_event_replaces_the_wait_for_the_caller():
    order, log = make_order()
    previous = EventOverlap(SimpleNamespace(ptr=77))
    call(order, previous=previous, async_finish=True)
    assert ("wait", COMM, 77) in log and not any(e[0] == "record" and e[2] == CALLER for e in log)


def test_a_call_from_another_stream_waits_for_the_buffers_last_call():
    order, log = make_order()
    call(order, caller=CALLER)
    log.clear()
    call(order, caller=OTHER)
    assert log[0] == ("wait", OTHER, order._last_done.ptr)


def test_calls_from_one_stream_need_no_waits():
    order, log = make_order()
    for _ in range(3):
        call(order)
    assert not any(entry[0] == "wait" for entry in log)


def test_a_synchronous_call_after_an_asynchronous_one_waits_for_it():
    order, log = make_order()
    _, event = call(order, async_finish=True)
    log.clear()
    run_on, _ = call(order)
    assert run_on == CALLER and log[0] == ("wait", CALLER, event.event.ptr)


def test_outputs_allocated_on_the_comm_stream_are_marked_as_used_by_the_caller():
    order, _ = make_order()
    lib = Lib()
    call(order, on_comm=True, lib=lib)
    assert CALLER in lib.used


def test_the_legacy_default_stream_is_refused_when_ranks_share_the_gpu():
    order, _ = make_order(shares_gpu=True)
    with pytest.raises(ValueError, match="share GPU 0, so each must run on its own stream"):
        order.begin(0, None, False, rank=3)


def test_ranks_sharing_a_gpu_return_after_the_call_finished():
    order, log = make_order(shares_gpu=True)
    checked = []
    run_on = order.begin(CALLER, None, False, rank=0)
    order.finish(CALLER, run_on, Lib(), False, (), (), False, lambda: checked.append(1))
    assert ("stream sync", CALLER) in log and checked == [1]


# --- under CUDA stream capture -------------------------------------------------------------------

def test_a_captured_call_waits_for_no_eager_call_and_leaves_their_order_alone():
    order, log = make_order()
    call(order, caller=CALLER)
    eager_order = (order._last_stream, order._last_event)
    log.clear()
    order._runtime.capturing.add(OTHER)
    run_on, event = call(order, caller=OTHER)
    assert run_on == OTHER and event.event is None and log == []
    assert (order._last_stream, order._last_event) == eager_order


def test_an_eager_call_after_a_capture_waits_for_the_eager_call_before_it():
    order, log = make_order()
    call(order, caller=CALLER)
    order._runtime.capturing.add(OTHER)
    call(order, caller=OTHER)
    order._runtime.capturing.clear()
    log.clear()
    call(order, caller=OTHER)
    assert log[0] == ("wait", OTHER, order._last_done.ptr)


def test_a_captured_asynchronous_call_forks_the_comm_stream_with_events_of_its_own():
    order, log = make_order()
    order._runtime.capturing.add(CALLER)
    lib = Lib()
    run_on, event = call(order, async_finish=True, lib=lib)
    fork = log[0][1]
    assert run_on == COMM and fork not in (order._caller_done.ptr, order._last_done.ptr)
    assert log == [("record", fork, CALLER), ("wait", COMM, fork), ("record", event.event.ptr, COMM)]
    assert lib.used == []  # the capture's memory lives with its graph, not by stream bookkeeping


def test_ranks_sharing_a_gpu_do_not_wait_on_the_host_for_a_captured_call():
    order, log = make_order(shares_gpu=True)
    order._runtime.capturing.add(CALLER)
    run_on = order.begin(CALLER, None, False, rank=0)
    order.finish(CALLER, run_on, Lib(), False, (), (), False, lambda: pytest.fail("checked errors"))
    assert not any(entry[0].endswith("sync") for entry in log)


def test_a_captured_call_that_stops_records_nothing():
    order, log = make_order()
    order._runtime.capturing.add(CALLER)
    run_on = order.begin(CALLER, None, False, rank=0)
    order.abandon(run_on)
    assert log == [] and order._last_stream is None


def test_synchronize_also_waits_for_work_queued_outside_a_call_without_reordering_the_next_call():
    # A low-latency receive hook runs on the stream current when it is called.
    order, log = make_order()
    call(order, async_finish=True)
    order.note_side_work(OTHER)
    side = [e for e in log if e[0] == "record" and e[2] == OTHER]
    assert len(side) == 1
    before = len(log)
    order.synchronize()
    assert ("event sync", side[0][1]) in log[before:]
    run_on, _ = call(order, async_finish=True)
    assert run_on == COMM and not any(e[0] == "wait" and e[2] == side[0][1] for e in log)


def test_work_queued_outside_a_call_during_a_capture_is_not_waited_for():
    order, log = make_order()
    order._runtime.capturing.add(OTHER)
    order.note_side_work(OTHER)
    assert not any(e[2:] == (OTHER,) for e in log if e[0] == "record")
