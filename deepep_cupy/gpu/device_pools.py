"""The stream-ordered memory pool that in-process ranks sharing a GPU allocate from.

A plain cudaMalloc/cudaFree can wait for work already running on the device, which includes a
co-located peer's transfer that waits for this rank (deadlock). The stream-ordered allocator does
not, but a pool that allows reuse with "internal dependencies" may hand one rank memory that
another freed on its stream and make the first stream wait for the second, which ties the ranks
together again. So the ranks on a GPU allocate from a pool with that reuse switched off.

The ranks on a GPU share one such pool: CuPy's ``MemoryAsyncPool`` allocates from the device's
*current* pool (``cudaMallocAsync``), so pools of their own would all serve every rank anyway. The
pool becomes current when the first rank on the GPU starts, and the pool that was current before
becomes current again when the last one ends. Destroying it while other ranks still ran would make
the device's default pool current for them, and that pool allows the reuse forbidden here.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, Optional, Sequence


@dataclass
class _DevicePool:
    pool: int
    previous: int  # the device's current pool before this one
    malloc: Callable[[int], Any]
    users: int = 0


class DevicePools:
    """Per GPU: the pool its in-process ranks share, made on the first :meth:`acquire` and
    destroyed on the last :meth:`release`.

    ``runtime`` is ``cupy.cuda.runtime`` and ``async_pool_type`` ``cupy.cuda.MemoryAsyncPool``
    (taken as arguments so that the bookkeeping is testable without a GPU).
    """

    def __init__(self, runtime: Any, async_pool_type: Callable[[list], Any]):
        self._runtime = runtime
        self._async_pool_type = async_pool_type
        self._lock = threading.Lock()  # also keeps CuPy's pool objects from being made concurrently
        self._pools: Dict[int, _DevicePool] = {}

    def acquire(self, device: int) -> Callable[[int], Any]:
        """A CuPy allocator (``malloc``) of ``device``'s shared pool, which is current from now on."""
        with self._lock:
            entry = self._pools.get(device)
            if entry is None:
                entry = self._pools[device] = self._make(device)
            entry.users += 1
            return entry.malloc

    def release(self, device: int) -> None:
        """One rank on ``device`` is done; the last one gives the device its previous pool back.

        Safe with allocations still alive (results handed back): the driver releases a destroyed
        pool once the last of them is freed.
        """
        with self._lock:
            entry = self._pools[device]
            entry.users -= 1
            if entry.users == 0:
                del self._pools[device]
                self._runtime.deviceSetMemPool(device, entry.previous)
                self._runtime.memPoolDestroy(entry.pool)

    def _make(self, device: int) -> _DevicePool:
        runtime = self._runtime
        previous = runtime.deviceGetMemPool(device)
        props = runtime.MemPoolProps(runtime.cudaMemAllocationTypePinned, runtime.cudaMemHandleTypeNone,
                                     runtime.cudaMemLocationTypeDevice, device)
        pool = runtime.memPoolCreate(props)
        runtime.memPoolSetAttribute(pool, runtime.cudaMemPoolReuseAllowInternalDependencies, 0)
        handles = ["current"] * runtime.getDeviceCount()
        handles[device] = pool
        # CuPy's pool object makes ``pool`` the device's current pool.
        return _DevicePool(pool, previous, self._async_pool_type(handles).malloc)


_device_pools: Optional[DevicePools] = None
_device_pools_lock = threading.Lock()


def _process_device_pools() -> DevicePools:
    global _device_pools
    with _device_pools_lock:
        if _device_pools is None:
            import cupy

            _device_pools = DevicePools(cupy.cuda.runtime, cupy.cuda.MemoryAsyncPool)
        return _device_pools


@contextlib.contextmanager
def _allocating_from(pools: DevicePools, device: int):
    import cupy

    malloc = pools.acquire(device)
    try:
        with cupy.cuda.using_allocator(malloc):
            yield
    finally:
        pools.release(device)


def allocator_for(devices: Sequence[Optional[int]], rank: int,
                  pools: Optional[DevicePools] = None) -> ContextManager[None]:
    """Where ``rank`` shares its GPU (``devices[rank]``) with other ranks of ``devices``: a context
    in which the calling thread's CuPy allocations come from that GPU's shared pool. Otherwise (also
    for a rank without a GPU, None) a context that changes nothing."""
    device = devices[rank]
    if device is None or sum(1 for d in devices if d == device) < 2:
        return contextlib.nullcontext()
    return _allocating_from(pools or _process_device_pools(), device)


class _CollectorHold:
    """How many threads capture now, and whether the collector ran before the first began."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.captures = 0
        self.was_enabled = False


_HOLD = _CollectorHold()


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector off while any thread is inside: wrap every CUDA graph
    capture of ranks that allocate from the shared pool. An array of CuPy's stream-ordered pool is
    freed on the stream it was allocated on, or on the current stream once that one is gone; a
    collection, which can start in any thread at any allocation, that frees one onto a stream being
    captured breaks the capture (cudaErrorStreamCaptureUnsupported). The first thread in collects
    first (no capture is under way then) and the last one out restores the collector's state."""
    with _HOLD.lock:
        if _HOLD.captures == 0:
            _HOLD.was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
        _HOLD.captures += 1
    try:
        yield
    finally:
        with _HOLD.lock:
            _HOLD.captures -= 1
            if _HOLD.captures == 0 and _HOLD.was_enabled:
                gc.enable()
