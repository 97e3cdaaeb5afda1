"""Group.split: sub-groups of a group (the nodes, the rails), for each kind of group.

In-process groups run here with pure-Python ranks; MPIGroup under mpiexec
(tests/workers/split_worker.py); TorchGroup with Gloo in spawned processes.
"""

from __future__ import annotations

import time

import pytest
from _harness import WORKERS, describe, gloo_records, import_or_skip, run_mpi, worker_records
from transport_fakes import FakeComm

from deepep_cupy.errors import DeepEPTimeoutError, GroupAbortedError, RankFailed, RankMismatchError
from deepep_cupy.groups.group import MPIGroup, check_partition
from deepep_cupy.groups.local import ThreadGroup, run_local_group

RAILS_OF_3x2 = [[0, 2, 4], [1, 3, 5]]
NODES_OF_3x2 = [[0, 1], [2, 3], [4, 5]]


def run(fn, n, **kwargs):
    kwargs.setdefault("use_devices", False)
    kwargs.setdefault("timeout_s", 20.0)
    return run_local_group(fn, n, **kwargs)


# ---------------------------------------------------------------------------------------------
# The partition


def test_a_partition_must_cover_every_rank_once():
    assert check_partition([(0, 2), [1, 3]], 4) == [[0, 2], [1, 3]]
    for bad in ([[0, 1], [2]], [[0, 1], [1, 2, 3]], [[0, 1, 2, 3], []], [[0, 1, 2, 4]], [[0, 1], 2]):
        with pytest.raises(ValueError, match="partition: expected"):
            check_partition(bad, 4)


# ---------------------------------------------------------------------------------------------
# ThreadGroup


