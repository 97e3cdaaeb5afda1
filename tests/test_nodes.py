"""Node discovery: host names gathered over the group, simulated nodes, and GPUs that cannot map
each other's memory (every GPU its own node). Ranks are threads of an in-process group (CPU)."""

from __future__ import annotations

import threading

import pytest

from deepep_cupy.errors import RankMismatchError
from deepep_cupy.groups import nodes
from deepep_cupy.groups.group import Group
from deepep_cupy.groups.local import run_local_group
from deepep_cupy.groups.nodes import RANKS_PER_NODE_ENV, NodeTopology, discover_topology


class OnHost(Group):
    """A rank of a thread group that reports a host name of its own choosing."""

    def __init__(self, group, host):
        self._group, self._host = group, host

    rank = property(lambda self: self._group.rank)
    size = property(lambda self: self._group.size)

    def allgather(self, obj):
        return self._group.allgather(obj)

    def barrier(self):
        self._group.barrier()

    def host_name(self):
        return self._host


def _rank_of_this_thread() -> int:
    return int(threading.current_thread().name.rsplit("-", 1)[1])


@pytest.fixture
def fake_gpus(monkeypatch):
    """Rank r's GPU has bus id 0000:r:00.0; ``probed`` records each probe; ``mappable`` decides it."""
    state = {"mappable": True, "probed": []}
    monkeypatch.setattr(nodes, "gpu_bus_id", lambda: f"0000:{_rank_of_this_thread():02x}:00.0")

    def probe(mine, peers):
        state["probed"].append((mine, list(peers)))
        return state["mappable"]

    monkeypatch.setattr(nodes, "can_map_peers", probe)
    return state


def _discover(hosts, **kwargs):
    def body(group):
        return discover_topology(OnHost(group, hosts[group.rank]), **kwargs)

    return run_local_group(body, num_ranks=len(hosts), use_devices=False, timeout_s=20)


