"""Whether this process can use a CUDA GPU and, when it cannot, why, in one sentence.

The commands a user runs (``python -m deepep_cupy.bench``, the random-case soak, the examples,
the scripts) call :func:`exit_unless_gpu` first, so that a machine without a GPU, without a driver
or without CuPy ends in one sentence on stderr and exit status 2 instead of a traceback. The library
calls that need a GPU (``Buffer()``, ``run_local_group``) call :func:`require_gpu`, which raises
:class:`~deepep_cupy.errors.GpuUnavailableError` with the same sentence instead of CuPy's bare
CUDA error. The test harness reads :func:`probe` to say why its GPU tests skip. A leaf: it imports
only the package's exception types, and CuPy only when asked. (``deepep_cupy/driver_check.py`` asks
the driver without CuPy, for make.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from ..errors import GpuUnavailableError

#: The exit status of a command that found no usable GPU (1 is a failed check, as in pytest).
NO_GPU_EXIT_STATUS = 2


@dataclass(frozen=True)
class GpuProbe:
    """``count`` CUDA devices are visible; ``reason`` says why none can be used when the probe
    failed (it is None when the probe worked, even if it found 0). Not a NamedTuple: its ``count``
    would hide the tuple's method of that name."""

    count: int
    reason: Optional[str] = None


def _cuda_error_reason(exc: BaseException) -> str:
    """A clause naming what is missing, from the CUDA runtime's error (kept verbatim in brackets)."""
    text = str(exc)
    if "cudaErrorInsufficientDriver" in text:
        return f"the NVIDIA driver is missing or older than CuPy's CUDA runtime ({text})"
    if "cudaErrorNoDevice" in text:
        return f"the driver sees no CUDA GPU; check CUDA_VISIBLE_DEVICES ({text})"
    return f"the CUDA runtime cannot count the GPUs ({type(exc).__name__}: {text})"


def probe() -> GpuProbe:
    """Count the visible CUDA devices with CuPy; never raises."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU for us
        return GpuProbe(0, f"CuPy does not import ({type(exc).__name__}: {exc}); install the cuda12 or cuda13 "
                           f"extra")
    try:
        return GpuProbe(int(cupy.cuda.runtime.getDeviceCount()))
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError, or a driver library that fails to load
        return GpuProbe(0, _cuda_error_reason(exc))


def missing_gpu_reason(found: Optional[GpuProbe] = None) -> Optional[str]:
    """Why no CUDA GPU can be used (a clause without a final stop), or None when at least one can."""
    found = probe() if found is None else found
    if found.reason is not None:
        return found.reason
    if found.count < 1:
        return "no CUDA GPU is visible; check CUDA_VISIBLE_DEVICES"
    return None


def no_gpu_sentence(what: str, reason: str) -> str:
    """``"<what> needs a CUDA GPU, but <reason>."``: what every command and call says without one."""
    return f"{what} needs a CUDA GPU, but {reason}."


def require_gpu(what: str) -> int:
    """The number of usable CUDA devices (at least 1); raise :class:`GpuUnavailableError` saying
    that ``what`` needs a GPU, and why none is usable, when there is none."""
    found = probe()
    reason = missing_gpu_reason(found)
    if reason is not None:
        raise GpuUnavailableError(no_gpu_sentence(what, reason))
    return found.count


def exit_unless_gpu(program: str, say: bool = True) -> None:
    """Print ``"<program> needs a CUDA GPU, but <reason>."`` to stderr and exit with
    :data:`NO_GPU_EXIT_STATUS` when no GPU can be used; return when one can. ``say=False`` exits
    without printing: the ranks of an mpirun job but one, so that the job says it once."""
    reason = missing_gpu_reason()
    if reason is not None:
        if say:
            print(no_gpu_sentence(program, reason), file=sys.stderr, flush=True)
        raise SystemExit(NO_GPU_EXIT_STATUS)
