"""Peak device memory an op's calls take per rank, as the benchmark reports it beside the times.

The outputs, handles and the next call's prepared outputs of a Buffer's calls come from CuPy's
memory pool (the benchmark's arrays are CuPy's). A memory hook on the rank's thread counts the
bytes the pool hands out and takes back over :data:`PEAK_MEMORY_CALLS` calls of an op, made after
its timed calls (the hook's Python runs at every allocation, which the times must not include);
its peak is what the op's calls hold at most at once, above what was in use before them (the
NVLink buffer, allocated once, is reported apart as ``nvl_bytes``).
"""

from __future__ import annotations

from typing import Any

#: Calls of an op whose allocations the hook counts: in a steady loop a call holds its outputs and
#: the next call's, so two show the peak; one more for the outputs a call lets go late.
PEAK_MEMORY_CALLS = 3


def peak_pool_bytes() -> Any:
    """A context manager counting, on this thread, the pool bytes in use since it was entered and
    their peak (``.peak_bytes``)."""
    from cupy.cuda import memory_hook

    class PeakPoolBytes(memory_hook.MemoryHook):
        name = "deepep_cupy_peak_pool_bytes"

        def __init__(self):
            self.in_use = self.peak_bytes = 0

        def malloc_postprocess(self, **kwargs):
            self.in_use += kwargs["mem_size"]
            self.peak_bytes = max(self.peak_bytes, self.in_use)

        def free_postprocess(self, **kwargs):
            self.in_use -= kwargs["mem_size"]

    return PeakPoolBytes()
