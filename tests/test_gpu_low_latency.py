"""The low-latency (decode) calls on real GPUs, bit-exact against deepep_cupy/reference/low_latency.py.

The worker (tests/workers/low_latency_worker.py) runs every case: BF16 and FP8 dispatch (plain,
power-of-two scales, UE8M0) with and without the receive hook, then combine; 1 to 128 tokens per
rank with -1 entries; two calls in flight; zero-copy combine; the statistics tensors; hidden 7168;
asynchronous calls; a decode step captured in a CUDA graph (CuPy and PyTorch, with and without
hooks) replayed with new routing; and DeepEP's own low-latency test as its user writes it
(tests/workers/deepep_style_low_latency.py). In one process with N rank threads (sharing GPUs
when there are fewer), and under mpiexec (``DEEPEP_TEST_ONE_GPU_MPI=1``: processes sharing one GPU).

Across simulated nodes (``--ranks-per-node``, against deepep_cupy/reference/low_latency_nodes.py):
every case again with in-process ranks on the local rail (``DEEPEP_TEST_LL_NODES``, default
``2x1,2x2,4x1,2x4``: nodes x ranks per node), and under mpiexec on the MPI rail (2 nodes of 1).

Environment: ``DEEPEP_TEST_LOCAL_RANKS`` (default ``2,4,8``), ``DEEPEP_TEST_RANKS`` for mpiexec
(default ``2``).
"""

import os

import pytest
from _harness import (
    WORKERS,
    describe,
    gpu_count,
    records_by,
    run_mpi,
    run_python,
    script_constant,
    skip_unless_gpus_for_mpiexec,
)

WORKER = WORKERS / "low_latency_worker.py"
CASES = script_constant(WORKER, "CASES")
LOCAL_RANKS = [int(n) for n in os.environ.get("DEEPEP_TEST_LOCAL_RANKS", "2,4,8").split(",")]
MPI_RANKS = [int(n) for n in os.environ.get("DEEPEP_TEST_RANKS", "2").split(",")]
NODE_SHAPES = [tuple(int(v) for v in shape.split("x"))
               for shape in os.environ.get("DEEPEP_TEST_LL_NODES", "2x1,2x2,4x1,2x4").split(",")]
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def local_runs():
    cache = {}

    def get(num_ranks):
        if num_ranks not in cache:
            cache[num_ranks] = run_python([WORKER, "--local", num_ranks], TIMEOUT_S)
        return cache[num_ranks]

    return get


@pytest.fixture(scope="module")
def mpi_runs():
    cache = {}

    def get(num_ranks):
        skip_unless_gpus_for_mpiexec(num_ranks)
        if num_ranks not in cache:
            cache[num_ranks] = run_mpi(num_ranks, [WORKER], TIMEOUT_S)
        return cache[num_ranks]

    return get


def _every_rank_passed(run, case, num_ranks):
    entries = records_by(run.stdout, "case").get(case)
    if not entries:  # the job stopped in this case: the errors its ranks printed first say why
        errors = "".join(f"\n--- rank {e['rank']}: {e['error']}"
                         for e in records_by(run.stdout, "case", "CASE_ERROR").get(case, []))
        raise AssertionError(f"no result for {case} with {num_ranks} ranks{errors}\n{describe(run)}")
    assert sorted(e["rank"] for e in entries) == list(range(num_ranks)), entries
    failed = [f"rank {e['rank']}: {e['error']}" for e in entries if not e["ok"]]
    assert not failed, "\n".join(failed)
    skipped = {e.get("skipped") for e in entries}
    if skipped != {None}:
        pytest.skip(f"{case} with {num_ranks} ranks: {sorted(map(str, skipped))}")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("num_ranks", LOCAL_RANKS)
@pytest.mark.parametrize("case", CASES)
def test_low_latency_with_in_process_ranks(local_runs, num_ranks, case):
    _every_rank_passed(local_runs(num_ranks), case, num_ranks)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("num_ranks", LOCAL_RANKS)
def test_the_in_process_worker_exits_cleanly(local_runs, num_ranks):
    run = local_runs(num_ranks)
    assert run.returncode == 0, describe(run)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("num_ranks", MPI_RANKS)
@pytest.mark.parametrize("case", CASES)
def test_low_latency_under_mpi(mpi_runs, num_ranks, case):
    _every_rank_passed(mpi_runs(num_ranks), case, num_ranks)


@pytest.fixture(scope="module")
def across_nodes_runs():
    cache = {}

    def get(num_nodes, ranks_per_node, mpi=False):
        key = (num_nodes, ranks_per_node, mpi)
        if key not in cache:
            num_ranks = num_nodes * ranks_per_node
            if mpi:
                skip_unless_gpus_for_mpiexec(num_ranks)
                cache[key] = run_mpi(num_ranks, [str(WORKER), "--ranks-per-node", str(ranks_per_node)], TIMEOUT_S)
            else:
                cache[key] = run_python([WORKER, "--local", num_ranks, "--ranks-per-node", ranks_per_node], TIMEOUT_S)
        return cache[key]

    return get


#: Shapes whose ranks, threads of one process sharing one GPU, are known to fail in the decode
#: across nodes (docs/DECODE.md "Across nodes": 2x4, 8 ranks, failed in the first dispatch in 7
#: of 9 runs; what the traces showed is there). Not run there: each of its cases would wait out the
#: kernels' timeout (up to the job's 900 s); run the worker itself to work on it.
SHARED_GPU_FAILURES = {(2, 4)}


def _node_shape(shape):
    if shape in SHARED_GPU_FAILURES and 0 < gpu_count() < shape[0] * shape[1]:
        return pytest.param(shape, marks=pytest.mark.xfail(
            run=False, reason=f"{shape[0]}x{shape[1]} in-process ranks sharing a GPU: known failure (docs/DECODE.md)"))
    return shape


@pytest.mark.gpu(1)
@pytest.mark.parametrize("shape", [_node_shape(s) for s in NODE_SHAPES], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", CASES)
def test_low_latency_across_simulated_nodes_with_in_process_ranks(across_nodes_runs, shape, case):
    _every_rank_passed(across_nodes_runs(*shape), case, shape[0] * shape[1])


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_low_latency_across_two_simulated_nodes_under_mpi(across_nodes_runs, case):
    _every_rank_passed(across_nodes_runs(2, 1, mpi=True), case, 2)
