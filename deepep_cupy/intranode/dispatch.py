"""The host path of ``Buffer.dispatch``: fresh (the host waits for the receive counts, or allocates
ahead of them), with ``num_worst_tokens`` (never waits: counts and verdict stay on the device) and
cached (the layout of an earlier dispatch's handle).

A :class:`DispatchPath` is owned by an intranode engine
(:class:`deepep_cupy.intranode.engine.IntranodeEngine`), whose ``dispatch`` checks the shared
arguments and routes here; the transfer kernel's binding and outputs are :mod:`.transfer`'s. It
takes everything the engine's operations share from the
:class:`deepep_cupy.intranode.context.OperationContext` it is given (group, slots, stream order,
NVLink buffer, plans, binding and ordering a call), and keeps what only dispatches need: the
receive-count guess, the outputs prepared for the next call, how the last one was sized.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

import numpy as np

from ..constants import VERDICT_OVER_CAPACITY
from ..errors import DeepEPError
from ..gpu import launch
from ..gpu.launch import KernelCall
from ..gpu.layout import INT_BYTES
from ..gpu.slots import host_failure_code, refused_before_launch, verdict_error
from ..tensors import read, row_bytes
from . import plans
from .capacity import ReceiveCapacityGuess
from .context import OperationContext
from .handle import DispatchHandle, KeptOutputs, handle_layout, kept_outputs
from .next_outputs import NextOutputs, ReadyOutputs, prepared_rows
from .plans import CachedDispatchPlan, FreshDispatchPlan
from .rows_in_buffer import RowsInBuffer
from .transfer import (
    bind_transfer,
    check_recv_rows_fit,
    device_pointers,
    dispatch_outputs,
    output_windows,
    scale_strides_of,
)

#: The array arguments of a fresh and of a cached dispatch, as their errors name them (``x[1]``:
#: the FP8 scales of ``x = (rows, scales)``).
FRESH_INPUTS = ("x", "x[1]", "num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert", "topk_idx",
                "topk_weights")
CACHED_INPUTS = FRESH_INPUTS[:2]

#: dispatch_kernel's parameters that change per call, in the order ``run`` takes them: a fresh
#: dispatch's transfer; then, when it makes the count exchange itself, the exchange's; a cached one's.
TRANSFER_PER_CALL = ("recv_x", "recv_x_scales", "recv_src_idx", "recv_topk_idx", "recv_topk_weights",
                     "recv_channel_prefix_matrix", "send_head", "x", "x_scales", "topk_idx", "topk_weights",
                     "is_token_in_rank", "channel_prefix_matrix", "rank_prefix_matrix", "num_tokens",
                     "scale_token_stride", "scale_hidden_stride")
EXCHANGE_PER_CALL = ("num_tokens_per_rank", "num_tokens_per_expert", "recv_capacity", "recv_counter", "mismatch_flag",
                     "recv_expert_counter")
#: ... when it makes the exchange for a host that waits for the counts (in the slots the plan binds).
HOST_EXCHANGE_PER_CALL = ("num_tokens_per_rank", "num_tokens_per_expert", "recv_capacity")
CACHED_PER_CALL = ("recv_x", "recv_x_scales", "x", "x_scales", "is_token_in_rank", "channel_prefix_matrix",
                   "rank_prefix_matrix", "num_tokens", "scale_token_stride", "scale_hidden_stride", "dispatch_verdict")
#: ... when it only refuses the call: its operation (``check_op``) is then minus what failed.
CACHED_REFUSE_PER_CALL = CACHED_PER_CALL[:-1] + ("check_op", "dispatch_verdict")
#: expand_kernel's.
EXPAND_PER_CALL = ("expanded_x", "expanded_scales", "expanded_rows", "recv_x", "recv_scales", "recv_topk_idx",
                   "num_recv")
#: notify_dispatch_kernel's.
NOTIFY_PER_CALL = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "rank_prefix_matrix",
                   "channel_prefix_matrix", "recv_capacity", "topk_idx", "num_tokens")


def refusal_scratch(lib, device_id: int, num_ranks: int, num_channels: int) -> Tuple[Any, int]:
    """``(array, its address)``: device memory for the prefix matrices a count exchange writes when
    this rank takes part only to refuse the call (its handle may be what it failed to allocate):
    made with the plan, before any call needs it."""
    scratch = lib.empty((num_ranks * (num_ranks + num_channels),), "int32", device_id)
    return scratch, lib.pointer(scratch)


#: Output addresses of a dispatch that allocates no outputs (rows in place).
NO_OUTPUTS = (0, 0, 0, 0)


def ahead_row_bytes(outputs, kept: Optional[KeptOutputs], rows_in_buffer: bool) -> int:
    """Bytes per received row that a fresh dispatch allocating ahead allocates: its handle's source
    index, the outputs the handle's allocation keeps (``kept``) and those allocated apart (of
    ``outputs``, ``plans.received_arrays``: none with rows in place, ``recv_x`` alone when the
    others are kept)."""
    apart = () if rows_in_buffer else outputs[:1] if kept is not None else outputs
    return INT_BYTES + (0 if kept is None else kept.row_bytes) + sum(row_bytes(*out) for out in apart
                                                                     if out is not None)


def checked_in_buffer(recv_x_in_buffer) -> bool:
    """``recv_x_in_buffer`` checked (a bool)."""
    if not isinstance(recv_x_in_buffer, (bool, np.bool_)):
        raise TypeError(f"recv_x_in_buffer: expected a bool, got {recv_x_in_buffer!r}")
    return bool(recv_x_in_buffer)


class DispatchCall(NamedTuple):
    """One fresh dispatch's arguments as the kernels take them."""
    plan: FreshDispatchPlan
    lib: Any
    num_tokens: int
    x: int
    x_scales: int
    per_rank: int
    in_rank: int
    per_expert: int
    topk: int
    weights: int
    scale_strides: Tuple[int, int]  # (token, scale) strides of x's FP8 scales, in elements
    arrays: tuple  # (x rows, scales, per_rank, in_rank, per_expert, topk, weights) as the caller passed them

    @property
    def in_rank_array(self) -> Any:
        return self.arrays[3]

    @property
    def topk_array(self) -> Any:
        return self.arrays[5]


