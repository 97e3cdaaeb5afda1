"""Recovery after a timeout and calls that overlap, under mpiexec (one process per rank,
tests/workers/failure_worker.py) and with both ranks in one process, on one GPU or two
(tests/workers/local_failure_worker.py: the same cases on ``deepep_cupy.run_local_group``, each
rank catching what its case raises, as the README asks of in-process jobs that go on after a
timeout). Each behaviour is asserted once, for both transports (the ``transport`` fixture); the
runs themselves are the session's (tests/conftest.py).
"""

import _recovery_checks as check
import pytest
from _harness import WORKERS, describe, script_constant, worker_records

#: The cases the in-process worker runs: those of failure_worker.py that take any rank group.
GROUP_CASES = script_constant(WORKERS / "failure_worker.py", "GROUP_CASES")


@pytest.fixture(params=[pytest.param("mpi", marks=pytest.mark.mpi), "in process"])
def transport(request):
    """``(records by case, CompletedProcess)`` of the failure cases, under each transport in turn."""
    return request.getfixturevalue("failure_results" if request.param == "mpi" else "local_failure_results")


def test_the_in_process_cases_are_cases_of_the_mpi_run():
    assert GROUP_CASES and set(GROUP_CASES) <= set(script_constant(WORKERS / "failure_worker.py", "CASES"))


@pytest.mark.gpu(1)
def test_the_in_process_worker_exits_cleanly(local_failure_results):
    results, run = local_failure_results
    assert run.returncode == 0 and not worker_records(run.stdout, "ERROR"), describe(run)
    assert all(e["in_process"] for entries in results.values() for e in entries)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("case", GROUP_CASES)
def test_in_process_case_passes_on_every_rank(local_failure_results, case):
    results, run = local_failure_results
    for entry in check.by_rank(results, case, describe(run)).values():
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"


@pytest.mark.gpu(1)
def test_after_a_peer_never_joins_the_waiting_rank_times_out(transport):
    results, run = transport
    check.a_missing_peer_made_rank_0_time_out(results, describe(run))


@pytest.mark.gpu(1)
def test_after_a_peer_never_joins_every_rank_recovers_on_a_new_buffer(transport):
    results, run = transport
    check.recovered_with_exact_results(results, "recovery_after_a_peer_never_joins", describe(run))


@pytest.mark.gpu(1)
def test_a_late_rank_fails_at_once_naming_the_rank_that_gave_up(transport):
    results, run = transport
    check.a_late_peer_failed_at_once(results, describe(run))


@pytest.mark.gpu(1)
def test_after_a_late_rank_every_rank_recovers_on_a_new_buffer(transport):
    results, run = transport
    check.recovered_with_exact_results(results, "recovery_after_a_late_peer", describe(run))


@pytest.mark.gpu(1)
def test_two_buffers_on_one_group_used_alternately_give_exact_results(transport):
    results, run = transport
    check.every_round_exact(results, "two_buffers_used_alternately", describe(run))


@pytest.mark.gpu(1)
def test_a_dispatch_issued_while_an_async_combine_runs_gives_exact_results(transport):
    results, run = transport
    check.async_combines_were_asynchronous(results, describe(run))
    check.every_round_exact(results, "dispatch_while_an_async_combine_is_in_flight", describe(run))
