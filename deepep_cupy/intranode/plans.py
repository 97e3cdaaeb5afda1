"""The intranode operations' specs and plans: what their argument checks produce for the engine to cache.

Every check here is complete: built on the shared ones (:mod:`deepep_cupy.checks`), it reads the
arguments with :func:`deepep_cupy.tensors.describe` and raises ``TypeError``/``ValueError`` naming
the argument before anything runs. What it returns is a frozen *spec*: everything an operation
needs to know about arguments of those kinds (element type, row size, top-k width, buffer layout,
the settings ranks compare). A plan is a spec with its kernels bound, one record per operation
(:class:`LayoutPlan`, :class:`FreshDispatchPlan`, :class:`CachedDispatchPlan`,
:class:`CombinePlan`). The intranode engine keeps the plan,
with its kernel calls bound, under the key :func:`deepep_cupy.tensors.read` gives the arguments,
so later calls with arguments of the same kinds skip the checks: a key holds everything the
checks look at except the row counts, which the fast path compares itself.

Nothing here touches a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

from ..checks import (
    check_expert_alignment,
    check_num_experts,
    check_row_bytes,
    check_topk,
    check_topk_width,
    check_x,
    split_bias,  # noqa: F401  (re-exported: the paths split bias and x where they read them)
    split_x,  # noqa: F401
)
from ..config import Config
from ..constants import SIGNATURE_ROWS_IN_BUFFER
from ..gpu import layout
from ..gpu.kernels import COMBINE_ELEMENTS
from ..gpu.launch import KernelCall
from ..gpu.plan_cache import MAX_PLANS, PlanCache  # noqa: F401  (re-exported: plans.PlanCache has users)
from ..tensors import ITEMSIZE, ArrayInfo, ArrayLib, check_array, describe
from .handle import KeptOutputs

#: Which operation a cached dispatch / combine announces in the settings ranks compare (its transfer
#: kernel's ``check_op``; 0: no check there, a fresh dispatch's notify kernel made it). A combine
#: whose x lies where a dispatch with rows in place put recv_x is an operation of its own: every
#: rank must read the others' rows where they lie, none may push.
OP_CACHED_DISPATCH, OP_COMBINE, OP_COMBINE_IN_PLACE = 1, 2, 3


class Context(NamedTuple):
    """What the checks need to know of the Buffer."""
    num_ranks: int
    device_id: int
    num_nvl_bytes: int


@dataclass(frozen=True)
class Rows:
    """``x`` as a dispatch sees it: the rows, and the FP8 scales if any. (What every call reads is
    computed once: ``cached_property``, which a frozen dataclass allows.)"""
    info: ArrayInfo
    scales: Optional[ArrayInfo]

    @property
    def lib(self) -> ArrayLib:
        return self.info.lib

    @property
    def dtype_name(self) -> str:
        dtype_name = self.info.dtype_name
        if dtype_name is None:  # check_x refused it
            raise TypeError(f"x: expected a dtype the kernels move, got {self.info.dtype}")
        return dtype_name

    @property
    def hidden(self) -> int:
        return self.info.shape[1]

    @property
    def row_bytes(self) -> int:
        return self.info.shape[1] * ITEMSIZE[self.dtype_name]

    @functools.cached_property
    def num_scales(self) -> int:
        """FP8 scales per token: 0 without scales, 1 for ``[N]``, S for ``[N, S]``."""
        if self.scales is None:
            return 0
        return 1 if len(self.scales.shape) == 1 else self.scales.shape[1]

    @functools.cached_property
    def scales_strided(self) -> bool:
        """The scales are not row-major contiguous: their strides are read on every call."""
        return self.scales is not None and not self.scales.contiguous

    @functools.cached_property
    def scale_strides(self) -> Tuple[int, int]:
        """``(token stride, scale stride)`` in elements of contiguous scales."""
        return (self.num_scales, 1)

    @property
    def scales_tail(self) -> Optional[Tuple[int, ...]]:
        """The scales' shape after the token axis (``()`` for ``[N]``), None without scales."""
        return None if self.scales is None else tuple(self.scales.shape[1:])


@dataclass(frozen=True)
class LayoutSpec:
    lib: ArrayLib  # topk_idx's (its kind, so its library, is in the plan's key)
    num_topk: int
    num_experts: int


@dataclass(frozen=True)
class DispatchSpec:
    """A dispatch's arguments of one kind (fresh: with layout inputs; cached: without)."""
    rows: Rows
    config: Config
    layout: layout.DispatchLayout
    num_topk: int = 0
    with_weights: bool = False
    num_experts: int = 0
    expert_alignment: int = 1
    #: the outputs lie in the receivers' NVLink buffers, written there by the senders (``recv_x_in_buffer``)
    rows_in_buffer: bool = False

    @functools.cached_property
    def signature(self) -> Tuple[int, ...]:
        """The settings of a fresh dispatch every rank must share (slots.SIGNATURE_FIELDS)."""
        c = self.config
        topk_code = 2 * self.num_topk + self.with_weights + (SIGNATURE_ROWS_IN_BUFFER if self.rows_in_buffer else 0)
        return (self.rows.row_bytes, topk_code, self.rows.num_scales,
                self.num_experts, c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens)