def test_a_thread_group_splits_into_rails_numbered_by_position():
    def body(group):
        rail = group.split(RAILS_OF_3x2)
        return rail.rank, rail.size, rail.allgather(group.rank), rail.in_process

    results = run(body, 6)
    assert results == [(r // 2, 3, RAILS_OF_3x2[r % 2], True) for r in range(6)]


def test_a_part_numbers_its_ranks_in_the_order_given():
    def body(group):
        sub = group.split([[3, 1], [0, 2]])
        return sub.rank, sub.allgather(group.rank)

    assert run(body, 4) == [(0, [0, 2]), (1, [3, 1]), (1, [0, 2]), (0, [3, 1])]


def test_a_sub_group_names_its_ranks_by_the_ranks_of_the_group_it_was_split_from():
    def body(group):
        rail = group.split(RAILS_OF_3x2)
        halves = rail.split([[0], [1, 2]])
        return group.buffer_ranks, rail.buffer_ranks, halves.buffer_ranks

    results = run(body, 6)
    assert results[0][0] == tuple(range(6))
    assert [r[1] for r in results] == [tuple(RAILS_OF_3x2[r % 2]) for r in range(6)]
    assert results[5][2] == (3, 5) and results[1][2] == (1,)


def test_sub_groups_of_a_thread_group_run_collectives_independently():
    def body(group):
        node = group.split(NODES_OF_3x2)
        if node.rank == 1:
            time.sleep(0.05)   # the other nodes' collectives do not wait for this one
        node.barrier()
        out = [node.allgather(i * 10 + group.rank) for i in range(3)]
        group.barrier()
        return out

    results = run(body, 6)
    for r, out in enumerate(results):
        first = r - r % 2
        assert out == [[i * 10 + first, i * 10 + first + 1] for i in range(3)]


def test_a_sub_group_keeps_the_devices_of_its_ranks():
    def body(group):
        rail = group.split(RAILS_OF_3x2)
        return rail.devices, rail.device_id, rail.ranks_on_device(0)

    results = run(body, 6, devices=[0, 0, 1, 1, 0, 2])
    assert results[0] == ([0, 1, 0], 0, 2)
    assert results[5] == ([0, 1, 2], 2, 1)


def test_an_abort_of_the_group_reaches_its_sub_groups():
    def body(group):
        sub = group.split([[0, 1], [2, 3]])
        if group.rank == 3:
            raise KeyError("rank 3 fails")
        sub.barrier()   # rank 2 would wait out the timeout without the abort

    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run(body, 4, timeout_s=60.0)
    assert time.monotonic() - start < 30
    assert info.value.rank == 3
    assert isinstance(info.value.failures[2], GroupAbortedError)


def test_a_sub_group_made_after_an_abort_is_broken():
    groups = ThreadGroup.create(2, timeout_s=5)
    groups[0]._hub.abort("gone")
    children = groups[0]._hub.make_children([[0, 1]])
    with pytest.raises(GroupAbortedError, match="gone"):
        ThreadGroup(children[0], 0).barrier()


def test_a_sub_group_waits_for_its_own_ranks_only_until_its_timeout():
    def body(group):
        sub = group.split([[0, 1], [2, 3]])
        sub.timeout_s = 0.3
        if sub.rank == 0:
            sub.barrier()

    with pytest.raises(RankFailed) as info:
        run(body, 4)
    assert isinstance(info.value.exception, DeepEPTimeoutError)
    assert "for ranks [1]" in str(info.value.exception)


def test_ranks_passing_different_partitions_are_refused():
    def body(group):
        group.split([[0, 1], [2, 3]] if group.rank else [[0, 2], [1, 3]])

    with pytest.raises(RankFailed) as info:
        run(body, 4)
    assert isinstance(info.value.exception, RankMismatchError)


def test_a_freed_sub_group_no_longer_follows_its_parent():
    groups = ThreadGroup.create(2, timeout_s=5)
    child = groups[0]._hub.make_children([[0, 1]])[0]
    sub = ThreadGroup(child, 0)
    sub.free()
    sub.free()
    groups[0].abort("later")
    assert sub.aborted is None


# ---------------------------------------------------------------------------------------------
# MPIGroup


class FakeSplitComm(FakeComm):
    def __init__(self, rank, size):
        super().__init__(rank, size)
        self.calls = []

    def Split(self, color, key):
        self.calls.append(("Split", color, key))
        return FakeSplitComm(key, 3)

    def Free(self):
        self.calls.append(("Free",))


def test_mpi_split_colors_by_part_and_keys_by_position():
    comm = FakeSplitComm(rank=4, size=6)
    sub = MPIGroup(comm).split(RAILS_OF_3x2)
    assert comm.calls == [("Split", 0, 2)]
    assert (sub.rank, sub.size) == (2, 3)
    sub.free()
    sub.free()
    assert sub.comm is None and sub.comm is None


def test_mpi_free_leaves_the_users_communicator_alone():
    comm = FakeSplitComm(rank=0, size=2)
    MPIGroup(comm).free()
    assert comm.calls == []


def _results(proc, n):
    assert proc.returncode == 0, describe(proc)
    records = sorted(worker_records(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == list(range(n)), describe(proc)
    return records


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_mpi_group_splits_into_nodes_and_rails(n):
    records = _results(run_mpi(n, [str(WORKERS / "split_worker.py")], timeout=180), n)
    for r in records:
        rank = r["rank"]
        assert r["node"] == [rank % 2, 2, [rank - rank % 2, rank - rank % 2 + 1]], r
        rail = list(range(rank % 2, n, 2))
        assert r["rail"] == [rail.index(rank), len(rail), rail], r
        assert r["reversed"] == [n - 1 - rank, n, list(range(n - 1, -1, -1))], r
        assert r["freed"] is True
        # Nodes from the host names (one host here), and simulated nodes of 2 ranks.
        assert r["topology"] == [[rank, n, 2], rail, [rank, n, n]], r


# ---------------------------------------------------------------------------------------------
# TorchGroup (Gloo, two or four spawned processes)


def _torch_rank_main(rank: int, size: int) -> dict:
    import torch.distributed as dist

    from deepep_cupy.groups.group import TorchGroup, as_group

    world = as_group(dist.group.WORLD)
    rails = world.split([list(range(local, size, 2)) for local in range(2)])
    record = {"rail": [rails.rank, rails.size, rails.allgather(rank)],
              "rail_global": [rails.global_rank(i) for i in range(rails.size)]}
    # A group that is not the world: split it among its own ranks only.
    evens = dist.new_group([0, 2])
    if rank in (0, 2):
        halves = TorchGroup(evens).split([[0], [1]])
        record["evens"] = [halves.rank, halves.size, halves.allgather(rank)]
        halves.free()
    try:
        world.split([[1, 0], [2, 3]])
    except ValueError as exc:
        record["descending"] = str(exc)
    rails.free()
    world.barrier()
    return record


@pytest.fixture(scope="module")
def torch_records(tmp_path_factory):
    import_or_skip("torch", "the torch.distributed split tests")
    import_or_skip("torch.distributed", "the torch.distributed split tests")
    return gloo_records(_torch_rank_main, 4, tmp_path_factory.mktemp("torch_split"))


def test_a_torch_group_splits_into_rails(torch_records):
    assert [r["rail"] for r in torch_records] == [[0, 2, [0, 2]], [0, 2, [1, 3]], [1, 2, [0, 2]], [1, 2, [1, 3]]]
    assert [r["rail_global"] for r in torch_records] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_a_torch_sub_group_of_the_world_splits_among_its_own_ranks(torch_records):
    assert torch_records[0]["evens"] == [0, 1, [0]] and torch_records[2]["evens"] == [0, 1, [2]]


def test_a_torch_split_needs_ascending_parts(torch_records):
    assert all("every part must be ascending, got [1, 0]" in r["descending"] for r in torch_records)
