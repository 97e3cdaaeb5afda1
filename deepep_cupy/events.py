"""EventOverlap: what an asynchronous operation returns to order later work after it."""

from __future__ import annotations

from typing import Any, Optional, Tuple


class EventOverlap:
    """A CUDA event recorded on the Buffer's communication stream after an operation.

    With ``async_finish=True`` the operation's inputs and outputs are kept alive here until the
    caller has waited for the event (``current_stream_wait``) or dropped this object.

    Can be used as a context manager: the body runs while the communication is in flight
    (overlap), and on exit the caller's current stream waits for it.

    Args:
        event: a ``cupy.cuda.Event`` or ``None`` (already complete for the caller's stream).
        extra_tensors: objects to keep alive until the event has been waited for.
        lib: the caller's array library (a :class:`deepep_cupy.tensors.ArrayLib`): whose current
            stream waits. ``None``: CuPy's.
        device_id: the GPU whose current stream waits (default: CuPy's current device).
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Tuple[Any, ...] = (), lib: Any = None,
                 device_id: Optional[int] = None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._lib = lib
        self._device_id = device_id

    def current_stream_wait(self) -> None:
        """Make the caller's current stream (CuPy's, or PyTorch's for tensors) wait for the event."""
        if self.event is None:
            return
        import cupy

        device_id = cupy.cuda.Device().id if self._device_id is None else self._device_id
        stream_ptr = (cupy.cuda.get_current_stream().ptr if self._lib is None
                      else self._lib.current_stream(device_id))
        cupy.cuda.runtime.streamWaitEvent(stream_ptr, self.event.ptr, 0)
        self.extra_tensors = ()

    def synchronize(self) -> None:
        """Block the host until the operation has finished."""
        if self.event is not None:
            self.event.synchronize()
        self.extra_tensors = ()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()
