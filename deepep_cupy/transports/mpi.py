"""The MPI rail transport: mpi4py ``Ialltoallv`` over the rail's sub-communicator.

Where the MPI is CUDA-aware, the device buffers go to MPI as they are; elsewhere they are staged
through pinned host memory (copied out on the stream, exchanged, copied back on the stream).
Either way the call synchronises its stream first and returns once the bytes have arrived (the
copy back, if any, is queued on the stream).

A wait never stays a hang: the requests are polled until ``timeout_s``, then
:class:`deepep_cupy.DeepEPTimeoutError` names the rail peers not heard from. Next to the data,
each rank sends every peer a tiny arrival message carrying its call number, which is what tells
who never reached the call (a collective request alone cannot say), and that the ranks agree on
the call count. After a timeout the transport is unusable (MPI cannot cancel a collective), and
what the call left posted (requests, their arrays, the staging buffers, the owners of device
memory given to MPI) is kept for good.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..errors import DeepEPError, DeepEPTimeoutError, RankMismatchError
from .base import RailTransport, offsets
from .memory import CudaMemory

#: Environment variable: ``1``/``0`` says whether the MPI is CUDA-aware, instead of asking it.
MPI_CUDA_AWARE_ENV = "DEEPEP_CUPY_MPI_CUDA_AWARE"

_ARRIVAL_TAG = 7101
_INTS_TAG = 7102

#: Pinned staging buffers grow in steps of this many bytes (and never shrink).
STAGING_GRANULE = 1 << 20

#: What closed transports that timed out left posted (their requests, the arrays those read and
#: write, the staging buffers): MPI cannot cancel them, so a late peer may still write there, and
#: the memory must never be reused. Never emptied (one entry per broken transport).
_LEFT_POSTED: List[Any] = []


def mpi_is_cuda_aware(comm: Any) -> bool:
    """Whether ``comm``'s MPI takes device pointers: :data:`MPI_CUDA_AWARE_ENV` if set, else
    ``MPI.Query_cuda_support()`` where mpi4py has it (Open MPI), else whether the communicator's
    ``mpi_memory_alloc_kinds`` info (MPI 4.1) names CUDA memory."""
    text = os.environ.get(MPI_CUDA_AWARE_ENV, "").strip()
    if text:
        if text not in ("0", "1"):
            raise ValueError(f"{MPI_CUDA_AWARE_ENV}: expected 0 or 1, got {text!r}")
        return text == "1"
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            pass
    try:
        kinds = comm.Get_info().Get("mpi_memory_alloc_kinds") or ""
    except Exception:
        return False
    return "cuda" in kinds.lower()


class MpiRailTransport(RailTransport):
    """Rail all-to-all through mpi4py (see the module docstring).

    Args:
        rail_group: the rail's :class:`deepep_cupy.groups.group.MPIGroup` (owned: freed by :meth:`close`).
        rail: the rail's global ranks (for messages).
        device_id: this rank's CUDA device.
        timeout_s: how long a call waits for its peers.
        cuda_aware: pass device buffers to MPI (default: :func:`mpi_is_cuda_aware`).
        memory: the device operations (default :class:`deepep_cupy.transports.memory.CudaMemory`).
    """

    name = "mpi"

    def __init__(self, rail_group: Any, rail: Sequence[int], device_id: int, timeout_s: float, *,
                 cuda_aware: Optional[bool] = None, memory: Any = None):
        super().__init__(rail_group, rail, device_id, timeout_s)
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = rail_group.comm
        self.cuda_aware = mpi_is_cuda_aware(self._comm) if cuda_aware is None else bool(cuda_aware)
        self._memory = CudaMemory(device_id) if memory is None else memory
        self._send_host: Optional[np.ndarray] = None
        self._recv_host: Optional[np.ndarray] = None
        self._copied_back: Optional[int] = None     # event: the last copy out of _recv_host has run
        self._calls = 0
        self._broken: Optional[str] = None
        #: Per timed-out wait, ``(its requests, the arrays they use)``: kept while MPI may use them.
        self._abandoned: List[Any] = []

    # -- the operations ---------------------------------------------------------------------

    def alltoallv(self, send_ptr: int, send_bytes: Sequence[int], recv_ptr: int, recv_bytes: Sequence[int],
                  stream: int, owners: Sequence[Any] = ()) -> None:
        self._check_usable()
        send_bytes, recv_bytes = self._byte_counts(send_bytes, recv_bytes)
        me, memory = self.rank, self._memory
        send_off, recv_off = offsets(send_bytes), offsets(recv_bytes)
        if send_bytes[me]:
            memory.copy(recv_ptr + recv_off[me], send_ptr + send_off[me], send_bytes[me], stream)
        # The self entry is the copy above; MPI moves the others.
        send_counts, recv_counts = list(send_bytes), list(recv_bytes)
        send_counts[me] = recv_counts[me] = 0
        send_total, recv_total = sum(send_bytes), sum(recv_bytes)
        if self.cuda_aware:
            memory.synchronize(stream)
            self._exchange([memory.device_view(send_ptr, send_total), (send_counts, send_off), self._MPI.BYTE],
                           [memory.device_view(recv_ptr, recv_total), (recv_counts, recv_off), self._MPI.BYTE],
                           owners)
            return
        send_host = self._staging("_send_host", send_total)
        for start, end in self._ranges(send_off, send_bytes):
            memory.to_host(send_host, start, send_ptr + start, end - start, stream)
        memory.synchronize(stream)
        if self._copied_back is not None:   # the previous call's copy back out of _recv_host
            memory.event_synchronize(self._copied_back)
        recv_host = self._staging("_recv_host", recv_total)
        self._exchange([send_host, (send_counts, send_off), self._MPI.BYTE],
                       [recv_host, (recv_counts, recv_off), self._MPI.BYTE])
        for start, end in self._ranges(recv_off, recv_bytes):
            memory.to_device(recv_ptr + start, recv_host, start, end - start, stream)
        if self._copied_back is None:
            self._copied_back = memory.new_event()
        memory.record(self._copied_back, stream)

    def alltoall_ints(self, values: Sequence[int]) -> List[int]:
        self._check_usable()
        values = self._check_ints(values)
        me = self.rank
        out = np.zeros(self.size, np.int64)
        out[me] = values[me]
        sent = np.asarray(values, np.int64)
        requests: Dict[int, Any] = {}
        for p in range(self.size):
            if p != me:
                requests[p] = self._comm.Irecv([out[p:p + 1], self._MPI.INT64_T], source=p, tag=_INTS_TAG)
        sends = [self._comm.Isend([sent[p:p + 1], self._MPI.INT64_T], dest=p, tag=_INTS_TAG)
                 for p in range(self.size) if p != me]
        self._wait(requests, sends, "alltoall_ints", (out, sent))
        return [int(v) for v in out]

    def close(self) -> None:
        group = self._take_group()
        if group is not None:
            if self._copied_back is not None:
                if self._broken is None:    # the last copy back still reads _recv_host
                    self._memory.event_synchronize(self._copied_back)
                self._memory.destroy_event(self._copied_back)
                self._copied_back = None
            if self._broken is not None:
                # Outstanding requests still use the communicator (not freed), their arrays and
                # the staging buffers (kept for good, past this transport).
                _LEFT_POSTED.append((self._abandoned, self._send_host, self._recv_host))
            self._send_host = self._recv_host = None
            self._abandoned = []
            if self._broken is None:
                group.free()
            self._broken = self._broken or "the transport was closed"

    # -- helpers ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise DeepEPError(f"rank {self.rail[self.rank]}: the MPI rail transport is unusable: {self._broken}")

    def _ranges(self, offs: List[int], counts: List[int]):
        """The packed byte ranges of the peers other than this rank (before and after its own)."""
        me = self.rank
        return [(s, e) for s, e in ((0, offs[me]), (offs[me] + counts[me], offs[-1] + counts[-1])) if e > s]

    def _staging(self, attr: str, nbytes: int) -> np.ndarray:
        buf = getattr(self, attr)
        if buf is None or buf.nbytes < nbytes:
            size = -(-max(nbytes, 1) // STAGING_GRANULE) * STAGING_GRANULE
            buf = self._memory.pinned(size)
            setattr(self, attr, buf)
        return buf

    def _exchange(self, sendbuf: list, recvbuf: list, owners: Sequence[Any] = ()) -> None:
        """Ialltoallv plus the arrival messages, waited for with the deadline (``owners``: those of
        device memory that the buffers view, kept with them after a timeout)."""
        call = self._calls
        self._calls += 1
        me = self.rank
        stamps = np.full(self.size, -1, np.int64)
        mine = np.full(1, call, np.int64)
        arrivals = {p: self._comm.Irecv([stamps[p:p + 1], self._MPI.INT64_T], source=p, tag=_ARRIVAL_TAG)
                    for p in range(self.size) if p != me}
        sends = [self._comm.Isend([mine, self._MPI.INT64_T], dest=p, tag=_ARRIVAL_TAG)
                 for p in range(self.size) if p != me]
        data = self._comm.Ialltoallv(sendbuf, recvbuf)
        self._wait(arrivals, sends + [data], "alltoallv", (stamps, mine, sendbuf, recvbuf, tuple(owners)))
        wrong = {self.rail[p]: int(stamps[p]) for p in arrivals if stamps[p] != call}
        if wrong:
            self._broken = "ranks disagree on the number of calls"
            raise RankMismatchError(f"rank {self.rail[me]}: rail alltoallv call {call}, but rail peers are at calls "
                                    f"{wrong} (global rank: call; every rank must make the same calls)")

    def _wait(self, from_peers: Dict[int, Any], others: List[Any], what: str, buffers: Sequence[Any]) -> None:
        """Poll until every request completed, or raise DeepEPTimeoutError after ``timeout_s``,
        keeping the requests still posted and ``buffers`` (the arrays they read and write: MPI
        may still use them, a late peer writes there) for as long as MPI may use them."""
        pending = dict(from_peers)
        rest = list(others)
        deadline = time.monotonic() + self.timeout_s
        polls = 0
        while True:
            for p in [p for p, req in pending.items() if req.Test()]:
                del pending[p]
            rest = [req for req in rest if not req.Test()]
            if not pending and not rest:
                return
            if time.monotonic() > deadline:
                break
            polls += 1
            # Spin first (a transfer that is about to end), then give the core away.
            if polls > 1000:
                time.sleep(1e-4)
            else:
                os.sched_yield()
        me = self.rail[self.rank]
        self._broken = f"a {what} timed out"
        self._abandoned.append((list(pending.values()) + rest, tuple(buffers)))
        if pending:
            missing = sorted(pending)
            globals_ = [self.rail[p] for p in missing]
            raise DeepEPTimeoutError(
                f"rank {me}: MPI rail {what} timed out after {self.timeout_s:g} s: rail peers {missing} "
                f"(global ranks {globals_}) never reached it", rank=me, kernel=f"mpi rail {what}", peer=globals_[0])
        raise DeepEPTimeoutError(
            f"rank {me}: MPI rail {what} timed out after {self.timeout_s:g} s: every rail peer reached it, but the "
            "transfer did not complete", rank=me, kernel=f"mpi rail {what}")
