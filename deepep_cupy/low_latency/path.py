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
the host refuses what would pair them wrongly (:mod:`.receive_hooks`). The zero-copy rows have two
areas too, alternating per combine call as DeepEP's halves alternate per call (counted on the host,
as DeepEP counts its buffer index: a captured call keeps the area it was captured with):
:meth:`LowLatencyPath.next_combine_buffer` is the area the next combine sends from, so the rows of
a second combine can be written while the first one's send still reads its own.

The path's parts: :mod:`.layout` (where the data lie, the size hint), :mod:`.checks` (the sizes'
checks), :mod:`.handle`, :mod:`.receive_hooks`, :mod:`.rank_mask` (shrink mode) and
:mod:`deepep_cupy.gpu.local_buffer` (DeepEP's ``get_local_buffer_tensor``); this module keeps the calls, and names
the ones the Buffer imports from it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

from .. import tensors
from ..constants import (
    FP8_SCALE_BLOCK,
    LL_CALLS_INT,
    LL_DATA_OFFSET,
    LL_MASK_INT,
    MAX_TOPK,
    UE8M0_PER_INT,
)
from ..gpu import launch
from ..gpu.call_span import CallSpan
from ..gpu.launch import KernelCall
from ..gpu.local_buffer import local_buffer_tensor
from ..gpu.plan_cache import PlanCache
from ..gpu.slots import ERROR_RECORD
from ..tensors import ArrayLib, check_array, check_int, describe, read
from .arguments import check_logfmt, checked_layout, clean_arguments
from .handle import LowLatencyHandle, low_latency_handle
from .layout import SHRINK_WORDS_END, LowLatencyLayout, get_low_latency_rdma_size_hint, logfmt_unroll
from .rank_mask import RankMask
from .receive_hooks import OwedReceives, receive_hook

# The Buffer imports the size hint, the clean's check and local_buffer_tensor from here.
__all__ = ["LowLatencyHandle", "LowLatencyLayout", "LowLatencyPath", "Relay", "clean_arguments",
           "get_low_latency_rdma_size_hint", "local_buffer_tensor"]

#: The kernels (kernels/low_latency.cu), namespaced as DeepEP's: DeepEP's benchmark (bench_kineto)
#: finds them by ``::dispatch`` / ``::combine`` in the profiler's kernel names.
DISPATCH_KERNEL = "deepep_cupy::low_latency::dispatch"
COMBINE_KERNEL = "deepep_cupy::low_latency::combine"
#: The masked barrier of a clean in shrink mode.
BARRIER_KERNEL = "deepep_cupy::low_latency::barrier"
#: Blocks per launch at most (fewer where ranks share a GPU: their grids must fit on it together).
#: 66 against 32 on 2 ranks sharing an H100: 128 tokens 69 / 54 us against 82 / 61, 1 token
#: within 1 us (docs/PERFORMANCE.md, "Decode on one GPU").
DEFAULT_NUM_SMS = 66
_PHASE_SEND, _PHASE_RECV, _PHASE_BOTH = 1, 2, 3


class Relay(NamedTuple):
    """The steps of a decode call across nodes around the node's kernels
    (:mod:`deepep_cupy.low_latency.across_nodes`): ``before(stream)`` runs before the send,
    ``after(stream, outputs)`` after the receive (in the hook with ``return_recv_hook``), on the
    same stream; ``arrays`` are what they read or write, kept alive as the call's arrays are."""

    before: Callable[[int], None]
    after: Callable[[int, Tuple[Any, ...]], None]
    arrays: Tuple[Any, ...] = ()


class _ReceiveThen:
    """A receive half followed by a relay's ``after`` step (what a hook launches)."""

    def __init__(self, receive: KernelCall, after: Callable[[int, Tuple[Any, ...]], None],
                 outputs: Tuple[Any, ...]):
        self._receive, self._after, self._outputs = receive, after, outputs

    def run(self, stream: int, *values) -> None:
        self._receive.run(stream, *values)
        self._after(stream, self._outputs)


class _Plan(NamedTuple):
    """A checked kind of dispatch or combine: its layout, the library of its arrays and its kernel
    bound once per phase."""

    layout: LowLatencyLayout
    lib: ArrayLib        # x's (its kind, so its library, is in the plan's key)
    send: KernelCall     # the send half (return_recv_hook=True)
    receive: KernelCall  # the receive half (the hook)
    both: KernelCall


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
        self._span = CallSpan(order, device_id, rank, slots=slots, mark_gave_up=getattr(owner, "mark_gave_up", None))
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
        self._barrier_call: Optional[KernelCall] = None
        self._owed_dispatch = OwedReceives("dispatch")
        self._owed_combine = OwedReceives("combine")
        self._rank_mask = RankMask(local_ptr + LL_MASK_INT * 4, rank=rank, num_ranks=num_ranks, device_id=device_id,
                                   order=order, slots=slots, on_device=on_device)

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

    @property
    def shared_arguments(self) -> Mapping[str, int]:
        """The arguments this buffer's kernels share (:func:`deepep_cupy.gpu.launch.shared_arguments`; read only)."""
        return self._shared

    def check(self) -> None:
        """Raise what a wait outside the Buffer's own kernels left behind: none on one node (the
        kernels' errors are the slots')."""

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

    def _plan(self, kernel: str, layout: LowLatencyLayout, lib: ArrayLib, per_call: Tuple[str, ...],
              **fixed) -> _Plan:
        """``kernel`` bound for each of its phases (send, receive, both) with the shared arguments
        it names and ``fixed``."""
        return _Plan(layout, lib, *(launch.bind(kernel, self._shared, grid=self.num_sms, per_call=per_call,
                                                phases=phases, **fixed)
                                    for phases in (_PHASE_SEND, _PHASE_RECV, _PHASE_BOTH)))

    def _layout(self, num_max: Any, hidden: int, num_experts: Any) -> LowLatencyLayout:
        return checked_layout(num_max, hidden, num_experts, self.num_ranks, self.num_bytes)

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                 use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                 async_finish: bool = False, return_recv_hook: bool = False, relay: Optional[Relay] = None):
        """See :meth:`deepep_cupy.Buffer.low_latency_dispatch`; ``relay``: steps of a call across nodes."""
        self._slots.raise_if_failed()
        self._owed_dispatch.check_call(return_recv_hook)
        _, x_ptr, num_tokens, x_key = read(x)
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
        layout, lib = plan.layout, plan.lib
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
                                       self._owed_dispatch, relay)
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
        return self._plan(DISPATCH_KERNEL, layout, info.lib, per_call, **fixed)

    def _launch(self, plan: _Plan, lib: ArrayLib, values: Tuple[int, ...], arrays: Tuple[Any, ...],
                outputs: Tuple[Any, ...], async_finish: bool, return_recv_hook: bool,
                owed: OwedReceives, relay: Optional[Relay] = None) -> Tuple[Any, Optional[Callable[[], None]]]:
        """Launch the call (both phases, or with ``return_recv_hook`` the send), ordered as every call
        of the Buffer (deepep_cupy/gpu/streams.py), with ``relay``'s steps around it; its event and its
        hook (the receive, then owed by the op) or None."""
        if relay is not None:
            arrays = arrays + relay.arrays
        with self._span.begin(lib, None, async_finish) as span:
            span.launched = True
            if relay is not None:
                relay.before(span.run_on)
            (plan.send if return_recv_hook else plan.both).run(span.run_on, *values)
            if relay is not None and not return_recv_hook:
                relay.after(span.run_on, outputs)
            span.settled = True
            event = span.finish(lib, async_finish, arrays, outputs)
        if not return_recv_hook:
            return event, None
        receive = plan.receive if relay is None else _ReceiveThen(plan.receive, relay.after, outputs)
        return event, receive_hook(receive, lib, values, arrays, owed, order=self._order, slots=self._slots,
                                   device_id=self.device_id, on_device=self._on_device)

    # -----------------------------------------------------------------------------------------
    # Combine

    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_logfmt: bool = False,
                zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False, out=None,
                combine_wait_recv_cost_stats=None, relay: Optional[Relay] = None):
        """See :meth:`deepep_cupy.Buffer.low_latency_combine`; ``relay``: steps of a call across nodes."""
        self._slots.raise_if_failed()
        self._owed_combine.check_call(return_recv_hook)
        low_latency_handle(handle)
        use_logfmt = bool(use_logfmt)
        if use_logfmt:
            check_logfmt(handle.hidden, zero_copy)
        _, x_ptr, x_rows, x_key = read(x)
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
        layout, lib, dev = plan.layout, plan.lib, self.device_id
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
            arrays: Tuple[Any, ...] = (x, topk_idx, topk_weights, handle.src_info, handle.layout_range, out)
            if combine_wait_recv_cost_stats is not None:
                arrays += (combine_wait_recv_cost_stats,)
            event, hook = self._launch(plan, lib, values, arrays, (out,), async_finish, return_recv_hook,
                                       self._owed_combine, relay)
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
        return self._plan(COMBINE_KERNEL, layout, info.lib, per_call, **fixed)

    def next_combine_buffer(self, handle: LowLatencyHandle):
        """The zero-copy area the next combine sends from, as ``[L, R * M, hidden]`` BF16 of the handle's
        library: rows written there are what the next ``combine(..., zero_copy=True)`` sends (its ``x``
        is then only checked for shape). The two areas alternate per combine call (DeepEP's halves)."""
        low_latency_handle(handle)
        lib = tensors.lib_of(handle.src_info)
        if lib is None:
            raise TypeError(f"handle.src_info: expected the CuPy array or PyTorch tensor a low-latency dispatch "
                            f"returned, got {type(handle.src_info).__name__}")
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
        if self.enable_shrink:
            barrier = self._device_barrier
        with self._on_device:
            self._order.synchronize()
            barrier()
            for start, end in ((LL_CALLS_INT * 4, LL_MASK_INT * 4), (SHRINK_WORDS_END * 4, LL_DATA_OFFSET)):
                launch.fill_bytes(self.local_ptr + start, 0, end - start, self._order.ptr)
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

    def _mask(self) -> RankMask:
        if not self.enable_shrink:
            raise ValueError("enable_shrink: the mask calls need a Buffer made with enable_shrink=True "
                             "(and low_latency_mode=True)")
        return self._rank_mask

    def update_mask(self, rank_to_mask: Any, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask`` in this rank's mask: masked ranks are neither
        sent to nor waited for. The host waits for this Buffer's calls first."""
        self._mask().update(rank_to_mask, mask)

    def query_mask(self, mask_status: Any) -> None:
        """Copy this rank's mask into ``mask_status`` (int32 ``[num_ranks]``: 1 masked, 0 not), on the
        caller's current stream, after this Buffer's calls."""
        self._mask().query(mask_status)

    def clean_mask(self) -> None:
        """Unmask every rank (this rank's mask). The host waits for this Buffer's calls first."""
        self._mask().clear()
