"""Which stream a Buffer's kernels run on, and how calls are ordered against the caller's work.

DeepEP's contract, which every operation keeps:

* the call's kernels run after the work already queued on the caller's current stream (or,
  given ``previous_event``, after that event instead);
* without ``async_finish`` the caller's stream can use the results at once; with it, the caller
  gets an :class:`EventOverlap` and the inputs and outputs are kept alive until that event
  (PyTorch: ``record_stream`` on the communication stream, as DeepEP does; CuPy: references held
  by the event object);
* ``allocate_on_comm_stream`` allocates the outputs for the communication stream (PyTorch is told
  that the caller's stream uses them too);
* a Buffer's calls run one after the other on the GPU, whatever streams they were issued from:
  they share its NVLink queues.

How: a call with ``previous_event``, ``async_finish`` or ``allocate_on_comm_stream`` runs on the
Buffer's communication stream, ordered by events as DeepEP does. A plain synchronous call runs
its kernels straight on the caller's stream: the same order as "wait for the caller, run on the
communication stream, make the caller wait", with one event operation instead of four. Calls stay
in order across streams because each records an event at its end; the next call waits for it
only when it runs on another stream than the last one.

Under CUDA stream capture (``torch.cuda.graph``, ``cupy.cuda.Stream.begin_capture``) a call
joins the capture and nothing else: it waits for the caller's stream (or ``previous_event``) but
not for the Buffer's eager calls, records no event that an eager call would later wait for, and
keeps none of the host waits of ranks sharing a GPU. Waiting across the capture's boundary is an
error in CUDA, and within a capture the caller's stream already orders the calls (an
asynchronous call's event must be waited on before the capture ends, as CUDA requires of every
stream a capture forks). Replays are ordered by the stream they are launched on.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..events import EventOverlap

#: Per device, communication streams that no Buffer uses now. Streams are made once and never
#: destroyed: PyTorch remembers the streams a tensor was used on (``record_stream``, as an
#: asynchronous call tells it) and records an event on each when the tensor is freed, which may be
#: after the Buffer's destroy() or at the interpreter's exit; a stream destroyed by then crashes it.
_FREE_STREAMS: Dict[int, List[Any]] = {}


def kept_stream(device_id: int):
    """A non-blocking stream on ``device_id`` (a ``cupy.cuda.ExternalStream`` that nothing ever
    destroys), from the streams Buffers gave back or new."""
    import cupy

    free = _FREE_STREAMS.setdefault(device_id, [])
    if free:
        return free.pop()
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(device_id):
        ptr = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
    return cupy.cuda.ExternalStream(ptr, device_id)


class StreamOrder:
    """The communication stream of one Buffer and the ordering of its calls.

    Args:
        device_id: the Buffer's GPU.
        shares_gpu: other ranks of an in-process group run on this GPU (see :meth:`finish`).
        stream: the communication stream (a ``cupy.cuda.Stream``); ``new_event`` makes events
            (``.ptr``, ``.synchronize()``); ``runtime`` is ``cupy.cuda.runtime``. :meth:`create`
            makes all three.
    """

    def __init__(self, device_id: int, shares_gpu: bool, stream, new_event: Callable[[], Any], runtime):
        self.device_id = device_id
        self.shares_gpu = shares_gpu
        self.stream = stream
        self.ptr = stream.ptr
        self._new_event = new_event
        self._runtime = runtime
        self._caller_done, self._last_done, self.notify_done = new_event(), new_event(), new_event()
        # Where the Buffer's last call left off: a stream, and an event recorded after the call.
        self._last_stream: Optional[int] = None
        self._last_event = self._last_done
        self._done: dict = {}  # per array library: the (immutable) EventOverlap of a finished call
        self._side_work: dict = {}  # stream -> event after the Buffer's work queued there outside a call
        #: Whether the running call's stream is being captured into a CUDA graph (set by :meth:`begin`).
        self.capturing = False

    @classmethod
    def create(cls, device_id: int, shares_gpu: bool) -> "StreamOrder":
        """A communication stream on the current device (:func:`kept_stream`; CuPy's events and runtime)."""
        import cupy

        stream = kept_stream(device_id)
        order = cls(device_id, shares_gpu, stream, lambda: cupy.cuda.Event(disable_timing=True), cupy.cuda.runtime)
        weakref.finalize(order, _FREE_STREAMS.setdefault(device_id, []).append, stream)
        return order

    def begin(self, caller_ptr: int, previous_event: Optional[EventOverlap], on_comm_stream: bool,
              rank: int) -> int:
        """Order the call; return the stream its kernels run on.

        ``on_comm_stream``: the call must run on the communication stream (asynchronous, after
        ``previous_event``, or allocating there); otherwise it runs on the caller's stream.
        """
        if caller_ptr == 0 and self.shares_gpu:
            raise ValueError(
                f"rank {rank}: ranks of this group share GPU {self.device_id}, so each must run on its own "
                "stream, not the legacy default stream (one rank's wait there would block a peer's launch); "
                "run_local_group sets one per rank, or use `with cupy.cuda.Stream(non_blocking=True):`")
        runtime = self._runtime
        self.capturing = capturing = bool(runtime.streamIsCapturing(caller_ptr))
        # A synchronous call's EventOverlap holds no event: nothing to wait for.
        previous = None if previous_event is None else previous_event.event
        run_on = self.ptr if on_comm_stream or previous is not None else caller_ptr
        if not capturing and self._last_stream is not None and self._last_stream != run_on:
            runtime.streamWaitEvent(run_on, self._last_event.ptr, 0)  # after the Buffer's last call
        if run_on == self.ptr:
            if previous is not None:
                runtime.streamWaitEvent(self.ptr, previous.ptr, 0)
            else:
                # A stream wait takes the event's state when it is enqueued, so one event serves
                # every call; a capture gets its own (its record is a node of the graph).
                caller_done = self._new_event() if capturing else self._caller_done
                runtime.eventRecord(caller_done.ptr, caller_ptr)
                runtime.streamWaitEvent(self.ptr, caller_done.ptr, 0)
        return run_on

    def begin_on_comm_stream(self) -> int:
        """Order a call that concerns only the Buffer (a barrier) after its last call; return the
        communication stream it runs on."""
        if self._last_stream is not None and self._last_stream != self.ptr:
            self._runtime.streamWaitEvent(self.ptr, self._last_event.ptr, 0)
        return self.ptr

    def record_notify_done(self, stream_ptr: int) -> None:
        """Record :attr:`notify_done` on ``stream_ptr`` (in-process count waits use it)."""
        self._runtime.eventRecord(self.notify_done.ptr, stream_ptr)

    def finish(self, caller_ptr: int, run_on: int, lib, async_finish: bool, arrays: Sequence[Any],
               outputs: Sequence[Any] = (), allocated_on_comm: bool = False,
               check_errors=None) -> EventOverlap:
        """Hand the caller the call's results (or an event for them); keep ``arrays`` alive as needed.

        Args:
            run_on: the stream :meth:`begin` chose.
            arrays: every array the call's kernels touch (inputs, outputs, handle arrays).
            outputs: the arrays allocated for the call (told about the caller's stream when they
                were allocated for the communication stream).
            check_errors: called after the wait that ranks sharing a GPU do (see below).
        """
        runtime = self._runtime
        if self.capturing:
            return self._finish_captured(caller_ptr, run_on, lib, async_finish, arrays)
        if allocated_on_comm:
            lib.used_on(outputs, caller_ptr, self.device_id)
        if async_finish:
            event = self._new_event()
            runtime.eventRecord(event.ptr, self.ptr)
            lib.used_on(arrays, self.ptr, self.device_id)
            self._last_stream, self._last_event = self.ptr, event
            return EventOverlap(event, tuple(arrays), lib, self.device_id)
        runtime.eventRecord(self._last_done.ptr, run_on)
        if run_on != caller_ptr:
            runtime.streamWaitEvent(caller_ptr, self._last_done.ptr, 0)
        self._last_stream, self._last_event = caller_ptr, self._last_done
        if self.shares_gpu:
            # Ranks on one GPU in one process: return only once the transfer is over (the wait
            # releases the GIL). A host copy issued now (cupy.asnumpy) would sit in the driver
            # until this rank's kernels end, and it holds up a co-located rank's host copies
            # meanwhile, so that rank might never launch the kernels ours wait for.
            runtime.streamSynchronize(caller_ptr)
            if check_errors is not None:
                check_errors()
        return self._synchronous_result(lib)

    def _finish_captured(self, caller_ptr: int, run_on: int, lib, async_finish: bool, arrays) -> EventOverlap:
        """:meth:`finish` of a captured call: fresh events only, the Buffer's eager order untouched.
        Nothing is handed to the allocators: a capture's memory lives as long as its graph (PyTorch's
        graph pool) or as the caller's references (CuPy)."""
        runtime = self._runtime
        if async_finish:
            event = self._new_event()
            runtime.eventRecord(event.ptr, self.ptr)
            return EventOverlap(event, tuple(arrays), lib, self.device_id)
        if run_on != caller_ptr:
            joined = self._new_event()
            runtime.eventRecord(joined.ptr, run_on)
            runtime.streamWaitEvent(caller_ptr, joined.ptr, 0)
        return self._synchronous_result(lib)

    def _synchronous_result(self, lib) -> EventOverlap:
        """The (immutable, shared) EventOverlap a synchronous call returns."""
        done = self._done.get(lib)
        if done is None:
            done = self._done[lib] = EventOverlap(None, (), lib, self.device_id)
        return done

    def abandon(self, run_on: int) -> None:
        """A call that stops after launching kernels on ``run_on`` (a redone or refused dispatch, or
        one that raised): later calls and :meth:`synchronize` still come after them."""
        if self.capturing:
            return  # nothing ran: a capture only records (the caller discards the graph)
        self._runtime.eventRecord(self._last_done.ptr, run_on)
        self._last_stream, self._last_event = run_on, self._last_done

    def note_side_work(self, stream_ptr: int) -> None:
        """The Buffer queued work on ``stream_ptr`` outside a call (a low-latency receive hook, on
        the stream current when it is called): :meth:`synchronize` waits for it too. The order of
        the next call is not changed (the hook's stream is the caller's to order)."""
        runtime = self._runtime
        if runtime.streamIsCapturing(stream_ptr):
            return  # recorded into a graph, not run now: there is nothing to wait for
        event = self._side_work.get(stream_ptr)
        if event is None:
            event = self._side_work[stream_ptr] = self._new_event()
        runtime.eventRecord(event.ptr, stream_ptr)

    def synchronize(self) -> None:
        """Wait for every call of the Buffer, on whatever streams they ran (destroy uses it).

        The last call's event is enough for the caller's streams: each call waits for the one
        before it when it runs on another stream, and a call that stops early records it too
        (:meth:`abandon`); work queued outside a call is waited for through
        :meth:`note_side_work`'s events. Nothing else is waited for, not the device: a co-located
        rank's kernels may be waiting for this rank.
        """
        self.stream.synchronize()
        self._last_event.synchronize()
        for event in self._side_work.values():
            event.synchronize()
