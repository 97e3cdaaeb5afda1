"""The device operations the rail transports need, on raw pointers and raw streams.

:class:`CudaMemory` does them with the CUDA runtime through CuPy. The transports take any object
with the same methods, so that their tests can run on the CPU with host memory standing in for
device memory (tests/transport_fakes.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tensors import library


def _runtime():
    from cupy.cuda import runtime

    return runtime


class CudaMemory:
    """Copies, pinned host buffers and events on the CUDA device ``device_id``."""

    def __init__(self, device_id: int):
        self.device_id = device_id

    def device(self) -> Any:
        """A context in which this device is current."""
        import cupy

        return cupy.cuda.Device(self.device_id)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Device to device (this device), queued on ``stream``."""
        rt = _runtime()
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream)

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: int) -> None:
        """Device to device, possibly across GPUs, queued on ``stream``."""
        rt = _runtime()
        if dst_device == src_device:
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDeviceToDevice, stream)
        else:
            rt.memcpyPeerAsync(dst, dst_device, src, src_device, nbytes, stream)

    def to_host(self, host: np.ndarray, host_offset: int, src: int, nbytes: int, stream: int) -> None:
        """Device to (pinned) host bytes ``host[host_offset:host_offset+nbytes]``, queued on ``stream``."""
        rt = _runtime()
        rt.memcpyAsync(host.ctypes.data + host_offset, src, nbytes, rt.memcpyDeviceToHost, stream)

    def to_device(self, dst: int, host: np.ndarray, host_offset: int, nbytes: int, stream: int) -> None:
        """(Pinned) host bytes to the device, queued on ``stream``."""
        rt = _runtime()
        rt.memcpyAsync(dst, host.ctypes.data + host_offset, nbytes, rt.memcpyHostToDevice, stream)

    def synchronize(self, stream: int) -> None:
        """Block until the work queued on ``stream`` has run."""
        _runtime().streamSynchronize(stream)

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer of ``nbytes`` bytes (uint8), freed with the array."""
        import cupy

        memory = cupy.cuda.alloc_pinned_memory(max(1, nbytes))
        return np.frombuffer(memory, np.uint8, nbytes)

    def device_view(self, ptr: int, nbytes: int) -> Any:
        """A uint8 CuPy array over ``nbytes`` bytes at ``ptr`` (not owned), for CUDA-aware MPI."""
        if nbytes == 0:
            return np.empty(0, np.uint8)
        return library("cupy").window(ptr, nbytes, self.device_id, None)

    def new_event(self) -> int:
        rt = _runtime()
        return rt.eventCreateWithFlags(rt.eventDisableTiming)

    def record(self, event: int, stream: int) -> None:
        _runtime().eventRecord(event, stream)

    def wait(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event`` (which may be another GPU's)."""
        _runtime().streamWaitEvent(stream, event, 0)

    def event_synchronize(self, event: int) -> None:
        _runtime().eventSynchronize(event)

    def destroy_event(self, event: int) -> None:
        _runtime().eventDestroy(event)
