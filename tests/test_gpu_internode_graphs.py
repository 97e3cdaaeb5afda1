"""Internode calls with num_worst_tokens captured in CUDA graphs: in-process ranks on simulated
nodes over the "local" rail transport (sharing one GPU where there is one), a PyTorch graph of the
whole step (layout, dispatch, combine) replayed with new routing, every replay bit for bit against
deepep_cupy.reference.internode and against an eager step on the same inputs
(tests/workers/internode_graph_worker.py); on two GPUs, the same over the "nccl" rail transport
(its grouped send/receive captured)."""

import pytest
from _harness import WORKERS, describe, import_or_skip, records_by, run_python

WORKER = WORKERS / "internode_graph_worker.py"
SHAPES = [(2, 1), (2, 2), (4, 1)]
REPLAYS = 5
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def graph_runs():
    """The worker's records per (nodes, ranks per node, dtype, transport), each run once for the
    tests that read it, after checking that every rank reported and passed."""
    cache = {}

    def get(num_nodes, ranks_per_node, dtype, transport):
        key = (num_nodes, ranks_per_node, dtype, transport)
        if key not in cache:
            run = run_python([WORKER, num_nodes, ranks_per_node, "--replays", REPLAYS, "--dtype", dtype,
                              "--transport", transport], TIMEOUT_S)
            cache[key] = (records_by(run.stdout, "shape").get(f"{num_nodes}x{ranks_per_node}", []), describe(run))
        records, description = cache[key]
        assert sorted(r["rank"] for r in records) == list(range(num_nodes * ranks_per_node)), description
        failed = [f"rank {r['rank']}: {r['error']}" for r in records if not r["ok"]]
        assert not failed, "\n".join(failed)
        return records
    return get


@pytest.mark.gpu(1)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{lr}" for n, lr in SHAPES])
def test_a_captured_internode_step_replays_new_routing_bit_exactly(graph_runs, shape, dtype):
    import_or_skip("torch", "PyTorch's CUDA graphs")
    _every_replay_passed(graph_runs(*shape, dtype, "local"))


@pytest.mark.gpu(1)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{lr}" for n, lr in SHAPES])
def test_a_dispatch_in_blocks_with_too_few_rows_raises_on_every_rank_by_the_next_call(graph_runs, shape):
    import_or_skip("torch", "PyTorch's CUDA graphs")
    raised = {r["rank"]: r["too_few_rows"] for r in graph_runs(*shape, "bfloat16", "local")}
    assert set(raised.values()) <= {"ValueError", "PeerFailedError"} and "ValueError" in raised.values(), raised


@pytest.mark.gpu(2)
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_captured_internode_step_over_nccl_replays_new_routing_bit_exactly(graph_runs, dtype):
    import_or_skip("torch", "PyTorch's CUDA graphs")
    _every_replay_passed(graph_runs(2, 1, dtype, "nccl"))


def _every_replay_passed(records):
    assert all(r["replays"] == REPLAYS for r in records)
    assert all(r["bytes_needed"] <= r["bytes_sent"] for r in records)
