"""Teardown in any order: results of a Buffer freed after its destroy(), a torch.distributed group
destroyed before them, others kept until the interpreter exits; every process exits with status 0
(tests/workers/teardown_worker.py, one process per rank under mpiexec)."""

import pytest
from _harness import WORKERS, _free_port, describe, gpu_count, gpus_needed_under_mpiexec, import_or_skip, run_mpi

RANKS = {"intranode": 2, "internode": 4, "low_latency": 2}
KINDS = [("cupy", "mpi"), ("torch", "mpi"), ("torch", "torch")]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("path", sorted(RANKS))
@pytest.mark.parametrize("framework, group", KINDS, ids=["cupy-mpi", "torch-mpi", "torch-group"])
def test_results_freed_after_destroy_and_at_exit_leave_every_process_exiting_cleanly(path, framework, group):
    num_ranks = RANKS[path]
    if gpu_count() < gpus_needed_under_mpiexec(num_ranks):
        pytest.skip(f"needs {gpus_needed_under_mpiexec(num_ranks)} GPUs")
    if framework == "torch":
        import_or_skip("torch", "PyTorch tensors")
    run = run_mpi(num_ranks, [str(WORKERS / "teardown_worker.py"), path, framework, group], timeout=300,
                  env={"DEEPEP_TEST_PORT": str(_free_port())})
    assert run.returncode == 0, describe(run)
    assert run.stdout.count("TEARDOWN ok") == num_ranks, describe(run)
