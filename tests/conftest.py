"""Markers and automatic skips.

* ``@pytest.mark.gpu`` (or ``gpu(n)``): needs at least 2 (or ``n``) CUDA devices; skipped when
  there are fewer (``cupy.cuda.runtime.getDeviceCount()`` fails or is too small).
* ``@pytest.mark.mpi``: needs an ``mpiexec``/``mpirun`` (see ``_harness.find_mpiexec``); skipped
  when there is none, except under CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import pytest
from _harness import find_mpiexec, gpu_count, skip_or_fail


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(n=2): needs at least n CUDA devices (skipped otherwise)")
    config.addinivalue_line("markers", "mpi: runs worker processes under mpiexec/mpirun")


def _needed_gpus(marker) -> int:
    if marker.args:
        return int(marker.args[0])
    return int(marker.kwargs.get("n", 2))


def pytest_runtest_setup(item):
    gpu = item.get_closest_marker("gpu")
    if gpu is not None:
        need, have = _needed_gpus(gpu), gpu_count()
        if have < need:
            pytest.skip(f"needs {need} GPUs, found {have}")
    if item.get_closest_marker("mpi") is not None and find_mpiexec() is None:
        skip_or_fail("no mpiexec/mpirun found (set MPIEXEC, or install the 'test' extra: mpich)")
