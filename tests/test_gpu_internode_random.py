"""Random internode cases against deepep_cupy.reference.internode on GPUs: the seeds ``make test``
runs (``internode_cases.GPU_TEST_SEEDS``; ``make soak-internode`` runs more).

One mpiexec job of as many processes as the largest case has ranks runs
tests/workers/internode_random_worker.py: each case on an internode Buffer of its node split
(``ranks_per_node``) with the MPI rail transport, every output of the layout, the fresh dispatch
(exact or ``num_worst_tokens``), the cached dispatch and the combine compared bit-exactly on every
rank. With ``DEEPEP_TEST_ONE_GPU_MPI=1`` all ranks share one GPU (tests/workers/one_gpu_ranks.py).

Ranks that are threads of one process (run_local_group, the "local" transport) cannot share a GPU
on the internode path: its host runs CuPy work between the rail exchange and the node's NVLink
kernels, and the first launch of a CuPy kernel (a module load) or an allocation that reaches
cudaMalloc waits for every kernel running in the process's context, among them a node peer's
dispatch spinning until this rank's kernel starts (docs/GROUPS.md); and each node's intranode
Buffer checks the SM budget of its own node's ranks only, while every node's kernels are on the
GPU at once. Processes have contexts of their own, which take turns on the GPU, so the MPI
transport can run every case on one GPU.

Environment: ``DEEPEP_TEST_INTERNODE_SEEDS`` (default all): the part of the seeds to run, for a
machine whose calls are shorter than the whole job.
"""

import os
import sys

import pytest
from _harness import WORKERS, describe, gpu_count, gpus_needed_under_mpiexec, records_by, run_mpi, worker_records

sys.path.insert(0, str(WORKERS))  # the workers import their siblings as scripts do

from internode_cases import GPU_TEST_SEEDS, internode_cases  # noqa: E402

WORKER = WORKERS / "internode_random_worker.py"

def _selected_seeds(text):
    """``DEEPEP_TEST_INTERNODE_SEEDS``: ``a-b`` (inclusive) or ``s,t,...`` of GPU_TEST_SEEDS, so that
    a machine whose calls are shorter than the whole job can run it in parts; all by default."""
    if not text.strip():
        return list(GPU_TEST_SEEDS)
    if "-" in text:
        first, last = (int(v) for v in text.split("-"))
        chosen = list(range(first, last + 1))
    else:
        chosen = [int(v) for v in text.split(",")]
    unknown = sorted(set(chosen) - set(GPU_TEST_SEEDS))
    if unknown:
        raise ValueError(f"DEEPEP_TEST_INTERNODE_SEEDS: {unknown} are not among the test seeds {GPU_TEST_SEEDS}")
    return chosen


SEEDS = _selected_seeds(os.environ.get("DEEPEP_TEST_INTERNODE_SEEDS", ""))
CASES = {c["seed"]: c for c in internode_cases(GPU_TEST_SEEDS[0], len(GPU_TEST_SEEDS)) if c["seed"] in SEEDS}
#: Processes of the job: the most ranks a case has.
JOB_RANKS = max(c["num_ranks"] for c in CASES.values())
#: Seconds the job may take (kernel compilation included), as the internode scenario jobs.
JOB_TIMEOUT_S = float(os.environ.get("DEEPEP_TEST_INTERNODE_JOB_S", "600"))
#: Where the job's output is written as well (a folder), if set.
LOG_DIR = os.environ.get("DEEPEP_TEST_LOG_DIR")


@pytest.fixture(scope="module")
def random_results():
    if gpu_count() < gpus_needed_under_mpiexec(JOB_RANKS):
        pytest.skip(f"an mpiexec job of {JOB_RANKS} ranks needs {gpus_needed_under_mpiexec(JOB_RANKS)} GPUs "
                    "(DEEPEP_TEST_ONE_GPU_MPI=1: one for all)")
    try:
        run = run_mpi(JOB_RANKS, [str(WORKER), "--seeds", *map(str, SEEDS)],
                      timeout=JOB_TIMEOUT_S,
                      env={"DEEPEP_TEST_TIMEOUT_S": os.environ.get("DEEPEP_TEST_TIMEOUT_S", "60")})
        output, stdout, returncode = describe(run), run.stdout, run.returncode
    except AssertionError as exc:  # a job that timed out: its records so far still count
        output = stdout = str(exc)
        returncode = None
    if LOG_DIR:
        with open(os.path.join(LOG_DIR, "internode_random.log"), "w") as log:
            log.write(output)
    try:
        records = records_by(stdout, "seed")
    except ValueError:  # a record cut short by the timeout
        records = {}
    return records, output, stdout, returncode


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("seed", SEEDS)
def test_random_internode_case_matches_the_node_reference(random_results, seed):
    records, output, _, _ = random_results
    case = CASES[seed]
    entries = records.get(seed)
    assert entries, f"no result for seed {seed}\n{output[-6000:]}"
    assert sorted(e["rank"] for e in entries) == list(range(case["num_ranks"])), entries
    errors = "\n".join(f"--- rank {e['rank']}: {e['error']}" for e in entries if not e["ok"])
    assert not errors, f"{entries[0]['shape']} seed {seed}\nrun it alone: make soak-internode " \
        f"SOAK_INTERNODE_SEED={seed} SOAK_INTERNODE_CASES=1\n{errors}"


@pytest.mark.gpu
@pytest.mark.mpi
def test_random_internode_job_reports_every_case_and_exits_cleanly(random_results):
    records, output, stdout, returncode = random_results
    assert sorted(records) == sorted(SEEDS), output[-6000:]
    summaries = worker_records(stdout, "SUMMARY")
    assert summaries, output[-6000:]
    assert summaries[-1]["cases"] == len(SEEDS) and not summaries[-1]["failed"], summaries[-1]
    assert returncode == 0, output[-6000:]
