"""The host path of ``Buffer.combine``: rows sent back to their owners, or read where a dispatch
with rows in place left them (``x`` overwritten in place).

A :class:`CombinePath` is owned by a :class:`deepep_cupy.Buffer`; it takes everything the
Buffer's operations share from the :class:`deepep_cupy.intranode.context.OperationContext` it is
given (group, slots, stream order, NVLink buffer, plans, binding and ordering a call).
"""

from __future__ import annotations

from typing import Optional

from ..config import Config, combine_sender_blocks
from ..events import EventOverlap
from ..gpu.slots import host_failure_code, refused_before_launch
from ..tensors import ABSENT, read
from . import plans
from .context import OperationContext
from .handle import DispatchHandle
from .rows_in_buffer import RowsInBuffer

ABSENT_ROWS = ABSENT[2]
#: combine_kernel's parameters that change per call, in the order ``run`` takes them.
COMBINE_PER_CALL = ("combined_x", "combined_topk_weights", "x", "topk_weights", "bias_0", "bias_1",
                    "rank_prefix_matrix", "recv_channel_prefix_matrix", "send_head", "num_tokens", "dispatch_verdict")
#: ... when it only refuses the call: its operation (``check_op``) is then minus what failed.
REFUSE_PER_CALL = COMBINE_PER_CALL[:-1] + ("check_op", "dispatch_verdict")
#: The array arguments of combine, as its errors name them.
COMBINE_INPUTS = ("x", "topk_weights", "bias[0]", "bias[1]")


