"""DeepEP's ``Buffer.get_local_buffer_tensor``: a rank's own buffer (the NVLink buffer or the
low-latency one) as an array the caller writes."""

from __future__ import annotations

from typing import Any

from .. import tensors
from ..tensors import check_int

__all__ = ["local_buffer_tensor"]


def local_buffer_tensor(source: Any, dtype: Any, size: Any = None, offset: int = 0):
    """DeepEP's ``Buffer.get_local_buffer_tensor``: this rank's buffer (``source``: the Buffer's
    NvlBuffer, or its low-latency path's for ``use_rdma_buffer=True``: anything with ``local_ptr``,
    ``num_bytes`` and ``device_id``) as a 1-D array of ``dtype`` (a
    ``torch.dtype`` gives a tensor, any other dtype a CuPy array) from byte ``offset`` (DeepEP's C++
    offsets the pointer in bytes) to the end of the buffer, or its first ``size`` elements shaped as
    ``size``. A view: writes land in the buffer."""
    if source is None:
        raise ValueError("use_rdma_buffer: this Buffer has no such buffer (the NVLink buffer needs num_nvl_bytes "
                         "> 0, the low-latency one low_latency_mode=True)")
    offset = check_int(offset, "offset", minimum=0)
    if offset > source.num_bytes:
        raise ValueError(f"offset: at most the buffer's {source.num_bytes} bytes, got {offset}")
    is_torch = type(dtype).__module__.startswith("torch")
    lib = tensors.library("torch" if is_torch else "cupy")
    owner = getattr(source, "_owner", None) or source
    window = lib.window(source.local_ptr + offset, source.num_bytes - offset, source.device_id, owner)
    if is_torch:
        itemsize = dtype.itemsize
        flat = window[:(source.num_bytes - offset) // itemsize * itemsize].view(dtype)
    else:
        import numpy as np

        itemsize = np.dtype(dtype).itemsize
        flat = window[:(source.num_bytes - offset) // itemsize * itemsize].view(dtype)
    if size is None:
        return flat
    shape = tuple(size) if isinstance(size, (tuple, list)) or hasattr(size, "numel") else (int(size),)
    count = 1
    for extent in shape:
        count *= int(extent)
    if count > flat.shape[0]:
        raise ValueError(f"size: {count} elements, more than the {flat.shape[0]} of the buffer from offset {offset}")
    return flat[:count].reshape(shape)
