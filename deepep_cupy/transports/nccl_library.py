"""CuPy's NCCL bindings with libnccl loaded: the one loader of the rail transport and of the
benchmark's NCCL baseline, so that both find the same library or both say why not."""
import glob
import importlib
import os
import sys
import warnings
from typing import Any, List, Optional

from ..errors import NcclUnavailable

NCCL_LIB_ENV = "DEEPEP_CUPY_NCCL_LIB"
NO_NCCL_HINT = (f"CuPy cannot load libnccl here (pip install nvidia-nccl-cu12 or -cu13, or set "
                f"{NCCL_LIB_ENV}=/path/libnccl.so.2)")

_loaded: Optional[Any] = None


def _candidate_paths() -> List[str]:
    """:data:`NCCL_LIB_ENV` first, then the libnccl of pip's NVIDIA wheels and of PyTorch."""
    paths = [os.environ.get(NCCL_LIB_ENV, "")]
    for entry in sys.path:
        for pattern in (("nvidia", "nccl", "lib"), ("nvidia", "cu*", "lib"), ("torch", "lib")):
            paths += sorted(glob.glob(os.path.join(entry, *pattern, "libnccl.so*")))
    return [p for p in paths if p]


def load_nccl() -> Any:
    """``cupy.cuda.nccl``, or, where CuPy cannot find libnccl itself, CuPy's bindings after loading
    the first of :func:`_candidate_paths` that loads.

    Raises:
        NcclUnavailable: no libnccl loads; the message names what was tried.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # CuPy warns when libnccl is missing; the error below says it
        from cupy.cuda import nccl
    if getattr(nccl, "available", False) and hasattr(nccl, "NcclCommunicator"):
        _loaded = nccl
        return nccl
    import ctypes

    errors = []
    for path in _candidate_paths():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _loaded = importlib.import_module("cupy_backends.cuda.libs.nccl")
            return _loaded
        except (OSError, ImportError) as exc:
            errors.append(f"{path}: {exc}")
    raise NcclUnavailable(NO_NCCL_HINT + (f"; tried {errors[:3]}" if errors else ""))


def nccl_or_none() -> Optional[Any]:
    """:func:`load_nccl`, or None where it raises."""
    try:
        return load_nccl()
    except NcclUnavailable:
        return None