@dataclass(frozen=True)
class CombineSpec:
    lib: ArrayLib  # x's (its kind, so its library, is in the plan's key)
    dtype_name: str
    hidden: int
    row_bytes: int
    num_topk: int
    config: Config
    layout: layout.CombineLayout

    @property
    def element(self) -> str:
        return COMBINE_ELEMENTS[self.dtype_name]

    @property
    def row_detail(self) -> int:
        """Element type and top-k width, as combine announces them in the settings ranks compare."""
        return (list(COMBINE_ELEMENTS).index(self.dtype_name) + 1) * 256 + self.num_topk


def fitting_layout(make, ctx: Context, what: str, row_bytes: int):
    """``make(T)``, the transfer layout with the largest regions (T slots each) that fit the Buffer."""
    plan = layout.largest_fitting(make, ctx.num_nvl_bytes)
    if plan is None:
        raise ValueError(
            f"num_nvl_bytes: a {what} of {row_bytes}-byte rows needs more than the Buffer's {ctx.num_nvl_bytes} "
            "bytes of NVLink buffer for even one token; create it with deepep_cupy.get_nvl_buffer_size_hint(...) bytes")
    return plan


def _dispatch_layout(ctx: Context, config: Config, rows: Rows, num_topk: int,
                     rows_in_buffer: bool) -> layout.DispatchLayout:
    """The transfer layout of a dispatch of ``rows`` with ``num_topk`` top-k columns (0: none moved)."""
    return fitting_layout(functools.partial(layout.dispatch_layout, ctx.num_ranks, config.num_channels,
                                            row_bytes=rows.row_bytes, num_topk=num_topk, num_scales=rows.num_scales,
                                            rows_in_buffer=rows_in_buffer),
                          ctx, "dispatch", rows.row_bytes)


def check_layout(ctx: Context, topk_idx: Any, num_experts: Any) -> LayoutSpec:
    """Check :meth:`Buffer.get_dispatch_layout`'s arguments."""
    topk = describe(topk_idx, "topk_idx", ctx.device_id)
    check_array(topk, "topk_idx", ("int64",), 2)
    num_experts = check_num_experts(num_experts, ctx.num_ranks)
    check_topk_width(topk.shape[1], "topk_idx")
    return LayoutSpec(topk.lib, topk.shape[1], num_experts)


def check_rows(x: Any, ctx: Context) -> Rows:
    """``x`` or ``(x_fp8, x_scales)`` of a dispatch."""
    return Rows(*check_x(x, ctx.device_id))


def check_fresh_dispatch(ctx: Context, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                         topk_idx, topk_weights, expert_alignment, config: Config,
                         rows_in_buffer: bool = False) -> DispatchSpec:
    """Check a dispatch without a handle."""
    R, dev = ctx.num_ranks, ctx.device_id
    rows = check_rows(x, ctx)
    num_tokens = rows.info.shape[0]
    for arg, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                       ("num_tokens_per_expert", num_tokens_per_expert)):
        if value is None:
            raise ValueError(f"{arg}: required without a handle (from Buffer.get_dispatch_layout)")
    check_array(describe(num_tokens_per_rank, "num_tokens_per_rank", dev), "num_tokens_per_rank", ("int32",), 1, (R,))
    check_array(describe(is_token_in_rank, "is_token_in_rank", dev), "is_token_in_rank", ("bool",), 2,
                (num_tokens, R))
    per_expert = describe(num_tokens_per_expert, "num_tokens_per_expert", dev)
    check_array(per_expert, "num_tokens_per_expert", ("int32",), 1)
    num_experts = check_num_experts(per_expert.shape[0], R)
    expert_alignment = check_expert_alignment(expert_alignment)
    topk, weights = check_topk(topk_idx, topk_weights, num_tokens, dev)
    num_topk = 0 if topk is None else topk.shape[1]
    return DispatchSpec(rows, config, _dispatch_layout(ctx, config, rows, num_topk, rows_in_buffer), num_topk,
                        weights is not None, num_experts, expert_alignment, rows_in_buffer)


def check_cached_dispatch(ctx: Context, x, config: Config, rows_in_buffer: bool = False) -> DispatchSpec:
    """Check a dispatch with a handle (the handle itself is checked per call)."""
    rows = check_rows(x, ctx)
    return DispatchSpec(rows, config, _dispatch_layout(ctx, config, rows, 0, rows_in_buffer),
                        rows_in_buffer=rows_in_buffer)


