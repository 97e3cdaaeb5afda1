"""The benchmark's own CUDA kernels, in ``deepep_cupy/bench/kernels/``: the copy-kernel ceiling's
copy, the NCCL baseline's row gather and the SM-rate probe of scripts/sm_rates_probe.py.

They are no library kernels: not in :data:`deepep_cupy.gpu.kernels.SOURCES`, never warmed up by a
Buffer, shipped as the bench's package data rather than in ``deepep_cupy/_kernels``. Each is
``extern "C"`` and compiled by its user with ``cupy.RawKernel`` / ``cupy.RawModule``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict

from ..constants import cuda_header
from ..gpu import kernels

#: The folder of the benchmark's kernel sources (next to this module, in a checkout or a wheel).
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def read_source(name: str) -> str:
    """The text of ``name`` (a file of :data:`KERNEL_DIR`) with every local ``#include "..."``
    inlined, each header once: a header of this folder, else one of the library's (``common.cuh``
    and the rest of :func:`deepep_cupy.gpu.kernels.kernel_dir`, ``constants.cuh`` generated)."""
    seen: set = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        if file_name == kernels.GENERATED_HEADER:
            return cuda_header()
        own = KERNEL_DIR / file_name
        text = (own if own.is_file() else kernels.kernel_dir() / file_name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


_RAW_KERNELS: Dict[str, Any] = {}


def raw_kernel(file_name: str, name: str):
    """The ``cupy.RawKernel`` ``name`` of the bench kernel source ``file_name``, compiled once (CuPy
    builds it for each device on its first launch there)."""
    import cupy

    if name not in _RAW_KERNELS:
        _RAW_KERNELS[name] = cupy.RawKernel(read_source(file_name), name)
    return _RAW_KERNELS[name]