class CombinePath:
    """A Buffer's combine (see the module docstring); ``context``: the Buffer's
    :class:`deepep_cupy.intranode.context.OperationContext`; ``rows_in_buffer``: which dispatch's
    rows lie in the buffer (:mod:`.rows_in_buffer`), shared with the dispatch path."""

    def __init__(self, context: OperationContext, rows_in_buffer: RowsInBuffer):
        self._ctx = context
        self._rows_in_buffer = rows_in_buffer

    def combine(self, x, handle: DispatchHandle, topk_weights, bias, config: Config,
                previous_event: Optional[EventOverlap], async_finish: bool, allocate_on_comm_stream: bool):
        """``Buffer.combine`` once its config is resolved (its docstring is the contract)."""
        ctx = self._ctx
        _, x_ptr, n, x_key = read(x)
        _, w_ptr, n_w, w_key = read(topk_weights)
        biases = plans.split_bias(bias)
        _, b0_ptr, n_b0, b0_key = read(biases[0])
        _, b1_ptr, n_b1, b1_key = read(biases[1])
        in_place = None
        rows_in_buffer = self._rows_in_buffer
        if rows_in_buffer.used:
            in_place = self._rows_in_place(handle, x_ptr, w_ptr)
            if in_place is None:
                rows_in_buffer.refuse_inputs(ctx.nvl, COMBINE_INPUTS, x_ptr, w_ptr, b0_ptr, b1_ptr)
            else:
                rows_in_buffer.refuse_inputs(ctx.nvl, COMBINE_INPUTS[2:], b0_ptr, b1_ptr)
        key = ("combine", x_key, w_key, b0_key, b1_key, config, in_place)
        plan = ctx.plans.get(key)
        if plan is None or (n, n_w).count(n) != plan.row_args:
            plan = ctx.plans.make(key, self._combine_plan, x, topk_weights, config, biases, in_place)
        ctx.handle_for(handle, config)
        if n != handle.rows:
            received = "its num_worst_tokens" if handle.num_worst_tokens else "the tokens its dispatch received"
            raise ValueError(f"x: expected {handle.rows} rows ({received}), got {n}")
        if in_place is not None and n * plan.spec.row_bytes > in_place.src_idx_off - in_place.x_off:
            raise ValueError(f"x: {n} rows of {plan.spec.row_bytes} bytes in place overrun the area of this Buffer "
                             "that holds them (rows wider than the dispatch's); pass a copy. No tokens were moved")
        spec, num_tokens, dev = plan.spec, handle.num_tokens, ctx.device_id
        lib = spec.lib  # x's: its kind, so its library, is in the plan's key
        if n_b0 != ABSENT_ROWS or n_b1 != ABSENT_ROWS:
            for i, rows in enumerate((n_b0, n_b1)):
                if rows != num_tokens and rows != ABSENT_ROWS:
                    raise ValueError(f"bias[{i}]: expected {num_tokens} rows (the tokens of the handle's dispatch), "
                                     f"got {rows}")
        with ctx.on_device, ctx.span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as ordered:
            run_on = ordered.run_on
            try:
                with ctx.allocating(lib, allocate_on_comm_stream):
                    combined = lib.empty((num_tokens, spec.hidden), spec.dtype_name, dev)
                    combined_weights = lib.empty((num_tokens, spec.num_topk), "float32", dev) if spec.num_topk \
                        else None
            except BaseException as failure:
                # Take part only to refuse the call: no rank moves anything (call_check.cuh).
                plan.refuse.run(run_on, 0, 0, x_ptr, w_ptr, b0_ptr, b1_ptr, handle.rank_prefix_ptr,
                                handle.recv_channel_prefix_ptr, handle.send_head_ptr, num_tokens,
                                -host_failure_code(failure), handle.verdict_ptr)
                refused_before_launch(failure, ctx.rank)
                raise
            if in_place is None:
                self._rows_in_buffer.of = None  # its regions overlap the areas of rows in place
            weights_ptr = 0 if combined_weights is None else lib.pointer(combined_weights)
            ordered.launched = True
            plan.main.run(run_on, lib.pointer(combined), weights_ptr, x_ptr, w_ptr, b0_ptr, b1_ptr,
                          handle.rank_prefix_ptr, handle.recv_channel_prefix_ptr, handle.send_head_ptr, num_tokens,
                          handle.verdict_ptr)
            ordered.settled = True
            outputs = (combined, combined_weights)
            event = ordered.finish(lib, async_finish,
                               (x, topk_weights, *biases, handle.block, *outputs), outputs,
                               allocate_on_comm_stream)
        return combined, combined_weights, event

    def _rows_in_place(self, handle, x_ptr: int, w_ptr: int):
        """The buffer layout of ``handle``'s dispatch when ``x`` lies where it put ``recv_x`` (a
        combine that reads the ranks' rows in place), else None."""
        lay = getattr(handle, "rows_in_buffer", None)  # the handle itself is checked later
        base = self._ctx.nvl.local_ptr
        if lay is None or x_ptr != base + lay.x_off:
            return None
        if handle is not self._rows_in_buffer.of:
            raise ValueError("x: lies where this handle's dispatch put recv_x, but a later dispatch or combine of "
                             "this Buffer has overwritten those rows since; dispatch in place again, or combine a "
                             "copy made before that call. No tokens were moved")
        if w_ptr and w_ptr != base + lay.topk_weights_off:
            raise ValueError("topk_weights: with x in place (the recv_x of a dispatch with recv_x_in_buffer) the "
                             "weights are read in place too: pass None or that dispatch's recv_topk_weights. No "
                             "tokens were moved")
        return lay

    def _combine_plan(self, x, topk_weights, config, biases, in_place):
        spec = plans.check_combine(self._ctx.checks, x, topk_weights, config, biases)
        if in_place is None:
            lay, op, num_senders, template_args = spec.layout, plans.OP_COMBINE, \
                combine_sender_blocks(config.num_sms), (spec.element, self._ctx.num_ranks)
        else:
            lay, op, num_senders, template_args = in_place, plans.OP_COMBINE_IN_PLACE, 0, \
                (spec.element, self._ctx.num_ranks, "true")
        fixed = dict(num_channels=config.num_channels, hidden_int4=spec.row_bytes // 16, num_topk=spec.num_topk,
                     meta_off=lay.meta_off, x_off=lay.x_off, topk_weights_off=lay.topk_weights_off,
                     region_tokens=lay.region_tokens, num_senders=num_senders,
                     send_chunk=config.num_max_nvl_chunked_send_tokens,
                     **plans.call_check_arguments(op, spec.row_bytes, spec.row_detail, config, lay))
        main = self._ctx.bind("combine_kernel", template_args, grid=config.num_sms, per_call=COMBINE_PER_CALL, **fixed)
        fixed.pop("check_op")
        refuse = self._ctx.bind("combine_kernel", template_args, grid=config.num_sms, per_call=REFUSE_PER_CALL,
                                **fixed)
        return plans.CombinePlan(spec, main, 1 + (spec.num_topk > 0), refuse)
