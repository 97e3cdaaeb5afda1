"""Internode dispatch and combine on GPUs, one process per rank under mpiexec, with the MPI rail
transport over simulated nodes (``ranks_per_node``), against deepep_cupy.reference.internode.

Shapes (nodes x ranks per node): 2x1, 2x2, 4x1 and 3x2, in one mpiexec job per rank count
(tests/workers/internode_worker.py); every scenario's result is checked on every rank. With
``DEEPEP_TEST_ONE_GPU_MPI=1`` all ranks share one GPU.
"""

import os

import pytest
from _harness import gpus_needed_under_mpiexec, mpi_job_records

#: Ranks of each mpiexec job and the ranks per node of the Buffers it makes in turn.
JOBS = {2: (1,), 4: (2, 1), 6: (2,)}
SHAPES = [(2, 1), (2, 2), (4, 1), (3, 2)]
#: Seconds one mpiexec job may take (kernel compilation included).
JOB_TIMEOUT_S = float(os.environ.get("DEEPEP_TEST_INTERNODE_JOB_S", "600"))
SCENARIOS = ["bf16", "fp16", "fp32", "fp8", "fp8 column scales", "topk -1 aligned", "uneven and zero",
             "all to one node", "num_worst_tokens", "async previous_event", "torch bf16", "torch fp8"]


@pytest.fixture(scope="module")
def internode_results():
    return mpi_job_records("internode_worker.py", JOBS, JOB_TIMEOUT_S, "internode")


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{lr}" for n, lr in SHAPES])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_internode_dispatch_and_combine_match_the_node_reference(internode_results, shape, scenario):
    num_nodes, ranks_per_node = shape
    num_ranks = num_nodes * ranks_per_node
    results, outputs = internode_results
    if num_ranks not in outputs:
        pytest.skip(f"needs {gpus_needed_under_mpiexec(num_ranks)} GPUs")
    entries = results.get((num_ranks, f"{num_nodes}x{ranks_per_node} {scenario}"))
    if entries is None and scenario.startswith("torch"):
        pytest.skip("PyTorch is not installed on the GPU machine")
    assert entries, f"no result for {scenario} on {shape}\n{outputs[num_ranks][-6000:]}"
    assert len(entries) == num_ranks, entries
    for entry in entries:
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"
