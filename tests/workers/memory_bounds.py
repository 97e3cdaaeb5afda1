"""What a fresh dispatch may allocate, computed from what a test itself knows, and the device
memory it measures (issue 36: allocation ahead never exceeds a bound).

The bound (``deepep_cupy/intranode/capacity.py``): a dispatch allocating ahead of its receive count
allocates at most ``min(with_headroom(largest receive count seen), most_rows)`` rows, where the
largest count is that of the fresh dispatches *before* it (with exact rows: ``num_worst_tokens``
calls are not counted) and ``most_rows = num_ranks * region_tokens`` (the regions of the call's
plan in the Buffer's NVLink bytes). A call whose guess is above it allocates exactly, i.e. its
receive count. A steady call (same plan and token count as the fresh dispatch before it) may take
outputs that call prepared: an eighth more than its guess (``next_outputs.prepared_rows``). So:

    rows allocated <= max(exact count, bound)            (bound: prepared_rows(bound) when steady)

and during the call the device holds at most the exact outputs, the rows allocated ahead (freed
only once a call redone with exact rows has its own), and the next call's outputs
(``next_outputs.MAX_BYTES``, per Buffer):

    peak - before <= exact output bytes + bound x row bytes + MAX_BYTES + PEAK_SLACK_BYTES

Plain Python, importable without a GPU (the CPU tests check it); :class:`CupyMemoryCounter` and
:class:`TorchPeak` measure on the device.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from deepep_cupy.config import Config
from deepep_cupy.constants import FP8_SCALE_BLOCK
from deepep_cupy.gpu import layout  # noqa: E402
from deepep_cupy.intranode.capacity import with_headroom
from deepep_cupy.intranode.next_outputs import MAX_BYTES, prepared_rows

#: Allocations a dispatch makes besides its outputs (a plan's refusal scratch, allocator rounding).
PEAK_SLACK_BYTES = 16 << 20
INT_BYTES = 4
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def num_scales(dtype: str, hidden: int) -> int:
    """FP8 scales per token of the workers' FP8 rows (``[N, hidden / 128]``); 0 for the others."""
    return hidden // FP8_SCALE_BLOCK if dtype == "float8_e4m3fn" else 0


def output_row_bytes(dtype: str, hidden: int, num_topk: int, with_weights: bool) -> int:
    """Bytes a fresh dispatch allocates per received row: the row, its scales, top-k ids (int64)
    and weights (float32), and its source index (int32)."""
    return (hidden * ITEMSIZE[dtype] + INT_BYTES * num_scales(dtype, hidden) + 8 * num_topk
            + (INT_BYTES * num_topk if with_weights else 0) + INT_BYTES)


def handle_bytes(num_ranks: int, num_channels: int, num_tokens: int) -> int:
    """Bytes of a handle's arrays besides the source indices: the prefix matrices and send_head."""
    return INT_BYTES * (num_ranks * num_ranks + 2 * num_ranks * num_channels + num_tokens * num_ranks)


def exact_output_bytes(rows: int, row_bytes: int, num_ranks: int, num_channels: int, num_tokens: int) -> int:
    """Bytes of a fresh dispatch's outputs and handle with exactly ``rows`` received rows."""
    return rows * row_bytes + handle_bytes(num_ranks, num_channels, num_tokens)


@functools.lru_cache(maxsize=1024)
def most_rows(num_ranks: int, config: Config, dtype: str, hidden: int, num_topk: int, nvl_bytes: int) -> int:
    """The most rows a rank can receive in a dispatch (without rows in place): ``num_ranks`` x the
    slots of a region of the largest transfer layout that fits the Buffer."""
    make = functools.partial(layout.dispatch_layout, num_ranks, config.num_channels,
                             row_bytes=hidden * ITEMSIZE[dtype], num_topk=num_topk,
                             num_scales=num_scales(dtype, hidden), rows_in_buffer=False)
    fitting = layout.largest_fitting(make, nvl_bytes)
    if fitting is None:
        raise ValueError(f"{nvl_bytes} NVLink bytes hold no {dtype} row of hidden {hidden}")
    return num_ranks * fitting.region_tokens


def ahead_bound(largest_before: int, most: int, steady: bool = False) -> int:
    """The most rows a dispatch may allocate ahead of its count, after fresh dispatches that
    received at most ``largest_before`` rows; ``steady``: the call may take outputs prepared by a
    call like it (an eighth more)."""
    bound = min(with_headroom(largest_before), most)
    return prepared_rows(bound) if steady else bound


def allowed_rows(exact: int, largest_before: int, most: int, steady: bool = False) -> int:
    """The most rows a fresh dispatch that receives ``exact`` rows may allocate (module docstring)."""
    return max(exact, ahead_bound(largest_before, most, steady))


def peak_limit(exact_bytes: int, bound_bytes: int, num_buffers: int = 1) -> int:
    """The most device bytes ``num_buffers`` Buffers' dispatches (one each, at once on one device)
    may add: their exact outputs, their rows allocated ahead, the outputs each prepares for its
    next call, and some slack."""
    return exact_bytes + bound_bytes + num_buffers * MAX_BYTES + PEAK_SLACK_BYTES


# ---------------------------------------------------------------------------------------------
# Measuring


class CupyMemoryCounter:
    """Counts the bytes a CuPy allocator hands out and still has out, and their peak.

    :meth:`wrap` returns an allocator (``cupy.cuda.using_allocator``) that allocates with ``malloc``
    and counts; several threads (ranks sharing a GPU, and so its pool) may use one counter. An
    allocation is counted until the last view of it is gone: the memory handed out is an
    ``UnownedMemory`` owning a tracker, which gives the bytes back when it is collected.
    """

    def __init__(self) -> None:
        # Reentrant: a collection inside a count may give bytes back on the same thread.
        self._lock = threading.RLock()
        self.in_use = 0
        self.peak = 0

    def reset_peak(self) -> int:
        """Start a new peak from the bytes in use now; returns them."""
        with self._lock:
            self.peak = self.in_use
            return self.in_use

    def _add(self, num_bytes: int) -> None:
        with self._lock:
            self.in_use += num_bytes
            self.peak = max(self.peak, self.in_use)

    def _remove(self, num_bytes: int) -> None:
        with self._lock:
            self.in_use -= num_bytes

    def wrap(self, malloc: Callable[[int], Any]) -> Callable[[int], Any]:
        from cupy.cuda import memory

        counter = self

        class _Tracked:
            __slots__ = ("pointer", "size")

            def __init__(self, pointer, size):
                self.pointer, self.size = pointer, size
                counter._add(size)

            def __del__(self):
                counter._remove(self.size)

        def counted_malloc(size: int):
            pointer = malloc(size)
            if size == 0:
                return pointer
            tracked = _Tracked(pointer, size)
            return memory.MemoryPointer(memory.UnownedMemory(pointer.ptr, size, tracked, pointer.device_id), 0)

        return counted_malloc


class TorchPeak:
    """PyTorch's caching-allocator statistics of one device (shared by every thread of the process)."""

    def __init__(self, device: int) -> None:
        self.device = device

    def reset_peak(self) -> int:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    @property
    def peak(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device))
