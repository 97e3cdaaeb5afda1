"""What every operation of an intranode Buffer shares: its rank group and GPU, its NVLink buffer,
host-mapped slots and stream order, the kernel arguments every launch carries, the plans made so
far, and the span of one call (:class:`OrderedCall`).

The Buffer makes one :class:`OperationContext` and hands it to each operation path it owns (the
dispatch path, the combine path); the paths take everything they share from it, explicitly, and
never from the Buffer. It knows no operation: binding, planning, ordering and finishing a call are
the same for all of them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

from ..config import Config
from ..constants import HOST_FAILURES
from ..errors import DeepEPError
from ..events import EventOverlap
from ..gpu import launch, slots
from ..gpu.launch import KernelCall
from ..gpu.slots import ERROR_RECORD, HostSlots
from ..gpu.streams import StreamOrder
from ..groups.group import Group
from . import plans
from .handle import DispatchHandle

_NO_CONTEXT = contextlib.nullcontext()


class DeviceScope:
    """Makes a GPU current for the duration of a call (nothing to do when it is)."""

    def __init__(self, device_id: int):
        from cupy.cuda import runtime

        self.device_id = device_id
        self._runtime = runtime
        self._previous: List[int] = []

    def __enter__(self):
        current = self._runtime.getDevice()
        if current != self.device_id:
            self._runtime.setDevice(self.device_id)
        self._previous.append(current)

    def __exit__(self, *exc):
        previous = self._previous.pop()
        if previous != self.device_id:
            self._runtime.setDevice(previous)


class OrderedCall:
    """The span of one operation's GPU work, from :meth:`OperationContext.begin`: entering gives the
    call itself, which unpacks as ``(caller's stream, stream to run on)``. The operation sets
    ``launched`` before its first kernel that meets other ranks and ``settled`` once what the call
    does on every rank no longer depends on this host (its kernels are queued and, for a host that
    waits for the counts, its verdict is in). Leaving by an exception tells the stream order that
    kernels may be queued already (``StreamOrder.abandon``), so that destroy() and the next call
    come after them; and when the call had launched such kernels but was not settled, or was
    interrupted at any point after its launch, the rank gives up on the Buffer (:meth:`give_up`),
    so that its peers stop at once, naming it, instead of waiting out their timeout. Exceptions the
    ranks raise together (``DeepEPError``) need none of that. One per Buffer, reused by each call
    (a Buffer's calls never nest)."""

    __slots__ = ("_order", "_nvl", "_slots", "caller", "run_on", "launched", "settled")

    def __init__(self, order: StreamOrder, nvl: Any, host_slots: HostSlots):
        self._order, self._nvl, self._slots = order, nvl, host_slots
        self.caller = self.run_on = 0
        self.launched = self.settled = False

    def give_up(self, failure: BaseException) -> None:
        """This rank's host failed after its call launched kernels that meet the other ranks: mark
        the Buffer given up on every rank (their kernels stop and name this rank and the failure,
        instead of waiting out their timeout) and on this one (its next call raises)."""
        code = slots.host_failure_code(failure, before_launch=False)
        what = HOST_FAILURES[code]
        try:
            self._nvl.mark_gave_up(code)
        except Exception as exc:  # the context may be the thing that failed
            what += f"; telling the other ranks failed too ({exc})"
        self._slots.failed = (f"this rank gave up on it after {what} ({type(failure).__name__}) once its call had "
                              f"launched kernels; the other ranks' kernels stop naming it. {slots.RECOVERY}")

    def __iter__(self):
        return iter((self.caller, self.run_on))

    def __enter__(self) -> "OrderedCall":
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if exc_type is None:
            self.launched = self.settled = False
            return False
        launched, settled = self.launched, self.settled
        self.launched = self.settled = False
        self._order.abandon(self.run_on)
        if launched and not issubclass(exc_type, DeepEPError) and (not settled or not issubclass(exc_type, Exception)):
            self.give_up(exc)
        return False


class OperationContext:
    """One intranode Buffer's shared state and helpers, as its operation paths use them.

    Args:
        group: the rank group; ``device_id``: the Buffer's GPU; ``timeout_s``: its peers' deadline;
        ``num_nvl_bytes``: the size of each rank's NVLink buffer.

    Attributes (set by :meth:`attach` once the GPU resources exist): ``nvl`` (the
    :class:`deepep_cupy.gpu.ipc.NvlBuffer`, or a stand-in), ``slots``, ``order``; ``plans``: the plans
    by kind of arguments; ``checks``: the :class:`deepep_cupy.intranode.plans.Context` argument checks read;
    ``exchange_in_transfer``: whether a fresh dispatch may make its count exchange in its transfer
    kernel (ranks with processes of their own; in-process ranks wait on an event behind a count
    exchange of its own); ``rows_in_buffer_used``: a plan made views of the NVLink buffer (from
    then on every call's inputs are checked against it); ``rows_in_buffer_of``: the handle of the
    dispatch whose rows in place the buffer's areas hold, or None.
    """

    def __init__(self, group: Group, device_id: int, timeout_s: float, num_nvl_bytes: int):
        self.group = group
        self.rank, self.num_ranks = group.rank, group.size
        self.device_id = device_id
        self.timeout_s = timeout_s
        self.on_device = DeviceScope(device_id)
        self.checks = plans.Context(self.num_ranks, device_id, num_nvl_bytes)
        self.exchange_in_transfer = not group.in_process
        self.nvl: Any = None
        self.slots: Optional[HostSlots] = None
        self.order: Optional[StreamOrder] = None
        self.plans = plans.PlanCache(self.on_device)
        self.rows_in_buffer_used = False
        self.rows_in_buffer_of: Optional[DispatchHandle] = None
        self.shared_args: Dict[str, Any] = {}
        self.host_counts: Dict[str, Any] = {}
        self._call: Optional[OrderedCall] = None
        #: What a handle made by this Buffer's dispatches names as its owner.
        self.owner = id(self)

    def attach(self, nvl: Any, host_slots: HostSlots, order: StreamOrder, peer_table_ptr: int) -> None:
        """Take the NVLink buffer, the slots and the stream order; bind the arguments every kernel
        shares (:meth:`bind`)."""
        self.nvl, self.slots, self.order = nvl, host_slots, order
        self._call = OrderedCall(order, nvl, host_slots)
        self.shared_args = launch.shared_arguments(peer_table_ptr, self.num_ranks, self.rank, self.timeout_s,
                                                   host_slots.device_ptr(ERROR_RECORD))
        # Where a count exchange publishes the counts and verdict of a dispatch whose host waits for them.
        self.host_counts = dict(recv_counter=host_slots.device_ptr(slots.RECV_COUNT),
                                mismatch_flag=host_slots.device_ptr(slots.VERDICT),
                                recv_expert_counter=host_slots.device_ptr(slots.EXPERT_COUNTS), report_refusal=0)

    def bind(self, kernel: str, template_args: Tuple[object, ...] = (), *, grid: int, shared_mem: int = 0,
             per_call: Tuple[str, ...] = (), **fixed) -> KernelCall:
        """A kernel call with the shared arguments (those the kernel names) and ``fixed`` bound,
        launched by ``run`` with ``per_call``'s values (launch.KernelCall)."""
        return launch.bind(kernel, self.shared_args, template_args, grid=grid, shared_mem=shared_mem,
                           per_call=per_call, **fixed)

    def begin(self, lib, previous_event: Optional[EventOverlap], async_finish: bool,
              allocate_on_comm_stream: bool) -> OrderedCall:
        """Order the call after the caller's work (see deepep_cupy/gpu/streams.py); the call's GPU work
        goes in ``with context.begin(...) as call:`` (``caller, run_on = call``)."""
        call = self._call
        call.caller = caller = lib.current_stream(self.device_id)
        call.run_on = self.order.begin(caller, previous_event, async_finish or allocate_on_comm_stream, self.rank)
        return call

    def allocating(self, lib, on_comm_stream: bool):
        return lib.allocating_on(self.order.stream, self.device_id) if on_comm_stream else _NO_CONTEXT

    def finish(self, caller: int, run_on: int, lib, async_finish: bool, arrays, outputs, allocated_on_comm: bool):
        return self.order.finish(caller, run_on, lib, async_finish, arrays, outputs, allocated_on_comm,
                                 self.slots.raise_if_failed)

    def refuse_buffer_rows(self, args: Tuple[str, ...], *pointers: int) -> None:
        """Refuse an input (``args``: the arguments' names, ``pointers``: their device addresses, 0
        for none) that lies in this rank's NVLink buffer (an output of a ``recv_x_in_buffer``
        dispatch): the call would overwrite it while it reads it. Nothing can lie there before a
        plan of such a dispatch was made: callers check :attr:`rows_in_buffer_used` first."""
        begin = self.nvl.local_ptr
        end = begin + self.nvl.num_bytes
        for ptr in pointers:
            if begin <= ptr < end:
                arg = args[pointers.index(ptr)]
                raise ValueError(f"{arg}: lies in this Buffer's NVLink buffer (an output of a dispatch with "
                                 "recv_x_in_buffer), which this call overwrites while it reads it; pass a copy")

    def check_handle(self, handle, config: Config) -> DispatchHandle:
        """``handle`` as a cached dispatch or a combine with ``config`` may use it."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle: expected the handle returned by Buffer.dispatch, got {type(handle).__name__}")
        if handle.owner != self.owner:
            raise ValueError("handle: it was made by another Buffer; a handle is only valid on the Buffer "
                             "whose dispatch returned it")
        if handle.num_channels != config.num_channels:
            raise ValueError(f"config: the handle was made with another num_sms ({handle.num_channels} channels; "
                             f"num_sms={config.num_sms} makes {config.num_channels}); dispatch and combine must use "
                             "the same num_sms")
        return handle
