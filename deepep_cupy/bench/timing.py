"""Timing between CUDA events, the L2 flush before each timed call, and a progress counter."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, List, Optional, Sequence

#: Bytes zeroed before every timed call so that no call finds its inputs in L2.
L2_FLUSH_BYTES = 256 * 1024 * 1024


def interpreter_us(repeats: int = 2000) -> float:
    """Median microseconds of ``sum(range(200))`` in this process: how fast its host runs Python.

    Host times follow it: on one GPU machine it went from 1.1 to 2.5 us between processes, and the
    host times with it (docs/PERFORMANCE.md, issue 36), so two runs' host times compare only beside it.
    """
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sum(range(200))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def make_l2_flush(enabled: bool) -> Optional[Callable[[], None]]:
    """A callable that zeroes 256 MB on the current stream of the current device (or ``None``)."""
    if not enabled:
        return None
    import cupy
    scratch = cupy.empty(L2_FLUSH_BYTES, dtype=cupy.uint8)
    return lambda: scratch.data.memset_async(0, L2_FLUSH_BYTES)


def time_ops_multi(fn: Callable[[], Any], warmup: int, iters: int, streams: Sequence[Any],
                   devices: Sequence[int], flushes: Optional[Sequence[Optional[Callable]]] = None
                   ) -> List[List[float]]:
    """Time ``fn`` between events recorded on several devices' streams (one thread drives them all).

    Returns:
        Per stream, ``iters`` elapsed times in seconds.
    """
    import cupy
    for _ in range(warmup):
        fn()
    events = []
    for dev in devices:
        with cupy.cuda.Device(dev):
            events.append([(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)])
    for i in range(iters):
        for k, (dev, stream) in enumerate(zip(devices, streams)):
            with cupy.cuda.Device(dev):
                flush = flushes[k] if flushes else None
                if flush is not None:
                    with stream:
                        flush()
                events[k][i][0].record(stream)
        fn()
        for k, (dev, stream) in enumerate(zip(devices, streams)):
            with cupy.cuda.Device(dev):
                events[k][i][1].record(stream)
    out = []
    for k, dev in enumerate(devices):
        with cupy.cuda.Device(dev):
            events[k][-1][1].synchronize()
            out.append([cupy.cuda.get_elapsed_time(s, e) * 1e-3 for s, e in events[k]])
    return out


def time_op(fn: Callable[[], Any], warmup: int, iters: int, stream: Any,
            flush: Optional[Callable[[], None]] = None) -> List[float]:
    """Call ``fn`` ``warmup`` times, then ``iters`` times between CUDA events on ``stream``.

    ``stream`` must be the stream ``fn``'s work is ordered on (the caller's current stream for the
    library in sync mode) and belong to the current device. ``flush`` runs before each start event.

    Returns:
        ``iters`` elapsed times in seconds.
    """
    import cupy
    return time_ops_multi(fn, warmup, iters, [stream], [cupy.cuda.Device().id], [flush])[0]


class _Progress:
    """A progress counter on stderr (tqdm when importable); silent when ``enabled`` is false."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.n, self._bar = total, desc, enabled, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except Exception:
                self._bar = None

    def update(self, note: str = "") -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        else:
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} {note:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()
