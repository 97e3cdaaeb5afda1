"""DeepEP's names and arguments where they differ from this library's own, in one place.

A DeepEP intranode script runs with ``import deepep_cupy as deep_ep``: ``Buffer`` takes DeepEP's
constructor arguments (and refuses the internode and low-latency ones it cannot honour before
any collective starts), ``Buffer.capture()`` records an event for ``previous_event``, and
``deep_ep.topk_idx_t`` names the dtype of expert ids. The table of docs/DEEPEP_MIGRATION.md lists every
difference that remains.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from . import tensors
from .events import EventOverlap
from .tensors import library

#: What :class:`deepep_cupy.Buffer` refuses, with why: DeepEP features it does not have.
_UNSUPPORTED = {
    "allow_mnnvl": "multi-node NVLink (MNNVL) is not supported; all ranks must share one node",
    "use_fabric": "fabric memory handles are for multi-node NVLink, which is not supported",
    "enable_shrink": "shrinking the group after a rank failure is not supported; destroy the Buffer on every "
                     "rank and make a new one",
}


def check_supported(num_rdma_bytes: int, low_latency_mode: bool = False, **flags: bool) -> None:
    """Refuse DeepEP constructor settings this library cannot honour.

    ``num_rdma_bytes > 0`` asks for an internode Buffer (deepep_cupy/internode/path.py): the
    hierarchical path when the group spans nodes, the intranode one on one node (as DeepEP). With
    ``low_latency_mode`` the RDMA bytes are the low-latency buffer's (DeepEP's decode API, over
    NVLink on one node): a positive int.

    Raises:
        ValueError: ``num_rdma_bytes`` is not as above, or one of ``flags`` (named in
            :data:`_UNSUPPORTED`) is true; the message says why.
    """
    if isinstance(num_rdma_bytes, bool) or not isinstance(num_rdma_bytes, int) or num_rdma_bytes < 0:
        raise ValueError(f"num_rdma_bytes: expected an int >= 0, got {num_rdma_bytes!r} (0: one node; > 0: an "
                         "internode Buffer, sized with Config.get_rdma_buffer_size_hint, or with "
                         "low_latency_mode=True the low-latency buffer)")
    if low_latency_mode and num_rdma_bytes == 0:
        raise ValueError("num_rdma_bytes: expected a positive int with low_latency_mode=True (the low-latency "
                         "buffer; size it with Buffer.get_low_latency_rdma_size_hint), got 0")
    for name, value in flags.items():
        if value:
            raise ValueError(f"{name}=True: {_UNSUPPORTED[name]}")


def resolve_group(group: Any, comm: Any) -> Any:
    """The one rank group a Buffer was given: DeepEP's ``group`` (a ProcessGroup), its ``comm=``
    (an mpi4py communicator), or a :class:`deepep_cupy.Group` in either place."""
    if group is None and comm is None:
        raise TypeError("Buffer: expected a group (torch.distributed ProcessGroup, mpi4py communicator or "
                        "deepep_cupy Group) as the first argument or as comm=")
    if group is not None and comm is not None and group is not comm:
        raise ValueError("Buffer: got both group and comm; pass one of them")
    return group if group is not None else comm


def resolve_device(device: Optional[int], group: Any) -> int:
    """The GPU of a Buffer: ``device`` if given; else torch's current device for a ProcessGroup
    (DeepEP's rule: ``torch.cuda.set_device(local_rank)`` picks it); else CuPy's current device."""
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device: expected a CUDA device id (a non-negative int), got {device!r}")
        return device
    from .gpu.check import require_gpu
    from .groups.group import TorchGroup

    require_gpu("deepep_cupy.Buffer")  # before the first CUDA call: one sentence, not CuPy's bare error

    if isinstance(group, TorchGroup):
        import torch

        return torch.cuda.current_device()
    import cupy

    return cupy.cuda.Device().id


def _torch_cuda_in_use() -> Any:
    """The ``torch`` module when this process has initialised its CUDA state, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch
    return None


def capture(stream: Any = None) -> EventOverlap:
    """An :class:`EventOverlap` whose event is recorded now on ``stream``.

    Args:
        stream: a ``cupy.cuda.Stream``, a ``torch.cuda.Stream`` or None: PyTorch's current stream
            when this process uses PyTorch's CUDA (DeepEP's ``Buffer.capture()``), otherwise
            CuPy's current stream.

    Returns:
        An EventOverlap to pass as ``previous_event``: the operation then starts after the work
        queued on ``stream`` so far, instead of after the caller's current stream.
    """
    import cupy

    lib = None
    if stream is None:
        torch = _torch_cuda_in_use()
        if torch is not None:
            stream = torch.cuda.current_stream()
        else:
            stream = cupy.cuda.get_current_stream()
    if hasattr(stream, "cuda_stream"):  # a torch.cuda.Stream: its caller waits on torch's stream
        lib = library("torch")
        device_id, stream_ptr = stream.device.index, stream.cuda_stream
    else:
        # CuPy's null stream belongs to no device (device_id -1): the current device records on it.
        device_id = getattr(stream, "device_id", -1)
        device_id = cupy.cuda.Device().id if device_id is None or device_id < 0 else device_id
        stream_ptr = stream.ptr
    with cupy.cuda.Device(device_id):
        event = cupy.cuda.Event(disable_timing=True)
        cupy.cuda.runtime.eventRecord(event.ptr, stream_ptr)
    return EventOverlap(event, (), lib, device_id)


def topk_idx_dtype() -> Any:
    """DeepEP's ``topk_idx_t``: the dtype of expert ids, ``torch.int64`` (``numpy.int64`` without PyTorch)."""
    try:
        import torch
    except ImportError:
        import numpy

        return numpy.int64
    return torch.int64


def torch_stream_of(stream: Any, device_id: int) -> Any:
    """``stream`` (a CuPy stream) as a ``torch.cuda.Stream`` naming it, as DeepEP's
    ``get_comm_stream`` returns it; the CuPy stream itself where PyTorch is not installed."""
    try:
        torch_lib = tensors.library("torch")
    except ImportError:
        return stream
    return torch_lib.stream(stream.ptr, device_id)
