"""Markers and automatic skips, and the failure-worker runs that two test modules share.

* ``@pytest.mark.gpu`` (or ``gpu(n)``): needs at least 2 (or ``n``) CUDA devices; skipped when
  there are fewer, the reason saying how many were found and, when the probe failed
  (``deepep_cupy.gpu.check.probe``: no CuPy, no driver, ...), why: "needs 2 GPUs, found 0: the
  NVIDIA driver is missing ...". A test marked ``mpi`` too needs one device in all under
  ``DEEPEP_TEST_ONE_GPU_MPI=1`` (``_harness.ONE_GPU_MPI``).
* ``DEEPEP_TEST_REQUIRE_GPUS=N``: the run promises N usable GPUs. A GPU test that needs ``need``
  GPUs and finds ``have < need`` then fails instead of skipping when ``have < min(N, need)``, i.e.
  when the machine has fewer GPUs than it promised and the test needed them; a probe that failed
  counts as 0 found, so with N >= 1 it fails every GPU test, saying why. Tests that need more than
  N GPUs still skip when there are fewer than they need. Unset or 0: too few GPUs is a skip. The
  GPU runs of the issues set it (``DEEPEP_TEST_REQUIRE_GPUS=2 make test`` on two GPUs).
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
    gpus_needed_under_mpiexec,
    records_by,
    run_mpi,
    run_python,
    skip_or_fail,
    skip_unless_gpus,
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
        need = _needed_gpus(gpu)
        skip_unless_gpus(gpus_needed_under_mpiexec(need) if mpi is not None else need)
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
