"""The local rail's mailboxes: an all-to-all of equal blocks between the threads of one process,
ordered on the device alone (kernels/rail.cu), so that a CUDA graph can hold it.

Every rank of the rail owns one mailbox in its device memory, and its peers read and add to it;
the device addresses are exchanged once, when the mailboxes are made. A rank on another GPU is
reached through peer access, which is enabled here; where a pair of GPUs has none the mailboxes
are not made (:func:`make_mailboxes` returns None) and the transport keeps its event-ordered copies.
"""

from __future__ import annotations

from typing import Any, Optional

from ..constants import RAIL_ERROR, RAIL_MAILBOX_WORDS, RAIL_PULL_BLOCKS
from ..gpu import kernels
from ..gpu.launch import every_argument_per_call


class Mailboxes:
    """This rank's mailbox and its peers' (see the module docstring).

    Args:
        own: this rank's mailbox (a CuPy int64 array of ``RAIL_MAILBOX_WORDS``, zeroed).
        table: a CuPy uint64 array of every rank's mailbox address, in rail order.
        rank: this rank's index in the rail.
        timeout_s: how long a wait of the kernels may last before it gives up.
    """

    def __init__(self, own: Any, table: Any, rank: int, timeout_s: float):
        self.own, self.table, self.rank = own, table, rank
        self.num_peers = int(table.shape[0])
        self.timeout_ns = int(timeout_s * 1e9) if timeout_s > 0 else 0
        kernels.load(kernels.SOURCES["rail.cu"])
        self._post = every_argument_per_call("deepep_cupy::rail::post", grid=1)
        self._pull = every_argument_per_call("deepep_cupy::rail::pull", grid=RAIL_PULL_BLOCKS)

    def exchange(self, send_ptr: int, recv_ptr: int, block_bytes: int, stream: int) -> None:
        """Block ``p`` of the send buffer to peer ``p``, peer ``p``'s block for this rank into block
        ``p`` of the receive buffer (``block_bytes`` a multiple of 16), queued on ``stream``."""
        self._post.run(stream, self.own.data.ptr, send_ptr)
        self._pull.run(stream, self.table.data.ptr, self.rank, self.num_peers, recv_ptr, block_bytes, self.timeout_ns)

    @property
    def error_ptr(self) -> int:
        """Device address of this rank's error word (what :meth:`error` reads)."""
        return self.own.data.ptr + RAIL_ERROR * self.own.itemsize

    def error(self) -> int:
        """What a timed-out wait left (0: none; ``1 + p``: peer ``p`` did not post its call;
        ``1 + size + rank``: the peers did not all finish reading this rank's blocks). Waits for the device."""
        return int(self.own[RAIL_ERROR].get())


def make_mailboxes(group: Any, device_id: int, timeout_s: float) -> Optional[Mailboxes]:
    """Every rank's mailbox, made collectively over the rail's in-process ``group``; None (on every
    rank) where some pair of the rail's GPUs cannot reach each other's memory."""
    import cupy

    with cupy.cuda.Device(device_id):
        own = cupy.zeros(RAIL_MAILBOX_WORDS, cupy.int64)
        posts = group.allgather((own.data.ptr, device_id))
        reachable = all(_peer_access(device_id, d) for _, d in posts)
        if not all(group.allgather(reachable)):
            return None
        table = cupy.asarray([p for p, _ in posts], dtype=cupy.uint64)
        cupy.cuda.Device(device_id).synchronize()
        return Mailboxes(own, table, group.rank, timeout_s)


def _peer_access(device_id: int, peer: int) -> bool:
    """Whether kernels on ``device_id`` can reach ``peer``'s memory (enabling the access)."""
    if peer == device_id:
        return True
    from cupy.cuda import runtime

    if not runtime.deviceCanAccessPeer(device_id, peer):
        return False
    try:
        runtime.deviceEnablePeerAccess(peer)
    except runtime.CUDARuntimeError as exc:  # already enabled by an earlier Buffer
        if "PeerAccessAlreadyEnabled" not in str(exc):
            raise
    return True
