"""Whether an NVIDIA driver is installed and sees a GPU, asked with the standard library alone.

make runs this file as a script (``python3 deepep_cupy/driver_check.py "make bench"``) before a
target that needs a GPU creates ``.venv`` or installs anything: a machine without a GPU is told so
in one sentence at once, not after a download of a GB or more. It loads the driver's own library
(libcuda) through ctypes and imports nothing else, neither CuPy nor NumPy nor this package, so any
Python 3 runs it. :mod:`deepep_cupy.gpu.check` asks the same question through CuPy once it is there.
"""

import ctypes
import sys
from typing import Any, Callable, Optional

#: The exit status of a command that found no usable GPU (deepep_cupy.gpu.check.NO_GPU_EXIT_STATUS).
NO_GPU_EXIT_STATUS = 2

#: The CUDA driver API's "no CUDA-capable device is detected".
CUDA_ERROR_NO_DEVICE = 100


def missing_driver_reason(load: Callable[[str], Any] = ctypes.CDLL) -> Optional[str]:
    """Why the NVIDIA driver cannot run CUDA here (a clause without a final stop), or None when it
    sees at least one GPU. ``load`` opens a shared library (tests pass a stand-in): its functions,
    C functions of the driver API, are found by name when called, so it has no static type."""
    try:
        libcuda = load("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver is installed (libcuda.so.1 does not load)"
    status = libcuda.cuInit(0)
    if status == CUDA_ERROR_NO_DEVICE:
        return "the NVIDIA driver sees no GPU; check CUDA_VISIBLE_DEVICES"
    if status != 0:
        return f"the NVIDIA driver does not start (cuInit returned CUDA error {status})"
    count = ctypes.c_int(0)
    status = libcuda.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        return f"the NVIDIA driver cannot count the GPUs (cuDeviceGetCount returned CUDA error {status})"
    if count.value < 1:
        return "the NVIDIA driver sees no GPU; check CUDA_VISIBLE_DEVICES"
    return None


def exit_unless_driver(program: str) -> None:
    """Print ``"<program> needs a CUDA GPU, but <reason>."`` (deepep_cupy.gpu.check's form) to stderr
    and exit with :data:`NO_GPU_EXIT_STATUS` when the driver sees no GPU; return when it does."""
    reason = missing_driver_reason()
    if reason is not None:
        print(f"{program} needs a CUDA GPU, but {reason}.", file=sys.stderr, flush=True)
        raise SystemExit(NO_GPU_EXIT_STATUS)


if __name__ == "__main__":
    exit_unless_driver(sys.argv[1] if len(sys.argv) > 1 else "this command")
