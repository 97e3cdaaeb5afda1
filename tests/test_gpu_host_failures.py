"""A host that fails during a call, on real GPUs (tests/workers/host_failure_worker.py): 2 and 4
ranks, one process per rank (mpiexec) and ranks in one process. Before its count exchange, a
rank that cannot allocate (or is interrupted) refuses the call on every rank and the Buffer goes
on; after it, the rank gives up on the Buffer and every peer raises at once, naming it.
"""

import pytest
from _harness import (
    WORKERS,
    describe,
    run_mpi,
    run_python,
    script_constant,
    skip_unless_gpus_for_mpiexec,
    worker_records,
)

WORKER = WORKERS / "host_failure_worker.py"
CASES = script_constant(WORKER, "CASES")
RANK_COUNTS = (2, 4)


def _records_by_case(run, num_ranks):
    records = {}
    for record in worker_records(run.stdout):
        records.setdefault(record["case"], {})[record["rank"]] = record
    for case in CASES:
        assert sorted(records.get(case, {})) == list(range(num_ranks)), f"{case}: ranks missing\n{describe(run)}"
    return records


@pytest.fixture(scope="module", params=[pytest.param(("mpi", n), marks=pytest.mark.mpi) for n in RANK_COUNTS]
                + [("in process", n) for n in RANK_COUNTS], ids=lambda p: f"{p[0]} x{p[1]}")
def host_failure_run(request):
    how, num_ranks = request.param
    if how == "mpi":
        skip_unless_gpus_for_mpiexec(num_ranks)
        run = run_mpi(num_ranks, [WORKER], timeout=600)
    else:
        run = run_python([WORKER, "--in-process", num_ranks], timeout=600)
    return _records_by_case(run, num_ranks), run, num_ranks


@pytest.mark.gpu(1)
def test_the_host_failure_worker_exits_cleanly(host_failure_run):
    _, run, _ = host_failure_run
    assert run.returncode == 0 and not worker_records(run.stdout, "ERROR"), describe(run)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("case", CASES)
def test_every_rank_raises_within_a_second_and_the_job_goes_on(host_failure_run, case):
    records, run, _ = host_failure_run
    for rank, entry in sorted(records[case].items()):
        assert entry["ok"], f"rank {rank}: {entry['error']}"
        assert entry["seconds"] <= entry["raise_limit_s"], entry


@pytest.mark.gpu(1)
@pytest.mark.parametrize("case", ["out_of_memory_before_the_count_exchange", "interrupted_while_allocating"])
def test_a_refused_dispatch_leaves_the_buffer_usable(host_failure_run, case):
    records, run, _ = host_failure_run
    for entry in records[case].values():
        assert entry["exact_rounds_after"] == script_constant(WORKERS / "failure_worker.py", "ROUNDS"), entry
