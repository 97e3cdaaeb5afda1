"""What a training loop sees: loop time and host time per call, per op, array library and batch.

For every token count of ``--calls-tokens`` and array library of ``--calls-libs`` (CuPy arrays, and
PyTorch tensors when torch imports), each rank builds its workload in that library and times, per
op (layout; fresh dispatch BF16 and FP8 with top-k and weights; cached dispatch BF16 and FP8;
combine BF16 with weights; and the step an inference server captures, layout + dispatch with
``num_worst_tokens`` + combine, called eagerly and replayed from a CUDA graph:
:mod:`deepep_cupy.bench.graphs`), ``--calls-iters`` calls issued back to back after a warm-up:

* **loop time**: GPU time per call over the whole loop (events on the caller's stream around it;
  no L2 flush, no barrier between calls), so host stalls count: what a training loop sees;
* **host time**: the median wall time of the Python call; for a fresh dispatch also the part of it
  spent waiting for the receive counts (``Buffer.last_count_wait_s``).

The loops run in ``--calls-rounds`` rounds, each timing every library's ops in turn (A, B, A, B):
a host's speed can change between minutes (on a shared machine it does, by up to 2x), and
alternating gives both libraries the same conditions. Each figure is the median over the rounds,
then the maximum over ranks (a collective is as slow as its slowest rank).
:data:`DEEPEP_V1` holds DeepEP V1's figures on 2 x H200, measured with the same loop (issue
"PyTorch callers at full speed"), shown next to ours.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import tensors
from .graphs import STEP_OPS, step_ops
from .workload import make_workload

DEFAULT_CALLS_TOKENS = (128, 512, 1024, 2048, 4096, 8192)
OPS = ("layout", "dispatch BF16", "dispatch FP8", "cached dispatch BF16", "cached dispatch FP8",
       "combine BF16", "dispatch BF16 in place", "cached dispatch BF16 in place") + STEP_OPS

#: DeepEP V1 (commit 92fe2de) on 2 x H200, torch tensors, same loop: {op: {tokens: (loop us, host us)}}
#: (host None where it was not measured).
DEEPEP_V1: Dict[str, Dict[int, Tuple[float, Optional[float]]]] = {
    "layout": {128: (17, 15), 4096: (32, 24)},
    "dispatch BF16": {128: (70, None), 512: (101, None), 1024: (155, None), 4096: (450, None)},
    "dispatch FP8": {4096: (334, None)},
    "cached dispatch BF16": {128: (50, 47), 4096: (412, 54)},
    "cached dispatch FP8": {4096: (284, 57)},
    "combine BF16": {128: (45, 41), 4096: (490, 45)},
}


def available_libs(names: Sequence[str]) -> List[str]:
    """The libraries of ``names`` that import here (torch is optional)."""
    out = []
    for name in names:
        if name == "torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                continue
        out.append(name)
    return out


def device_arrays(lib: str, host: Dict[str, np.ndarray], device: int) -> Dict[str, Any]:
    """The workload as ``lib``'s device arrays (BF16 and FP8 in the library's own representation)."""
    if lib == "cupy":
        import cupy

        return {k: cupy.asarray(v) for k, v in host.items()}
    import torch

    dev = f"cuda:{device}"
    out = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in host.items()
           if k not in ("x", "x_fp8")}
    out["x"] = torch.from_numpy(host["x"].view(np.int16)).to(dev).view(torch.bfloat16)
    if "x_fp8" in host:
        out["x_fp8"] = torch.from_numpy(host["x_fp8"]).to(dev).view(torch.float8_e4m3fn)
    return out


def time_loop(fn: Callable[[], Any], stream_ptr: int, warmup: int, iters: int, barrier: Callable[[], None],
              wait_s: Optional[Callable[[], float]] = None) -> Dict[str, float]:
    """Loop and host time of ``fn`` (see the module docstring), in microseconds."""
    import cupy

    runtime = cupy.cuda.runtime
    for _ in range(warmup):
        fn()
    runtime.streamSynchronize(stream_ptr)
    barrier()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    hosts, waits = [], []
    runtime.eventRecord(start.ptr, stream_ptr)
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - t0)
        if wait_s is not None:
            waits.append(wait_s())
    runtime.eventRecord(end.ptr, stream_ptr)
    end.synchronize()
    out = {"loop_us": cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters,
           "host_us": float(np.median(hosts)) * 1e6}
    if waits:
        out["wait_us"] = float(np.median(waits)) * 1e6
        out["host_work_us"] = float(np.median(np.subtract(hosts, waits))) * 1e6
    return out


def bench_calls_rank(buf: Any, group: Any, args: Any, reference: Any, dispatch_config: Any,
                     combine_config: Any) -> Dict[str, Any]:
    """This rank's loop and host times for every (library, token count, op)."""
    import cupy

    device = cupy.cuda.Device().id
    E = args.num_experts
    d, c = dispatch_config, combine_config
    libs = available_libs(args.calls_libs)
    waits = lambda: buf.last_count_wait_s  # noqa: E731
    points = []
    for num_tokens in args.calls_tokens:
        host = make_workload(reference, args, group.rank, num_tokens)
        calls = {}
        for lib in libs:
            with _lib_stream(lib, device):
                a = device_arrays(lib, host, device)
                ops = _calls(buf, a, E, d, c)
                ops.update(step_ops(buf, lib, a, E, d, c, device, getattr(group, "in_process", False)))
                calls[lib] = ops
        rounds: Dict[str, Dict[str, List[Dict[str, float]]]] = {lib: {op: [] for op in OPS} for lib in libs}
        for _ in range(args.calls_rounds):
            for lib in libs:
                with _lib_stream(lib, device):
                    stream = tensors.library(lib).current_stream(device)
                    for op in OPS:
                        rounds[lib][op].append(time_loop(calls[lib][op], stream, args.calls_warmup, args.calls_iters,
                                                         group.barrier, waits if op.startswith("dispatch") else None))
        for lib in libs:
            points.append({"lib": lib, "num_tokens": num_tokens,
                           "ops": {op: _median_figures(rounds[lib][op]) for op in OPS}})
    return {"points": points}


