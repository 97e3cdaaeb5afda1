"""The NCCL rail transports: NCCL's host API, enqueued on the caller's stream.

* :class:`NcclRailTransport` (an mpi4py communicator): a CuPy ``NcclCommunicator`` per rail, its
  unique id made by rail rank 0 and broadcast over the rail's MPI sub-communicator; an
  all-to-all is ``ncclSend``/``ncclRecv`` per peer between ``ncclGroupStart``/``ncclGroupEnd``.
* :class:`TorchNcclRailTransport` (a ``torch.distributed`` NCCL group): the rail's sub-group and
  ``all_to_all_single`` with split sizes on zero-copy uint8 views of the buffers, issued with the
  caller's stream current (``torch.cuda.ExternalStream``), which the ProcessGroup orders its NCCL
  stream against.

NCCL is imported only when a transport is made (CPU machines have none). NCCL refuses two ranks
on one GPU, so these transports need a GPU per rank; tests with ranks sharing a GPU use the MPI
transport. NCCL has no deadline of its own: a peer that never comes leaves the stream waiting
(the Buffer's next wait on that stream is where it shows).
"""

from __future__ import annotations

from typing import Any, List, Sequence

from .base import RailTransport, offsets
from .memory import CudaMemory
from .nccl_library import NO_NCCL_HINT, nccl_or_none


def _host_alltoall_ints(transport: RailTransport, group: Any, values: Sequence[int]) -> List[int]:
    rows = group.allgather(transport._check_ints(values))
    return [int(rows[p][transport.rank]) for p in range(transport.size)]


class NcclRailTransport(RailTransport):
    """Rail all-to-all through a CuPy NCCL communicator (see the module docstring).

    Args:
        rail_group: the rail's :class:`deepep_cupy.groups.group.Group` (an MPIGroup; owned: freed by
            :meth:`close`); it carries the unique id and the host all-to-all of counts.
        rail: the rail's global ranks.
        device_id: this rank's CUDA device (the communicator's).
        timeout_s: unused by NCCL itself (kept for the common signature).
        nccl: CuPy's ``cupy.cuda.nccl`` module or a stand-in (tests).
        memory: the device operations (default :class:`deepep_cupy.transports.memory.CudaMemory`).
    """

    name = "nccl"
    capturable = True

    def __init__(self, rail_group: Any, rail: Sequence[int], device_id: int, timeout_s: float, *,
                 nccl: Any = None, memory: Any = None):
        super().__init__(rail_group, rail, device_id, timeout_s)
        if nccl is None:
            nccl = nccl_or_none()
            if nccl is None:
                raise ValueError(f"transport: 'nccl' needs NCCL: {NO_NCCL_HINT}; or choose 'mpi'")
        self._memory = CudaMemory(device_id) if memory is None else memory
        self._nccl = nccl
        unique_id = rail_group.allgather(nccl.get_unique_id() if self.rank == 0 else None)[0]
        with self._memory.device():
            self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)

    def alltoallv(self, send_ptr: int, send_bytes: Sequence[int], recv_ptr: int, recv_bytes: Sequence[int],
                  stream: int, owners: Sequence[Any] = ()) -> None:
        send_bytes, recv_bytes = self._byte_counts(send_bytes, recv_bytes)
        self._rail_group()   # refused once closed: close() destroyed the communicator
        me, nccl, comm = self.rank, self._nccl, self._comm
        send_off, recv_off = offsets(send_bytes), offsets(recv_bytes)
        if send_bytes[me]:
            self._memory.copy(recv_ptr + recv_off[me], send_ptr + send_off[me], send_bytes[me], stream)
        peers = [p for p in range(self.size) if p != me and (send_bytes[p] or recv_bytes[p])]
        if not peers:
            return
        nccl.groupStart()
        try:
            for p in peers:
                if send_bytes[p]:
                    comm.send(send_ptr + send_off[p], send_bytes[p], nccl.NCCL_INT8, p, stream)
                if recv_bytes[p]:
                    comm.recv(recv_ptr + recv_off[p], recv_bytes[p], nccl.NCCL_INT8, p, stream)
        finally:
            nccl.groupEnd()

    def alltoall_ints(self, values: Sequence[int]) -> List[int]:
        return _host_alltoall_ints(self, self._rail_group(), values)

    def close(self) -> None:
        group = self._take_group()
        if group is not None:
            self._comm.destroy()
            group.free()


class _CudaBytes:
    """``nbytes`` bytes of device memory at ``ptr``, as ``__cuda_array_interface__`` (no stream:
    the caller orders the use)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


class TorchNcclRailTransport(RailTransport):
    """Rail all-to-all through a ``torch.distributed`` NCCL sub-group (see the module docstring).

    Args:
        rail_group: the rail's :class:`deepep_cupy.groups.group.TorchGroup` (owned: freed by :meth:`close`).
        rail: the rail's global ranks (in the Buffer's group).
        device_id: this rank's CUDA device.
        timeout_s: unused (the ProcessGroup has its own timeout).
        torch: the ``torch`` module or a stand-in (tests); ``torch.distributed`` is ``torch.distributed``.
    """

    name = "nccl"
    capturable = True

    def __init__(self, rail_group: Any, rail: Sequence[int], device_id: int, timeout_s: float, *,
                 torch: Any = None):
        super().__init__(rail_group, rail, device_id, timeout_s)
        if torch is None:
            import torch
        self._torch = torch
        self._device = torch.device("cuda", device_id)
        self._stream: Any = (None, None)    # (raw stream, its torch.cuda.ExternalStream): the last one used

    def _bytes(self, ptr: int, nbytes: int) -> Any:
        torch = self._torch
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self._device)
        return torch.as_tensor(_CudaBytes(ptr, nbytes), device=self._device)

    def alltoallv(self, send_ptr: int, send_bytes: Sequence[int], recv_ptr: int, recv_bytes: Sequence[int],
                  stream: int, owners: Sequence[Any] = ()) -> None:
        send_bytes, recv_bytes = self._byte_counts(send_bytes, recv_bytes)
        group = self._rail_group()
        torch = self._torch
        # A collective, so every rank of the rail takes part in every call (also with nothing to
        # move), as torch's lazily made NCCL communicators need; NCCL copies the self entry on the device.
        if self._stream[0] != stream:
            # 0 is the legacy default stream, which ExternalStream would take for a new stream of its pool.
            named = torch.cuda.default_stream(self._device) if stream == 0 else \
                torch.cuda.ExternalStream(stream, device=self._device)
            self._stream = (stream, named)
        with torch.cuda.device(self.device_id), torch.cuda.stream(self._stream[1]):
            torch.distributed.all_to_all_single(
                self._bytes(recv_ptr, sum(recv_bytes)), self._bytes(send_ptr, sum(send_bytes)),
                output_split_sizes=recv_bytes, input_split_sizes=send_bytes,
                group=group.process_group)

    def alltoall_ints(self, values: Sequence[int]) -> List[int]:
        return _host_alltoall_ints(self, self._rail_group(), values)
