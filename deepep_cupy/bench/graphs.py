"""One MoE step (layout, a dispatch with ``num_worst_tokens``, combine) called eagerly and replayed
from a CUDA graph, for the loop benchmark (:mod:`deepep_cupy.bench.calls`).

The step is what an inference server captures: a dispatch that never waits for the host, sized for
every token of every rank. The graph is captured once per array library and token count, after a
warm-up call (plans, kernels and allocator pools made outside the capture; CuPy's on the capture
stream itself), on a capture stream of its own (``torch.cuda.graph``; CuPy's
``Stream.begin_capture``), in thread-local mode when the ranks are threads of one process (there
PyTorch's ``CUDAGraph.capture_begin``, without the device-wide synchronization of
``torch.cuda.graph``). A replay launches on the caller's current stream.

While any thread captures, Python's cyclic garbage collector is held off
(:func:`deepep_cupy.gpu.device_pools.collector_held`, which says why).
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from ..gpu.device_pools import collector_held

#: The two ops this module adds to the loop benchmark.
STEP_OPS = ("step eager", "step graph replay")


def step(buf: Any, a: Dict[str, Any], num_experts: int, dispatch_config: Any, combine_config: Any
         ) -> Callable[[], Any]:
    """The step on the workload ``a`` (``x``, ``topk_idx``, ``topk_weights``) as one call."""
    worst = a["x"].shape[0] * buf.num_ranks

    def run():
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(a["topk_idx"], num_experts)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            a["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=a["topk_idx"], topk_weights=a["topk_weights"], num_worst_tokens=worst, config=dispatch_config)
        return buf.combine(recv_x, handle, topk_weights=recv_w, config=combine_config)

    return run


class Replay:
    """``fn`` captured once into a CUDA graph, after one call outside the capture; calling the
    object replays it on the current stream. ``outputs``: what the captured call returned (the
    graph writes into them on every replay)."""

    #: A ``torch.cuda.CUDAGraph`` or a ``cupy.cuda.Graph``, as ``lib`` says: the two have no common type.
    graph: Any

    def __init__(self, lib: str, fn: Callable[[], Any], device: int, thread_local: bool):
        self.lib = lib
        if lib == "torch":
            import torch

            fn()
            caller = torch.cuda.current_stream(device)
            caller.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            if not thread_local:
                with collector_held(), torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device)):
                    self.outputs = fn()
                return
            # torch.cuda.graph synchronizes the whole device and empties the cache on entry, which
            # fails, and breaks the capture, while a rank thread sharing the GPU is capturing already.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(caller)
            with collector_held(), torch.cuda.stream(stream):
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.outputs = fn()
                finally:
                    self.graph.capture_end()
        else:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            capture = cupy.cuda.Stream(non_blocking=True)
            with capture:
                # CuPy's pool keeps freed blocks per stream: one call on the capture stream first
                # leaves the blocks that the capture then takes without a cudaMalloc.
                fn()
                capture.synchronize()
                with collector_held():
                    capture.begin_capture(cupy.cuda.runtime.streamCaptureModeThreadLocal if thread_local else None)
                    try:
                        self.outputs = fn()
                    finally:
                        self.graph = capture.end_capture()

    def __call__(self) -> None:
        if self.lib == "torch":
            self.graph.replay()
        else:
            import cupy

            self.graph.launch(cupy.cuda.get_current_stream())


def step_ops(buf: Any, lib: str, a: Dict[str, Any], num_experts: int, dispatch_config: Any, combine_config: Any,
             device: int, thread_local: bool) -> Dict[str, Callable[[], Any]]:
    """:data:`STEP_OPS` as calls: the eager step and its replay."""
    eager = step(buf, a, num_experts, dispatch_config, combine_config)
    return {"step eager": eager, "step graph replay": Replay(lib, eager, device, thread_local)}
