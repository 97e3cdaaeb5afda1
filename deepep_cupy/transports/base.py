"""The rail transport's interface: what every transport between nodes does, and checks in common.

A rail is the ranks with the same local index on every node (:meth:`NodeTopology.rail_ranks`),
one per node, in node order. Between nodes, the library only ever moves bytes along a rail, with
one operation: an all-to-all of variable byte counts on device memory, ordered on a CUDA stream
(:meth:`RailTransport.alltoallv`), plus a small host all-to-all of counts. The implementations
(:mod:`deepep_cupy.transports.nccl`, ``.mpi``, ``.torch_staged``, ``.local``) import this module
only; :mod:`deepep_cupy.transports.factory` picks one.
"""

from __future__ import annotations

import abc
from typing import Any, List, Optional, Sequence, Tuple


class RailTransport(abc.ABC):
    """Moves bytes between the ranks of one rail (one rank per node).

    Args:
        rail_group: the rail's :class:`deepep_cupy.groups.group.Group` (one rank per node; owned by the
            transport: freed by :meth:`close`).
        rail: the rail's global ranks (in the Buffer's group), in rail order (for messages).
        device_id: this rank's CUDA device.
        timeout_s: how long a host wait of the transport may last (where it has one).

    Attributes:
        name: ``"nccl"``, ``"mpi"``, ``"torch"`` or ``"local"``.
        capturable: whether :meth:`exchange_blocks` can be captured in a CUDA graph.
        size: ranks in the rail (the number of nodes).
        rank: this rank's index in the rail (its node index).
        rail: the global ranks of the rail (in the Buffer's group), in rail order.
        device_id, timeout_s: as given.
    """

    name: str = ""
    #: Whether :meth:`exchange_blocks` queues only device work (no host wait, no host callback), so
    #: that a CUDA graph capture of the stream can hold it.
    capturable: bool = False
    #: Device address of an int64 word that a timed-out device wait of :meth:`exchange_blocks` sets (to
    #: a code that is not 0), or 0 where the transport has no such waits.
    device_error_ptr: int = 0

    def __init__(self, rail_group: Any, rail: Sequence[int], device_id: int, timeout_s: float):
        self.rail = [int(r) for r in rail]
        self.size = len(self.rail)
        self.rank = rail_group.rank
        if rail_group.size != self.size:
            raise ValueError(f"rail: {self.size} ranks, but the rail group has {rail_group.size}")
        self.device_id = device_id
        self.timeout_s = float(timeout_s)
        # None once close() has taken it: that is what "closed" means for every transport.
        self._group: Optional[Any] = rail_group

    @abc.abstractmethod
    def alltoallv(self, send_ptr: int, send_bytes: Sequence[int], recv_ptr: int, recv_bytes: Sequence[int],
                  stream: int, owners: Sequence[Any] = ()) -> None:
        """Send ``send_bytes[p]`` bytes to rail peer ``p`` and receive ``recv_bytes[p]`` from it.

        Every rank of the rail calls it, with matching counts (``send_bytes[q]`` on rank ``p``
        equals ``recv_bytes[p]`` on rank ``q``).

        Args:
            send_ptr: device pointer (this rank's GPU) of the bytes to send, packed by peer:
                peer ``p``'s bytes start at ``sum(send_bytes[:p])``.
            send_bytes: ``size`` non-negative ints.
            recv_ptr: device pointer of the receive buffer, packed by peer likewise.
            recv_bytes: ``size`` non-negative ints.
            stream: a raw ``cudaStream_t``: the move starts after the work queued on it so far,
                and work queued on it afterwards sees the received bytes. The self entry
                (``p == rank``) is a device-to-device copy. Both buffers must stay alive until
                that work has run.
            owners: the objects that own the memory at ``send_ptr`` and ``recv_ptr``. A transport
                that gives up on a move its library cannot cancel (a timed-out MPI request on
                device memory) keeps them for good, since a late peer may still write there.
        """

    def exchange_blocks(self, send_ptr: int, recv_ptr: int, block_bytes: int, stream: int,
                        owners: Sequence[Any] = ()) -> None:
        """:meth:`alltoallv` of ``block_bytes`` to and from every peer (block ``p`` of each buffer
        is peer ``p``'s): sizes that every rank knows without asking, as a call with no host wait
        sends them."""
        blocks = [int(block_bytes)] * self.size
        self.alltoallv(send_ptr, blocks, recv_ptr, blocks, stream, owners)

    @abc.abstractmethod
    def alltoall_ints(self, values: Sequence[int]) -> List[int]:
        """Host all-to-all of one int per peer.

        Args:
            values: ``size`` ints, ``values[p]`` for rail peer ``p``.

        Returns:
            ``size`` ints, entry ``p`` being what rail peer ``p`` passed for this rank.
        """

    def check(self) -> None:
        """Raise what a wait of the transport on the device left behind (a transport whose waits
        are on the host has none)."""
        return None

    def close(self) -> None:
        """Release the transport's resources (idempotent)."""
        group = self._take_group()
        if group is not None:
            group.free()

    # -- the rail group, owned until close ----------------------------------------------------

    def _rail_group(self) -> Any:
        """The rail's group, for a call.

        Raises:
            ValueError: the transport was closed.
        """
        if self._group is None:
            raise ValueError(f"rank {self.rail[self.rank]}: the {self.name} rail transport was closed")
        return self._group

    def _take_group(self) -> Optional[Any]:
        """The rail's group, which the caller (a close) now frees; None once taken, so that closing
        twice frees it once."""
        group, self._group = self._group, None
        return group

    # -- shared argument checks ----------------------------------------------------------------

    def _counts(self, name: str, counts: Sequence[int]) -> List[int]:
        what = "non-negative byte counts"
        values = self._check_ints(counts, name, what)
        if any(v < 0 for v in values):
            raise ValueError(f"{name}: expected {self.size} {what} (one per rail peer), got {values}")
        return values

    def _byte_counts(self, send_bytes: Sequence[int], recv_bytes: Sequence[int]) -> Tuple[List[int], List[int]]:
        """:meth:`alltoallv`'s counts checked, the self entries equal (a copy on the device)."""
        send_bytes, recv_bytes = self._counts("send_bytes", send_bytes), self._counts("recv_bytes", recv_bytes)
        me = self.rank
        if send_bytes[me] != recv_bytes[me]:
            raise ValueError(f"send_bytes/recv_bytes: this rank sends itself {send_bytes[me]} bytes but receives "
                             f"{recv_bytes[me]}")
        return send_bytes, recv_bytes

    def _check_ints(self, values: Sequence[int], name: str = "values", what: str = "ints") -> List[int]:
        """``values`` as ``size`` ints (``what`` names them in the message of a wrong count)."""
        try:
            ints = [int(v) for v in values]
        except (TypeError, ValueError):
            raise TypeError(f"{name}: expected {self.size} ints, got {values!r}") from None
        if len(ints) != self.size:
            raise ValueError(f"{name}: expected {self.size} {what} (one per rail peer), got {ints}")
        return ints

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rail={self.rail}, rank={self.rank})"


def offsets(counts: Sequence[int]) -> List[int]:
    """Exclusive prefix sums: where each peer's bytes start in a packed buffer."""
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out
