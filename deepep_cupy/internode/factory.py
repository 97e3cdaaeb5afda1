"""Building an internode path, collectively: the node sub-group, the rail transport, the node's
intranode engine, the record kernels and a stream order."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..gpu.streams import StreamOrder
from ..transports import make_transport
from .block_kernels import BlockKernels
from .path import InternodePath
from .records import RecordKernels


def create_internode_path(group, topology, *, device_id: int, timeout_s: float, transport_kind: Optional[str],
                          make_intranode: Callable[[Any], Any], shares_gpu: bool = False) -> InternodePath:
    """Build an :class:`InternodePath` for ``group`` (collective): the node sub-group
    (``group.split``), the rail transport (``transports.make_transport`` of the rail's ranks), the node's intranode
    engine (``make_intranode(node_group)``, only with more than one rank per node), the record
    kernels and a stream order.

    Args:
        group: the Buffer's :class:`deepep_cupy.groups.group.Group`.
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology`.
        transport_kind: ``"nccl"``, ``"mpi"``, ``"torch"``, ``"local"`` or None (automatic).
        make_intranode: makes the intranode engine of a node sub-group (an
            :class:`deepep_cupy.intranode.engine.IntranodeEngine`).
        shares_gpu: other in-process ranks run on this GPU (the stream order waits for each call).
    """
    node_group = group.split(topology.node_partition())
    releases: List[Callable[[], Any]] = [node_group.free]
    transport = engine = None
    try:
        transport = make_transport(transport_kind, group, topology.rail_ranks(), device_id, timeout_s)
        engine = make_intranode(node_group) if topology.ranks_per_node > 1 else None
        order = StreamOrder.create(device_id, shares_gpu)
        return InternodePath(topology, transport, device_id, engine, order, records=RecordKernels(),
                             vote=lambda obj: group.allgather_within(obj, timeout_s), on_destroy=releases,
                             group_barrier=group.barrier, block_kernels=BlockKernels())
    except BaseException:
        if engine is not None:
            engine.destroy()
        if transport is not None:
            transport.close()
        for release in releases:
            release()
        raise
