"""The span of one call of a Buffer, whatever its path: ordered after the caller's work, its results
handed to the caller's stream, and the Buffer given up on when the host fails halfway.

Every operation of every path (intranode, internode, low latency) runs its GPU work inside
``with span.begin(lib, previous_event, on_comm_stream):`` and ends it with :meth:`CallSpan.finish`
(deepep_cupy/gpu/streams.py says how calls are ordered). It knows no operation.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Literal, Optional

from ..constants import HOST_FAILURES
from ..errors import DeepEPError
from ..events import EventOverlap
from . import slots as slot_words
from .slots import HostSlots
from .streams import StreamOrder


class CallSpan:
    """The span of one call of a Buffer (one per Buffer, reused: a Buffer's calls never nest).

    :meth:`begin` orders the call and returns the span, which unpacks as ``(caller's stream, stream
    to run on)``. The operation sets ``launched`` before its first kernel that meets other ranks and
    ``settled`` once what the call does on every rank no longer depends on this host (its kernels
    are queued and, for a host that waits for the counts, its verdict is in). Leaving by an
    exception tells the stream order that kernels may be queued already (``StreamOrder.abandon``),
    so that destroy() and the next call come after them; and when the call had launched such
    kernels but was not settled, or was interrupted at any point after its launch, the rank gives
    up on the Buffer (:meth:`give_up`), so that its peers stop at once, naming it, instead of
    waiting out their timeout. Exceptions the ranks raise together (``DeepEPError``) need none of
    that.

    Args:
        order: the Buffer's :class:`deepep_cupy.gpu.streams.StreamOrder`.
        device_id, rank: the Buffer's GPU and rank.
        slots: the Buffer's host slots (their failure is raised after the waits of ranks sharing a
            GPU, and a give-up is recorded there); None for a path without any.
        mark_gave_up: writes this rank's abort mark into every rank's buffer
            (``NvlBuffer.mark_gave_up``); None for a path whose kernels wait for no peer.
    """

    __slots__ = ("order", "device_id", "rank", "_slots", "_mark_gave_up", "caller", "run_on", "launched", "settled",
                 "_streams")

    def __init__(self, order: StreamOrder, device_id: int, rank: int, *, slots: Optional[HostSlots] = None,
                 mark_gave_up: Optional[Callable[[int], None]] = None):
        self.order = order
        self.device_id, self.rank = device_id, rank
        self._slots, self._mark_gave_up = slots, mark_gave_up
        self.caller = self.run_on = 0
        self.launched = self.settled = False
        self._streams: dict = {}

    def begin(self, lib, previous_event: Optional[EventOverlap], on_comm_stream: bool) -> "CallSpan":
        """Order the call after the caller's current stream (or ``previous_event``); ``on_comm_stream``:
        it must run on the communication stream (asynchronous, or allocating there)."""
        self.caller = caller = lib.current_stream(self.device_id)
        self.run_on = self.order.begin(caller, previous_event, on_comm_stream, self.rank)
        return self

    def abandon(self) -> None:
        """A round that stops early after queueing work on the call's stream (a dispatch redone with
        exact sizes): later calls and destroy() come after that work."""
        self.order.abandon(self.run_on)

    def finish(self, lib, async_finish: bool, arrays, outputs=(), allocated_on_comm: bool = False) -> EventOverlap:
        """Hand the caller the call's results, or an event for them (``StreamOrder.finish``)."""
        check = None if self._slots is None else self._slots.raise_if_failed
        return self.order.finish(self.caller, self.run_on, lib, async_finish, arrays, outputs, allocated_on_comm,
                                 check)

    @contextlib.contextmanager
    def current(self, lib) -> Iterator[None]:
        """Inside, CuPy's current stream (and the allocations of the caller's library) are the call's
        stream: for a path whose array work is CuPy's and whose calls take the current stream."""
        cupy = _cupy()
        stream = self._streams.get(self.run_on)
        if stream is None:
            stream = self._streams[self.run_on] = cupy.cuda.ExternalStream(self.run_on, self.device_id)
        with cupy.cuda.Device(self.device_id), stream:
            if lib.name == "cupy":
                yield
            else:
                with lib.allocating_on(stream, self.device_id):
                    yield

    def give_up(self, failure: BaseException) -> None:
        """This rank's host failed after its call launched kernels that meet the other ranks: mark
        the Buffer given up on every rank (their kernels stop and name this rank and the failure,
        instead of waiting out their timeout) and on this one (its next call raises)."""
        if self._slots is None:
            return
        code = slot_words.host_failure_code(failure, before_launch=False)
        what = HOST_FAILURES[code]
        try:
            if self._mark_gave_up is None:
                raise RuntimeError("this path has no buffer to mark")
            self._mark_gave_up(code)
        except Exception as exc:  # the GPU context may be the thing that failed
            what += f"; telling the other ranks failed too ({exc})"
        self._slots.failed = (f"this rank gave up on it after {what} ({type(failure).__name__}) once its call had "
                              f"launched kernels; the other ranks' kernels stop naming it. {slot_words.RECOVERY}")

    def __iter__(self) -> Iterator[int]:
        return iter((self.caller, self.run_on))

    def __enter__(self) -> "CallSpan":
        return self

    def __exit__(self, exc_type, exc, traceback) -> Literal[False]:
        if exc_type is None:
            self.launched = self.settled = False
            return False
        launched, settled = self.launched, self.settled
        self.launched = self.settled = False
        self.order.abandon(self.run_on)
        if launched and not issubclass(exc_type, DeepEPError) and (not settled or not issubclass(exc_type, Exception)):
            self.give_up(exc)
        return False

    def forget_streams(self) -> None:
        """Drop the CuPy stream objects :meth:`current` made (on destroy)."""
        self._streams.clear()



def _cupy():
    import cupy

    return cupy
