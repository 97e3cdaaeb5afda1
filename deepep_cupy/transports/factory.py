"""Which rail transport a rank gets, made collectively: :func:`make_transport`.

One interface (:class:`deepep_cupy.transports.base.RailTransport`), one implementation per
transport (as CuPy's ``cupyx.distributed`` does):

* ``"nccl"`` (:mod:`deepep_cupy.transports.nccl`): grouped ``ncclSend``/``ncclRecv``, through
  the ProcessGroup of a ``torch.distributed`` NCCL group, or through a CuPy NCCL communicator
  per rail whose id is broadcast over an mpi4py communicator. Enqueued on the stream.
* ``"mpi"`` (:mod:`deepep_cupy.transports.mpi`): mpi4py ``Ialltoallv`` on device buffers where
  the MPI is CUDA-aware, staged through pinned host memory where it is not. Synchronous.
* ``"torch"`` (:mod:`deepep_cupy.transports.torch_staged`): a ``torch.distributed`` group of any other
  backend (Gloo): ``all_to_all_single`` on pinned host copies. Synchronous.
* ``"local"`` (:mod:`deepep_cupy.transports.local`): ranks that are threads of one process
  (:class:`deepep_cupy.groups.local.ThreadGroup`): device-to-device copies ordered by events.

All of them move bytes, so their results are identical. The implementations import CUDA, MPI,
NCCL and torch only when one is made, so importing them all here costs nothing.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import RankMismatchError
from ..groups.group import MPIGroup, TorchGroup
from ..groups.nodes import gpu_address
from .base import RailTransport
from .local import LocalRailTransport
from .mpi import MpiRailTransport
from .nccl import NcclRailTransport, TorchNcclRailTransport
from .nccl_library import NO_NCCL_HINT, nccl_or_none
from .torch_staged import TorchStagedRailTransport

#: Environment variable: the transport :func:`make_transport` picks when its ``kind`` is None.
TRANSPORT_ENV = "DEEPEP_CUPY_TRANSPORT"

#: The transports by name.
TRANSPORT_KINDS = ("nccl", "mpi", "torch", "local")


def _requested_kind(kind: Optional[str]) -> Optional[str]:
    source = "kind"
    if kind is None:
        kind = os.environ.get(TRANSPORT_ENV, "").strip() or None
        source = TRANSPORT_ENV
    if kind is None:
        return None
    if not isinstance(kind, str) or kind.lower() not in TRANSPORT_KINDS:
        raise ValueError(f"{source}: expected one of {list(TRANSPORT_KINDS)}, got {kind!r}")
    return kind.lower()


def nccl_module() -> Any:
    """CuPy's NCCL bindings (:func:`deepep_cupy.transports.nccl_library.load_nccl`), or None when no libnccl loads.

    The automatic choice asks here, not the loader itself, so that tests can stand in for NCCL.
    """
    return nccl_or_none()


def _torch_backend(group: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group.process_group)).lower()


def choose_kind(kind: Optional[str], group: Any) -> str:
    """The transport for ``group``: ``kind``, else :data:`TRANSPORT_ENV`, else automatic.

    Automatic: an in-process group -> ``"local"``; a ``torch.distributed`` group on the NCCL
    backend -> ``"nccl"``, on another backend -> ``"torch"``; an mpi4py communicator -> ``"nccl"``
    where CuPy can load NCCL, else ``"mpi"``.

    Raises:
        ValueError: an unknown kind, or one this group cannot use.
    """
    requested = _requested_kind(kind)
    kind_of_group = ("in-process" if group.in_process else "torch.distributed" if isinstance(group, TorchGroup)
                     else "mpi4py" if isinstance(group, MPIGroup) else type(group).__name__)
    if requested is None:
        if group.in_process:
            return "local"
        if isinstance(group, TorchGroup):
            return "nccl" if _torch_backend(group) == "nccl" else "torch"
        if isinstance(group, MPIGroup):
            return "nccl" if nccl_module() is not None else "mpi"
        raise ValueError(f"transport: no rail transport for a {kind_of_group} group")
    usable = {"local": group.in_process,
              "mpi": isinstance(group, MPIGroup),
              "torch": isinstance(group, TorchGroup),
              "nccl": isinstance(group, (MPIGroup, TorchGroup))}[requested]
    if not usable:
        needs = {"local": "an in-process group (run_local_group)", "mpi": "an mpi4py communicator",
                 "torch": "a torch.distributed group",
                 "nccl": "a torch.distributed NCCL group or an mpi4py communicator"}[requested]
        raise ValueError(f"transport: {requested!r} needs {needs}, got a {kind_of_group} group")
    if requested == "nccl" and isinstance(group, TorchGroup) and _torch_backend(group) != "nccl":
        raise ValueError(f"transport: 'nccl' over a torch.distributed group needs the NCCL backend, "
                         f"got {_torch_backend(group)!r}")
    if requested == "nccl" and isinstance(group, MPIGroup) and nccl_module() is None:
        raise ValueError(f"transport: 'nccl' over an mpi4py communicator needs NCCL: {NO_NCCL_HINT}; "
                         f"or choose 'mpi'")
    return requested


def _agree(group: Any, kind: Optional[str], rail: Sequence[int], device_id: int) -> Tuple[str, List[List[int]]]:
    """The transport every rank takes, and every rank's rail (each once, in the order first seen).

    Each rank proposes a kind (:func:`choose_kind`); an explicit kind must be the same everywhere.
    Automatic choices fall back to ``"mpi"`` where ``"nccl"`` cannot serve every rank of an
    mpi4py communicator: CuPy cannot load NCCL on some rank, or two ranks of a rail share a GPU
    (NCCL refuses that; tests run ranks on one GPU).
    """
    mine = [int(r) for r in rail]
    # What this rank refuses is refused on every rank (after the gather), so that none waits.
    try:
        if group.rank not in mine:
            raise ValueError(f"rail: expected a list of ranks holding this rank ({group.rank}), got {mine}")
        explicit = _requested_kind(kind) is not None
        proposal, refusal = choose_kind(kind, group), None
    except ValueError as exc:
        explicit, proposal, refusal = True, None, str(exc)
    address = None if group.in_process else gpu_address(device_id)
    everyone = group.allgather((mine, proposal, explicit, address, refusal))
    refusals = {r: e[4] for r, e in enumerate(everyone) if e[4] is not None}
    if refusals:
        first = min(refusals)
        raise ValueError(refusal if refusal is not None else f"rank {first}: {refusals[first]}")
    parts: List[List[int]] = []
    for other, *_ in everyone:
        if other not in parts:
            parts.append(other)
    proposals = [e[1] for e in everyone]
    # The group's verdict, not this rank's: a kind asked for on some ranks only binds them all.
    explicit = any(e[2] for e in everyone)
    if len(set(proposals)) > 1:
        if explicit or set(proposals) != {"nccl", "mpi"}:
            raise RankMismatchError(f"transport: ranks chose different transports, got {proposals} (rank order)")
        return "mpi", parts     # NCCL is not loadable on every rank
    chosen = proposals[0]
    if chosen == "nccl":
        where = {r: e[3] for r, e in enumerate(everyone)}
        shared = [part for part in parts
                  if len({where[r] for r in part if where[r] is not None}) < len([r for r in part if where[r]])]
        if shared:
            if explicit or not isinstance(group, MPIGroup):
                raise ValueError(f"transport: NCCL refuses two ranks on one GPU, and rails {shared} share GPUs "
                                 "(choose 'mpi')")
            return "mpi", parts
    return chosen, parts


def make_transport(kind: Optional[str], group: Any, rail: Sequence[int], device_id: int,
                   timeout_s: float, *, memory: Any = None) -> RailTransport:
    """The rail transport of this rank (collective over the whole ``group``).

    Args:
        kind: ``"nccl"``, ``"mpi"``, ``"torch"``, ``"local"`` or None (see :func:`choose_kind`).
        group: the Buffer's :class:`deepep_cupy.groups.group.Group`.
        rail: the global ranks of this rank's rail, in node order (``NodeTopology.rail_ranks()``).
            The rails of all ranks must partition the group.
        device_id: this rank's CUDA device.
        timeout_s: how long a host wait of the transport may last before it raises
            :class:`deepep_cupy.DeepEPTimeoutError` (MPI and local transports).
        memory: the device operations of the transport (default: CUDA's, through CuPy; tests pass
            host memory standing in, tests/transport_fakes.py). Unused by the torch NCCL transport.

    Returns:
        A :class:`RailTransport`; :meth:`RailTransport.close` it when done.

    Raises:
        ValueError: a kind the group cannot use, a rail without this rank, rails that do not
            partition the group, or NCCL asked for ranks that share a GPU.
        RankMismatchError: ranks asked for different transports.
    """
    chosen, parts = _agree(group, kind, rail, device_id)
    mine = [int(r) for r in rail]
    rail_group = group.split(parts)
    try:
        if chosen == "local":
            return LocalRailTransport(rail_group, mine, device_id, timeout_s, memory=memory)
        if chosen == "mpi":
            return MpiRailTransport(rail_group, mine, device_id, timeout_s, memory=memory)
        if chosen == "torch":
            return TorchStagedRailTransport(rail_group, mine, device_id, timeout_s, memory=memory)
        if isinstance(group, TorchGroup):
            return TorchNcclRailTransport(rail_group, mine, device_id, timeout_s)
        return NcclRailTransport(rail_group, mine, device_id, timeout_s, memory=memory)
    except BaseException:
        rail_group.free()
        raise
