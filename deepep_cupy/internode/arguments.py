"""The internode calls' arguments: checked with the shared vocabulary (:mod:`deepep_cupy.checks`)
on every rank before the call's vote, and read as CuPy views of the caller's arrays."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

from .. import checks, tensors
from ..tensors import check_array, check_int, describe
from . import arrays
from .handle import InternodeHandle
from .records import RecordLayout


class FreshArgs(NamedTuple):
    """A fresh dispatch's checked arguments (CuPy views of the caller's arrays)."""
    info: tensors.ArrayInfo
    scales_info: Optional[tensors.ArrayInfo]
    x_rows: Any
    x_scales: Any
    topk: Any
    weights: Any
    in_rank: Any         # a view of the caller's is_token_in_rank, or None
    per_expert: Any
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int
    settings: tuple      # what every rank must pass alike


def check_unavailable(expand: bool, recv_x_in_buffer: bool, config) -> None:
    """The intranode-only settings, refused across nodes; and the config's type."""
    if expand:
        raise ValueError("expand: not available across nodes; expand the received rows yourself")
    if recv_x_in_buffer:
        raise ValueError("recv_x_in_buffer: not available across nodes (the rows arrive through the rail "
                         "transport and the node's intranode dispatch)")
    checks.check_config(config)


def internode_handle(handle, owner: int) -> InternodeHandle:
    """``handle`` as an internode dispatch of the Buffer ``owner`` made it."""
    return checks.check_handle(handle, InternodeHandle, "Buffer.dispatch", owner)


def read_x(x, info, scales_info, device_id: int):
    """x as uint8 rows ``[T, row bytes]`` and its scales as ``[T, S]`` (None without), CuPy views."""
    rows, scales = checks.split_x(x)
    x_rows = arrays.byte_rows(arrays.device_view(rows, info, device_id))
    x_scales = None if scales_info is None else \
        arrays.scale_rows(arrays.device_view(scales, scales_info, device_id), scales_info)
    return x_rows, x_scales


def check_cached(x, handle, num_worst_tokens, expand, recv_x_in_buffer, config, *, device_id: int, owner: int):
    """A cached dispatch's arguments: ``(x's info, scales' info, handle, x rows, x scales)``."""
    check_unavailable(expand, recv_x_in_buffer, config)
    info, scales_info = checks.check_x(x, device_id)
    if num_worst_tokens:
        raise ValueError("num_worst_tokens: a cached dispatch receives the handle's row count; pass 0")
    handle = internode_handle(handle, owner)
    if info.shape[0] != handle.num_tokens:
        raise ValueError(f"x: expected {handle.num_tokens} rows (the tokens of the handle's dispatch), got "
                         f"{info.shape[0]}")
    return (info, scales_info, handle, *read_x(x, info, scales_info, device_id))


def check_fresh(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                num_worst_tokens, expand, recv_x_in_buffer, config, *, device_id: int, num_ranks: int) -> FreshArgs:
    """A fresh dispatch's arguments (routed by ``is_token_in_rank``, or by the experts of ``topk_idx``)."""
    check_unavailable(expand, recv_x_in_buffer, config)
    info, scales_info = checks.check_x(x, device_id)
    T, dev, R = info.shape[0], device_id, num_ranks
    topk_info, weights_info = checks.check_topk(topk_idx, topk_weights, T, dev)
    in_rank = None
    if is_token_in_rank is not None:
        in_rank_info = describe(is_token_in_rank, "is_token_in_rank", dev)
        check_array(in_rank_info, "is_token_in_rank", ("bool",), 2, (T, R), any_strides=True)
        in_rank = arrays.device_view(is_token_in_rank, in_rank_info, dev)
    elif topk_info is None:
        raise ValueError("is_token_in_rank: a dispatch without topk_idx is routed by is_token_in_rank; pass the "
                         "one get_dispatch_layout returned")
    if num_tokens_per_expert is None:
        raise ValueError("num_tokens_per_expert: required (its length is the expert count, and the receivers' "
                         "expert counts are the senders' sums); pass the one get_dispatch_layout returned")
    per_expert_info = describe(num_tokens_per_expert, "num_tokens_per_expert", dev)
    check_array(per_expert_info, "num_tokens_per_expert", ("int32",), 1)
    num_experts = per_expert_info.shape[0]
    per_expert = arrays.device_view(num_tokens_per_expert, per_expert_info, dev)
    if num_experts == 0 or num_experts % R:
        raise ValueError(f"num_tokens_per_expert: expected a multiple of the rank count ({R}) of experts, got "
                         f"{num_experts}")
    expert_alignment = checks.check_expert_alignment(expert_alignment)
    num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens", 0)
    x_rows, x_scales = read_x(x, info, scales_info, dev)
    topk = None if topk_info is None else arrays.device_view(topk_idx, topk_info, dev)
    weights = None if weights_info is None else arrays.device_view(topk_weights, weights_info, dev)
    num_topk = 0 if topk_info is None else topk_info.shape[1]
    settings = (num_experts, info.dtype_name, info.shape[1:],
                None if scales_info is None else scales_info.shape[1:], num_topk, weights_info is not None,
                num_worst_tokens, expert_alignment)
    return FreshArgs(info, scales_info, x_rows, x_scales, topk, weights, in_rank, per_expert,
                     num_experts, expert_alignment, num_worst_tokens, settings)


