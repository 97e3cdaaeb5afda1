"""Rank groups: the few collective operations a Buffer needs from its launcher.

A Buffer never talks to MPI directly. It asks a :class:`Group` for its rank, its size, an
``allgather`` of small Python objects and a ``barrier``. Three transports implement that:

* :class:`MPIGroup` wraps an mpi4py communicator (one process per GPU, ``mpirun``/``mpiexec``);
* :class:`TorchGroup` wraps a ``torch.distributed`` ProcessGroup (one process per GPU, ``torchrun``
  or ``torch.multiprocessing.spawn``: what DeepEP's ``Buffer`` takes);
* :class:`deepep_cupy.groups.local.ThreadGroup`, the in-process group (one Python process drives
  every rank, one thread per rank, see :func:`deepep_cupy.groups.local.run_local_group`), where
  ranks share one address space and exchange raw device pointers instead of CUDA IPC handles.
"""

from __future__ import annotations

import abc
import socket
import sys
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import DeepEPError, RankMismatchError


class Group(abc.ABC):
    """The collective interface a :class:`deepep_cupy.Buffer` is built on."""

    #: True when every rank lives in this process, so device pointers can be shared as they are.
    in_process: bool = False
    _buffer_ranks: Optional[Tuple[int, ...]] = None

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

    @property
    def buffer_ranks(self) -> Tuple[int, ...]:
        """The rank of each rank of this group in the group the Buffer was made on: a sub-group
        from :meth:`split` names its ranks as the group it was split from does."""
        return self._buffer_ranks if self._buffer_ranks is not None else tuple(range(self.size))

    def allgather_within(self, obj: Any, timeout_s: float) -> List[Any]:
        """:meth:`allgather`, raising :class:`deepep_cupy.DeepEPTimeoutError` when some rank has not
        arrived after ``timeout_s`` (where the transport can wait with a deadline; a
        ``torch.distributed`` group waits as long as its own timeout)."""
        return self.allgather(obj)

    def host_name(self) -> str:
        """The name of the node this rank runs on (used to check that all ranks share one node)."""
        return socket.gethostname()

    def ranks_on_device(self, device_id: int) -> int:
        """How many ranks of this group this process runs on CUDA device ``device_id``: 1 where each
        rank is a process of its own (an in-process group counts its ranks there)."""
        return 1

    def split(self, partition: Sequence[Sequence[int]]) -> "Group":
        """Split the group into disjoint sub-groups (collective over the whole group).

        Every rank calls it with the same partition of ``range(size)`` (e.g. the nodes, or the
        rails of :class:`deepep_cupy.groups.nodes.NodeTopology`). Sub-groups support what their parent
        does; call :meth:`free` on them when done.

        Args:
            partition: lists of ranks of this group, disjoint, together covering ``range(size)``.

        Returns:
            The sub-group holding this rank; its ranks are numbered by their position in its list.

        Raises:
            ValueError: ``partition`` is not a partition of ``range(size)``.
            RankMismatchError: ranks passed different partitions.
        """
        parts = check_partition(partition, self.size)
        gathered = self.allgather(parts)
        if any(g != parts for g in gathered):
            raise RankMismatchError(f"partition: ranks disagree, got {gathered} (rank order)")
        index = next(i for i, part in enumerate(parts) if self.rank in part)
        sub = self._split(parts, index)
        sub._buffer_ranks = tuple(self.buffer_ranks[r] for r in parts[index])
        return sub

    def _split(self, parts: List[List[int]], index: int) -> "Group":
        """The sub-group of ``parts[index]`` (this rank's part); every rank calls it with the same ``parts``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be split into sub-groups")

    def free(self) -> None:
        """Release what this group holds, if it made it (a sub-group from :meth:`split`); a group
        wrapped around the user's communicator is left alone. Idempotent."""
        return None


def check_partition(partition: Sequence[Sequence[int]], size: int) -> List[List[int]]:
    """``partition`` as lists of ints, or ValueError unless it is a partition of ``range(size)``."""
    try:
        parts = [[int(r) for r in part] for part in partition]
    except (TypeError, ValueError):
        raise ValueError(f"partition: expected lists of ranks, got {partition!r}") from None
    flat = sorted(r for part in parts for r in part)
    if any(not part for part in parts) or flat != list(range(size)):
        raise ValueError(f"partition: expected non-empty, disjoint lists of ranks covering 0..{size - 1}, "
                         f"got {parts}")
    return parts


