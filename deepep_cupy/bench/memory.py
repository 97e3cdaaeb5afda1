"""Peak device memory an op's calls take per rank, as the benchmark reports it beside the times.

The outputs, handles and the next call's prepared outputs of a Buffer's calls come from CuPy's
memory pool (the benchmark's arrays are CuPy's). A memory hook on the rank's thread counts the
bytes the pool hands out and takes back while an op is timed; its peak is what the op's calls
hold at most at once, above what was in use when timing began (the NVLink buffer, allocated once,
is reported apart as ``nvl_bytes``).
"""

from __future__ import annotations

from typing import Any


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
