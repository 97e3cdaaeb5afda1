"""Markers and automatic skips, and the failure-worker runs that two test modules share.

* ``@pytest.mark.gpu`` (or ``gpu(n)``): needs at least 2 (or ``n``) CUDA devices; skipped when
  there are fewer (``cupy.cuda.runtime.getDeviceCount()`` fails or is too small). A test marked
  ``mpi`` too needs one device in all under ``DEEPEP_TEST_ONE_GPU_MPI=1`` (``_harness.ONE_GPU_MPI``).
* ``@pytest.mark.mpi``: needs an ``mpiexec``/``mpirun`` (see ``_harness.find_mpiexec``); skipped
  when there is none, except under CI (``CI=true``), where that is a failure.
* ``failure_results`` / ``local_failure_results``: one run per session of the failure cases,
  under mpiexec (tests/workers/failure_worker.py) and with both ranks in one process
  (tests/workers/local_failure_worker.py): ``(records by case, CompletedProcess)``.
"""

from __future__ import annotations

import pytest
from _harness import (
    WORKERS,
    find_mpiexec,
    gpu_count,
    gpus_needed_under_mpiexec,
    records_by,
    run_mpi,
    run_python,
    skip_or_fail,
    skip_unless_gpus_for_mpiexec,
)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n=2): needs at least n CUDA devices (skipped otherwise)")
    config.addinivalue_line("markers", "mpi: runs worker processes under mpiexec/mpirun")


def _needed_gpus(marker) -> int:
    if marker.args:
        return int(marker.args[0])
    return int(marker.kwargs.get("n", 2))


def pytest_runtest_setup(item):
    gpu, mpi = item.get_closest_marker("gpu"), item.get_closest_marker("mpi")
    if gpu is not None:
        need, have = _needed_gpus(gpu), gpu_count()
        if mpi is not None:
            need = gpus_needed_under_mpiexec(need)
        if have < need:
            pytest.skip(f"needs {need} GPUs, found {have}")
    if mpi is not None and find_mpiexec() is None:
        skip_or_fail("no mpiexec/mpirun found (set MPIEXEC, or install the 'test' extra: mpich)")


@pytest.fixture(scope="session")
def failure_results():
    skip_unless_gpus_for_mpiexec(2)
    run = run_mpi(2, [WORKERS / "failure_worker.py"], timeout=900)
    return records_by(run.stdout, "case"), run


@pytest.fixture(scope="session")
def local_failure_results():
    # A subprocess with a wall-clock limit, so that a hang cannot hang pytest.
    run = run_python([WORKERS / "local_failure_worker.py"], timeout=300)
    return records_by(run.stdout, "case"), run