class MPIGroup(Group):
    """A :class:`Group` over an mpi4py communicator.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (intra-communicator). It is used as given, not duplicated,
            so every rank must create Buffers in the same order.
    """

    in_process = False

    def __init__(self, comm: Any, *, _owned: bool = False):
        for attr in ("Get_rank", "Get_size", "allgather", "Barrier"):
            if not hasattr(comm, attr):
                raise TypeError(f"group: expected a torch.distributed ProcessGroup, an mpi4py communicator or a "
                                f"deepep_cupy Group, got {type(comm).__name__}")
        self._comm = comm
        self._owned = _owned

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

    def allgather_within(self, obj: Any, timeout_s: float) -> List[Any]:
        # Pickled bytes through two non-blocking collectives (their sizes, then the bytes), polled
        # until the deadline: a blocking allgather would wait for a rank that never comes.
        import pickle

        import numpy as np
        from mpi4py import MPI

        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        _wait_within(self._comm.Iallgather(np.array([data.size], np.int64), sizes), timeout_s, self.rank, "sizes")
        gathered = np.empty(int(sizes.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        _wait_within(self._comm.Iallgatherv(data, [gathered, (sizes, offsets), MPI.BYTE]), timeout_s, self.rank,
                     "objects")
        return [pickle.loads(gathered[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]

    def _split(self, parts: List[List[int]], index: int) -> "MPIGroup":
        # Split orders a color's ranks by key: the position in the part.
        return MPIGroup(self._comm.Split(index, parts[index].index(self.rank)), _owned=True)

    def free(self) -> None:
        if self._owned and self._comm is not None:
            comm, self._comm = self._comm, None
            comm.Free()

    def host_name(self) -> str:
        try:
            from mpi4py import MPI
            return MPI.Get_processor_name()
        except Exception:  # pragma: no cover - mpi4py always has it; keep a fallback for stubs
            return socket.gethostname()


def _wait_within(request: Any, timeout_s: float, rank: int, what: str) -> None:
    """Poll ``request`` until it completes; DeepEPTimeoutError after ``timeout_s`` (the request is
    left posted: MPI cannot cancel a collective, and the communicator is then out of step)."""
    import os
    import time

    from ..errors import DeepEPTimeoutError

    deadline = time.monotonic() + timeout_s
    polls = 0
    while not request.Test():
        if time.monotonic() > deadline:
            raise DeepEPTimeoutError(f"rank {rank}: the group's allgather of {what} timed out after {timeout_s:g} s: "
                                     "some rank never reached it", rank=rank, kernel="group allgather")
        polls += 1
        if polls > 1000:
            time.sleep(1e-4)
        else:
            os.sched_yield()


class TorchGroup(Group):
    """A :class:`Group` over a ``torch.distributed`` ProcessGroup (NCCL or Gloo backend).

    The allgather is ``torch.distributed.all_gather_object`` and the barrier an allgather of
    nothing, so both behave alike on either backend (with NCCL, torch's current CUDA device must
    be this rank's GPU, as NCCL itself requires). Ranks are the group's own.

    Args:
        process_group: a ``torch.distributed.ProcessGroup`` (e.g. ``torch.distributed.group.WORLD``
            or one from ``torch.distributed.new_group``). It is used as given, not duplicated.
    """

    in_process = False

    def __init__(self, process_group: Any, *, _owned: bool = False):
        import torch.distributed as dist

        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
        self._dist = dist
        self._group: Optional[Any] = process_group     # None once free() destroyed an owned one
        self._rank = process_group.rank()
        self._size = process_group.size()
        self._owned = _owned

    @property
    def process_group(self) -> Any:
        """The wrapped ``torch.distributed.ProcessGroup``.

        Raises:
            DeepEPError: :meth:`free` destroyed it (torch would take a group of None for the world).
        """
        if self._group is None:
            raise DeepEPError(f"rank {self._rank}: this torch.distributed group was freed")
        return self._group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather(self, obj: Any) -> List[Any]:
        gathered: List[Any] = [None] * self._size
        self._dist.all_gather_object(gathered, obj, group=self.process_group)
        return gathered

    def barrier(self) -> None:
        # Not dist.barrier: with NCCL it guesses a device and only orders GPU work; an allgather
        # returns on the host once every rank has arrived, on either backend.
        self.allgather(None)

    def global_rank(self, rank: int) -> int:
        """The rank of this group's ``rank`` in torch's default group (torch's P2P calls take those)."""
        return self._dist.get_global_rank(self.process_group, rank)

    def _split(self, parts: List[List[int]], index: int) -> "TorchGroup":
        dist = self._dist
        # A group smaller than the world: only its own ranks call new_group, so it must not wait
        # for the others (use_local_synchronization); torch's rule otherwise: every rank creates
        # every part, in the same order. (Torch names a locally synchronised group by its ranks and
        # the number of groups this process has: the ranks of a part must have made as many.)
        local_sync = self._size < dist.get_world_size()
        backend = dist.get_backend(self.process_group)
        every_members = [[self.global_rank(r) for r in part] for part in parts]
        for part, members in zip(parts, every_members):  # all checked before any group is made
            if members != sorted(members):
                raise ValueError(f"partition: a torch.distributed group numbers its ranks in ascending order, "
                                 f"so every part must be ascending, got {part}")
        mine = None
        for i, members in enumerate(every_members):
            if local_sync and i != index:
                continue
            made = dist.new_group(members, backend=backend, use_local_synchronization=local_sync)
            if i == index:
                mine = made
        return TorchGroup(mine, _owned=True)

    def free(self) -> None:
        if self._owned and self._group is not None:
            group, self._group = self._group, None
            self._dist.destroy_process_group(group)


def is_torch_process_group(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a ProcessGroup exists only if torch was imported
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    return dist is not None and dist.is_available() and isinstance(obj, dist.ProcessGroup)


def as_group(comm_or_group: Any) -> Group:
    """Return ``comm_or_group`` as a :class:`Group`: a Group as it is, a ``torch.distributed``
    ProcessGroup as a :class:`TorchGroup`, anything else as an mpi4py communicator (:class:`MPIGroup`)."""
    if isinstance(comm_or_group, Group):
        return comm_or_group
    if is_torch_process_group(comm_or_group):
        return TorchGroup(comm_or_group)
    return MPIGroup(comm_or_group)
