"""Dispatch and combine on real GPUs, one process per GPU under mpiexec, against the reference.

All scenarios (tests/workers/gpu_scenarios.py) run in one mpiexec job per rank count (start-up
and kernel compilation are paid once); each test then checks its scenario's result on every rank.
"""

import os

import pytest
from _harness import (
    WORKERS,
    describe,
    gpu_count,
    gpus_needed_under_mpiexec,
    records_by,
    run_mpi,
    skip_unless_gpus_for_mpiexec,
)
from workers.gpu_scenarios import NAMES

RANK_COUNTS = [int(n) for n in os.environ.get("DEEPEP_TEST_RANKS", "2").split(",")]


@pytest.fixture(scope="module")
def mpi_results(request):
    """{(num_ranks, scenario): [per-rank result dicts]} from one worker job per rank count."""
    results = {}
    outputs = {}
    for num_ranks in RANK_COUNTS:
        if gpu_count() < gpus_needed_under_mpiexec(num_ranks):
            continue
        run = run_mpi(num_ranks, [str(WORKERS / "gpu_worker.py")], timeout=900)
        outputs[num_ranks] = run
        for scenario, entries in records_by(run.stdout, "scenario").items():
            results[(num_ranks, scenario)] = entries
    return results, outputs


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
@pytest.mark.parametrize("scenario", NAMES)
def test_dispatch_and_combine_match_reference(mpi_results, num_ranks, scenario):
    skip_unless_gpus_for_mpiexec(num_ranks)
    results, outputs = mpi_results
    entries = results.get((num_ranks, scenario), [])
    ranks = sorted(e["rank"] for e in entries)
    assert ranks == list(range(num_ranks)), (f"{scenario}: results of ranks {ranks}, expected 0..{num_ranks - 1}\n"
                                             f"{describe(outputs[num_ranks])}")
    for entry in entries:
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
def test_the_mpiexec_run_exits_cleanly(mpi_results, num_ranks):
    """Exit status 0: every scenario passed on every rank, and destroy() and MPI's finalize ended
    without a crash (which no RESULT line would show)."""
    skip_unless_gpus_for_mpiexec(num_ranks)
    _, outputs = mpi_results
    assert outputs[num_ranks].returncode == 0, describe(outputs[num_ranks])
