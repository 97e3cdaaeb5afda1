"""Failure behaviour on real GPUs under mpiexec: refusals leave the Buffer usable, ranks that
disagree raise on every rank, a missing peer becomes an exception within the timeout, nothing leaks.
"""

import pytest
from _harness import WORKERS, describe, gpu_count, records_by, run_mpi


def _cases():
    import ast

    tree = ast.parse((WORKERS / "failure_worker.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CASES":
            return ast.literal_eval(node.value)
    raise AssertionError("failure_worker.py defines no CASES")


CASES = _cases()




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
