"""How a Buffer becomes internode: num_rdma_bytes > 0 on a group of several nodes routes every
operation to an InternodePath (built collectively; here a stand-in, no GPU)."""

import contextlib
from types import SimpleNamespace

import pytest

import deepep_cupy as ep
from deepep_cupy import engines
from deepep_cupy.groups import nodes
from deepep_cupy.groups.local import ThreadGroup


@pytest.fixture
def built(monkeypatch):
    """Buffer construction with the topology and the path replaced; returns what was asked for."""
    asked = {}
    monkeypatch.setattr(engines, "DeviceScope", lambda device_id: contextlib.nullcontext())

    def topology(group, ranks_per_node=None, peers_mappable=None):
        asked["ranks_per_node"] = ranks_per_node
        return nodes.NodeTopology(group.rank, group.size, ranks_per_node or group.size)

    def path(group, topology, **settings):
        asked.update(settings, topology=topology, group=group)
        return SimpleNamespace(comm_stream="the path's stream", topology=topology, internode_transport="mpi",
                               **{name: (lambda *a, _name=name, **k: _name) for name in
                                  ("get_dispatch_layout", "dispatch", "combine", "destroy", "check_kernel_errors",
                                   "barrier")})

    monkeypatch.setattr(engines, "discover_topology", topology)
    monkeypatch.setattr(engines, "create_internode_path", path)
    return asked


def test_a_buffer_with_rdma_bytes_across_nodes_routes_every_operation_to_the_internode_path(built):
    group = ThreadGroup.create(4)[1]
    buf = ep.Buffer(group, 1 << 20, 1 << 20, device=0, ranks_per_node=2, internode_transport="mpi", timeout_s=7.0)
    assert built["ranks_per_node"] == 2 and built["transport_kind"] == "mpi"
    assert built["topology"] == nodes.NodeTopology(1, 4, 2) and buf.topology is built["topology"]
    assert built["device_id"] == 0 and built["timeout_s"] == 7.0
    assert [buf.get_dispatch_layout(None, 8), buf.dispatch(None), buf.combine(None, None)] == \
        ["get_dispatch_layout", "dispatch", "combine"]
    assert buf.comm_stream == "the path's stream" and buf.internode_transport == "mpi"
    assert buf.num_rdma_bytes == 1 << 20 and buf.num_ranks == 4
    with buf:
        pass  # leaving the context destroys through the path


def test_internode_settings_without_rdma_bytes_are_refused():
    group = ThreadGroup.create(2)[0]
    with pytest.raises(ValueError, match="ranks_per_node, internode_transport: internode settings; pass "
                                         "num_rdma_bytes > 0"):
        ep.Buffer(group, 1 << 20, 0, device=0, ranks_per_node=1)


def test_the_rdma_size_hint_counts_a_record_per_token_and_node_both_ways():
    hint = ep.Config().get_rdma_buffer_size_hint(7168 * 2, 16, num_topk=8, num_max_tokens_per_rank=4096)
    record = 7168 * 2 + 4 * 56 + 12 * 8
    assert hint == 2 * 4096 * 16 * (-(-record // 16) * 16)
    with pytest.raises(ValueError, match="num_ranks"):
        ep.Config().get_rdma_buffer_size_hint(7168 * 2, 0)
