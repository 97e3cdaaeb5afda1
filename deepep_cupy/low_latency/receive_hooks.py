"""The receive halves of the low-latency calls made with ``return_recv_hook=True``: the hooks.

On the device a receive pairs with a send by order alone (one call counter per op, two halves of
the buffer), so the host keeps that order: it refuses a call or a hook that would pair them wrongly,
and a hook launches its receive once, on the caller's stream current then.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

__all__ = ["CALLS_IN_FLIGHT", "OwedReceives", "receive_hook"]

#: Calls of an op whose receive may be owed at once (the buffer's two halves).
CALLS_IN_FLIGHT = 2


class OwedReceives:
    """The hooks of an op's calls whose receive has not been issued yet, oldest first (host side).

    On the device a receive pairs with a send by order alone (one call counter per op), so the
    host keeps that order: a call without a hook, or a hook out of turn, would receive another
    call's data, and a third send would wait for a receive that cannot come until it times out.
    """

    def __init__(self, op: str):
        self.op = op
        self._hooks: List[Callable[[], None]] = []

    def check_call(self, return_recv_hook: bool) -> None:
        """Raise unless a call with (or without) a hook may be issued now."""
        if not self._hooks:
            return
        if not return_recv_hook:
            raise ValueError(
                f"return_recv_hook=False: a low-latency {self.op} sent with return_recv_hook=True has not "
                f"received yet; call its hook first (the kernels pair receives with sends by order, so this "
                f"call would receive that one's data)")
        if len(self._hooks) >= CALLS_IN_FLIGHT:
            raise ValueError(
                f"return_recv_hook=True: two low-latency {self.op} calls already wait for their hooks (at most "
                f"{CALLS_IN_FLIGHT} in flight); call the older hook first (a third send waits on the GPU for "
                f"its receive and would time out)")

    def check_hook(self, hook: Callable[[], None]) -> None:
        """Raise unless ``hook`` is the oldest owed."""
        if hook not in self._hooks:
            raise ValueError("hook: clean_low_latency_buffer reset the low-latency calls since this hook's call; "
                             "make the call again")
        if self._hooks[0] is not hook:
            raise ValueError(f"hook: the hook of an earlier low-latency {self.op} has not been called; call the "
                             f"hooks in the order of their calls (the kernels pair receives with sends by order)")

    def add(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

    def remove(self, hook: Callable[[], None]) -> None:
        self._hooks.remove(hook)

    def clear(self) -> None:
        self._hooks.clear()


def receive_hook(call: Any, lib: Any, values: Tuple[int, ...], arrays: Tuple[Any, ...], owed: OwedReceives,
                 *, order: Any, slots: Any, device_id: int, on_device: Any) -> Callable[[], None]:
    """The receive half of a call (``call``: a :class:`KernelCall`, or what runs like one), owed by
    its op until launched: launched on the caller's current stream when called (once, in the order
    of the op's calls).

    ``order``, ``slots``, ``on_device``: the path's stream order, host slots and device context."""
    pending = [arrays]  # the call's arrays, kept alive until the receive is issued; empty once the hook ran

    def hook() -> None:
        slots.raise_if_failed()  # as every call: not on a destroyed or failed Buffer
        if not pending:
            raise RuntimeError("deepep_cupy: this receive hook was called already (each hook runs once)")
        owed.check_hook(hook)
        with on_device:
            stream = lib.current_stream(device_id)
            call.run(stream, *values)
            # Launched: no longer owed (a launch that failed leaves the hook to be called again).
            owed.remove(hook)
            kept = pending.pop()
            order.note_side_work(stream)  # destroy() and clean() wait for the receive too
            if order.shares_gpu and not _capturing(stream):
                # As StreamOrder.finish: ranks sharing a GPU in one process return once their
                # kernels are over (see there).
                _synchronize(stream)
                slots.raise_if_failed()
        del kept

    owed.add(hook)
    return hook


def _capturing(stream_ptr: int) -> bool:
    from cupy.cuda import runtime

    return bool(runtime.streamIsCapturing(stream_ptr))


def _synchronize(stream_ptr: int) -> None:
    from cupy.cuda import runtime

    runtime.streamSynchronize(stream_ptr)
