"""The kernels as the timeline scripts compile them (kernel_timeline.py, decode_timeline.py).

:func:`compile_patched` makes every kernel source pass through ``patch`` before NVRTC sees it, and
keeps each compiled module by the kernel instances it was made for, so that a script can read its
stamp tables (``__device__`` globals) from it. For the rest of the process: a script's whole run.
"""
from __future__ import annotations

from typing import Callable, Dict


def compile_patched(patch: Callable[[str, str], str]) -> Dict[str, object]:
    """Patch the kernel sources with ``patch(file name, source)``; returns ``{instance: module}``,
    filled as the kernels are compiled."""
    import cupy

    from deepep_cupy.gpu import kernels

    plain_source = kernels.read_source
    kernels.read_source = lambda name: patch(name, plain_source(name))
    modules: Dict[str, object] = {}
    plain_module = cupy.RawModule

    class RecordedModule(plain_module):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            for expression in k.get("name_expressions", ()):
                modules[expression] = self

    cupy.RawModule = RecordedModule
    return modules
