"""The internode matrix on GPUs: every node shape (2x2, 2x3, 3x2, 2x4, 4x2, and 4x1 for the
failures), CuPy and PyTorch inputs, the caller's default stream and a side stream, one process per
rank under mpiexec (tests/workers/internode_matrix_worker.py; with ``DEEPEP_TEST_ONE_GPU_MPI=1`` the
ranks share one GPU). Checks are layout-agnostic: the rows that arrived, as a set of (source,
token) pairs, against the reference; then bytes, order and the combine, bit for bit. Two failures
per case must raise on every rank and leave the communicator's own allgather in step.
"""

import os

import pytest
from _harness import gpus_needed_under_mpiexec, mpi_job_records

#: Ranks of each mpiexec job and the ranks per node of the Buffers it makes in turn.
JOBS = {4: (2, 1), 6: (3, 2), 8: (4, 2)}
SHAPES = [(2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (4, 1)]
CASES = [f"{framework} {stream} {scenario}" for framework in ("cupy", "torch") for stream in ("default", "side")
         for scenario in ("calls", "failures")]
JOB_TIMEOUT_S = float(os.environ.get("DEEPEP_TEST_INTERNODE_JOB_S", "600"))


@pytest.fixture(scope="module")
def matrix_results():
    return mpi_job_records("internode_matrix_worker.py", JOBS, JOB_TIMEOUT_S, "internode_matrix",
                           env={"DEEPEP_CUPY_MPI_CUDA_AWARE": "0"})


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{lr}" for n, lr in SHAPES])
@pytest.mark.parametrize("case", CASES)
def test_every_rank_gets_its_rows_on_every_stream_and_node_shape(matrix_results, shape, case):
    num_nodes, ranks_per_node = shape
    num_ranks = num_nodes * ranks_per_node
    results, outputs = matrix_results
    if num_ranks not in outputs:
        pytest.skip(f"needs {gpus_needed_under_mpiexec(num_ranks)} GPUs")
    entries = results.get((num_ranks, f"{num_nodes}x{ranks_per_node} {case}"))
    if entries is None and case.startswith("torch"):
        pytest.skip("PyTorch is not installed on the GPU machine")
    assert entries, f"no result for {case} on {shape}\n{outputs[num_ranks][-6000:]}"
    assert len(entries) == num_ranks, entries
    for entry in entries:
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"
