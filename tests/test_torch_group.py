"""A torch.distributed ProcessGroup as a Buffer's group, on the CPU: two processes started the
PyTorch way (``torch.multiprocessing.spawn`` + ``init_process_group`` over a TCP store, Gloo)."""

import pytest
from _harness import gloo_records, import_or_skip

torch = import_or_skip("torch", "the PyTorch tests (the torch extra)", allow_module_level=True)
dist = import_or_skip("torch.distributed", "the PyTorch tests (the torch extra)", allow_module_level=True)

NUM_RANKS = 2


def _rank_main(rank: int, num_ranks: int) -> dict:
    from deepep_cupy.groups.group import TorchGroup, as_group

    world = as_group(dist.group.WORLD)
    sub = TorchGroup(dist.new_group([0, 1]))
    record = {
        "type": type(world).__name__,
        "rank": world.rank, "size": world.size,
        "gathered": world.allgather({"rank": rank, "bus": f"gpu-{rank}"}),
        "sub": [sub.rank, sub.size, sub.allgather(rank * 10)],
        "is_group": world.process_group is dist.group.WORLD,
    }
    world.barrier()
    sub.barrier()
    return record


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return gloo_records(_rank_main, NUM_RANKS, tmp_path_factory.mktemp("torch_group"))


def test_a_process_group_becomes_a_torch_group(records):
    assert all(r["type"] == "TorchGroup" and r["is_group"] for r in records)


def test_ranks_and_size_are_the_process_groups(records):
    assert [(r["rank"], r["size"]) for r in records] == [(0, 2), (1, 2)]


def test_allgather_returns_every_ranks_object_in_rank_order(records):
    for r in records:
        assert r["gathered"] == [{"rank": 0, "bus": "gpu-0"}, {"rank": 1, "bus": "gpu-1"}]


def test_a_new_group_works_the_same_way(records):
    assert [r["sub"] for r in records] == [[0, 2, [0, 10]], [1, 2, [0, 10]]]


def test_anything_else_is_not_a_torch_group():
    from deepep_cupy.groups.group import TorchGroup

    with pytest.raises(TypeError, match="group: expected a torch.distributed.ProcessGroup, got int"):
        TorchGroup(3)
