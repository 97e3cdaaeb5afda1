"""The staged torch.distributed rail transport: ``all_to_all_single`` on pinned host copies.

For a ``torch.distributed`` group whose backend moves host memory only (Gloo, or any backend
but NCCL): the bytes for the other nodes are copied out on the stream into a pinned buffer,
exchanged by the rail's ProcessGroup, and copied back on the stream, as the MPI transport does
with an MPI that is not CUDA-aware. The call synchronises its stream first and returns once the
bytes have arrived (the copy back is queued on the stream). A wait lasts as long as the
ProcessGroup's own timeout.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from .base import RailTransport, offsets
from .memory import CudaMemory

#: Pinned staging buffers grow in steps of this many bytes (and never shrink).
STAGING_GRANULE = 1 << 20


class TorchStagedRailTransport(RailTransport):
    """Rail all-to-all through a ``torch.distributed`` sub-group, staged through pinned host memory.

    Args:
        rail_group: the rail's :class:`deepep_cupy.groups.group.TorchGroup` (owned: freed by :meth:`close`).
        rail: the rail's global ranks (for messages).
        device_id: this rank's CUDA device.
        timeout_s: unused (the ProcessGroup has its own timeout).
        memory: the device operations (default :class:`deepep_cupy.transports.memory.CudaMemory`).
    """

    name = "torch"

    def __init__(self, rail_group: Any, rail: Sequence[int], device_id: int, timeout_s: float, *,
                 memory: Any = None):
        super().__init__(rail_group, rail, device_id, timeout_s)
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self._memory = CudaMemory(device_id) if memory is None else memory
        self._send_host: Optional[Any] = None
        self._recv_host: Optional[Any] = None
        self._copied_back: Optional[int] = None     # event: the last copy out of _recv_host has run

    def alltoallv(self, send_ptr: int, send_bytes: Sequence[int], recv_ptr: int, recv_bytes: Sequence[int],
                  stream: int, owners: Sequence[Any] = ()) -> None:
        group = self._rail_group()
        send_bytes, recv_bytes = self._byte_counts(send_bytes, recv_bytes)
        me, memory = self.rank, self._memory
        send_off, recv_off = offsets(send_bytes), offsets(recv_bytes)
        if send_bytes[me]:
            memory.copy(recv_ptr + recv_off[me], send_ptr + send_off[me], send_bytes[me], stream)
        # The host buffers hold the other peers' bytes only, packed (all_to_all_single has no
        # displacements): the device ranges before and after this rank's own.
        send_host = self._staging("_send_host", sum(send_bytes) - send_bytes[me])
        for host_start, start, end in _other_ranges(send_off, send_bytes, me):
            memory.to_host(send_host.numpy(), host_start, send_ptr + start, end - start, stream)
        memory.synchronize(stream)
        if self._copied_back is not None:   # the previous call's copy back out of _recv_host
            memory.event_synchronize(self._copied_back)
        recv_host = self._staging("_recv_host", sum(recv_bytes) - recv_bytes[me])
        send_counts = [0 if p == me else c for p, c in enumerate(send_bytes)]
        recv_counts = [0 if p == me else c for p, c in enumerate(recv_bytes)]
        self._dist.all_to_all_single(recv_host[:sum(recv_counts)], send_host[:sum(send_counts)],
                                     output_split_sizes=recv_counts, input_split_sizes=send_counts,
                                     group=group.process_group)
        for host_start, start, end in _other_ranges(recv_off, recv_bytes, me):
            memory.to_device(recv_ptr + start, recv_host.numpy(), host_start, end - start, stream)
        if self._copied_back is None:
            self._copied_back = memory.new_event()
        memory.record(self._copied_back, stream)

    def alltoall_ints(self, values: Sequence[int]) -> List[int]:
        rows = self._rail_group().allgather(self._check_ints(values))
        return [int(rows[p][self.rank]) for p in range(self.size)]

    def close(self) -> None:
        group = self._take_group()
        if group is not None:
            if self._copied_back is not None:
                self._memory.event_synchronize(self._copied_back)
                self._memory.destroy_event(self._copied_back)
                self._copied_back = None
            self._send_host = self._recv_host = None
            group.free()

    def _staging(self, attr: str, nbytes: int) -> Any:
        buf = getattr(self, attr)
        if buf is None or buf.numel() < nbytes:
            size = -(-max(nbytes, 1) // STAGING_GRANULE) * STAGING_GRANULE
            buf = self._torch.empty(size, dtype=self._torch.uint8, device="cpu", pin_memory=True)
            setattr(self, attr, buf)
        return buf


def _other_ranges(offs: List[int], counts: List[int], me: int):
    """``(host start, device start, device end)`` of the peers' bytes before and after ``me``'s own,
    packed on the host without them."""
    before = (0, 0, offs[me])
    after = (offs[me], offs[me] + counts[me], offs[-1] + counts[-1])
    return [r for r in (before, after) if r[2] > r[1]]
