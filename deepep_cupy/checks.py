"""The argument checks every operation path shares (intranode, internode, low latency): one
vocabulary, one message per mistake. Each raises ``TypeError``/``ValueError`` naming the argument
before anything runs, and touches no GPU (the arrays are read with
:func:`deepep_cupy.tensors.describe`). What is particular to one path (a transfer layout that must
fit its buffer, a routing view) stays with that path and builds on these.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .config import Config
from .constants import MAX_EXPERTS, MAX_LOCAL_EXPERTS, MAX_TOPK
from .tensors import ITEMSIZE, ArrayInfo, check_array, describe

#: Element types of dispatch's and combine's rows (FP8 rows come with their scales, dispatch only).
ROW_DTYPES = ("bfloat16", "float16", "float32")
FP8_DTYPE = "float8_e4m3fn"


def split_x(x) -> Tuple[Any, Any]:
    """``x`` or ``(x_fp8, x_scales)`` -> (rows, scales or None); anything else is left to the checks."""
    if type(x) is tuple and len(x) == 2:
        return x
    return x, None


def split_bias(bias) -> Tuple[Any, Any]:
    """DeepEP's ``bias`` (None, one array, or a pair whose entries may be None) -> ``(bias_0, bias_1)``."""
    if bias is None:
        return None, None
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2:
            raise ValueError(f"bias: expected an array or a pair of arrays, got a sequence of {len(bias)}")
        return bias[0], bias[1]
    return bias, None


def check_config(config: Any) -> None:
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config: expected deepep_cupy.Config, got {type(config).__name__}")


def check_row_bytes(info: ArrayInfo, arg: str) -> int:
    """Bytes of one row of ``info`` (2-D, its dtype checked: :func:`deepep_cupy.tensors.check_array`),
    which the kernels move in 16-byte pieces."""
    dtype_name = info.dtype_name
    if dtype_name is None:
        raise TypeError(f"{arg}: expected a dtype the kernels move, got {info.dtype}")
    itemsize = ITEMSIZE[dtype_name]
    row_bytes = info.shape[1] * itemsize
    if row_bytes % 16:
        raise ValueError(f"{arg}: row bytes must be a multiple of 16, got hidden {info.shape[1]} x {itemsize} B = "
                         f"{row_bytes} B")
    return row_bytes


def check_x(x: Any, device_id: int) -> Tuple[ArrayInfo, Optional[ArrayInfo]]:
    """A dispatch's ``x`` or ``(x_fp8, x_scales)``: ``(rows' info, scales' info or None)``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError(f"x: expected an array or a tuple (x_fp8, x_scales), got a tuple of {len(x)}")
        rows = describe(x[0], "x[0]", device_id)
        check_array(rows, "x[0]", (FP8_DTYPE,), 2)
        scales = describe(x[1], "x[1]", device_id)
        # Any non-negative strides: DeepEP's own callers pass column-major scales.
        if len(scales.shape) == 1:
            check_array(scales, "x[1]", ("float32",), 1, (rows.shape[0],), any_strides=True)
        else:
            check_array(scales, "x[1]", ("float32",), 2, (rows.shape[0], None), any_strides=True)
    else:
        rows = describe(x, "x", device_id)
        if rows.dtype_name == FP8_DTYPE:
            raise ValueError("x: FP8 rows need their scales: pass x=(x_fp8, x_scales)")
        check_array(rows, "x", ROW_DTYPES, 2)
        scales = None
    check_row_bytes(rows, "x")
    return rows, scales


def check_topk_width(num_topk: int, arg: str) -> None:
    if num_topk > MAX_TOPK:
        raise ValueError(f"{arg}: expected at most {MAX_TOPK} columns, got {num_topk}")


def check_topk(topk_idx: Any, topk_weights: Any, num_tokens: int, device_id: int
               ) -> Tuple[Optional[ArrayInfo], Optional[ArrayInfo]]:
    """A dispatch's optional top-k: ``(ids' info or None, weights' info or None)``."""
    if topk_idx is None:
        if topk_weights is not None:
            raise ValueError("topk_weights: given without topk_idx")
        return None, None
    topk = describe(topk_idx, "topk_idx", device_id)
    check_array(topk, "topk_idx", ("int64",), 2, (num_tokens, None))
    check_topk_width(topk.shape[1], "topk_idx")
    weights = None
    if topk_weights is not None:
        weights = describe(topk_weights, "topk_weights", device_id)
        check_array(weights, "topk_weights", ("float32",), 2, topk.shape)
    return topk, weights


def check_num_experts(num_experts: Any, num_ranks: int) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts <= 0:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of the rank count {num_ranks}, got {num_experts}")
    if num_experts // num_ranks > MAX_LOCAL_EXPERTS:
        raise ValueError(f"num_experts: at most {MAX_LOCAL_EXPERTS} experts per rank, got {num_experts // num_ranks}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: at most {MAX_EXPERTS}, got {num_experts}")
    return int(num_experts)


def check_expert_alignment(expert_alignment: Any) -> int:
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, (int, np.integer)) \
            or expert_alignment < 1:
        raise ValueError(f"expert_alignment: expected a positive int, got {expert_alignment!r}")
    return int(expert_alignment)


def check_handle(handle: Any, handle_type: type, made_by: str, owner: Any = None) -> Any:
    """``handle`` as the handle a call of ``made_by`` returned (of ``handle_type``), on the Buffer
    whose ``owner`` it names (None: any)."""
    if not isinstance(handle, handle_type):
        raise TypeError(f"handle: expected the handle returned by {made_by}, got {type(handle).__name__}")
    if owner is not None and getattr(handle, "owner", None) != owner:
        raise ValueError("handle: it was made by another Buffer; a handle is only valid on the Buffer "
                         "whose dispatch returned it")
    return handle
