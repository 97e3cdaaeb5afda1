"""The rail transports on GPUs, bit-exact: the MPI transport staged through pinned memory under
mpiexec (``DEEPEP_TEST_ONE_GPU_MPI=1``: every rank on one GPU), and the local transport between
the rank threads of one process (ranks share GPUs where there are fewer GPUs than ranks)."""

import pytest
from _harness import WORKERS, describe, run_mpi, run_python, skip_unless_gpus_for_mpiexec, worker_records


def _records(proc, n):
    assert proc.returncode == 0, describe(proc)
    records = sorted(worker_records(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == list(range(n)), describe(proc)
    return records


@pytest.mark.gpu(2)
@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_transport_staged_alltoallv_is_bit_exact(n):
    skip_unless_gpus_for_mpiexec(n)
    proc = run_mpi(n, [str(WORKERS / "transport_worker.py"), "gpu"], timeout=300,
                   env={"DEEPEP_CUPY_MPI_CUDA_AWARE": "0"})
    for r in _records(proc, n):
        assert r["mismatches"] == [], r
        assert r["cases"] >= 9
        assert r["ints"] == [100 * p + r["rank"] for p in range(n)]
        # One host whose GPUs map each other (or one GPU shared by every rank): one node.
        assert r["ranks_per_node"] == n


@pytest.mark.gpu(1)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_local_transport_alltoallv_is_bit_exact(n):
    proc = run_python([WORKERS / "local_transport_worker.py", str(n)], timeout=300)
    for r in _records(proc, n):
        assert r["name"] == "local"
        assert r["mismatches"] == [], r
        assert r["ints"] == [10 * p + r["rank"] for p in range(n)]
