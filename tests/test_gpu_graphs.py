"""CUDA graphs on real GPUs: layout, a dispatch with ``num_worst_tokens``, a cached dispatch and a
combine, captured once (``torch.cuda.graph`` and CuPy's stream capture) and replayed with new inputs
and new routing in the same buffers, every replay bit-exact against the reference; a replay that
only one rank runs ends in a timeout exception, and a new Buffer works after it. Under mpiexec and
with both ranks in one process (tests/workers/graph_worker.py)."""

import pytest
from _harness import (
    WORKERS,
    describe,
    records_by,
    run_mpi,
    run_python,
    script_constant,
    skip_unless_gpus,
    skip_unless_gpus_for_mpiexec,
)

WORKER = WORKERS / "graph_worker.py"
CASES = script_constant(WORKER, "CASES")
TIMEOUT_S = script_constant(WORKER, "TIMEOUT_S")


def _results(run):
    return records_by(run.stdout, "case"), run


@pytest.fixture(scope="module")
def mpi_results():
    skip_unless_gpus_for_mpiexec(2)
    return _results(run_mpi(2, [str(WORKER)], timeout=300))


@pytest.fixture(scope="module")
def local_results():
    skip_unless_gpus(2)
    return _results(run_python([str(WORKER), "--local"], timeout=300))


def _every_rank_passed(results, run, case):
    entries = results.get(case, [])
    ranks = sorted(e["rank"] for e in entries)
    assert ranks == [0, 1], f"{case}: results of ranks {ranks}, expected [0, 1]\n{describe(run)}"
    for entry in entries:
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"
    return entries


@pytest.mark.gpu
@pytest.mark.mpi
def test_the_mpiexec_run_exits_cleanly(mpi_results):
    _, run = mpi_results
    assert run.returncode == 0, describe(run)


@pytest.mark.gpu
def test_the_in_process_run_exits_cleanly(local_results):
    _, run = local_results
    assert run.returncode == 0, describe(run)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_captured_steps_under_mpi(mpi_results, case):
    _every_rank_passed(*mpi_results, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_captured_steps_with_in_process_ranks(local_results, case):
    _every_rank_passed(*local_results, case)


@pytest.mark.gpu
@pytest.mark.mpi
def test_a_lone_replay_raises_a_timeout_after_the_buffers_timeout(mpi_results):
    entries = _every_rank_passed(*mpi_results, "lone_replay_times_out")
    lone = next(e for e in entries if e["rank"] == 0)
    assert lone["raised"] == "DeepEPTimeoutError" and lone["replay_seconds"] <= TIMEOUT_S + 10


@pytest.mark.gpu
@pytest.mark.mpi
def test_replays_receive_what_their_own_routing_sends(mpi_results):
    entries = _every_rank_passed(*mpi_results, "replay_torch")
    assert all(len(set(e["received"])) > 1 for e in entries)  # the routing changed between replays