def check_combine(x, handle, topk_weights, bias, config, *, device_id: int, owner: int):
    """A combine's arguments: ``(handle, x's info, weights' info or None, the biases' CuPy views)``."""
    checks.check_config(config)
    handle = internode_handle(handle, owner)
    info = describe(x, "x", device_id)
    dtype_name = check_array(info, "x", checks.ROW_DTYPES, 2)
    if info.shape[0] != handle.rows:
        received = "its num_worst_tokens" if handle.num_worst_tokens else "the tokens its dispatch received"
        raise ValueError(f"x: expected {handle.rows} rows ({received}), got {info.shape[0]}")
    checks.check_row_bytes(info, "x")
    w_info = None
    if topk_weights is not None:
        w_info = describe(topk_weights, "topk_weights", device_id)
        check_array(w_info, "topk_weights", ("float32",), 2, (handle.rows, None))
    views = []
    for i, b in enumerate(checks.split_bias(bias)):
        if b is None:
            continue
        b_info = describe(b, f"bias[{i}]", device_id)
        check_array(b_info, f"bias[{i}]", (dtype_name,), 2, (handle.num_tokens, info.shape[1]))
        views.append(arrays.device_view(b, b_info, device_id))
    return handle, info, w_info, views


def refuse_capture(capturing: bool, what: str, transport: str, capturable: bool) -> None:
    """An internode call inside a CUDA graph capture that cannot be captured: refused as a bad
    argument is (every rank raises from the call's vote, before anything moves). Only the calls in
    fixed-size blocks (a fresh dispatch with ``num_worst_tokens``, the cached dispatches and combines
    of its handle) on a transport that queues device work alone (NCCL, local) have no host wait."""
    if not capturing:
        return
    if not capturable:
        raise ValueError(f"{what}: the '{transport}' rail transport waits on the host, so an internode call "
                         "over it cannot be captured in a CUDA graph; use the 'nccl' transport (or 'local' for "
                         "in-process ranks), or run the call outside the capture")
    raise ValueError(f"{what}: an internode call without a fixed output size cannot be captured in a CUDA graph "
                     "(its host learns the per-node counts before the rail transfer); a dispatch with "
                     "num_worst_tokens, and the cached dispatches and combines of its handle, can be")


class CachedDispatchArgs(NamedTuple):
    """A cached dispatch's checked arguments and rail buffers (``InternodePath._check_cached``), in
    the order ``InternodePath._cached_dispatch`` takes them."""
    rows: Any                                   # x's rows and scales, as the caller passed them
    scales: Any
    info: tensors.ArrayInfo
    scales_info: Optional[tensors.ArrayInfo]
    handle: InternodeHandle
    x_rows: Any                                 # uint8 [T, row bytes] (CuPy view)
    x_scales: Any                               # float32 [T, S] (CuPy view), or None
    layout: RecordLayout
    send: Any                                   # the rail buffers (CuPy, uint8)
    recv: Any


class CombineArgs(NamedTuple):
    """A combine's checked arguments, rail buffers and outputs
    (``InternodePath._check_and_allocate_combine``), in the order ``InternodePath._combine`` takes
    them after ``x`` and ``weights``."""
    handle: InternodeHandle
    info: tensors.ArrayInfo
    w_info: Optional[tensors.ArrayInfo]
    bias_views: List[Any]
    layout: RecordLayout
    send: Any
    recv: Any
    out: Tuple[Any, Any]                        # (array of the caller's library, CuPy view)
    out_w: Optional[Tuple[Any, Any]]
