"""Random cases against the NumPy reference on real GPUs: the seeds ``make test`` runs.

tests/workers/random_soak.py runs the cases of ``random_cases.GPU_TEST_SEEDS`` (every rank count
2..8 as threads of one process, rank ``r`` on GPU ``r % G``, so ranks share GPUs when there are
fewer than 8) through ``gpu_worker.run_scenario``: every output and handle field compared
bit-exactly with the reference. It runs as a subprocess with a wall-clock limit, so a hang cannot
hang pytest. The 1000-case soak is ``make soak`` (README, "Set-up and commands").

Environment: ``DEEPEP_TEST_LOCAL_GPUS`` (as for test_gpu_local.py): use only GPUs ``0..G-1``.
"""

import pytest
from _harness import WORKERS, describe, local_gpu_args, run_python, worker_records
from workers.random_cases import GPU_TEST_SEEDS

SOAK = WORKERS / "random_soak.py"
# Kernel compiles for every rank count and dtype (when CuPy's cache is cold) plus the cases.
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def soak_run():
    first, count = GPU_TEST_SEEDS[0], len(GPU_TEST_SEEDS)
    run = run_python([SOAK, "--seed", first, "--cases", count, "--records", *local_gpu_args()], timeout=TIMEOUT_S)
    return run, {record["seed"]: record for record in worker_records(run.stdout, "CASE")}


@pytest.mark.gpu(1)
@pytest.mark.parametrize("seed", GPU_TEST_SEEDS)
def test_random_case_matches_reference(soak_run, seed):
    run, records = soak_run
    record = records.get(seed)
    assert record is not None, f"no result for seed {seed}\n{describe(run)}"
    errors = "\n".join(f"--- rank {rank}: {error}" for rank, error in record["errors"].items())
    assert record["ok"], f"{record['case']}\nrun it alone: {record['reproduce']}\n{errors}"


@pytest.mark.gpu(1)
def test_random_soak_reports_every_case_and_exits_cleanly(soak_run):
    run, records = soak_run
    summaries = worker_records(run.stdout, "SUMMARY")
    assert summaries, describe(run)
    assert summaries[-1]["cases"] == len(GPU_TEST_SEEDS) and not summaries[-1]["failed"], summaries[-1]
    assert sorted(records) == list(GPU_TEST_SEEDS), describe(run)
    assert run.returncode == 0, describe(run)
