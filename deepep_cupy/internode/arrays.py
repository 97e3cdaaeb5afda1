"""The internode path's array work on the device (CuPy): views of the caller's arrays, rows as
bytes, counts without a host sync, and DeepEP's receive order."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .. import tensors
from ..tensors import ITEMSIZE, STORAGE
from .records import UnpackTargets


def cupy_module():
    import cupy

    return cupy


def device_view(array, info: tensors.ArrayInfo, device_id: int):
    """A CuPy array over ``array``'s memory (storage dtype, shape and strides of ``info``)."""
    cupy = cupy_module()
    dtype_name = info.dtype_name
    if dtype_name is None:  # its checks refused it (tensors.check_array)
        raise TypeError(f"expected an array of a dtype the kernels move, got {info.dtype}")
    dtype = STORAGE[dtype_name]
    if any(extent == 0 for extent in info.shape):
        return cupy.empty(info.shape, dtype)
    if info.lib.name == "cupy":
        return array.view(dtype)
    ptr = tensors.read(array)[1]
    extent = ITEMSIZE[dtype_name] + sum((n - 1) * s for n, s in zip(info.shape, info.strides))
    memory = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, extent, array, device_id), 0)
    return cupy.ndarray(info.shape, dtype, memory, strides=info.strides)


def device_pointer(values) -> int:
    """The device address of a CuPy array."""
    return values.data.ptr


def byte_rows(values):
    """The ``[T, H]`` ``values`` as uint8 rows ``[T, row bytes]`` (a copy unless C-contiguous)."""
    return cupy_module().ascontiguousarray(values).view(cupy_module().uint8)


def scale_rows(values, info: tensors.ArrayInfo):
    """FP8 scales ``[T, S]`` or ``[T]`` (any strides) as ``[T, S]``."""
    return values if len(info.shape) == 2 else values.reshape(info.shape[0], 1)


def c_strides(shape: Tuple[int, ...], dtype_name: str) -> Tuple[int, ...]:
    strides, step = [], ITEMSIZE[dtype_name]
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def deepep_order(counts: np.ndarray, num_nodes: int, ranks_per_node: int) -> Optional[np.ndarray]:
    """For each row of a receiver in DeepEP's order (by source rank ``g = m*L + j``, then source
    token), its row in the node stage's order (by forwarding local rank ``j``, then source node
    ``m``, then source token); ``counts[g]``: the rows from source rank ``g``. None when the two
    orders are the same."""
    c = np.asarray(counts, np.int64).reshape(num_nodes, ranks_per_node)   # [m, j]
    stage_start = (np.cumsum(c.T.ravel()) - c.T.ravel()).reshape(ranks_per_node, num_nodes).T
    deepep_start = (np.cumsum(c.ravel()) - c.ravel()).reshape(num_nodes, ranks_per_node)
    shift = (stage_start - deepep_start).ravel()
    if not shift.any():
        return None
    return np.repeat(shift, c.ravel()) + np.arange(int(c.sum()), dtype=np.int64)


def counts(ids, length: int):
    """int32 occurrences of each id in ``[0, length)`` among ``ids`` (any shape; other values, -1
    included, are not counted). No host sync: ``cupy.bincount`` and a boolean mask both read a size
    back to the host, a scatter-add into one spare bin for the ids not counted does not."""
    cupy = cupy_module()
    bins = cupy.zeros(length + 1, cupy.int32)
    if ids.size:
        cupy.add.at(bins, cupy.where((ids >= 0) & (ids < length), ids, length).ravel(), 1)
    return bins[:length]


def call_lib(*arrays) -> tensors.ArrayLib:
    """The array library of a call: its first argument's that has one (an argument of no library
    is refused by the checks, on every rank, in the call's vote), else CuPy's."""
    for array in arrays:
        lib = None if array is None else tensors.lib_of(array)
        if lib is not None:
            return lib
    return tensors.library("cupy")


def inverse_of(order):
    """The permutation that undoes ``order`` (a CuPy int64 permutation)."""
    cupy = cupy_module()
    inverse = cupy.empty_like(order)
    inverse[order] = cupy.arange(order.shape[0], dtype=order.dtype)
    return inverse


def new_output(lib, shape: Tuple[int, ...], dtype_name: str, device_id: int):
    """``(array, view)``: a new C-contiguous array of the caller's library and a CuPy view of it."""
    out = lib.empty(shape, dtype_name, device_id)
    if lib.name == "cupy":
        return out, out
    info = tensors.ArrayInfo(lib, dtype_name, None, tuple(shape), True, c_strides(shape, dtype_name))
    return out, device_view(out, info, device_id)


def new_bytes(lib, rows: int, row_bytes: int, device_id: int):
    """A byte buffer ``[rows, row_bytes]`` allocated by the caller's library (on the call's stream,
    so that a capture's buffers belong to its graph), as a CuPy uint8 view."""
    return new_output(lib, (rows, row_bytes), "bool", device_id)[1].view(cupy_module().uint8)


def to_lib(lib, values, dtype_name: str, device_id: int):
    """``values`` (CuPy, storage dtype) as an array of the caller's library (a copy for PyTorch)."""
    if lib.name == "cupy":
        return values
    out, view = new_output(lib, values.shape, dtype_name, device_id)
    if values.size:
        view[...] = values
    return out


def dispatch_outputs(lib, rows: int, info, scales_info, num_topk: int, weights: bool, in_rank: int, device_id: int):
    """``(arrays, views)`` of a dispatch's outputs of ``rows`` rows: rows, scales, top-k, weights
    (and, for the node stage's inputs, is_token_in_rank ``[rows, in_rank]``); the views as
    :class:`UnpackTargets` (the rows as bytes)."""
    x_out, x_view = new_output(lib, (rows, *info.shape[1:]), info.dtype_name, device_id)
    made = [None if scales_info is None else new_output(lib, (rows, *scales_info.shape[1:]), "float32", device_id),
            None if not num_topk else new_output(lib, (rows, num_topk), "int64", device_id),
            None if not weights else new_output(lib, (rows, num_topk), "float32", device_id),
            None if not in_rank else new_output(lib, (rows, in_rank), "bool", device_id)]
    row_bytes = tensors.row_bytes(info.shape[1:], info.dtype_name)
    arrays = [x_out] + [None if m is None else m[0] for m in made]
    views = [x_view.view(cupy_module().uint8).reshape(rows, row_bytes)] + [None if m is None else m[1] for m in made]
    if views[1] is not None:
        views[1] = views[1].reshape(rows, (scales_info.shape + (1,))[1])
    return arrays, UnpackTargets(*views)
