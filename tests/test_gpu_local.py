"""Dispatch and combine with every rank in one process (deepep_cupy.run_local_group), on real GPUs.

The worker (tests/workers/local_gpu_worker.py) runs the scenarios of the MPI tests
(gpu_scenarios.py, ``gpu_worker.run_scenario`` unchanged) with N rank threads, rank ``r`` on GPU
``r % G``: with fewer GPUs than ranks, ranks share GPUs (``num_sms`` lowered where they would not
fit together). It runs as a subprocess with a wall-clock limit, so a hang cannot hang pytest.

Environment:
    DEEPEP_TEST_LOCAL_RANKS: comma-separated rank counts (default ``2,4,8``: on a 2-GPU machine
        4 and 8 ranks put 2 and 4 ranks on each GPU).
    DEEPEP_TEST_LOCAL_GPUS: use only GPUs ``0..G-1`` (default: all visible), e.g. 2 on an 8-GPU
        machine to run 8 ranks four to a GPU.
    DEEPEP_TEST_COMPARE_MPI: ``0`` skips the comparison with the same scenarios run under mpiexec.
"""

import os
import re
import subprocess
import sys

import pytest
from _harness import (
    REPO_ROOT,
    WORKERS,
    describe,
    local_gpu_args,
    mpi_env,
    records_by,
    run_mpi,
    run_python,
    skip_unless_gpus_for_mpiexec,
    worker_records,
)
from workers.gpu_scenarios import NAMES

RANK_COUNTS = [int(n) for n in os.environ.get("DEEPEP_TEST_LOCAL_RANKS", "2,4,8").split(",")]
COMPARE_MPI = os.environ.get("DEEPEP_TEST_COMPARE_MPI", "1").strip() not in ("0", "false", "no")
WORKER = WORKERS / "local_gpu_worker.py"
EXAMPLE = REPO_ROOT / "examples" / "in_process_dispatch_combine.py"
TIMEOUT_S = 900


def run_worker(args, timeout=TIMEOUT_S, env=None):
    """``python local_gpu_worker.py args...``, killed after ``timeout`` s."""
    return run_python([WORKER, *args], timeout, env)


def by_scenario(run):
    return records_by(run.stdout, "scenario")


@pytest.fixture(scope="module")
def local_runs():
    """num_ranks -> CompletedProcess of one in-process worker run (all scenarios), made on first use."""
    cache = {}

    def get(num_ranks):
        if num_ranks not in cache:
            cache[num_ranks] = run_worker(["--ranks", num_ranks, *local_gpu_args()])
        return cache[num_ranks]

    return get


@pytest.mark.gpu(1)
@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
@pytest.mark.parametrize("scenario", NAMES)
def test_in_process_matches_reference(local_runs, num_ranks, scenario):
    run = local_runs(num_ranks)
    entries = by_scenario(run).get(scenario)
    assert entries, f"no result for {scenario} with {num_ranks} in-process ranks\n{describe(run)}"
    assert sorted(e["rank"] for e in entries) == list(range(num_ranks)), entries
    for entry in entries:
        assert entry["in_process"] is True
        assert entry["ok"], (f"rank {entry['rank']} (GPU {entry['device']}, {entry['ranks_on_device']} ranks on it, "
                             f"num_sms {entry['num_sms']}): {entry['error']}")


@pytest.mark.gpu(1)
def test_a_fresh_dispatch_in_one_launch_matches_reference():
    # The path of ranks with processes of their own (with rows in place, the count exchange in
    # the transfer kernel), taken here by in-process ranks.
    run = run_worker(["--ranks", "2", "--exchange-in-transfer", *local_gpu_args()])
    assert run.returncode == 0, describe(run)
    results = by_scenario(run)
    assert set(results) == set(NAMES), describe(run)
    for name, entries in results.items():
        assert sorted(e["rank"] for e in entries) == [0, 1], (name, describe(run))
    failed = [(name, e["rank"], e["error"]) for name, entries in results.items() for e in entries if not e["ok"]]
    assert not failed, failed