def test_topology_names_nodes_locals_and_rails():
    t = NodeTopology(rank=5, num_ranks=8, ranks_per_node=2)
    assert (t.num_nodes, t.node, t.local_rank) == (4, 2, 1)
    assert (t.node_of(3), t.local_rank_of(6)) == (1, 0)
    assert t.node_ranks() == [4, 5]
    assert t.rail_ranks() == [1, 3, 5, 7]
    assert t.node_partition() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.rail_partition() == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_ranks_of_one_host_form_a_node(fake_gpus):
    tops = _discover(["a", "a", "a", "b", "b", "b"])
    assert [t.ranks_per_node for t in tops] == [3] * 6
    assert [(t.rank, t.num_ranks, t.node, t.local_rank) for t in tops] == [
        (r, 6, r // 3, r % 3) for r in range(6)]


def test_each_rank_probes_the_gpus_of_its_own_node(fake_gpus):
    _discover(["a", "a", "b", "b"])
    assert sorted(fake_gpus["probed"]) == [("0000:00:00.0", ["0000:01:00.0"]), ("0000:01:00.0", ["0000:00:00.0"]),
                                           ("0000:02:00.0", ["0000:03:00.0"]), ("0000:03:00.0", ["0000:02:00.0"])]


def test_gpus_that_cannot_map_each_other_are_nodes_of_their_own(fake_gpus):
    fake_gpus["mappable"] = False
    tops = _discover(["a", "a", "a", "a"])
    assert [t.ranks_per_node for t in tops] == [1] * 4
    assert tops[2].rail_ranks() == [0, 1, 2, 3] and tops[2].node_ranks() == [2]


def test_one_rank_that_cannot_map_its_peers_makes_every_gpu_a_node(fake_gpus, monkeypatch):
    monkeypatch.setattr(nodes, "can_map_peers", lambda mine, peers: mine != "0000:03:00.0")
    assert [t.ranks_per_node for t in _discover(["a"] * 4)] == [1] * 4


def test_peers_mappable_false_forces_one_rank_per_node_without_probing(fake_gpus):
    tops = _discover(["a"] * 4, peers_mappable=False)
    assert [t.ranks_per_node for t in tops] == [1] * 4
    assert fake_gpus["probed"] == []


def test_peers_mappable_true_skips_the_probe(fake_gpus):
    fake_gpus["mappable"] = False
    assert [t.ranks_per_node for t in _discover(["a"] * 4, peers_mappable=True)] == [4] * 4
    assert fake_gpus["probed"] == []


def test_ranks_per_node_splits_a_host_into_simulated_nodes(fake_gpus):
    tops = _discover(["a"] * 6, ranks_per_node=2)
    assert [t.ranks_per_node for t in tops] == [2] * 6
    assert tops[3].node_ranks() == [2, 3] and tops[3].rail_ranks() == [1, 3, 5]
    assert fake_gpus["probed"] == []


def test_ranks_per_node_one_forces_every_gpu_to_be_a_node(fake_gpus):
    assert [t.num_nodes for t in _discover(["a", "a", "b", "b"], ranks_per_node=1)] == [4] * 4


def test_the_environment_variable_splits_the_group(fake_gpus, monkeypatch):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    assert [t.ranks_per_node for t in _discover(["a"] * 4)] == [2] * 4


def test_the_keyword_wins_over_the_environment_variable(fake_gpus, monkeypatch):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    assert [t.ranks_per_node for t in _discover(["a"] * 4, ranks_per_node=1)] == [1] * 4


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_environment_variable_is_refused(monkeypatch, value):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, value)
    with pytest.raises(ValueError, match=RANKS_PER_NODE_ENV):
        discover_topology(None)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_bad_ranks_per_node_is_refused(value):
    with pytest.raises(ValueError, match="ranks_per_node: expected a positive int"):
        discover_topology(None, ranks_per_node=value)


def test_a_simulated_node_never_spans_two_hosts(fake_gpus):
    with pytest.raises(Exception) as info:
        _discover(["a", "a", "a", "b", "b", "b"], ranks_per_node=2)
    assert isinstance(info.value.__cause__, ValueError)
    assert "ranks_per_node: 2 must divide the ranks of every host (3)" in str(info.value.__cause__)


def test_a_simulated_node_size_must_divide_the_group(fake_gpus):
    with pytest.raises(Exception) as info:
        _discover(["a"] * 6, ranks_per_node=4)
    assert "must divide" in str(info.value.__cause__)


def test_uneven_nodes_are_refused(fake_gpus):
    with pytest.raises(Exception) as info:
        _discover(["a", "a", "a", "b"])
    assert isinstance(info.value.__cause__, ValueError)
    assert "every node must run the same number of ranks, got {'a': 3, 'b': 1}" in str(info.value.__cause__)


def test_ranks_of_a_host_must_be_consecutive(fake_gpus):
    with pytest.raises(Exception) as info:
        _discover(["a", "b", "a", "b"])
    assert "the ranks of a host must be consecutive, got hosts ['a', 'b', 'a', 'b']" in str(info.value.__cause__)


def test_ranks_asking_for_different_node_sizes_are_refused(fake_gpus):
    def body(group):
        return discover_topology(OnHost(group, "a"), ranks_per_node=1 + group.rank % 2)

    with pytest.raises(Exception) as info:
        run_local_group(body, num_ranks=4, use_devices=False, timeout_s=20)
    assert isinstance(info.value.__cause__, RankMismatchError)


def test_a_bus_id_decorated_by_a_test_launcher_names_its_gpu():
    assert nodes._pci_address("0000:1B:00.0/rank3") == "0000:1b:00.0"
    assert nodes._pci_address("0000:1b:00.0") == "0000:1b:00.0"


def test_gpu_address_is_the_pci_address_of_the_device_or_none_where_cuda_cannot_say(monkeypatch):
    from cupy.cuda import runtime

    monkeypatch.setattr(runtime, "deviceGetPCIBusId", lambda device_id: f"0000:1B:0{device_id}.0/rank3")
    assert nodes.gpu_address(2) == "0000:1b:02.0"

    def no_cuda(device_id):
        raise runtime.CUDARuntimeError(100)

    monkeypatch.setattr(runtime, "deviceGetPCIBusId", no_cuda)
    assert nodes.gpu_address(0) is None
