"""The copy-kernel ceiling: 16-byte-vector copies over NVLink peer access between two GPUs
(push, pull, both directions) and a copy-engine ``cudaMemcpyPeerAsync``."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..errors import DeepEPError
from ..gpu.sm_budget import sm_count_of
from .own_kernels import raw_kernel
from .timing import time_ops_multi
from .workload import gbps

# ----------------------------------------------------------------------------------------------
# Copy-kernel ceiling
# ----------------------------------------------------------------------------------------------

def _enable_peer(dev: int, peer: int) -> None:
    import cupy
    rt = cupy.cuda.runtime
    if not rt.deviceCanAccessPeer(dev, peer):
        raise DeepEPError(f"GPU {dev} cannot access GPU {peer} (no P2P)")
    with cupy.cuda.Device(dev):
        try:
            rt.deviceEnablePeerAccess(peer)
        except rt.CUDARuntimeError as exc:  # already enabled (e.g. by the library) is fine
            if "AlreadyEnabled" not in str(exc) and getattr(exc, "status", None) != 704:
                raise


def copy_ceiling(devices: Tuple[int, int], nbytes: int, sms_list: Sequence[int], iters: int,
                 warmup: int = 2) -> List[Dict[str, Any]]:
    """NVLink copy ceiling between two GPUs of this process.

    For each SM count: the kernel on GPU a writes a's buffer into b's memory (push, one direction),
    the kernel on b reads a's buffer (pull), and both GPUs push at once; plus
    ``cudaMemcpyPeerAsync`` (copy engine). Returns table rows (``op``, ``time_mean_us``, ``gbps``...).
    """
    import cupy
    a, b = devices
    _enable_peer(a, b)
    _enable_peer(b, a)
    n_vec = nbytes // 16
    nbytes = n_vec * 16
    bufs, kernels, streams, nsm = {}, {}, {}, {}
    for d in (a, b):
        with cupy.cuda.Device(d):
            bufs[d] = (cupy.ones(nbytes, dtype=cupy.uint8), cupy.zeros(nbytes, dtype=cupy.uint8))
            kernels[d] = raw_kernel("bench_copy.cu", "copy_int4")
            streams[d] = cupy.cuda.Stream(non_blocking=True)
            nsm[d] = sm_count_of(d)
            cupy.cuda.Device(d).synchronize()  # the fills ran on the default stream

    def launcher(run_on, src, dst, blocks):
        def go():
            with cupy.cuda.Device(run_on):
                kernels[run_on]((blocks,), (1024,), (np.uint64(src.data.ptr), np.uint64(dst.data.ptr),
                                                     np.uint64(n_vec)), stream=streams[run_on])
        return go

    rows = []
    for sms in sms_list:
        label = f"{sms} SMs" if sms < max(nsm.values()) else f"all {sms} SMs"
        cases = [
            (f"push GPU{a}->GPU{b}, {label}", [a], [launcher(a, bufs[a][0], bufs[b][1], sms)]),
            (f"pull GPU{a}->GPU{b}, {label}", [b], [launcher(b, bufs[a][0], bufs[b][1], sms)]),
            (f"push both directions, {label}", [a, b],
             [launcher(a, bufs[a][0], bufs[b][1], sms), launcher(b, bufs[b][0], bufs[a][1], sms)]),
        ]
        for name, on, fns in cases:
            times = time_ops_multi(lambda: [f() for f in fns], warmup, iters, [streams[d] for d in on], on)
            means = [float(np.mean(t)) for t in times]
            rows.append({"op": name, "time_mean_us": max(means) * 1e6,
                         "time_min_us": max(float(np.min(t)) for t in times) * 1e6,
                         "gbps": min(gbps(nbytes, m) for m in means),  # per direction
                         "gbps_total": gbps(nbytes * len(on), max(means))})

    def ce():
        with cupy.cuda.Device(a):
            cupy.cuda.runtime.memcpyPeerAsync(bufs[b][1].data.ptr, b, bufs[a][0].data.ptr, a, nbytes,
                                              streams[a].ptr)
    ce_times = time_ops_multi(ce, warmup, iters, [streams[a]], [a])[0]
    rows.append({"op": f"copy engine GPU{a}->GPU{b}", "time_mean_us": float(np.mean(ce_times)) * 1e6,
                 "time_min_us": float(np.min(ce_times)) * 1e6, "gbps": gbps(nbytes, float(np.mean(ce_times))),
                 "gbps_total": gbps(nbytes, float(np.mean(ce_times)))})
    bufs.clear()  # free the 2 x nbytes per GPU now
    return rows


def run_copy_ceiling(args: argparse.Namespace, devices: Sequence[int]) -> Dict[str, Any]:
    """Copy ceiling between the first two distinct GPUs, or ``{"skipped": reason}``."""
    if not args.copy:
        return {"skipped": "disabled by --no-copy"}
    distinct = list(dict.fromkeys(devices))
    if len(distinct) < 2:
        return {"skipped": "needs two visible GPUs"}
    try:
        a, b = distinct[0], distinct[1]
        sm_all = sm_count_of(a)
        sms = sorted({min(args.num_sms, sm_all), sm_all})
        rows = copy_ceiling((a, b), args.copy_mib * 1024 * 1024, sms, args.copy_iters)
        return {"skipped": None, "bytes": args.copy_mib * 1024 * 1024, "rows": rows}
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
