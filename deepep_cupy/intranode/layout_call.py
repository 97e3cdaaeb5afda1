"""The host path of ``Buffer.get_dispatch_layout``: per rank and per expert counts and
``is_token_in_rank``, one kernel on one block, no rank waiting for another."""

from __future__ import annotations

from typing import Optional

from ..events import EventOverlap
from ..tensors import read
from . import plans
from .context import OperationContext


class LayoutPath:
    """An intranode engine's layout (``context``: its
    :class:`deepep_cupy.intranode.context.OperationContext`)."""

    def __init__(self, context: OperationContext):
        self._ctx = context


    def layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap], async_finish: bool,
               allocate_on_comm_stream: bool):
        """``Buffer.get_dispatch_layout``: ``(per rank, per expert, in rank, event)``."""
        ctx = self._ctx
        _, topk_ptr, num_tokens, topk_key = read(topk_idx)
        key = ("layout", topk_key, num_experts)
        plan = ctx.plans.get(key) or ctx.plans.make(key, self._layout_plan, topk_idx, num_experts)
        R, dev, lib = ctx.num_ranks, ctx.device_id, plan.spec.lib  # topk_idx's library: its kind is in the key
        on_comm_stream = async_finish or allocate_on_comm_stream
        with ctx.on_device, ctx.span.begin(lib, previous_event, on_comm_stream) as span:
            with ctx.allocating(lib, allocate_on_comm_stream):
                per_rank = lib.empty((R,), "int32", dev)
                per_expert = lib.empty((num_experts,), "int32", dev)
                in_rank = lib.empty((num_tokens, R), "bool", dev)
            plan.main.run(span.run_on, topk_ptr, lib.pointer(per_rank), lib.pointer(per_expert), lib.pointer(in_rank),
                          num_tokens)
            outputs = (per_rank, per_expert, in_rank)
            event = span.finish(lib, async_finish, (topk_idx, *outputs), outputs,
                               allocate_on_comm_stream)
        return per_rank, per_expert, in_rank, event

    def _layout_plan(self, topk_idx, num_experts) -> plans.LayoutPlan:
        spec = plans.check_layout(self._ctx.checks, topk_idx, num_experts)
        main = self._ctx.bind("dispatch_layout_kernel", grid=1, shared_mem=4 * (spec.num_experts + self._ctx.num_ranks),
                              per_call=("topk_idx", "num_tokens_per_rank", "num_tokens_per_expert",
                                        "is_token_in_rank", "num_tokens"),
                              num_topk=spec.num_topk, num_experts=spec.num_experts)
        return plans.LayoutPlan(spec, main)
