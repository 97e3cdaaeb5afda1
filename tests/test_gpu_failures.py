"""Failure behaviour on real GPUs under mpiexec: refusals leave the Buffer usable, ranks that
disagree raise on every rank, a missing peer becomes an exception within the timeout, nothing leaks.
(test_gpu_recovery.py checks recovery after a timeout and calls that overlap, under mpiexec and
with both ranks in one process.)
"""

import _recovery_checks as check
import pytest
from _harness import WORKERS, describe, script_constant

CASES = script_constant(WORKERS / "failure_worker.py", "CASES")


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_failure_behaviour(failure_results, case):
    results, run = failure_results
    for entry in check.by_rank(results, case, describe(run)).values():
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"


@pytest.mark.gpu
@pytest.mark.mpi
def test_the_mpiexec_failure_run_exits_cleanly(failure_results):
    """Every case catches the failure it provokes (a refusal, a timeout, a peer that gave up), so the
    run exits with 0; a crash in destroy() or in MPI's finalize would not."""
    _, run = failure_results
    assert run.returncode == 0, describe(run)


@pytest.mark.gpu
@pytest.mark.mpi
def test_a_missing_peer_raises_within_timeout_plus_one_second(failure_results):
    results, run = failure_results
    waiting = [e for e in results.get("peer_never_joins", []) if e["rank"] == 0]
    assert waiting, describe(run)
    assert waiting[0]["seconds"] <= waiting[0]["timeout_s"] + 1.0
    assert "notify_dispatch" in waiting[0]["message"]
