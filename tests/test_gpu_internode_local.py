"""Internode dispatch and combine with every rank in one process (run_local_group) and the "local"
rail transport, one GPU per rank, against deepep_cupy.reference.internode (the scenarios of
tests/workers/internode_worker.py). Ranks sharing a GPU in one process are not run here: a first
launch of a CuPy kernel on one rank's thread may wait for a peer's spinning NVLink kernel."""

import sys

import pytest
from _harness import WORKERS

sys.path.insert(0, str(WORKERS))  # the worker imports its siblings as a script does
import internode_worker  # noqa: E402

SCENARIOS = [s for s in internode_worker.SCENARIOS if s.get("framework") != "torch"]


def run(num_nodes, ranks_per_node, scenarios):
    import deepep_cupy as ep

    def rank(group):
        nvl = ep.get_nvl_buffer_size_hint(internode_worker.HIDDEN * 4, max(ranks_per_node, 2),
                                          num_max_tokens_per_rank=2048)
        buf = ep.Buffer(group, nvl, 1, ranks_per_node=ranks_per_node, internode_transport="local", timeout_s=60)
        try:
            return [internode_worker.run_scenario(buf, sc, seed=100 + i) for i, sc in enumerate(scenarios)]
        finally:
            buf.destroy()

    num_ranks = num_nodes * ranks_per_node
    return ep.run_local_group(rank, num_ranks, devices=list(range(num_ranks)))


@pytest.mark.gpu(2)
def test_two_nodes_of_one_rank_in_process():
    results = run(2, 1, SCENARIOS)
    assert len(results) == 2 and all(len(r) == len(SCENARIOS) for r in results)


@pytest.mark.gpu(4)
def test_two_nodes_of_two_ranks_in_process():
    results = run(2, 2, SCENARIOS)
    assert len(results) == 4 and all(len(r) == len(SCENARIOS) for r in results)
