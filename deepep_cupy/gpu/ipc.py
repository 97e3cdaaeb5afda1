"""The NVLink buffer: one device allocation per rank, mapped by every peer.

Across processes the allocation's CUDA IPC handle is exchanged with the group's ``allgather``
and opened by every peer (``cudaIpcOpenMemHandle``). Inside one process (the thread group)
ranks exchange the raw device pointers and enable peer access instead. Either way each rank ends
with ``peer_ptrs``: a device array of R pointers, entry r valid on this rank's device and naming
rank r's buffer (entry ``rank`` its own).
"""

from __future__ import annotations

import ctypes
from typing import List

import numpy as np

from ..constants import ABORT_INT, ABORT_REASON_INT
from ..errors import DeepEPError
from ..groups.group import Group


def _runtime():
    from cupy.cuda import runtime
    return runtime


def _enable_peer_access(peer_devices: List[int], device_id: int) -> None:
    runtime = _runtime()
    for peer in set(peer_devices) - {device_id}:
        if not runtime.deviceCanAccessPeer(device_id, peer):
            raise DeepEPError(f"deepep_cupy: GPU {device_id} cannot access GPU {peer} as a peer (no NVLink/P2P path)")
        try:
            runtime.deviceEnablePeerAccess(peer)
        except runtime.CUDARuntimeError as exc:
            if "PeerAccessAlreadyEnabled" not in str(exc):
                raise


class NvlBuffer:
    """This rank's NVLink buffer and its mapping of every peer's.

    Args:
        group: the rank group (every rank must construct its NvlBuffer collectively).
        num_bytes: size of each rank's buffer (identical on every rank).
    """

    def __init__(self, group: Group, num_bytes: int):
        import cupy

        runtime = _runtime()
        self.num_bytes = num_bytes
        self.rank = group.rank
        self.device_id = cupy.cuda.Device().id
        self._opened: List[int] = []
        self.local_ptr = runtime.malloc(num_bytes)
        try:
            # The barrier words must start at zero, and stale queue flags must not look valid.
            runtime.memset(self.local_ptr, 0, num_bytes)
            runtime.deviceSynchronize()
            if group.in_process:
                entries = group.allgather((self.local_ptr, self.device_id))
                _enable_peer_access([d for _, d in entries], self.device_id)
                ptrs = [p for p, _ in entries]
            else:
                handles = group.allgather(runtime.ipcGetMemHandle(self.local_ptr))
                ptrs = []
                for r, handle in enumerate(handles):
                    if r == self.rank:
                        ptrs.append(self.local_ptr)
                    else:
                        ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
                        self._opened.append(ptr)
                        ptrs.append(ptr)
            self.ptrs = ptrs
            self.peer_ptrs = cupy.asarray(np.array(ptrs, dtype=np.uint64))
        except Exception:
            self.close()
            raise

    def mark_gave_up(self, reason: int) -> None:
        """Write this rank's abort mark, with ``reason`` (a ``constants.HOST_FAILURES`` code), into
        every rank's buffer, its own included, as a kernel that gives up does (kernels/common.cuh):
        the peers' kernels that wait for this rank, and every later one, stop at once and name it.
        For a host that fails after its call launched kernels. The copies go on a stream of their
        own, which the Buffer's kernels (spinning, maybe, on peers) do not hold up."""
        from cupy.cuda import runtime

        words = np.array([reason, self.rank + 1], dtype=np.int32)
        stream = runtime.streamCreateWithFlags(runtime.streamNonBlocking)
        pinned = runtime.hostAlloc(words.nbytes, 0)
        try:
            ctypes.memmove(pinned, words.ctypes.data, words.nbytes)
            for ptr in self.ptrs:
                # The reason first: a kernel that sees the mark reads it.
                runtime.memcpyAsync(ptr + 4 * ABORT_REASON_INT, pinned, 4, runtime.memcpyHostToDevice, stream)
                runtime.memcpyAsync(ptr + 4 * ABORT_INT, pinned + 4, 4, runtime.memcpyHostToDevice, stream)
            runtime.streamSynchronize(stream)
        finally:
            runtime.freeHost(pinned)
            runtime.streamDestroy(stream)

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's (idempotent)."""
        runtime = _runtime()
        for ptr in self._opened:
            try:
                runtime.ipcCloseMemHandle(ptr)
            except Exception:
                pass
        self._opened = []
        self.peer_ptrs = None
        if self.local_ptr:
            runtime.free(self.local_ptr)
            self.local_ptr = 0