def dispatch_result(outputs, per_expert_list, handle: DispatchHandle, event) -> tuple:
    """DeepEP's dispatch result from ``[recv_x, recv_scales, recv_topk_idx, recv_topk_weights]``:
    ``(recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights, per_expert_list, handle, event)``."""
    recv_x, recv_scales, recv_topk, recv_weights = outputs
    return (recv_x if recv_scales is None else (recv_x, recv_scales), recv_topk, recv_weights, per_expert_list,
            handle, event)


class DispatchPath:
    """A Buffer's layout and dispatch, after their shared arguments were checked (see the module
    docstring).

    Args:
        context: the Buffer's :class:`deepep_cupy.intranode.context.OperationContext`.
        rows_in_buffer: which dispatch's rows lie in the buffer (:mod:`.rows_in_buffer`), shared
            with the combine path.
        allocate_ahead: size a fresh dispatch's outputs from a guess (``capacity.py``).

    Attributes:
        allocate_ahead, last_dispatch_allocation, last_dispatch_rows_allocated: as the Buffer's.
    """

    def __init__(self, context: OperationContext, rows_in_buffer: RowsInBuffer, allocate_ahead: bool):
        self._ctx = context
        self._rows_in_buffer = rows_in_buffer
        self.allocate_ahead = bool(allocate_ahead)
        self.last_dispatch_allocation: Optional[str] = None
        self.last_dispatch_rows_allocated: Optional[int] = None
        self._capacity_guess = ReceiveCapacityGuess()
        self._next_outputs = NextOutputs()
        self._expand_calls: Dict[tuple, KernelCall] = {}

    def forget(self) -> None:
        """Let go of what the dispatches keep between calls (the Buffer is being destroyed)."""
        self._next_outputs.drop()
        self._expand_calls.clear()

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def fresh(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
              expert_alignment, num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream,
              expand=False, recv_x_in_buffer=False):
        """A dispatch with routing (``Buffer.dispatch`` without a handle)."""
        ctx = self._ctx
        call = self._read_fresh(x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                topk_weights, expert_alignment, config, recv_x_in_buffer)
        if expand:
            if num_worst_tokens:
                raise ValueError("expand: the expanded rows are sized from the receive counts, which a dispatch "
                                 "with num_worst_tokens does not wait for; pass one or the other")
            if call.topk_array is None:
                raise ValueError("expand: rows are grouped by their top-k experts; pass topk_idx")
        if num_worst_tokens:
            return self._worst_case_dispatch(call, num_worst_tokens, previous_event, async_finish,
                                             allocate_on_comm_stream)
        # Every round allocates its outputs before its count exchange (so a host that fails to
        # allocate can still take part, only to refuse the call on every rank): from the guess,
        # or, without one, for nothing, so that the round's count exchange tells the host its
        # count. A round some rank lacks rows for moves nothing on any rank, and every rank redoes
        # the call with the count it was given.
        guess = self._capacity_guess.rows(call.num_tokens, call.plan.most_recv_rows) if self.allocate_ahead else None
        rows = 0 if guess is None else guess
        with ctx.on_device:
            out = self._exchange_and_transfer(call, rows, guess, previous_event, async_finish,
                                              allocate_on_comm_stream, expand)
            if isinstance(out, int):
                # Some rank received more than it allocated: every rank's transfer moved nothing.
                # Again, with exactly the rows this rank's count exchange said it receives (all
                # ranks come here together, and the second round fits on every one).
                self.last_dispatch_allocation = "exact" if guess is None else "retried"
                first_rows = self.last_dispatch_rows_allocated
                out = self._exchange_and_transfer(call, out, None, previous_event, async_finish,
                                                  allocate_on_comm_stream, expand)
                self.last_dispatch_rows_allocated = max(first_rows, self.last_dispatch_rows_allocated)
                if isinstance(out, int):  # pragma: no cover - the same inputs give the same counts
                    raise DeepEPError(f"rank {ctx.rank}: a dispatch redone with its exact receive count was "
                                      "refused for want of rows again")
            else:
                self.last_dispatch_allocation = "exact" if guess is None else "ahead"
        self._capacity_guess.observe(call.num_tokens, out[4].num_recv_tokens)
        return out

    def _worst_case_dispatch(self, call: DispatchCall, num_worst_tokens: int, previous_event, async_finish: bool,
                             allocate_on_comm_stream: bool):
        """A fresh dispatch whose outputs have ``num_worst_tokens`` rows (DeepEP's fixed-size mode)."""
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, (int, np.integer)) \
                or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens: expected a non-negative int, got {num_worst_tokens!r}")
        rows, plan, lib, dev = int(num_worst_tokens), call.plan, call.lib, self._ctx.device_id
        spec = plan.spec
        check_recv_rows_fit(plan, rows, "num_worst_tokens")
        num_local_experts = spec.num_experts // self._ctx.num_ranks
        layout = handle_layout(self._ctx.num_ranks, spec.config.num_channels, call.num_tokens)
        ctx = self._ctx
        with ctx.on_device, ctx.span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as ordered:
            run_on = ordered.run_on
            try:
                with ctx.allocating(lib, allocate_on_comm_stream):
                    block = lib.empty((layout.words(rows, num_local_experts),), "int64", dev)
                    outputs = dispatch_outputs(self._ctx, lib, plan, rows)
            except BaseException as failure:
                # The peers learn of it at their next call, as of any refusal of this dispatch (a
                # capture runs nothing: there is no call to refuse).
                if not self._ctx.order.capturing:
                    self._refuse(call, run_on, failure, peers_raise_later=True)
                raise
            ordered.launched = True
            handle = DispatchHandle(lib, block, layout, None, call.in_rank_array, call.in_rank, self._ctx.owner)
            handle.publish_on_device(rows, num_local_experts)
            self._rows_in_buffer.note_dispatch(plan, handle)
            pointers = device_pointers(lib, outputs)
            if outputs[2] is not None:
                # All bytes 0xFF: every id -1; the transfer then writes the rows it receives.
                launch.fill_bytes(pointers[2], 0xFF, rows * spec.num_topk * 8, run_on)
            self._launch_transfer(run_on, plan.main_with_exchange, call, pointers, handle,  # EXCHANGE_PER_CALL
                                  call.per_rank, call.per_expert, rows, handle.recv_count_ptr, handle.verdict_ptr,
                                  handle.recv_expert_counts_ptr)
            ordered.settled = True
            allocated = (block, *outputs)
            event = ordered.finish(lib, async_finish, (*call.arrays, *allocated), allocated,
                               allocate_on_comm_stream)
        self.last_dispatch_allocation = "fixed"
        return dispatch_result(outputs, [], handle, event)

    def _launch_notify(self, stream: int, call: DispatchCall, handle: DispatchHandle, recv_capacity: int) -> None:
        """notify_dispatch of a fresh dispatch whose host waits for the counts (in the slots)."""
        call.plan.notify.run(stream, call.per_rank, call.per_expert, call.in_rank, handle.rank_prefix_ptr,
                   handle.channel_prefix_ptr, recv_capacity, call.topk, call.num_tokens)

    def _read_fresh(self, x, per_rank, in_rank, per_expert, topk_idx, topk_weights, expert_alignment,
                    config, recv_x_in_buffer) -> DispatchCall:
        """A fresh dispatch's arguments, checked by the plan made for arguments of their kinds."""
        rows, scales = plans.split_x(x)
        lib, x_ptr, n, x_key = read(rows)
        _, s_ptr, n_s, s_key = read(scales)
        _, r_ptr, n_r, r_key = read(per_rank)
        _, i_ptr, n_i, i_key = read(in_rank)
        _, e_ptr, n_e, e_key = read(per_expert)
        _, t_ptr, n_t, t_key = read(topk_idx)
        _, w_ptr, n_w, w_key = read(topk_weights)
        ctx = self._ctx
        if self._rows_in_buffer.used:
            self._rows_in_buffer.refuse_inputs(ctx.nvl, FRESH_INPUTS, x_ptr, s_ptr, r_ptr, i_ptr, e_ptr, t_ptr, w_ptr)
        key = ("dispatch", type(x) is tuple, x_key, s_key, r_key, n_r, i_key, e_key, n_e, t_key, w_key,
               expert_alignment, config, recv_x_in_buffer)
        plan = ctx.plans.get(key)
        if plan is None or (n, n_s, n_i, n_t, n_w).count(n) != plan.row_args:
            plan = ctx.plans.make(key, self._fresh_plan, x, per_rank, in_rank, per_expert, topk_idx, topk_weights,
                            expert_alignment, config, recv_x_in_buffer)
        return DispatchCall(plan, lib, n, x_ptr, s_ptr, r_ptr, i_ptr, e_ptr, t_ptr, w_ptr,
                             scale_strides_of(plan.spec.rows, lib, scales),
                             (rows, scales, per_rank, in_rank, per_expert, topk_idx, topk_weights))

    def _fresh_plan(self, x, per_rank, in_rank, per_expert, topk_idx, topk_weights, expert_alignment, config,
                    recv_x_in_buffer):
        ctx = self._ctx
        spec = plans.check_fresh_dispatch(ctx.checks, x, per_rank, in_rank, per_expert, topk_idx, topk_weights,
                                          expert_alignment, config, checked_in_buffer(recv_x_in_buffer))
        lay = spec.layout
        row_bytes, topk_code, num_scales, num_experts, num_sms, send_chunk, recv_chunk = spec.signature
        # The count exchange of a host that waits for the counts, and of one that only refuses the call.
        exchange_settings = dict(row_bytes=row_bytes, topk_code=topk_code, num_scales=num_scales, num_sms=num_sms,
                                 send_chunk=send_chunk, recv_chunk=recv_chunk, num_topk=spec.num_topk,
                                 num_experts=num_experts, num_channels=config.num_channels,
                                 expert_alignment=spec.expert_alignment, zero_off=lay.meta_off,
                                 zero_count=lay.zero_count, region_tokens=lay.region_tokens, **ctx.host_counts)
        notify = ctx.bind("notify_dispatch_kernel", grid=1 + ctx.num_ranks, per_call=NOTIFY_PER_CALL,
                          **exchange_settings)
        main = bind_transfer(self._ctx, spec, TRANSFER_PER_CALL)
        exchange = dict(exchange=1, row_bytes=row_bytes, topk_code=topk_code, num_sms=num_sms, recv_chunk=recv_chunk,
                        expert_alignment=spec.expert_alignment, zero_off=lay.meta_off, zero_count=lay.zero_count)
        main_with_exchange = bind_transfer(self._ctx, spec, TRANSFER_PER_CALL + EXCHANGE_PER_CALL, **exchange,
                                                 report_refusal=1)
        main_for_host = bind_transfer(self._ctx, spec, TRANSFER_PER_CALL + HOST_EXCHANGE_PER_CALL, **exchange,
                                            **ctx.host_counts)
        row_args = 2 + (spec.rows.scales is not None) + (spec.num_topk > 0) + spec.with_weights
        outputs = plans.received_arrays(spec)
        lib = spec.rows.lib
        kept = kept_outputs(outputs) if lib.carves_outputs and not spec.rows_in_buffer else None
        return FreshDispatchPlan(spec, notify, main, row_args, outputs, main_with_exchange, kept,
                                 output_windows(self._ctx, self._rows_in_buffer, lib, spec, outputs), main_for_host,
                                 ahead_row_bytes(outputs, kept, spec.rows_in_buffer),
                                 refusal_scratch(lib, ctx.device_id, ctx.num_ranks, config.num_channels),
                                 ctx.num_ranks * lay.region_tokens)

    def _exchange_and_transfer(self, call: DispatchCall, rows: int, rows_guessed: Optional[int], previous_event,
                               async_finish: bool, allocate_on_comm_stream: bool, expand: bool = False):
        """One round of a fresh dispatch whose host waits for the counts: its outputs allocated for
        ``rows`` received rows (or more), then the count exchange and the transfer.

        Returns the call's result, or, when some rank receives more rows than it allocated (nothing
        was moved on any rank), this rank's receive count: the rows to redo the call with.
        ``rows_guessed``: the guess ``rows`` came from (None for a round sized otherwise); a steady
        loop's call prepares the next call's outputs from it. With ``expand`` the rows come back
        grouped per local expert (:meth:`_expand`).

        The round takes the allocations the previous call made for it (``next_outputs.py``) or
        makes them, always before its first launch: a host that fails to allocate (out of memory,
        or interrupted) then takes part in the count exchange only to refuse the call, every rank
        raises from it and the Buffer stays usable (:meth:`_refuse`). Ranks with processes of their
        own launch the transfer alone, making the count exchange itself (``plan.main_for_host``);
        in-process ranks launch the count exchange first, as notify_dispatch, then the transfer:
        their host waits for the counts through an event recorded after notify_dispatch
        (HostSlots.wait_for_count). While the host waits for the counts, a steady loop's call
        allocates the next call's outputs.

        Allocated by a library that carves (``plan.kept_outputs``: CuPy), the outputs besides
        ``recv_x`` lie in the handle's allocation: two allocations per call, and one view per output
        once the count is known (``recv_x`` trimmed, the others carved out of the handle's
        allocation). Otherwise each output is allocated and cut to the count (``ArrayLib.shrink``).
        With rows in place (``plan.windows``) nothing is allocated but the handle: the outputs are
        views of the Buffer's areas, made once the count is known.
        """
        ctx = self._ctx
        plan, lib = call.plan, call.lib
        kept = plan.kept_outputs
        with ctx.span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as ordered:
            caller, run_on = ordered.caller, ordered.run_on
            if ctx.order.capturing:
                raise ValueError("dispatch: a fresh dispatch without num_worst_tokens makes the host wait for the "
                                 "receive counts, which a CUDA graph capture cannot; pass num_worst_tokens "
                                 "(fixed-size outputs, no host wait) or capture a cached dispatch")
            ready = self._next_outputs.take(plan, call.num_tokens, caller, allocate_on_comm_stream, rows)
            try:
                if ready is not None:
                    rows, handle, kept_offset = ready.rows, ready.handle, ready.kept_offset
                    outputs, pointers = ready.outputs, ready.pointers
                else:
                    layout = handle_layout(ctx.num_ranks, plan.spec.config.num_channels, call.num_tokens)
                    handle, kept_offset = self._allocate_handle(lib, plan, layout, rows, allocate_on_comm_stream)
                    outputs, pointers = self._outputs_ahead(lib, plan, handle.base_ptr + kept_offset, rows,
                                                            allocate_on_comm_stream)
            except BaseException as failure:
                self._refuse(call, run_on, failure)
                raise
            self.last_dispatch_rows_allocated = rows
            ctx.slots.start_dispatch()
            kernel_done = event = None
            ordered.launched = True
            if ctx.exchange_in_transfer:
                self._launch_transfer(run_on, plan.main_for_host, call, pointers, handle,  # HOST_EXCHANGE_PER_CALL
                                      call.per_rank, call.per_expert, rows)
            else:
                self._launch_notify(run_on, call, handle, rows)
                ctx.order.record_notify_done(run_on)  # in-process ranks wait on it (HostSlots.wait_for_count)
                kernel_done = ctx.order.notify_done
                self._launch_transfer(run_on, plan.main, call, pointers, handle)
            handle.route(call.in_rank_array, call.in_rank)
            self._rows_in_buffer.note_dispatch(plan, handle)
            block = handle.block
            # What is returned lies in these allocations (views of them, or they themselves cut to
            # the count): handing them to the stream order and the allocators covers it.
            allocated = (block,) if outputs is None else (block, *outputs)
            if not expand:
                # Every kernel of the call is queued: the call is handed over while the count
                # exchange runs, which the host waits for anyway (docs/PERFORMANCE.md).
                event = ordered.finish(lib, async_finish, (*call.arrays, *allocated), allocated,
                                   allocate_on_comm_stream)
            if self._next_outputs.steady and rows_guessed is not None:
                self._prepare_next(lib, plan, handle.layout, rows_guessed, caller, allocate_on_comm_stream)
            num_recv = ctx.slots.wait_for_count(kernel_done)
            verdict = ctx.slots.verdict()
            ordered.settled = True
            if verdict == VERDICT_OVER_CAPACITY:
                ordered.abandon()  # the transfer moved nothing
                return num_recv
            if verdict:
                raise self._verdict_error(verdict, call)
            per_expert_list = ctx.slots.expert_counts(plan.spec.num_experts // ctx.num_ranks)
            if plan.windows is not None:
                outputs = dispatch_outputs(self._ctx, lib, plan, num_recv)
            elif outputs is not None:
                shrink = lib.shrink
                outputs = [None if a is None else shrink(a, num_recv) for a in outputs]
                if kept is not None:
                    outputs += lib.carve(block, kept.views(kept_offset, rows, num_recv))
            handle.num_recv_tokens = num_recv
            if expand:
                with ctx.allocating(lib, allocate_on_comm_stream):
                    outputs, expanded = self._expand(run_on, lib, plan.spec, outputs, per_expert_list, handle)
                allocated = (*allocated, *expanded)
            if event is None:
                event = ordered.finish(lib, async_finish, (*call.arrays, *allocated), allocated,
                                   allocate_on_comm_stream)
            return dispatch_result(outputs, per_expert_list, handle, event)

    def _refuse(self, call: DispatchCall, run_on: int, failure: BaseException, peers_raise_later: bool = False) -> None:
        """Take part in a fresh dispatch's count exchange only to refuse it, after this rank's host
        failed to get ready for it (``failure``: its outputs could not be allocated, or it was
        interrupted): notify_dispatch with a negative capacity, minus what failed, so that every
        rank's verdict names this rank, nothing moves, and the Buffer stays usable. Waits for the
        exchange, so that the call ends on every rank alike. This rank raises ``failure`` itself;
        its peers raise from the verdict (a dispatch with ``num_worst_tokens``: from their error
        record, at their next call), so none is left in this rank's record, which the count wait
        would raise instead of ``failure``. The call span (``CallSpan``) abandons ``run_on`` as
        the exception leaves it."""
        code = host_failure_code(failure)
        plan = call.plan
        scratch = plan.refusal_scratch[1]
        self._ctx.slots.start_dispatch()
        plan.notify.run(run_on, call.per_rank, call.per_expert, call.in_rank, scratch,
                        scratch + INT_BYTES * self._ctx.num_ranks * self._ctx.num_ranks, -code, call.topk,
                        call.num_tokens)
        kernel_done = None
        if not self._ctx.exchange_in_transfer:  # in-process ranks: as _exchange_and_transfer's
            self._ctx.order.record_notify_done(run_on)
            kernel_done = self._ctx.order.notify_done
        try:
            self._ctx.slots.wait_for_count(kernel_done)
        finally:
            refused_before_launch(failure, self._ctx.rank,
                                  "every other rank raises PeerFailedError at its next call" if peers_raise_later
                                  else "every other rank raises PeerFailedError from it")

    def _outputs_ahead(self, lib, plan: FreshDispatchPlan, kept_ptr: int, rows: int,
                       on_comm_stream: bool) -> Tuple[Optional[list], list]:
        """``(outputs, their addresses)`` of a dispatch allocating ``rows`` rows ahead of its count
        (see :meth:`_exchange_and_transfer`), whose handle's allocation keeps its other outputs from
        ``kept_ptr`` on; in place, no outputs (the views are made once, at the count) and null
        addresses: the kernel writes the Buffer's areas."""
        if plan.windows is not None:
            return None, [*NO_OUTPUTS]
        kept = plan.kept_outputs
        with self._ctx.allocating(lib, on_comm_stream):
            if kept is None:
                outputs = dispatch_outputs(self._ctx, lib, plan, rows)
                return outputs, device_pointers(lib, outputs)
            recv_x_output = plan.outputs[0]
            if recv_x_output is None:  # plans.received_arrays: a dispatch always returns recv_x
                raise TypeError("dispatch: a plan without recv_x")
            x_tail, x_dtype = recv_x_output
            recv_x = lib.empty((rows, *x_tail), x_dtype, self._ctx.device_id)
        return [recv_x], [lib.pointer(recv_x), *kept.pointers(kept_ptr, rows)]

    def _allocate_handle(self, lib, plan: FreshDispatchPlan, layout, rows: int,
                         on_comm_stream: bool) -> Tuple[DispatchHandle, int]:
        """``(handle, byte offset of the outputs it keeps)`` of a fresh dispatch, on a new allocation
        with room for ``rows`` received rows (0 for a round sized by its count exchange) and the
        outputs ``plan.kept_outputs`` names;
        its routing is given once its transfer is launched (``DispatchHandle.route``)."""
        kept = plan.kept_outputs
        words, kept_offset = layout.with_kept_outputs(rows, 0 if kept is None else kept.row_bytes)
        with self._ctx.allocating(lib, on_comm_stream):
            block = lib.empty((words,), "int64", self._ctx.device_id)
        return DispatchHandle(lib, block, layout, 0, None, 0, self._ctx.owner), kept_offset

    def _prepare_next(self, lib, plan: FreshDispatchPlan, layout, rows_guessed: int, caller: int,
                      on_comm_stream: bool) -> None:
        """Allocate the next call's handle and outputs (``next_outputs.py``) for a call like this
        one, whose receive count was guessed at ``rows_guessed`` rows, unless they would take more
        than ``next_outputs.MAX_BYTES``. Allocations that fail are not made: the next call makes
        its own (and refuses itself on every rank if it cannot)."""
        rows = min(prepared_rows(rows_guessed), plan.most_recv_rows)  # no call receives more
        if not self._next_outputs.fits(INT_BYTES * layout.recv_src_idx + rows * plan.ahead_row_bytes):
            return
        try:
            handle, kept_offset = self._allocate_handle(lib, plan, layout, rows, on_comm_stream)
            outputs, pointers = self._outputs_ahead(lib, plan, handle.base_ptr + kept_offset, rows, on_comm_stream)
        except Exception:
            return
        self._next_outputs.keep(ReadyOutputs(caller, on_comm_stream, rows, handle, kept_offset, outputs, pointers))

    def _expand(self, stream: int, lib, spec: plans.DispatchSpec, outputs, per_expert_list, handle: DispatchHandle):
        """Launch expand_kernel behind the transfer: ``recv_x`` (and its scales) regrouped per local
        expert, padded to the alignment; the handle gets ``expanded_rows`` and ``expert_offsets``.
        Returns ``(outputs with the expanded rows, the arrays allocated)``."""
        recv_x, recv_scales, recv_topk, recv_weights = outputs
        num_local_experts = spec.num_experts // self._ctx.num_ranks
        key = ("expand", spec.rows.row_bytes, spec.num_topk, spec.rows.num_scales, num_local_experts,
               spec.expert_alignment)
        kernel = self._expand_calls.get(key)
        if kernel is None:
            kernel = self._expand_calls[key] = self._ctx.bind(
                "expand_kernel", grid=max(1, num_local_experts), per_call=EXPAND_PER_CALL,
                hidden_int4=spec.rows.row_bytes // 16, num_topk=spec.num_topk, num_scales=spec.rows.num_scales,
                num_local_experts=num_local_experts, expert_alignment=spec.expert_alignment)
        total = sum(per_expert_list)
        expanded_x = lib.empty((total, spec.rows.hidden), spec.rows.dtype_name, self._ctx.device_id)
        scales_tail = spec.rows.scales_tail  # None without scales (then recv_scales is None too)
        expanded_scales = None if scales_tail is None else lib.empty((total,) + scales_tail, "float32",
                                                                     self._ctx.device_id)
        expanded_rows = lib.empty((total,), "int32", self._ctx.device_id)
        if num_local_experts:
            expanded_ptrs = device_pointers(lib, (expanded_x, expanded_scales, expanded_rows, recv_x, recv_scales,
                                                 recv_topk))
            kernel.run(stream, *expanded_ptrs, handle.rows)  # its received rows (no num_worst_tokens with expand)
        handle.expanded_rows = expanded_rows
        handle.expert_offsets = [0, *np.cumsum(per_expert_list).tolist()]
        return [expanded_x, expanded_scales, recv_topk, recv_weights], (expanded_x, expanded_scales, expanded_rows)

    @staticmethod
    def _launch_transfer(stream: int, kernel: KernelCall, call: DispatchCall, pointers, handle: DispatchHandle,
                         *exchange: int) -> None:
        """The transfer of a fresh dispatch (``kernel``: one of its plan's), writing its outputs at
        ``pointers`` (device addresses of ``[recv_x, recv_scales, recv_topk_idx,
        recv_topk_weights]``, 0 for none); ``exchange``: the values of the kernel's per-call
        parameters after TRANSFER_PER_CALL, when it makes the count exchange itself."""
        recv_x, recv_scales, recv_topk, recv_weights = pointers
        kernel.run(stream, recv_x, recv_scales, handle.recv_src_idx_ptr, recv_topk, recv_weights,
                   handle.recv_channel_prefix_ptr, handle.send_head_ptr, call.x, call.x_scales, call.topk,
                   call.weights, call.in_rank, handle.channel_prefix_ptr, handle.rank_prefix_ptr, call.num_tokens,
                   *call.scale_strides, *exchange)

    def _verdict_error(self, verdict: int, call: DispatchCall) -> Exception:
        spec = call.plan.spec
        bad_ids = None
        if verdict == -(self._ctx.rank + 1) and call.topk_array is not None:
            topk = call.topk_array
            bad_ids = topk[(topk < -1) | (topk >= spec.num_experts)][:4].tolist()
        error = verdict_error(verdict, self._ctx.rank, spec.num_experts, spec.signature, bad_ids, self._ctx.slots.names)
        if error is None:  # callers handle 0 (no error) and VERDICT_OVER_CAPACITY (a retry) first
            raise DeepEPError(f"rank {self._ctx.rank}: verdict {verdict} names no error")
        return error

    def cached(self, x, handle, config, previous_event, async_finish, allocate_on_comm_stream, recv_x_in_buffer=False):
        """A dispatch with an earlier dispatch's handle (``Buffer.dispatch(x, handle=...)``)."""
        ctx = self._ctx
        rows, scales = plans.split_x(x)
        lib, x_ptr, n, x_key = read(rows)
        _, s_ptr, n_s, s_key = read(scales)
        if self._rows_in_buffer.used:
            self._rows_in_buffer.refuse_inputs(ctx.nvl, CACHED_INPUTS, x_ptr, s_ptr)
        key = ("cached dispatch", type(x) is tuple, x_key, s_key, config, recv_x_in_buffer)
        plan = ctx.plans.get(key)
        if plan is None or (n, n_s).count(n) != plan.row_args:
            plan = ctx.plans.make(key, self._cached_plan, x, config, recv_x_in_buffer)
        ctx.handle_for(handle, config)
        if n != handle.num_tokens:
            raise ValueError(f"x: the handle routes {handle.num_tokens} tokens, got {n}")
        num_recv = handle.rows
        check_recv_rows_fit(plan, num_recv, "the handle")
        scale_strides = scale_strides_of(plan.spec.rows, lib, scales)
        with ctx.on_device, ctx.span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as ordered:
            run_on = ordered.run_on
            try:
                with ctx.allocating(lib, allocate_on_comm_stream):
                    recv_x, recv_scales, _, _ = dispatch_outputs(self._ctx, lib, plan, num_recv)
            except BaseException as failure:
                # Take part only to refuse the call: no rank moves anything (call_check.cuh).
                plan.refuse.run(run_on, 0, 0, x_ptr, s_ptr, handle.in_rank_ptr, handle.channel_prefix_ptr,
                                handle.rank_prefix_ptr, n, *scale_strides, -host_failure_code(failure),
                                handle.verdict_ptr)
                refused_before_launch(failure, ctx.rank)
                raise
            recv_x_ptr, recv_scales_ptr = device_pointers(lib, (recv_x, recv_scales))
            self._rows_in_buffer.note_dispatch(plan, handle)
            ordered.launched = True
            plan.main.run(run_on, recv_x_ptr, recv_scales_ptr, x_ptr, s_ptr, handle.in_rank_ptr,
                          handle.channel_prefix_ptr, handle.rank_prefix_ptr, n, *scale_strides, handle.verdict_ptr)
            ordered.settled = True
            outputs = (recv_x, recv_scales)
            event = ordered.finish(lib, async_finish,
                               (rows, scales, handle.block, handle.is_token_in_rank, *outputs), outputs,
                               allocate_on_comm_stream)
        return dispatch_result((recv_x, recv_scales, None, None), None, handle, event)

    def _cached_plan(self, x, config, recv_x_in_buffer):
        spec = plans.check_cached_dispatch(self._ctx.checks, x, config, checked_in_buffer(recv_x_in_buffer))
        # A cached dispatch checks its settings in the transfer kernel; it neither moves top-k nor
        # writes the handle's receive side.
        checks = plans.call_check_arguments(plans.OP_CACHED_DISPATCH, spec.rows.row_bytes, spec.rows.num_scales,
                                            config, spec.layout)
        unused = dict(recv_src_idx=None, recv_topk_idx=None, recv_topk_weights=None, recv_channel_prefix_matrix=None,
                      send_head=None, topk_idx=None, topk_weights=None)
        main = bind_transfer(self._ctx, spec, CACHED_PER_CALL, **checks, **unused)
        checks.pop("check_op")
        refuse = bind_transfer(self._ctx, spec, CACHED_REFUSE_PER_CALL, **checks, **unused)
        outputs = plans.received_arrays(spec)
        return CachedDispatchPlan(spec, main, 1 + (spec.rows.scales is not None), outputs,
                                  output_windows(self._ctx, self._rows_in_buffer, spec.rows.lib, spec, outputs), refuse)
