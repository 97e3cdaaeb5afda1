"""CuPy and PyTorch arrays in, the same library's arrays out, and the caller's stream.

CuPy has no bfloat16 or float8 dtype, so the library names element types itself:

    name              CuPy storage       PyTorch dtype
    "bfloat16"        uint16 (raw bits)  torch.bfloat16
    "float16"         float16            torch.float16
    "float32"         float32            torch.float32
    "float8_e4m3fn"   uint8 (raw bits)   torch.float8_e4m3fn

PyTorch tensors are viewed zero-copy through ``__cuda_array_interface__`` (16-bit and 8-bit
floats are first reinterpreted as integers of the same width, which that interface can name);
outputs for a PyTorch caller are CuPy allocations wrapped zero-copy as tensors.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

_CUPY_NAMES = {
    np.dtype(np.uint16): "bfloat16",
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.uint8): "float8_e4m3fn",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.bool_): "bool",
}
STORAGE = {name: dtype for dtype, name in _CUPY_NAMES.items()}
ITEMSIZE = {name: dtype.itemsize for name, dtype in STORAGE.items()}

_TORCH_REINTERPRET = {"bfloat16": "int16", "float8_e4m3fn": "uint8"}


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _torch_dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def as_cupy(x: Any, arg: str, device_id: int):
    """View ``x`` (CuPy array or PyTorch CUDA tensor) as a CuPy array of its storage dtype.

    Returns:
        ``(array, dtype_name, framework)`` with framework ``"cupy"`` or ``"torch"``.

    Raises:
        TypeError: ``x`` is not a device array (NumPy arrays and CPU tensors included).
        ValueError: ``x`` lives on another GPU than the Buffer's.
    """
    import cupy

    if isinstance(x, cupy.ndarray):
        name = _CUPY_NAMES.get(x.dtype)
        if name is None:
            raise TypeError(f"{arg}: unsupported dtype {x.dtype} (see deepep_cupy.arrays for the accepted types)")
        if x.data.device_id != device_id:
            raise ValueError(f"{arg}: expected an array on GPU {device_id} (the Buffer's), got one on GPU "
                             f"{x.data.device_id}")
        return x, name, "cupy"
    if is_torch(x):
        if not x.is_cuda:
            raise TypeError(f"{arg}: expected a CUDA tensor, got one on {x.device}")
        if x.device.index != device_id:
            raise ValueError(f"{arg}: expected a tensor on GPU {device_id} (the Buffer's), got one on {x.device}")
        name = _torch_dtype_name(x)
        if name not in STORAGE:
            raise TypeError(f"{arg}: unsupported dtype {x.dtype}")
        viewed = x.view(getattr(__import__("torch"), _TORCH_REINTERPRET[name])) if name in _TORCH_REINTERPRET else x
        array = cupy.asarray(viewed)
        if array.dtype != STORAGE[name]:
            array = array.view(STORAGE[name])
        return array, name, "torch"
    if isinstance(x, np.ndarray):
        raise TypeError(f"{arg}: expected a device array (CuPy array or CUDA tensor), got a NumPy array on the host")
    raise TypeError(f"{arg}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")


def to_framework(array, dtype_name: str, framework: str):
    """Return ``array`` (CuPy storage of ``dtype_name``) as the caller's framework's array."""
    if array is None or framework == "cupy":
        return array
    import torch

    tensor = torch.as_tensor(array, device=f"cuda:{array.device.id}")
    if dtype_name in _TORCH_REINTERPRET:
        tensor = tensor.view(getattr(torch, dtype_name))
    return tensor


def caller_stream(framework: str, device_id: int):
    """The stream the caller's work runs on: CuPy's current stream, or PyTorch's current stream
    of ``device_id`` for tensors (PyTorch keeps its own current device, per thread)."""
    import cupy

    if framework == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream(device_id).cuda_stream, device_id)
    return cupy.cuda.get_current_stream()


def check_array(array, arg: str, dtype_names: Tuple[str, ...], ndim: int,
                shape: Optional[Tuple[Optional[int], ...]] = None) -> None:
    """Raise a clear error unless ``array`` (CuPy) has one of ``dtype_names``, ``ndim`` and ``shape``.

    ``None`` in ``shape`` accepts any extent. The array must be C-contiguous.
    """
    name = _CUPY_NAMES.get(array.dtype)
    if name not in dtype_names:
        raise TypeError(f"{arg}: expected dtype {' or '.join(dtype_names)}, got {name or array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{arg}: expected {ndim} dimensions, got shape {tuple(array.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, array.shape)):
            if want is not None and want != got:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{arg}: expected shape {expected}, got {tuple(array.shape)} (axis {axis})")
    if not array._c_contiguous:  # CuPy's cached flag: array.flags builds an object per call
        raise ValueError(f"{arg}: expected a contiguous (row-major) array, got strides {array.strides}")