def check_combine(ctx: Context, x, topk_weights, config: Config, biases: Tuple[Any, Any] = (None, None)
                  ) -> CombineSpec:
    """Check a combine's ``x``, ``topk_weights`` and ``biases`` (from :func:`split_bias`; their
    row counts and the handle are checked per call)."""
    rows = describe(x, "x", ctx.device_id)
    dtype_name = check_array(rows, "x", tuple(COMBINE_ELEMENTS), 2)
    row_bytes = check_row_bytes(rows, "x")
    for i, bias in enumerate(biases):
        if bias is not None:
            arg = f"bias[{i}]"
            check_array(describe(bias, arg, ctx.device_id), arg, (dtype_name,), 2, (None, rows.shape[1]))
    num_topk = 0
    if topk_weights is not None:
        weights = describe(topk_weights, "topk_weights", ctx.device_id)
        check_array(weights, "topk_weights", ("float32",), 2, (rows.shape[0], None))
        num_topk = weights.shape[1]
        check_topk_width(num_topk, "topk_weights")
    plan = fitting_layout(functools.partial(layout.combine_layout, ctx.num_ranks, config.num_channels,
                                            row_bytes=row_bytes, num_topk=num_topk), ctx, "combine", row_bytes)
    return CombineSpec(rows.lib, dtype_name, rows.shape[1], row_bytes, num_topk, config, plan)


def call_check_arguments(op: int, row_bytes: int, row_detail: int, config: Config, lay) -> Dict[str, int]:
    """The arguments with which a transfer kernel checks its call's settings across ranks and
    resets its metadata (kernels/call_check.cuh): a cached dispatch's (``OP_CACHED_DISPATCH``) and
    a combine's (``OP_COMBINE``), ``lay`` being the call's transfer layout. A combine in place
    (``OP_COMBINE_IN_PLACE``) has no metadata to reset."""
    return dict(check_op=op, row_bytes=row_bytes, row_detail=row_detail, num_sms=config.num_sms,
                recv_chunk=config.num_max_nvl_chunked_recv_tokens, zero_off=lay.meta_off,
                zero_count=0 if op == OP_COMBINE_IN_PLACE else lay.zero_count)


def received_arrays(spec: DispatchSpec) -> tuple:
    """A dispatch's outputs per received row: recv_x, its scales, top-k ids, top-k weights."""
    rows, k = spec.rows, spec.num_topk
    return (((rows.hidden,), rows.dtype_name),
            None if rows.scales is None else (rows.scales_tail, "float32"),
            ((k,), "int64") if k else None,
            ((k,), "float32") if spec.with_weights else None)


#: Per output of a dispatch: ``(extents after the rows, dtype name)``, None for one it does not return.
Output = Optional[Tuple[Tuple[int, ...], str]]


class LayoutPlan(NamedTuple):
    """``get_dispatch_layout``'s checked spec and its kernel."""
    spec: LayoutSpec
    main: KernelCall


class FreshDispatchPlan(NamedTuple):
    """A fresh dispatch's checked spec with its kernels bound.

    ``notify``: the count exchange (also a refusing host's, writing its prefix matrices into
    ``refusal_scratch``, a device array and its address: ``DispatchPath._refuse``); ``main``: the
    transfer; ``main_with_exchange``: the transfer making the count exchange itself (one launch, for
    a dispatch whose host does not wait for the counts); ``main_for_host``: the same for a host
    that waits for the counts in its slots. ``row_args``: how many of the call's arrays must have
    the first one's rows; ``outputs``: each output's :data:`Output`; ``kept_outputs``: where a
    dispatch allocating ahead keeps its outputs other than ``recv_x`` in the handle's allocation
    (None when its array library does not carve them: ``ArrayLib.carves_outputs``); ``windows``:
    per output, an array of its type over every row of its area in this rank's NVLink buffer, of
    which a dispatch writing its rows in place returns the first rows (None for one that allocates
    its outputs); ``ahead_row_bytes``: bytes per received row a dispatch allocating ahead
    allocates; ``most_recv_rows``: the most rows a rank can receive (every rank sends it at most a
    transfer region's tokens: ranks x region tokens), the cap of what it allocates ahead
    (``capacity.py``)."""
    spec: DispatchSpec
    notify: KernelCall
    main: KernelCall
    row_args: int
    outputs: Tuple[Output, ...]
    main_with_exchange: KernelCall
    kept_outputs: Optional[KeptOutputs]
    windows: Optional[tuple]
    main_for_host: KernelCall
    ahead_row_bytes: int
    refusal_scratch: Tuple[Any, int]
    most_recv_rows: int


class CachedDispatchPlan(NamedTuple):
    """A cached dispatch's: ``main`` (its transfer, checking the call's settings across ranks),
    ``refuse`` (the same for a host that takes part only to refuse the call), ``row_args``,
    ``outputs`` and ``windows`` as a fresh dispatch's."""
    spec: DispatchSpec
    main: KernelCall
    row_args: int
    outputs: Tuple[Output, ...]
    windows: Optional[tuple]
    refuse: KernelCall


class CombinePlan(NamedTuple):
    """A combine's: ``main``, ``refuse`` and ``row_args`` as a cached dispatch's."""
    spec: CombineSpec
    main: KernelCall
    row_args: int
    refuse: KernelCall


#: What the transfer kernel's helpers (``transfer.py``) take.
DispatchPlan = Union[FreshDispatchPlan, CachedDispatchPlan]
