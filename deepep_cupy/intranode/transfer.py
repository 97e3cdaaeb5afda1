"""The transfer kernel of a dispatch, fresh or cached: its binding for a checked spec, the outputs
it writes (allocated, or views of the NVLink buffer for rows in place)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..config import peer_blocks_in_place, sender_blocks
from ..gpu.launch import KernelCall
from ..tensors import row_bytes
from . import plans
from .context import OperationContext
from .plans import DispatchPlan
from .rows_in_buffer import RowsInBuffer


def scale_strides_of(rows: plans.Rows, lib, scales) -> Tuple[int, int]:
    if not rows.scales_strided:
        return rows.scale_strides
    strides = lib.element_strides(scales)
    return (strides[0], strides[1] if len(strides) > 1 else 1)


def output_windows(ctx: OperationContext, rows_in_buffer: RowsInBuffer, lib, spec: plans.DispatchSpec,
                   outputs) -> Optional[tuple]:
    """For a dispatch with rows in place: per output (``outputs``: plans.received_arrays), an
    array of ``lib`` with the output's type and every row of the area of this rank's NVLink
    buffer that holds it (None for one the call does not return); a call returns its first
    rows. None for a dispatch that allocates its outputs."""
    if not spec.rows_in_buffer:
        return None
    rows_in_buffer.used = True  # views of the buffer may reach the caller from now on
    lay, base = spec.layout, ctx.nvl.local_ptr
    offsets = (lay.x_off, lay.scales_off, lay.topk_idx_off, lay.topk_weights_off)
    return tuple(None if out is None else
                 lib.rows_in(lib.window(base + offset, lay.rows * row_bytes(*out), ctx.device_id, ctx.nvl),
                             lay.rows, *out)
                 for offset, out in zip(offsets, outputs))


def check_recv_rows_fit(plan: DispatchPlan, rows: int, what: str) -> None:
    """With rows in place, the outputs have at most the rows of the Buffer's areas."""
    if plan.windows is not None and rows > plan.spec.layout.rows:
        raise ValueError(f"recv_x_in_buffer: {what} asks for {rows} received rows, more than the "
                         f"{plan.spec.layout.rows} this Buffer holds for these rows; create it with "
                         "deepep_cupy.get_nvl_buffer_size_hint(..., recv_x_in_buffer=True) bytes. No tokens "
                         "were moved")


def bind_transfer(ctx: OperationContext, spec: plans.DispatchSpec, per_call: Tuple[str, ...], **fixed) -> KernelCall:
    """dispatch_kernel for ``spec``, launched with ``per_call``'s values, with neither a settings
    check nor a count exchange of its own unless ``fixed`` binds one (``check_op``: a cached
    dispatch; ``exchange``: a fresh one's counts, whose per-call values each launch then gives)."""
    lay, config = spec.layout, spec.config
    # Any: kernel arguments (ints, None for a null pointer), joining bind's keywords (grid, shared_mem).
    checks: Dict[str, Any] = dict(check_op=0, row_bytes=0, row_detail=0, num_sms=0, recv_chunk=0, zero_off=0,
                                  zero_count=0, dispatch_verdict=None, exchange=0, topk_code=0, expert_alignment=0)
    if not fixed.get("exchange"):
        checks.update(num_tokens_per_rank=None, num_tokens_per_expert=None, recv_capacity=0, recv_counter=None,
                      mismatch_flag=None, recv_expert_counter=None, report_refusal=0)
    checks.update(fixed)
    checks = {name: value for name, value in checks.items() if name not in per_call}
    template_args: Tuple[object, ...] = (ctx.num_ranks, "true") if spec.rows.scales_strided else (ctx.num_ranks,)
    if spec.rows_in_buffer:
        template_args = (ctx.num_ranks, "true" if spec.rows.scales_strided else "false", "true")
    num_senders = (peer_blocks_in_place(config.num_sms, ctx.num_ranks) if spec.rows_in_buffer
                   else sender_blocks(config.num_sms))
    return ctx.bind("dispatch_kernel", template_args, grid=config.num_sms, per_call=per_call,
                          hidden_int4=spec.rows.row_bytes // 16, num_topk=spec.num_topk,
                          num_experts=spec.num_experts, num_scales=spec.rows.num_scales, meta_off=lay.meta_off,
                          x_off=lay.x_off, src_idx_off=lay.src_idx_off, topk_idx_off=lay.topk_idx_off,
                          topk_weights_off=lay.topk_weights_off, scales_off=lay.scales_off,
                          region_tokens=lay.region_tokens, num_channels=config.num_channels,
                          num_senders=num_senders, send_chunk=config.num_max_nvl_chunked_send_tokens, **checks)


def dispatch_outputs(ctx: OperationContext, lib, plan: DispatchPlan, rows: int) -> list:
    """``[recv_x, recv_scales, recv_topk_idx, recv_topk_weights]`` with ``rows`` rows (None for
    what the call does not return)."""
    if plan.windows is not None:
        # Views of the areas the senders write (all of them at most: more are never received).
        rows, trim = min(rows, plan.spec.layout.rows), lib.trim
        return [None if w is None else trim(w, rows) for w in plan.windows]
    empty, dev = lib.empty, ctx.device_id
    return [None if out is None else empty((rows,) + out[0], out[1], dev) for out in plan.outputs]


def device_pointers(lib, arrays) -> list:
    """Device addresses of ``arrays`` (0 for None)."""
    return [0 if a is None else lib.pointer(a) for a in arrays]