@pytest.mark.gpu(1)
def test_ranks_sharing_a_gpu_allocate_from_one_pool_until_the_last_ends():
    run = run_python([WORKERS / "pool_worker.py"], 120)
    assert run.returncode == 0, describe(run)
    [record] = worker_records(run.stdout)
    during = [rank["while_both_run"] for rank in record["ranks"]]
    assert during[0] == during[1] and during[0]["pool"] != record["before"]["pool"], record
    assert during[0]["internal_reuse"] == 0, record
    assert record["ranks"][1]["after_rank0_ended"] == during[0], record
    assert record["ranks"][1]["allocates_after"], record
    assert record["after"] == record["before"], record


@pytest.mark.gpu(1)
@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
def test_in_process_worker_exits_cleanly(local_runs, num_ranks):
    run = local_runs(num_ranks)
    assert run.returncode == 0, describe(run)
    assert not worker_records(run.stdout, "ERROR"), describe(run)


@pytest.mark.gpu(1)
@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", RANK_COUNTS)
def test_in_process_gives_the_same_results_as_mpi(local_runs, num_ranks):
    """Same scenarios, same inputs: every dispatch/combine of every rank returns outputs that hash
    the same both ways, call for call (hashed as each call returns: tests/workers/local_gpu_worker.py)."""
    if not COMPARE_MPI:
        pytest.skip("DEEPEP_TEST_COMPARE_MPI=0")
    skip_unless_gpus_for_mpiexec(num_ranks)
    local = by_scenario(local_runs(num_ranks))
    mpi_run = run_mpi(num_ranks, [str(WORKER), "--mpi"], timeout=TIMEOUT_S)
    assert mpi_run.returncode == 0, describe(mpi_run)
    mpi = by_scenario(mpi_run)
    assert mpi, describe(mpi_run)
    compared = 0
    for scenario, entries in mpi.items():
        theirs = {e["rank"]: e for e in entries}
        for mine in local.get(scenario, []):
            other = theirs.get(mine["rank"])
            if other is None or not (mine["ok"] and other["ok"]):
                continue  # failures are reported by the tests above and test_gpu_mpi.py
            assert other["in_process"] is False
            where = f"{scenario}, rank {mine['rank']}"
            in_process, under_mpi = mine["call_hashes"], other["call_hashes"]
            assert in_process, f"{where}: no call recorded"
            assert [c["kind"] for c in in_process] == [c["kind"] for c in under_mpi], (where, in_process, under_mpi)
            for a, b in zip(in_process, under_mpi):
                assert a["hash"] == b["hash"], (f"{where}, call {a['call']} ({a['kind']}): in-process {a['hash']}, "
                                                f"mpiexec {b['hash']}")
            assert mine["recv_tokens"] == other["recv_tokens"]
            compared += 1
    assert compared, f"nothing to compare\n{describe(mpi_run)}"


@pytest.mark.gpu(1)
def test_a_failing_rank_ends_the_in_process_job():
    """Rank 1 raises while the others wait for it in their kernels: the job reports rank 1, no hang."""
    run = run_worker(["--ranks", 3, *local_gpu_args(), "--inject-failure", 1, "--timeout", 10, "bf16_basic"],
                     timeout=180)
    assert run.returncode == 1, describe(run)
    errors = worker_records(run.stdout, "ERROR")
    assert len(errors) == 1, describe(run)
    assert errors[0]["rank"] == 1 and "injected failure on rank 1" in errors[0]["message"], describe(run)
    assert errors[0]["stuck"] == [], describe(run)


@pytest.mark.gpu(1)
def test_the_in_process_example_runs_and_its_checks_pass():
    """examples/in_process_dispatch_combine.py (the notebook's code): a rank per GPU, two on one GPU;
    its own asserts compare the counts with the handle and the combine with k * x."""
    run = run_python([EXAMPLE], timeout=600)
    assert run.returncode == 0, describe(run)
    assert re.search(r"^combine checked on all \d+ ranks$", run.stdout, re.M), describe(run)


@pytest.mark.gpu(1)
def test_sm_budget_is_checked_before_any_rank_starts():
    """Eight ranks with 48 SMs each cannot share one GPU: a clear ValueError, nothing launched."""
    code = ("import deepep_cupy as ep\n"
            "try:\n"
            "    ep.run_local_group(lambda g: None, 8, devices=[0] * 8, num_sms=48)\n"
            "except ValueError as exc:\n"
            "    print('ERR', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=mpi_env(), timeout=120)
    assert "ERR GPU 0: 8 ranks x num_sms=48" in proc.stdout, proc.stdout + proc.stderr
