"""The low-latency (decode) path: DeepEP's ``low_latency_dispatch`` / ``low_latency_combine`` over NVLink.

A :class:`LowLatencyPath` owns its own IPC-mapped buffer (``num_rdma_bytes`` of a low-latency
Buffer, sized by :func:`get_low_latency_rdma_size_hint`) and two kernels (kernels/low_latency.cu):

* dispatch: each token is cast (FP8, in registers) and written straight into its slot of the
  owner of each of its experts, with one count per (local expert, source rank) signalled after the
  rows; the receive waits for the counts and packs the rows per expert;
* combine: each expert row is written straight into the token owner's area, with one flag per
  expert; the receive sums each token's rows with their weights.

One launch per call, or with ``return_recv_hook=True`` one for the send (the call) and one for the
receive (the hook). The host never waits for the device: every call can be captured in a CUDA
graph. Which half of the buffer a call uses, and the epoch its signals carry, are counted by the
kernels in the buffer itself, so a replayed graph alternates halves as eager calls do.

Receive order (deterministic, unlike DeepEP's): the rows of local expert ``l`` are the tokens of
rank 0 first, then rank 1, ...; inside a source rank by source token index. The NumPy model
(:mod:`deepep_cupy.reference.low_latency`) states the layout, the FP8 rounding and the combine sum
exactly; the GPU tests compare bit for bit.

Contract of the in-flight results (DeepEP's): the two halves let two calls of an op be in flight,
e.g. two dispatch sends before their hooks; the send of call ``n`` waits (on the device) until every
receiver has finished receiving call ``n - 2``, so a third send before the first hook never
completes: it times out (``DeepEPTimeoutError``). A receive pairs with a send by order alone, so
the host refuses what would pair them wrongly (:class:`_OwedReceives`). The zero-copy rows have two
areas too, alternating per combine call as DeepEP's halves alternate per call (counted on the host,
as DeepEP counts its buffer index: a captured call keeps the area it was captured with):
:meth:`LowLatencyPath.next_combine_buffer` is the area the next combine sends from, so the rows of
a second combine can be written while the first one's send still reads its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .. import tensors
from ..constants import (
    FP8_SCALE_BLOCK,
    LL_CALLS_INT,
    LL_DATA_OFFSET,
    LL_MASK_INT,
    LL_SYNC_INT,
    MAX_EXPERTS,
    MAX_RANKS,
    MAX_TOPK,
    UE8M0_PER_INT,
)
from ..gpu import launch
from ..gpu.launch import KernelCall
from ..gpu.slots import ERROR_RECORD
from ..intranode.plans import PlanCache
from ..tensors import check_array, check_int, describe, read

__all__ = ["LowLatencyHandle", "LowLatencyLayout", "LowLatencyPath", "get_low_latency_rdma_size_hint"]

#: The kernels (kernels/low_latency.cu), namespaced as DeepEP's: DeepEP's benchmark (bench_kineto)
#: finds them by ``::dispatch`` / ``::combine`` in the profiler's kernel names.
DISPATCH_KERNEL = "deepep_cupy::low_latency::dispatch"
COMBINE_KERNEL = "deepep_cupy::low_latency::combine"
#: The masked barrier of a clean in shrink mode.
BARRIER_KERNEL = "deepep_cupy::low_latency::barrier"
#: Blocks per launch when the GPU is not shared (latency, not bandwidth: every block spins).
DEFAULT_NUM_SMS = 32
#: LogFMT combines (DeepEP's) need hidden a multiple of this; with a multiple of 1024 their chunks
#: are 1024 channels (unroll 4), else 512 (unroll 2); at most 32 chunks (kernels/low_latency.cu).
LOGFMT_HIDDEN_MULTIPLE = 512
LOGFMT_MAX_CHUNKS = 32
#: Calls of an op whose receive may be owed at once (the buffer's two halves).
CALLS_IN_FLIGHT = 2
_PHASE_SEND, _PHASE_RECV, _PHASE_BOTH = 1, 2, 3


#: Equal data areas of the buffer: dispatch half 0 and 1, combine half 0 and 1, zero-copy rows 0 and 1.
NUM_AREAS = 6
_AREA_ALIGN = 4096


@dataclasses.dataclass(frozen=True)
class LowLatencyLayout:
    """Where the data of calls of these sizes lie in a low-latency buffer of ``num_bytes``.

    The header and signal words come first (kernels/low_latency.cu; fixed offsets, constants.LL_*),
    then :data:`NUM_AREAS` equal areas at fixed places (the buffer's size alone sets them): the two
    dispatch halves (``[L][R][M]`` records), the two combine halves (``[E][M][hidden]`` BF16 rows)
    and the two zero-copy areas (``[L][R * M][hidden]`` BF16 rows). Calls of other sizes index the same areas
    differently, so a half is never written while a call of other sizes still reads the other.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_ranks: int
    num_experts: int
    num_bytes: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows_per_expert(self) -> int:
        return self.num_ranks * self.num_max_dispatch_tokens_per_rank

    @property
    def record_bytes(self) -> int:
        """A dispatched row: BF16 (or FP8 plus its scales, which is smaller), then 16 bytes that
        hold its source token index."""
        return -(-(self.hidden * 2 + 16) // 16) * 16

    @property
    def logfmt_slot_bytes(self) -> int:
        """A row's slot in a combine half with LogFMT (kernels/low_latency.cu): one (amax, amin) BF16
        pair per 128 channels, then at most the BF16 row."""
        return self.hidden * 2 + self.hidden // FP8_SCALE_BLOCK * 4

    def combine_slot_bytes(self, use_logfmt: bool) -> int:
        """A row's slot in a combine half: the BF16 row, or its LogFMT slot."""
        return self.logfmt_slot_bytes if use_logfmt else self.hidden * 2

    @property
    def area_bytes_needed(self) -> int:
        """The largest of the areas these sizes use (a dispatch half or, with LogFMT possible, a combine half)."""
        combine_slot = self.combine_slot_bytes(self.hidden % LOGFMT_HIDDEN_MULTIPLE == 0)
        return max(self.num_local_experts * self.rows_per_expert * self.record_bytes,
                   self.num_experts * self.num_max_dispatch_tokens_per_rank * combine_slot)

    @property
    def area_bytes(self) -> int:
        """Bytes of each data area of a buffer of :attr:`num_bytes`."""
        return max(0, (self.num_bytes - LL_DATA_OFFSET) // NUM_AREAS) // _AREA_ALIGN * _AREA_ALIGN

    @property
    def fits(self) -> bool:
        return self.area_bytes_needed <= self.area_bytes

    @property
    def bytes_needed(self) -> int:
        """The smallest buffer in which calls of these sizes fit."""
        return LL_DATA_OFFSET + NUM_AREAS * -(-self.area_bytes_needed // _AREA_ALIGN) * _AREA_ALIGN

    @property
    def dispatch_offset(self) -> int:
        return LL_DATA_OFFSET

    @property
    def dispatch_half_bytes(self) -> int:
        return self.area_bytes

    @property
    def combine_offset(self) -> int:
        return LL_DATA_OFFSET + 2 * self.area_bytes

    @property
    def combine_half_bytes(self) -> int:
        return self.area_bytes

    @property
    def zero_copy_offset(self) -> int:
        """The first zero-copy area (the second follows it: :meth:`zero_copy_offset_of`)."""
        return LL_DATA_OFFSET + 4 * self.area_bytes

    def zero_copy_offset_of(self, index: int) -> int:
        """Zero-copy area ``index`` (0 or 1): the one combine call ``n`` sends from is ``n & 1``."""
        return self.zero_copy_offset + (index & 1) * self.area_bytes

    @property
    def zero_copy_bytes(self) -> int:
        return self.num_local_experts * self.rows_per_expert * self.hidden * 2


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """Bytes of the low-latency buffer (a Buffer's ``num_rdma_bytes``) for calls of these sizes
    (DeepEP's name), rounded up to 2 MiB."""
    num_max_dispatch_tokens_per_rank = check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
    hidden = check_int(hidden, "hidden")
    num_ranks = check_int(num_ranks, "num_ranks")
    num_experts = check_int(num_experts, "num_experts")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of num_ranks={num_ranks}, got {num_experts}")
    size = LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).bytes_needed
    return -(-size // (2 << 20)) * (2 << 20)


class LowLatencyHandle(NamedTuple):
    """What a low-latency dispatch hands its combine (DeepEP's handle, as a tuple).

    ``src_info`` int32 ``[L, R * M]``: the source token index of each received row;
    ``layout_range`` int64 ``[L, R]``: ``(first row from source r) << 32 | rows from r``. Both are
    device arrays of the caller's library, written by the receive.
    """

    src_info: Any
    layout_range: Any
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class _Plan(NamedTuple):
    """A checked kind of dispatch or combine: its layout and its kernel bound once per phase."""

    layout: LowLatencyLayout
    send: KernelCall     # the send half (return_recv_hook=True)
    receive: KernelCall  # the receive half (the hook)
    both: KernelCall


class _OwedReceives:
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


class LowLatencyPath:
    """A rank's low-latency buffer and the calls that use it.

    Args:
        peer_table_ptr: device address of the R peer pointers of the buffer (``NvlBuffer.peer_ptrs``).
        local_ptr, num_bytes: this rank's buffer.
        rank, num_ranks, device_id: the rank's place.
        order: the Buffer's :class:`deepep_cupy.gpu.streams.StreamOrder`.
        slots: the Buffer's :class:`deepep_cupy.gpu.slots.HostSlots` (the error record).
        timeout_s: the device waits' deadline.
        num_sms: blocks per launch.
        on_device: a context that makes the rank's GPU current.
        owner: what the buffer views returned to the caller keep alive (the NvlBuffer).
        enable_shrink: DeepEP's shrink mode: a rank whose wait times out is masked (its peers go on
            without it) instead of the call failing; the mask calls (:meth:`update_mask` ...).
    """

    def __init__(self, *, peer_table_ptr: int, local_ptr: int, num_bytes: int, rank: int, num_ranks: int,
                 device_id: int, order, slots, timeout_s: float, num_sms: int, on_device, owner: Any = None,
                 enable_shrink: bool = False):
        self.peer_table_ptr = peer_table_ptr
        self.local_ptr = local_ptr
        self.num_bytes = num_bytes
        self.rank, self.num_ranks, self.device_id = rank, num_ranks, device_id
        self._order = order
        self._slots = slots
        self.num_sms = num_sms
        self.enable_shrink = bool(enable_shrink)
        self._on_device = on_device
        self._owner = owner
        self._shared = launch.shared_arguments(peer_table_ptr, num_ranks, rank, timeout_s,
                                               slots.device_ptr(ERROR_RECORD))
        self._dispatch_plans = PlanCache(on_device)
        self._combine_plans = PlanCache(on_device)
        self._zero_copy_views: Dict[tuple, Any] = {}
        #: Combine calls issued (host side): call n's zero-copy rows are in area n & 1.
        self._combine_calls = 0
        self._barrier_call = None
        self._owed_dispatch = _OwedReceives("dispatch")
        self._owed_combine = _OwedReceives("combine")

    # -----------------------------------------------------------------------------------------
    # Set-up

    @classmethod
    def create(cls, group, num_bytes: int, *, order, slots, timeout_s: float, device_id: int, on_device,
               ranks_on_gpu: int = 1, enable_shrink: bool = False) -> "LowLatencyPath":
        """Map a new low-latency buffer of ``num_bytes`` on every rank (collective) and load the
        kernels. ``ranks_on_gpu``: ranks of this process on the GPU (their grids must fit at once)."""
        from ..gpu import kernels
        from ..gpu.ipc import NvlBuffer
        from ..gpu.sm_budget import check_sm_budget, largest_num_sms, sm_count_of

        num_bytes = check_int(num_bytes, "num_rdma_bytes")
        if num_bytes < LL_DATA_OFFSET:
            raise ValueError(f"num_rdma_bytes: expected at least {LL_DATA_OFFSET} bytes; size it with "
                             "Buffer.get_low_latency_rdma_size_hint(...)")
        num_sms = min(DEFAULT_NUM_SMS, largest_num_sms(ranks_on_gpu, sm_count_of(device_id)))
        check_sm_budget({device_id: ranks_on_gpu}, num_sms)
        nvl = NvlBuffer(group, num_bytes)
        try:
            for name in (DISPATCH_KERNEL, COMBINE_KERNEL) + ((BARRIER_KERNEL,) if enable_shrink else ()):
                kernels.get_kernel(name)
        except BaseException:
            nvl.close()
            raise
        return cls(peer_table_ptr=nvl.peer_ptrs.data.ptr, local_ptr=nvl.local_ptr, num_bytes=num_bytes,
                   rank=group.rank, num_ranks=group.size, device_id=device_id, order=order, slots=slots,
                   timeout_s=timeout_s, num_sms=num_sms, on_device=on_device, owner=nvl, enable_shrink=enable_shrink)

    def close(self) -> None:
        """Unmap and free the buffer (the Buffer's destroy waits for the kernels first)."""
        if self._owner is not None and hasattr(self._owner, "close"):
            self._owner.close()
        self._owner = None
        self._dispatch_plans.clear()
        self._combine_plans.clear()
        self._zero_copy_views.clear()
        self._owed_dispatch.clear()
        self._owed_combine.clear()

    def _plan(self, kernel: str, layout: LowLatencyLayout, per_call: Tuple[str, ...], **fixed) -> _Plan:
        """``kernel`` bound for each of its phases (send, receive, both) with the shared arguments
        it names and ``fixed``."""
        return _Plan(layout, *(launch.bind(kernel, self._shared, grid=self.num_sms, per_call=per_call,
                                           phases=phases, **fixed)
                               for phases in (_PHASE_SEND, _PHASE_RECV, _PHASE_BOTH)))

    def _layout(self, num_max: Any, hidden: int, num_experts: Any) -> LowLatencyLayout:
        num_max = check_int(num_max, "num_max_dispatch_tokens_per_rank")
        num_experts = check_int(num_experts, "num_experts")
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts: expected a multiple of the rank count {self.num_ranks}, got {num_experts}")
        if num_experts > MAX_EXPERTS:
            raise ValueError(f"num_experts: at most {MAX_EXPERTS}, got {num_experts}")
        layout = LowLatencyLayout(num_max, hidden, self.num_ranks, num_experts, self.num_bytes)
        if not layout.fits:
            raise ValueError(
                f"num_rdma_bytes: the low-latency buffer has {self.num_bytes} bytes, calls with "
                f"num_max_dispatch_tokens_per_rank={num_max}, hidden={hidden}, num_experts={num_experts} on "
                f"{self.num_ranks} ranks need {layout.bytes_needed}; create the Buffer with "
                f"Buffer.get_low_latency_rdma_size_hint({num_max}, {hidden}, {self.num_ranks}, {num_experts}) bytes")
        return layout

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                 use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                 async_finish: bool = False, return_recv_hook: bool = False):
        """See :meth:`deepep_cupy.Buffer.low_latency_dispatch`."""
        self._slots.raise_if_failed()
        self._owed_dispatch.check_call(return_recv_hook)
        lib, x_ptr, num_tokens, x_key = read(x)
        _, topk_ptr, topk_rows, topk_key = read(topk_idx)
        _, cum_ptr, cum_rows, cum_key = read(cumulative_local_expert_recv_stats)
        _, wait_ptr, wait_rows, wait_key = read(dispatch_wait_recv_cost_stats)
        # The statistics' lengths are in the key (the kernel writes L and R entries): an array of
        # another length is checked anew, not written past its end on a kept plan.
        key = (x_key, topk_key, cum_key, cum_rows, wait_key, wait_rows, num_max_dispatch_tokens_per_rank,
               num_experts, bool(use_fp8), bool(round_scale), bool(use_ue8m0))
        plan = self._dispatch_plans.get(key)
        if plan is None:
            plan = self._dispatch_plans.make(key, self._dispatch_plan, x, topk_idx,
                              num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                              dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0)
        if num_tokens != topk_rows:
            raise ValueError(f"topk_idx: expected one row per token of x ({num_tokens}), got {topk_rows}")
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"x: {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank}")
        layout = plan.layout
        L, rows, hidden, dev = layout.num_local_experts, layout.rows_per_expert, layout.hidden, self.device_id
        with self._on_device:
            # On the caller's current stream, as DeepEP allocates them (so an async call captures in
            # a graph: the capturing stream's pool); an async call's event keeps them and tells the
            # allocator of the communication stream (StreamOrder.finish).
            recv_x = lib.empty((L, rows, hidden), "float8_e4m3fn" if use_fp8 else "bfloat16", dev)
            scales = None
            if use_fp8 and use_ue8m0:
                scales = lib.empty((L, hidden // FP8_SCALE_BLOCK // UE8M0_PER_INT, rows), "int32", dev)
            elif use_fp8:
                scales = lib.empty((L, hidden // FP8_SCALE_BLOCK, rows), "float32", dev)
            recv_count = lib.empty((L,), "int32", dev)
            src_info = lib.empty((L, rows), "int32", dev)
            layout_range = lib.empty((L, self.num_ranks), "int64", dev)
            values = (lib.pointer(recv_x), 0 if scales is None else lib.pointer(scales), lib.pointer(recv_count),
                      lib.pointer(src_info), lib.pointer(layout_range), cum_ptr, wait_ptr, x_ptr, topk_ptr, num_tokens)
            arrays = (x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, recv_x, scales,
                      recv_count, src_info, layout_range)
            arrays = tuple(a for a in arrays if a is not None)
            outputs = tuple(a for a in (recv_x, scales, recv_count, src_info, layout_range) if a is not None)
            event, hook = self._launch(plan, lib, values, arrays, outputs, async_finish, return_recv_hook,
                                       self._owed_dispatch)
        if scales is not None:
            scales = scales.swapaxes(1, 2)  # [L, R * M, groups], column-major as DeepEP returns them
        handle = LowLatencyHandle(src_info, layout_range, layout.num_max_dispatch_tokens_per_rank, hidden,
                                  layout.num_experts)
        return ((recv_x, scales) if use_fp8 else recv_x), recv_count, handle, event, hook

    def _dispatch_plan(self, x, topk_idx, num_max, num_experts, cum_stats, wait_stats, use_fp8, round_scale,
                       use_ue8m0) -> _Plan:
        info = describe(x, "x", self.device_id)
        check_array(info, "x", ("bfloat16",), 2)
        hidden = info.shape[1]
        if hidden <= 0 or hidden % 8:
            raise ValueError(f"x: expected hidden (axis 1) a positive multiple of 8 (16-byte rows), got {hidden}")
        if use_fp8 and hidden % FP8_SCALE_BLOCK:
            raise ValueError(f"x: FP8 casts need hidden a multiple of {FP8_SCALE_BLOCK}, got {hidden}")
        if use_fp8 and use_ue8m0 and hidden % (FP8_SCALE_BLOCK * UE8M0_PER_INT):
            raise ValueError(f"x: UE8M0 scales pack 4 groups per int, so hidden must be a multiple of "
                             f"{FP8_SCALE_BLOCK * UE8M0_PER_INT}, got {hidden}")
        topk = describe(topk_idx, "topk_idx", self.device_id)
        check_array(topk, "topk_idx", ("int64",), 2)
        if topk.lib is not info.lib:
            raise TypeError("topk_idx: expected an array of the same library as x")
        num_topk = topk.shape[1]
        if not 0 < num_topk <= MAX_TOPK:
            raise ValueError(f"topk_idx: expected 1..{MAX_TOPK} columns, got {num_topk}")
        layout = self._layout(num_max, hidden, num_experts)
        if info.shape[0] > num_max:
            raise ValueError(f"x: {info.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={num_max}")
        if cum_stats is not None:
            check_array(describe(cum_stats, "cumulative_local_expert_recv_stats", self.device_id),
                        "cumulative_local_expert_recv_stats", ("int32",), 1, (layout.num_local_experts,))
        if wait_stats is not None:
            check_array(describe(wait_stats, "dispatch_wait_recv_cost_stats", self.device_id),
                        "dispatch_wait_recv_cost_stats", ("int64",), 1, (self.num_ranks,))
        fp8_mode = 0 if not use_fp8 else (3 if use_ue8m0 else (2 if round_scale else 1))
        per_call = ("recv_x", "recv_scales", "recv_count", "src_info", "layout_range", "cumulative_recv_stats",
                    "wait_recv_cost_stats", "x", "topk_idx", "num_tokens")
        fixed = dict(num_topk=num_topk, hidden=hidden, num_max=layout.num_max_dispatch_tokens_per_rank,
                     num_experts=layout.num_experts, fp8_mode=fp8_mode, shrink=int(self.enable_shrink),
                     record_bytes=layout.record_bytes, dispatch_off=layout.dispatch_offset,
                     half_bytes=layout.dispatch_half_bytes)
        return self._plan(DISPATCH_KERNEL, layout, per_call, **fixed)

    def _launch(self, plan: _Plan, lib, values: Tuple[int, ...], arrays, outputs, async_finish: bool,
                return_recv_hook: bool, owed: _OwedReceives) -> Tuple[Any, Optional[Callable[[], None]]]:
        """Launch the call (both phases, or with ``return_recv_hook`` the send), ordered as every call
        of the Buffer (deepep_cupy/gpu/streams.py); its event and its hook (the receive, then owed by the
        op) or None."""
        caller = lib.current_stream(self.device_id)
        run_on = self._order.begin(caller, None, async_finish, self.rank)
        try:
            (plan.send if return_recv_hook else plan.both).run(run_on, *values)
        except BaseException:
            self._order.abandon(run_on)
            raise
        event = self._order.finish(caller, run_on, lib, async_finish, arrays, outputs, False,
                                   self._slots.raise_if_failed)
        return event, (self._hook(plan.receive, lib, values, arrays, owed) if return_recv_hook else None)

    def _hook(self, call: KernelCall, lib, values: Tuple[int, ...], arrays, owed: _OwedReceives) -> Callable[[], None]:
        """The receive half of a call, owed by its op until launched: launched on the caller's current
        stream when called (once, in the order of the op's calls)."""
        order, slots, dev = self._order, self._slots, self.device_id
        pending = [arrays]  # the call's arrays, kept alive until the receive is issued; empty once the hook ran

        def hook() -> None:
            slots.raise_if_failed()  # as every call: not on a destroyed or failed Buffer
            if not pending:
                raise RuntimeError("deepep_cupy: this receive hook was called already (each hook runs once)")
            owed.check_hook(hook)
            with self._on_device:
                stream = lib.current_stream(dev)
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

    # -----------------------------------------------------------------------------------------
    # Combine

    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_logfmt: bool = False,
                zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False, out=None,
                combine_wait_recv_cost_stats=None):
        """See :meth:`deepep_cupy.Buffer.low_latency_combine`."""
        self._slots.raise_if_failed()
        self._owed_combine.check_call(return_recv_hook)
        _check_handle(handle)
        use_logfmt = bool(use_logfmt)
        if use_logfmt:
            _check_logfmt(handle.hidden, zero_copy)
        lib, x_ptr, x_rows, x_key = read(x)
        _, topk_ptr, num_tokens, topk_key = read(topk_idx)
        _, weights_ptr, weight_rows, weights_key = read(topk_weights)
        _, out_ptr, out_rows, out_key = read(out)
        _, src_ptr, src_rows, src_key = read(handle.src_info)
        _, range_ptr, range_rows, range_key = read(handle.layout_range)
        _, wait_ptr, wait_rows, wait_key = read(combine_wait_recv_cost_stats)
        # x's rows (one block per local expert, all read by the kernel) are in the key as the other
        # axes are: x of fewer experts is checked anew.
        key = (x_key, x_rows, topk_key, weights_key, out_key, src_key, range_key,
               handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, use_logfmt, wait_key,
               wait_rows)
        plan = self._combine_plans.get(key)
        if plan is None:
            plan = self._combine_plans.make(key, self._combine_plan, x, topk_idx, topk_weights, handle, out,
                                            use_logfmt, combine_wait_recv_cost_stats)
        if weight_rows != num_tokens or (out is not None and out_rows != num_tokens):
            raise ValueError(f"topk_weights/out: expected {num_tokens} rows (those of topk_idx), got {weight_rows}"
                             + ("" if out is None else f" and {out_rows}"))
        if num_tokens > handle.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"topk_idx: {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{handle.num_max_dispatch_tokens_per_rank}")
        layout, dev = plan.layout, self.device_id
        if src_rows != layout.num_local_experts or range_rows != layout.num_local_experts:
            raise ValueError(f"handle: expected src_info and layout_range of {layout.num_local_experts} rows (one per "
                             f"local expert), got {src_rows} and {range_rows}")
        area = self._combine_calls & 1
        if zero_copy:
            x_ptr = self.local_ptr + layout.zero_copy_offset_of(area)
        with self._on_device:
            if out is None:  # on the caller's current stream, as dispatch's outputs
                out = lib.empty((num_tokens, layout.hidden), "bfloat16", dev)
            values = (lib.pointer(out), x_ptr, topk_ptr, weights_ptr, src_ptr, range_ptr, wait_ptr, num_tokens)
            arrays = (x, topk_idx, topk_weights, handle.src_info, handle.layout_range, out)
            if combine_wait_recv_cost_stats is not None:
                arrays += (combine_wait_recv_cost_stats,)
            event, hook = self._launch(plan, lib, values, arrays, (out,), async_finish, return_recv_hook,
                                       self._owed_combine)
        self._combine_calls += 1  # launched: the next combine's rows go to the other area
        return out, event, hook

    def _combine_plan(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, out, use_logfmt: bool,
                      wait_stats) -> _Plan:
        layout = self._layout(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        info = describe(x, "x", self.device_id)
        check_array(info, "x", ("bfloat16",), 3, (layout.num_local_experts, layout.rows_per_expert, layout.hidden))
        topk = describe(topk_idx, "topk_idx", self.device_id)
        check_array(topk, "topk_idx", ("int64",), 2)
        num_topk = topk.shape[1]
        if not 0 < num_topk <= MAX_TOPK:
            raise ValueError(f"topk_idx: expected 1..{MAX_TOPK} columns, got {num_topk}")
        check_array(describe(topk_weights, "topk_weights", self.device_id), "topk_weights", ("float32",), 2,
                    (None, num_topk))
        check_array(describe(handle.src_info, "handle", self.device_id), "handle.src_info", ("int32",), 2,
                    (layout.num_local_experts, layout.rows_per_expert))
        check_array(describe(handle.layout_range, "handle", self.device_id), "handle.layout_range", ("int64",), 2,
                    (layout.num_local_experts, self.num_ranks))
        if out is not None:
            check_array(describe(out, "out", self.device_id), "out", ("bfloat16",), 2, (None, layout.hidden))
        if wait_stats is not None:
            check_array(describe(wait_stats, "combine_wait_recv_cost_stats", self.device_id),
                        "combine_wait_recv_cost_stats", ("int64",), 1, (self.num_ranks,))
        per_call = ("combined_x", "x", "topk_idx", "topk_weights", "src_info", "layout_range", "wait_recv_cost_stats",
                    "num_tokens")
        fixed = dict(num_topk=num_topk, hidden=layout.hidden, num_max=layout.num_max_dispatch_tokens_per_rank,
                     num_experts=layout.num_experts, combine_off=layout.combine_offset,
                     half_bytes=layout.combine_half_bytes, shrink=int(self.enable_shrink),
                     logfmt_unroll=logfmt_unroll(layout.hidden) if use_logfmt else 0,
                     slot_bytes=layout.combine_slot_bytes(use_logfmt))
        return self._plan(COMBINE_KERNEL, layout, per_call, **fixed)

    def next_combine_buffer(self, handle: LowLatencyHandle):
        """The zero-copy area the next combine sends from, as ``[L, R * M, hidden]`` BF16 of the handle's
        library: rows written there are what the next ``combine(..., zero_copy=True)`` sends (its ``x``
        is then only checked for shape). The two areas alternate per combine call (DeepEP's halves)."""
        _check_handle(handle)
        lib = tensors.lib_of(handle.src_info)
        area = self._combine_calls & 1
        key = (lib, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, area)
        view = self._zero_copy_views.get(key)
        if view is None:
            layout = self._layout(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
            window = lib.window(self.local_ptr + layout.zero_copy_offset_of(area), layout.zero_copy_bytes,
                                self.device_id, self._owner)
            view = lib.rows_in(window, layout.num_local_experts, (layout.rows_per_expert, layout.hidden), "bfloat16")
            self._zero_copy_views[key] = view
        return view

    # -----------------------------------------------------------------------------------------
    # Cleaning

    def clean(self, barrier: Callable[[], None]) -> None:
        """Zero this rank's call counters and signal words, between two group barriers (``barrier``):
        every rank's next call then starts from call 0, in step. Not for a capture (it waits).

        In shrink mode the barriers are DeepEP's masked ones, on the device (:data:`BARRIER_KERNEL`):
        masked ranks are not waited for, and a rank that does not arrive in time is masked, so a
        rank that stopped calling holds up no one. The mask and the barrier counts are kept."""
        from ..gpu.launch import fill_bytes

        if self.enable_shrink:
            barrier = self._device_barrier
        with self._on_device:
            self._order.synchronize()
            barrier()
            for start, end in ((LL_CALLS_INT * 4, LL_MASK_INT * 4), (SHRINK_WORDS_END * 4, LL_DATA_OFFSET)):
                fill_bytes(self.local_ptr + start, 0, end - start, self._order.ptr)
            # The counters that paired receives with sends start again: no receive is owed.
            self._owed_dispatch.clear()
            self._owed_combine.clear()
            self._order.synchronize()
            barrier()

    def _device_barrier(self) -> None:
        """The masked barrier of a shrink-mode clean: one launch on the communication stream, then
        the host waits for it."""
        call = self._barrier_call
        if call is None:
            call = self._barrier_call = launch.bind(BARRIER_KERNEL, self._shared, grid=1)
        call.run(self._order.ptr)
        self._order.synchronize()
        self._slots.raise_if_failed()

    # -----------------------------------------------------------------------------------------
    # Shrink mode: the mask (DeepEP's low_latency_*_mask_buffer)

    def _mask_ptr(self) -> int:
        if not self.enable_shrink:
            raise ValueError("enable_shrink: the mask calls need a Buffer made with enable_shrink=True "
                             "(and low_latency_mode=True)")
        return self.local_ptr + LL_MASK_INT * 4

    def update_mask(self, rank_to_mask: Any, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask`` in this rank's mask: masked ranks are neither
        sent to nor waited for. The host waits for this Buffer's calls first."""
        import numpy as np
        from cupy.cuda import runtime

        ptr = self._mask_ptr()
        rank_to_mask = check_int(rank_to_mask, "rank_to_mask", minimum=0)
        if rank_to_mask >= self.num_ranks:
            raise ValueError(f"rank_to_mask: expected a rank below {self.num_ranks}, got {rank_to_mask}")
        value = np.array([1 if mask else 0], np.int32)
        with self._on_device:
            self._order.synchronize()
            runtime.memcpy(ptr + 4 * rank_to_mask, value.ctypes.data, 4, runtime.memcpyHostToDevice)

    def query_mask(self, mask_status) -> None:
        """Copy this rank's mask into ``mask_status`` (int32 ``[num_ranks]``: 1 masked, 0 not), on the
        caller's current stream, after this Buffer's calls."""
        from cupy.cuda import runtime

        ptr = self._mask_ptr()
        info = describe(mask_status, "mask_status", self.device_id)
        check_array(info, "mask_status", ("int32",), 1, (self.num_ranks,))
        lib = info.lib
        with self._on_device:
            caller = lib.current_stream(self.device_id)
            run_on = self._order.begin(caller, None, False, self.rank)
            runtime.memcpyAsync(lib.pointer(mask_status), ptr, 4 * self.num_ranks, runtime.memcpyDeviceToDevice,
                                run_on)
            self._order.finish(caller, run_on, lib, False, (mask_status,), (), False, self._slots.raise_if_failed)

    def clean_mask(self) -> None:
        """Unmask every rank (this rank's mask). The host waits for this Buffer's calls first."""
        from ..gpu.launch import fill_bytes

        ptr = self._mask_ptr()
        with self._on_device:
            self._order.synchronize()
            fill_bytes(ptr, 0, 4 * self.num_ranks, self._order.ptr)
            self._order.synchronize()


#: The end (int index) of the shrink-mode words a clean keeps (constants.LL_MASK_INT, LL_SYNC_INT).
SHRINK_WORDS_END = LL_SYNC_INT + MAX_RANKS


def local_buffer_tensor(source: Any, dtype: Any, size: Any = None, offset: int = 0):
    """DeepEP's ``Buffer.get_local_buffer_tensor``: this rank's buffer (``source``: the Buffer's
    NvlBuffer, or its LowLatencyPath for ``use_rdma_buffer=True``) as a 1-D array of ``dtype`` (a
    ``torch.dtype`` gives a tensor, any other dtype a CuPy array) from byte ``offset`` (DeepEP's C++
    offsets the pointer in bytes) to the end of the buffer, or its first ``size`` elements shaped as
    ``size``. A view: writes land in the buffer."""
    if source is None:
        raise ValueError("use_rdma_buffer: this Buffer has no such buffer (the NVLink buffer needs num_nvl_bytes "
                         "> 0, the low-latency one low_latency_mode=True)")
    offset = check_int(offset, "offset", minimum=0)
    if offset > source.num_bytes:
        raise ValueError(f"offset: at most the buffer's {source.num_bytes} bytes, got {offset}")
    is_torch = type(dtype).__module__.startswith("torch")
    lib = tensors.library("torch" if is_torch else "cupy")
    owner = getattr(source, "_owner", None) or source
    window = lib.window(source.local_ptr + offset, source.num_bytes - offset, source.device_id, owner)
    if is_torch:
        itemsize = dtype.itemsize
        flat = window[:(source.num_bytes - offset) // itemsize * itemsize].view(dtype)
    else:
        import numpy as np

        itemsize = np.dtype(dtype).itemsize
        flat = window[:(source.num_bytes - offset) // itemsize * itemsize].view(dtype)
    if size is None:
        return flat
    shape = tuple(size) if isinstance(size, (tuple, list)) or hasattr(size, "numel") else (int(size),)
    count = 1
    for extent in shape:
        count *= int(extent)
    if count > flat.shape[0]:
        raise ValueError(f"size: {count} elements, more than the {flat.shape[0]} of the buffer from offset {offset}")
    return flat[:count].reshape(shape)


def logfmt_unroll(hidden: int) -> int:
    """The int4 per lane of a LogFMT chunk (DeepEP's kNumSendUnrolls): 4 (1024 channels) when hidden
    is a multiple of 1024, else 2 (512)."""
    return 4 if hidden % 1024 == 0 else 2


def _check_logfmt(hidden: int, zero_copy: bool) -> None:
    if zero_copy:
        raise ValueError("use_logfmt=True with zero_copy=True: the LogFMT cast reads x itself (DeepEP refuses "
                         "them together too); pass one of them")
    if hidden % LOGFMT_HIDDEN_MULTIPLE:
        raise ValueError(f"use_logfmt=True: LogFMT needs hidden a multiple of {LOGFMT_HIDDEN_MULTIPLE}, got {hidden}")
    if hidden // (256 * logfmt_unroll(hidden)) > LOGFMT_MAX_CHUNKS:
        raise ValueError(f"use_logfmt=True: hidden {hidden} is more than {LOGFMT_MAX_CHUNKS} LogFMT chunks")


def _check_handle(handle: Any) -> None:
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"handle: expected the handle returned by low_latency_dispatch, got {type(handle).__name__}")


def clean_arguments(num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> None:
    """Check :meth:`Buffer.clean_low_latency_buffer`'s arguments (sizes it no longer needs: the signal
    words sit at fixed places)."""
    check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
    check_int(hidden, "hidden")
    check_int(num_experts, "num_experts")


def _capturing(stream_ptr: int) -> bool:
    from cupy.cuda import runtime

    return bool(runtime.streamIsCapturing(stream_ptr))


def _synchronize(stream_ptr: int) -> None:
    from cupy.cuda import runtime

    runtime.streamSynchronize(stream_ptr)


assert MAX_RANKS <= 8  # the release words hold MAX_RANKS readers per (op, half)
