"""The local rail transport: ranks that are threads of one process (an in-process group).

Peers share the address space, so a rail all-to-all is device-to-device copies. Each call:

1. every rank records a *ready* event on its stream (its receive buffer may be written once the
   work queued before the call has run) and posts its receive pointer, device, counts and that
   event to the rail (an allgather of the rail's group, with the transport's deadline);
2. each rank pushes its send chunks into the peers' receive buffers on its own stream, each copy
   after that peer's ready event, and records a *done* event;
3. a second allgather hands the done events around; each rank's stream waits for the done events
   of the peers it receives from, so work queued afterwards sees the bytes.

An event is recorded again only in the next call, after every peer has passed the allgather that
follows its last use, so two events per rank serve every call.

Equal blocks (:meth:`LocalRailTransport.exchange_blocks`, the calls with no host wait) go through
the mailboxes of :mod:`deepep_cupy.transports.mailboxes` instead: device work alone, which a CUDA
graph can hold.
"""

from __future__ import annotations

from typing import Any, List, Sequence

from ..errors import DeepEPTimeoutError, RankMismatchError
from .base import RailTransport, offsets
from .mailboxes import make_mailboxes
from .memory import CudaMemory


class LocalRailTransport(RailTransport):
    """Rail all-to-all between the threads of an in-process group (see the module docstring).

    Args:
        rail_group: the rail's :class:`deepep_cupy.groups.local.ThreadGroup` (owned: freed by
            :meth:`close`).
        rail: the rail's global ranks (for messages).
        device_id: this rank's CUDA device.
        timeout_s: how long a call waits on the host for its peers
            (:class:`deepep_cupy.DeepEPTimeoutError` naming them).
        memory: the device operations (default :class:`deepep_cupy.transports.memory.CudaMemory`).
    """

    name = "local"

    def __init__(self, rail_group: Any, rail: Sequence[int], device_id: int, timeout_s: float, *,
                 memory: Any = None):
        if not rail_group.in_process:
            raise ValueError("transport: 'local' needs an in-process group (run_local_group)")
        super().__init__(rail_group, rail, device_id, timeout_s)
        self._memory = CudaMemory(device_id) if memory is None else memory
        self._ready: int = self._memory.new_event()
        self._done: int = self._memory.new_event()
        # Host memory standing in for the device (CPU tests) has no mailboxes.
        self._mailboxes = make_mailboxes(rail_group, device_id, timeout_s) if memory is None else None
        self.capturable = self._mailboxes is not None
        if self._mailboxes is not None:
            self.device_error_ptr = self._mailboxes.error_ptr

    def exchange_blocks(self, send_ptr: int, recv_ptr: int, block_bytes: int, stream: int,
                        owners: Sequence[Any] = ()) -> None:
        if self._mailboxes is None:
            super().exchange_blocks(send_ptr, recv_ptr, block_bytes, stream, owners)
            return
        self._rail_group()
        self._mailboxes.exchange(send_ptr, recv_ptr, int(block_bytes), stream)

    def check(self) -> None:
        """Raise what a timed-out wait of the block exchange left (waits for the device)."""
        code = 0 if self._mailboxes is None else self._mailboxes.error()
        if code:
            me = self.rail[self.rank]
            waited = f"rail rank {code - 1}'s post" if code <= self.size else "its peers to read its blocks"
            raise DeepEPTimeoutError(f"rank {me}: the local rail's block exchange timed out waiting for {waited} "
                                     f"(rail ranks 0..{self.size - 1} are global ranks {self.rail}); the Buffer "
                                     "must be destroyed", rank=me, kernel="local rail exchange_blocks")

    def alltoallv(self, send_ptr: int, send_bytes: Sequence[int], recv_ptr: int, recv_bytes: Sequence[int],
                  stream: int, owners: Sequence[Any] = ()) -> None:
        self._rail_group()  # a closed transport's events are gone: refuse before recording one
        send_bytes = self._counts("send_bytes", send_bytes)
        recv_bytes = self._counts("recv_bytes", recv_bytes)
        me, memory = self.rank, self._memory
        memory.record(self._ready, stream)
        posts = self._gather((recv_ptr, self.device_id, send_bytes, recv_bytes, self._ready), "alltoallv")
        # Every rank checks the whole matrix, so all of them raise together (and nobody waits).
        wrong = [(p, q) for p in range(self.size) for q in range(self.size) if posts[p][2][q] != posts[q][3][p]]
        if wrong:
            p, q = wrong[0]
            raise RankMismatchError(
                f"rank {self.rail[me]}: rail alltoallv: rail rank {p} sends {posts[p][2][q]} bytes to rail rank {q}, "
                f"which expects {posts[q][3][p]} (global ranks {self.rail[p]} -> {self.rail[q]})")
        send_off = offsets(send_bytes)
        for p in range(self.size):
            nbytes = send_bytes[p]
            if not nbytes:
                continue
            peer_ptr, peer_device, _, _, peer_ready = posts[p]
            if p != me:
                memory.wait(stream, peer_ready)
            memory.copy_peer(peer_ptr + offsets(posts[p][3])[me], peer_device, send_ptr + send_off[p],
                             self.device_id, nbytes, stream)
        memory.record(self._done, stream)
        dones = self._gather(self._done, "alltoallv (second phase)")
        for p in range(self.size):
            if p != me and recv_bytes[p]:
                memory.wait(stream, dones[p])

    def alltoall_ints(self, values: Sequence[int]) -> List[int]:
        values = self._check_ints(values)
        rows = self._gather(values, "alltoall_ints")
        return [int(rows[p][self.rank]) for p in range(self.size)]

    def _gather(self, obj: Any, what: str) -> List[Any]:
        """The rail group's allgather; a timeout names the rail's ranks as the Buffer's group numbers them."""
        try:
            return self._rail_group().allgather(obj, timeout_s=self.timeout_s)
        except DeepEPTimeoutError as exc:
            me = self.rail[self.rank]
            raise DeepEPTimeoutError(f"rank {me}: local rail {what} timed out (rail ranks 0..{self.size - 1} are "
                                     f"global ranks {self.rail}): {exc}", rank=me, kernel=f"local rail {what}") from exc

    def close(self) -> None:
        group = self._take_group()
        if group is not None:
            # A peer may still have work queued that waits on these events: they are destroyed
            # only once this rank's stream work is done (CUDA defers the release itself).
            for event in (self._ready, self._done):
                self._memory.destroy_event(event)
            group.free()
