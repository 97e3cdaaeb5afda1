"""Failure behaviour on real GPUs under mpiexec: refusals leave the Buffer usable, ranks that
disagree raise on every rank, a missing peer becomes an exception within the timeout, nothing leaks,
every rank recovers from a timeout with a new Buffer, and calls that overlap give exact results.
(test_gpu_recovery.py checks the recovery and overlap cases with both ranks in one process.)
"""

import _recovery_checks as check
import pytest
from _harness import WORKERS, describe, gpu_count, records_by, run_mpi, script_constant

CASES = script_constant(WORKERS / "failure_worker.py", "CASES")


@pytest.fixture(scope="module")
def failure_results():
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {gpu_count()}")
    run = run_mpi(2, [str(WORKERS / "failure_worker.py")], timeout=900)
    return records_by(run.stdout, "case"), run


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_failure_behaviour(failure_results, case):
    results, run = failure_results
    entries = results.get(case)
    assert entries and len(entries) == 2, f"no result for {case}\n{describe(run)}"
    for entry in entries:
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"


@pytest.mark.gpu
@pytest.mark.mpi
def test_a_missing_peer_raises_within_timeout_plus_one_second(failure_results):
    results, run = failure_results
    waiting = [e for e in results.get("peer_never_joins", []) if e["rank"] == 0]
    assert waiting, describe(run)
    assert waiting[0]["seconds"] <= waiting[0]["timeout_s"] + 1.0
    assert "notify_dispatch" in waiting[0]["message"]


@pytest.mark.gpu
@pytest.mark.mpi
def test_after_a_peer_never_joins_the_waiting_rank_times_out(failure_results):
    results, run = failure_results
    check.a_missing_peer_made_rank_0_time_out(results, describe(run))


@pytest.mark.gpu
@pytest.mark.mpi
def test_after_a_peer_never_joins_every_rank_recovers_on_a_new_buffer(failure_results):
    results, run = failure_results
    check.recovered_with_exact_results(results, "recovery_after_a_peer_never_joins", describe(run))


@pytest.mark.gpu
@pytest.mark.mpi
def test_a_late_rank_fails_at_once_naming_the_rank_that_gave_up(failure_results):
    results, run = failure_results
    check.a_late_peer_failed_at_once(results, describe(run))


@pytest.mark.gpu
@pytest.mark.mpi
def test_after_a_late_rank_every_rank_recovers_on_a_new_buffer(failure_results):
    results, run = failure_results
    check.recovered_with_exact_results(results, "recovery_after_a_late_peer", describe(run))


@pytest.mark.gpu
@pytest.mark.mpi
def test_two_buffers_on_one_group_used_alternately_give_exact_results(failure_results):
    results, run = failure_results
    check.every_round_exact(results, "two_buffers_used_alternately", describe(run))


@pytest.mark.gpu
@pytest.mark.mpi
def test_a_dispatch_issued_while_an_async_combine_runs_gives_exact_results(failure_results):
    results, run = failure_results
    check.async_combines_were_asynchronous(results, describe(run))
    check.every_round_exact(results, "dispatch_while_an_async_combine_is_in_flight", describe(run))
