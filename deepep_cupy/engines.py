"""Which engine a Buffer gets, chosen once from its settings: intranode (one node), internode (a
group of several nodes with ``num_rdma_bytes > 0``) or low-latency (``low_latency_mode``)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from .engine import Engine
from .gpu.device_scope import DeviceScope
from .groups.group import Group
from .groups.nodes import discover_topology
from .internode.factory import create_internode_path
from .intranode.engine import IntranodeEngine
from .low_latency.engine import LowLatencyEngine
from .low_latency.factory import create_low_latency_across_nodes


class Settings(NamedTuple):
    """A Buffer's settings, as its engine is made from them (``Buffer``'s docstring)."""
    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    enable_shrink: bool
    timeout_s: float
    device_id: int
    allocate_ahead: bool
    ranks_per_node: Optional[int]
    internode_transport: Optional[str]


def check_settings(num_nvl_bytes: Any, timeout_s: Any, low_latency_mode: bool) -> None:
    """The settings checked on the host before anything is made."""
    if low_latency_mode and num_nvl_bytes == 0:
        pass  # a decode-only Buffer, as DeepEP's: Buffer(group, 0, num_rdma_bytes, low_latency_mode=True)
    elif isinstance(num_nvl_bytes, bool) or not isinstance(num_nvl_bytes, (int, np.integer)) or num_nvl_bytes <= 0:
        raise ValueError(f"num_nvl_bytes: expected a positive int, got {num_nvl_bytes!r} (size it with "
                         "deepep_cupy.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")


def make_engine(group: Group, settings: Settings) -> Engine:
    """The engine of a new Buffer on ``group`` (collective: every rank calls it alike)."""
    s = settings
    if not s.num_rdma_bytes and (s.ranks_per_node is not None or s.internode_transport is not None):
        raise ValueError("ranks_per_node, internode_transport: internode settings; pass num_rdma_bytes > 0 "
                         "(Config.get_rdma_buffer_size_hint) to make an internode Buffer")
    if s.num_rdma_bytes and not s.low_latency_mode:
        engine = _internode_engine(group, s)
        if engine is not None:
            return engine
    if s.low_latency_mode:
        engine = _low_latency_across_nodes(group, s)
        if engine is not None:
            return engine
    intranode = IntranodeEngine.create(group, s.num_nvl_bytes, timeout_s=s.timeout_s, device_id=s.device_id,
                                       allocate_ahead=s.allocate_ahead, num_rdma_bytes=s.num_rdma_bytes)
    if not s.low_latency_mode:
        return intranode
    try:
        with intranode.on_device:
            engine = LowLatencyEngine.create(intranode, group, s.num_rdma_bytes, enable_shrink=s.enable_shrink)
    except BaseException:
        intranode.destroy()
        raise
    group.barrier()
    return engine


def _internode_engine(group: Group, s: Settings) -> Optional[Engine]:
    """The internode path when the group spans several nodes; None on one node, where the Buffer is
    intranode as DeepEP's is (``num_rdma_bytes`` unused)."""
    with DeviceScope(s.device_id):
        topology = discover_topology(group, s.ranks_per_node)
        if topology.num_nodes == 1:
            return None
        shares_gpu = group.ranks_on_device(s.device_id) > 1
        return create_internode_path(
            group, topology, device_id=s.device_id, timeout_s=s.timeout_s, transport_kind=s.internode_transport,
            shares_gpu=shares_gpu,
            make_intranode=lambda node_group: IntranodeEngine.create(
                node_group, s.num_nvl_bytes, timeout_s=s.timeout_s, device_id=s.device_id,
                allocate_ahead=s.allocate_ahead))


def _low_latency_across_nodes(group: Group, s: Settings) -> Optional[Engine]:
    """A low-latency engine whose decode calls cross nodes when the group spans several
    (:mod:`deepep_cupy.low_latency.across_nodes`); None on one node."""
    with DeviceScope(s.device_id):
        topology = discover_topology(group, s.ranks_per_node)
        if topology.num_nodes == 1:
            return None
        if s.enable_shrink:
            raise ValueError("enable_shrink: DeepEP's shrink mode is not available across nodes (the group spans "
                             f"{topology.num_nodes} nodes); create the Buffer without it")
        return create_low_latency_across_nodes(
            group, topology, s.num_rdma_bytes, device_id=s.device_id, timeout_s=s.timeout_s,
            transport_kind=s.internode_transport,
            # The normal calls are refused across nodes in low-latency mode: no NVLink buffer.
            make_intranode=lambda node_group: IntranodeEngine.create(
                node_group, 0, timeout_s=s.timeout_s, device_id=s.device_id, allocate_ahead=s.allocate_ahead,
                num_rdma_bytes=s.num_rdma_bytes, min_ranks=1))
