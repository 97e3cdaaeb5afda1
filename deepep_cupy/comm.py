"""Rank groups: the few collective operations a Buffer needs from its launcher.

A Buffer never talks to MPI directly. It asks a :class:`Group` for its rank, its size, an
``allgather`` of small Python objects and a ``barrier``. Two transports implement that:

* :class:`MPIGroup` wraps an mpi4py communicator (one process per GPU, ``mpirun``/``mpiexec``);
* the in-process thread group (one Python process drives every rank), where ranks share one
  address space and exchange raw device pointers instead of CUDA IPC handles.
"""

from __future__ import annotations

import abc
import socket
from typing import Any, List


class Group(abc.ABC):
    """The collective interface a :class:`deepep_cupy.Buffer` is built on."""

    #: True when every rank lives in this process, so device pointers can be shared as they are.
    in_process: bool = False

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This rank's index, ``0 <= rank < size``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of ranks in the group."""

    @abc.abstractmethod
    def allgather(self, obj: Any) -> List[Any]:
        """Gather one picklable object from every rank.

        Returns:
            A list of ``size`` objects, index ``i`` holding rank ``i``'s contribution.
        """

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group has called ``barrier``."""

    def host_name(self) -> str:
        """The name of the node this rank runs on (used to check that all ranks share one node)."""
        return socket.gethostname()


class MPIGroup(Group):
    """A :class:`Group` over an mpi4py communicator.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (intra-communicator). It is used as given, not duplicated,
            so every rank must create Buffers in the same order.
    """

    in_process = False

    def __init__(self, comm: Any):
        for attr in ("Get_rank", "Get_size", "allgather", "Barrier"):
            if not hasattr(comm, attr):
                raise TypeError(
                    f"comm: expected an mpi4py communicator or a deepep_cupy Group, got {type(comm).__name__}")
        self._comm = comm

    @property
    def comm(self) -> Any:
        """The wrapped mpi4py communicator."""
        return self._comm

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    def allgather(self, obj: Any) -> List[Any]:
        return self._comm.allgather(obj)

    def barrier(self) -> None:
        self._comm.Barrier()

    def host_name(self) -> str:
        try:
            from mpi4py import MPI
            return MPI.Get_processor_name()
        except Exception:  # pragma: no cover - mpi4py always has it; keep a fallback for stubs
            return socket.gethostname()


def as_group(comm_or_group: Any) -> Group:
    """Return ``comm_or_group`` as a :class:`Group` (wrapping an mpi4py communicator)."""
    if isinstance(comm_or_group, Group):
        return comm_or_group
    return MPIGroup(comm_or_group)
