"""Recovery after a timeout and calls that overlap, with both ranks in one process.

tests/workers/local_failure_worker.py runs the recovery and concurrency cases of
failure_worker.py on an in-process group (``deepep_cupy.run_local_group``, rank r on GPU r), each
rank catching what its case raises, as the README asks of in-process jobs that go on after a
timeout. It runs as a subprocess with a wall-clock limit, so a hang cannot hang pytest.
test_gpu_failures.py asserts the same behaviour under mpiexec (the checks are shared:
_recovery_checks.py).
"""

import subprocess
import sys

import _recovery_checks as check
import pytest
from _harness import WORKERS, _stop, describe, mpi_env, records_by, script_constant, worker_records

WORKER = WORKERS / "local_failure_worker.py"
#: The cases the in-process worker runs: those of failure_worker.py that take any rank group.
GROUP_CASES = script_constant(WORKERS / "failure_worker.py", "GROUP_CASES")
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def local_run():
    """``(results by case, CompletedProcess)`` of one in-process run of every case."""
    cmd = [sys.executable, str(WORKER)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env(),
                            cwd=str(WORKERS.parent.parent), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        raise AssertionError(f"timed out after {TIMEOUT_S} s: {' '.join(cmd)}\n"
                             f"--- stdout ---\n{stdout or ''}\n--- stderr ---\n{stderr or ''}") from None
    run = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    return records_by(run.stdout, "case"), run


def test_the_in_process_cases_are_cases_of_the_mpi_run():
    assert GROUP_CASES and set(GROUP_CASES) <= set(script_constant(WORKERS / "failure_worker.py", "CASES"))


@pytest.mark.gpu
def test_the_in_process_worker_exits_cleanly(local_run):
    results, run = local_run
    assert run.returncode == 0 and not worker_records(run.stdout, "ERROR"), describe(run)
    assert all(e["in_process"] for entries in results.values() for e in entries)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GROUP_CASES)
def test_in_process_case_passes_on_every_rank(local_run, case):
    results, run = local_run
    for entry in check.by_rank(results, case, describe(run)).values():
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"


@pytest.mark.gpu
def test_in_process_after_a_peer_never_joins_the_waiting_rank_times_out(local_run):
    results, run = local_run
    check.a_missing_peer_made_rank_0_time_out(results, describe(run))


@pytest.mark.gpu
def test_in_process_after_a_peer_never_joins_every_rank_recovers_on_a_new_buffer(local_run):
    results, run = local_run
    check.recovered_with_exact_results(results, "recovery_after_a_peer_never_joins", describe(run))


@pytest.mark.gpu
def test_in_process_a_late_rank_fails_at_once_naming_the_rank_that_gave_up(local_run):
    results, run = local_run
    check.a_late_peer_failed_at_once(results, describe(run))


@pytest.mark.gpu
def test_in_process_after_a_late_rank_every_rank_recovers_on_a_new_buffer(local_run):
    results, run = local_run
    check.recovered_with_exact_results(results, "recovery_after_a_late_peer", describe(run))


@pytest.mark.gpu
def test_in_process_two_buffers_on_one_group_used_alternately_give_exact_results(local_run):
    results, run = local_run
    check.every_round_exact(results, "two_buffers_used_alternately", describe(run))


@pytest.mark.gpu
def test_in_process_a_dispatch_issued_while_an_async_combine_runs_gives_exact_results(local_run):
    results, run = local_run
    check.async_combines_were_asynchronous(results, describe(run))
    check.every_round_exact(results, "dispatch_while_an_async_combine_is_in_flight", describe(run))