def _median_figures(rounds: List[Dict[str, float]]) -> Dict[str, float]:
    """Each figure's median over the rounds."""
    return {key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}


def _calls(buf: Any, a: Dict[str, Any], num_experts: int, dispatch_config: Any, combine_config: Any
           ) -> Dict[str, Callable[[], Any]]:
    """Each op of :data:`OPS` but the steps as a call on the workload ``a`` (one fresh dispatch made
    for the handle)."""
    d, c = dispatch_config, combine_config
    fp8 = (a["x_fp8"], a["x_scales"])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(a["topk_idx"], num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=a["topk_idx"], topk_weights=a["topk_weights"])
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(a["x"], config=d, **layout)
    return {"layout": lambda: buf.get_dispatch_layout(a["topk_idx"], num_experts),
            "dispatch BF16": lambda: buf.dispatch(a["x"], config=d, **layout),
            "dispatch FP8": lambda: buf.dispatch(fp8, config=d, **layout),
            "cached dispatch BF16": lambda: buf.dispatch(a["x"], handle=handle, config=d),
            "cached dispatch FP8": lambda: buf.dispatch(fp8, handle=handle, config=d),
            "combine BF16": lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=c),
            "dispatch BF16 in place": lambda: buf.dispatch(a["x"], config=d, recv_x_in_buffer=True, **layout),
            "cached dispatch BF16 in place": lambda: buf.dispatch(a["x"], handle=handle, config=d,
                                                                  recv_x_in_buffer=True)}


class _lib_stream:
    """In-process ranks: run PyTorch on the rank's CuPy stream (its current stream is per thread)."""

    def __init__(self, lib: str, device: int):
        self.lib, self.device, self._context = lib, device, None

    def __enter__(self):
        import cupy

        stream = cupy.cuda.get_current_stream()
        if self.lib == "torch" and stream.ptr != 0:
            import torch

            self._context = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{self.device}"))
            self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self._context is not None:
            self._context.__exit__(*exc)
