"""Building a low-latency engine whose decode calls cross nodes, collectively: the node sub-group,
the rail transport, the node's intranode engine and decode path, and the relay around them."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..transports import make_transport
from .across_nodes import LowLatencyAcrossNodes
from .engine import LowLatencyEngine
from .path import LowLatencyPath
from .relay_kernels import RelayKernels


def create_low_latency_across_nodes(group, topology, num_bytes: int, *, device_id: int, timeout_s: float,
                                    transport_kind: Optional[str],
                                    make_intranode: Callable[[Any], Any]) -> LowLatencyEngine:
    """A :class:`LowLatencyEngine` for ``group`` spanning ``topology``'s nodes (collective).

    Args:
        group: the Buffer's :class:`deepep_cupy.groups.group.Group`.
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology` (several nodes).
        num_bytes: the low-latency buffer's bytes (``num_rdma_bytes``): the node's decode calls of
            ``N * M`` tokens on ``P`` ranks need what calls of ``M`` tokens on ``N * P`` ranks do.
        transport_kind: ``"nccl"``, ``"mpi"``, ``"torch"``, ``"local"`` or None (automatic).
        make_intranode: makes the intranode engine of a node sub-group (its stream order and slots;
            the Buffer's normal calls are not offered across nodes in low-latency mode).
    """
    node_group = group.split(topology.node_partition())
    transport = intranode = node_path = None
    try:
        transport = make_transport(transport_kind, group, topology.rail_ranks(), device_id, timeout_s)
        intranode = make_intranode(node_group)
        # Ranks sharing the GPU run their node kernels and their rail's at once: every rank's decode
        # grid leaves room for the rail's (half the GPU).
        sharing = group.ranks_on_device(device_id)
        with intranode.on_device:
            node_path = LowLatencyPath.create(node_group, num_bytes, order=intranode.order, slots=intranode.slots,
                                              timeout_s=intranode.timeout_s, device_id=device_id,
                                              on_device=intranode.on_device,
                                              ranks_on_gpu=2 * sharing if sharing > 1 else 1)
            path = LowLatencyAcrossNodes(node_path, transport, topology, RelayKernels(),
                                         on_close=(node_group.free,),
                                         allgather=lambda key: group.allgather_within(key, timeout_s))
        intranode.mapped_beside.append(path)
        engine = LowLatencyEngine(intranode, path, group.barrier, across_nodes=True)
    except BaseException:
        if node_path is not None:
            node_path.close()
        if intranode is not None:
            intranode.destroy()
        if transport is not None:
            transport.close()
        node_group.free()
        raise
    group.barrier()
    return engine
