"""What the operations of an intranode engine share: its rank group and GPU, its NVLink buffer,
host-mapped slots and stream order, the kernel arguments every launch carries, the plans made so
far, the span of one call (:class:`deepep_cupy.gpu.call_span.CallSpan`), and where a count
exchange publishes the counts for the host. Which dispatch's rows lie in the buffer's areas is
not here: :class:`deepep_cupy.intranode.rows_in_buffer.RowsInBuffer`, which the engine hands to
its dispatch and combine paths.

The engine (:class:`deepep_cupy.intranode.engine.IntranodeEngine`) makes one
:class:`OperationContext` and hands it to each operation path it owns (layout, dispatch,
combine); the paths take everything they share from it, explicitly, and never from the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Tuple

from ..checks import check_handle
from ..config import Config
from ..gpu import launch, slots
from ..gpu.call_span import CallSpan
from ..gpu.device_scope import DeviceScope
from ..gpu.launch import KernelCall
from ..gpu.slots import ERROR_RECORD, HostSlots
from ..gpu.streams import StreamOrder
from ..groups.group import Group
from . import plans
from .handle import DispatchHandle

_NO_CONTEXT = contextlib.nullcontext()


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
    exchange of its own).
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
        # Set by attach, before any operation runs.
        self.slots: HostSlots
        self.order: StreamOrder
        self.plans = plans.PlanCache(self.on_device)
        self.shared_args: Dict[str, Any] = {}
        self.host_counts: Dict[str, Any] = {}
        #: The span of each call (gpu/call_span.py), made by :meth:`attach`.
        self.span: CallSpan
        #: What a handle made by this Buffer's dispatches names as its owner.
        self.owner = id(self)

    def attach(self, nvl: Any, host_slots: HostSlots, order: StreamOrder, peer_table_ptr: int) -> None:
        """Take the NVLink buffer, the slots and the stream order; bind the arguments every kernel
        shares (:meth:`bind`)."""
        self.nvl, self.slots, self.order = nvl, host_slots, order
        self.span = CallSpan(order, self.device_id, self.rank, slots=host_slots,
                              mark_gave_up=getattr(nvl, "mark_gave_up", None))
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

    def allocating(self, lib, on_comm_stream: bool):
        return lib.allocating_on(self.order.stream, self.device_id) if on_comm_stream else _NO_CONTEXT

    def handle_for(self, handle, config: Config) -> DispatchHandle:
        """``handle`` as a cached dispatch or a combine with ``config`` may use it."""
        if type(handle) is not DispatchHandle or handle.owner != self.owner:  # no call on the steady path
            check_handle(handle, DispatchHandle, "Buffer.dispatch", self.owner)
        if handle.num_channels != config.num_channels:
            raise ValueError(f"config: the handle was made with another num_sms ({handle.num_channels} channels; "
                             f"num_sms={config.num_sms} makes {config.num_channels}); dispatch and combine must use "
                             "the same num_sms")
        return handle
