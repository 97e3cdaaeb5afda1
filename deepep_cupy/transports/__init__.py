"""Rail transports: how bytes travel between nodes, from a rank to its rail peers (the ranks with
the same local index on the other nodes). :class:`RailTransport` (:mod:`.base`) is the one
interface; :func:`make_transport` (:mod:`.factory`) picks and makes the transport of a group,
NCCL, MPI, staged ``torch.distributed`` or in-process (:data:`TRANSPORT_KINDS`), by its argument,
:data:`TRANSPORT_ENV`, or the group's kind; :mod:`.nccl`, :mod:`.mpi`, :mod:`.torch_staged` and
:mod:`.local` implement it."""

from .base import RailTransport
from .factory import TRANSPORT_ENV, TRANSPORT_KINDS, make_transport

__all__ = ["RailTransport", "make_transport", "TRANSPORT_KINDS", "TRANSPORT_ENV"]
