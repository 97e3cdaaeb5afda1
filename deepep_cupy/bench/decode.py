"""The decode table of ``python -m deepep_cupy.bench --decode``: DeepEP's low-latency calls.

Per token count (``--decode-tokens``, default 1, 32, 64, 128, 256 per rank): a low-latency Buffer
sized for the largest count, FP8 dispatch (in-kernel cast) and BF16 combine, each captured in a
CUDA graph (CuPy) and replayed back to back. Figures per rank, medians over the ranks:

* dispatch / combine: GPU time per replay (events around ``--iters`` replays of that op alone);
* step host: median wall time of launching one replay of the whole step (dispatch, combine);
* bytes: what the rank receives, DeepEP's accounting: dispatch rows x (hidden + hidden / 128 x 4)
  (FP8 plus scales), combine rows x hidden x 2 (BF16).

A second table gives the same calls made eagerly, per library (CuPy, and PyTorch when it imports):
loop time (GPU time per call over ``--iters`` calls back to back) and host time (median wall time
of one call from Python). The eager calls pass ``async_finish=True`` and make the caller's stream
wait for the returned event, as a decode step that overlaps them does: a synchronous call of ranks
sharing a GPU in one process returns only once its kernels are over (deepep_cupy/gpu/streams.py),
which would put the kernels' time into the host time and the host time into the loop. Rank threads
of one process also share one interpreter, so while both call, each call's wall time holds the
other thread's Python too: "host alone" is the median of up to 20 calls made while the other
ranks wait at a barrier, rank after rank (their kernels wait on the GPU for the peers' calls, which
come in the peers' turns): the Python call as one process per GPU would see it.

The ranks run in this process (one per visible GPU, or ``--num-ranks`` sharing them).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

DEFAULT_DECODE_TOKENS = (1, 32, 64, 128, 256)
#: Calls a rank makes alone in its turn: their kernels wait on the GPU for the peers' turns, so a
#: turn queues them all; a few dozen keep the queue short.
HOST_ALONE_CALLS = 20


def decode_bytes(recv_rows: int, hidden: int) -> Dict[str, int]:
    """Bytes a rank receives for ``recv_rows`` (token, expert) rows: FP8 dispatch, BF16 combine."""
    return {"dispatch": recv_rows * (hidden + hidden // 128 * 4), "combine": recv_rows * hidden * 2}


def _rank(group, args, token_counts: Sequence[int]) -> Dict[str, List[Dict[str, Any]]]:
    import cupy

    import deepep_cupy as ep

    from .calls import _lib_stream, available_libs

    R, hidden, E = group.size, args.hidden, args.num_experts
    largest = max(token_counts)
    buf = ep.Buffer(group, 0, ep.Buffer.get_low_latency_rdma_size_hint(largest, hidden, R, E),
                    low_latency_mode=True, timeout_s=args.timeout)
    lib, device = _graph_library(), cupy.cuda.Device().id
    try:
        with _lib_stream(lib, device):
            graphs = [_measure(group, buf, args, n, largest, lib) for n in token_counts]
        eager = []
        for eager_lib in available_libs(("cupy", "torch")):
            with _lib_stream(eager_lib, device):
                eager += [_measure_eager(group, buf, args, n, largest, eager_lib) for n in token_counts]
        return {"graphs": graphs, "eager": eager}
    finally:
        group.barrier()
        buf.destroy()


def _graph_library() -> str:
    """PyTorch's graphs when it imports: CuPy cannot allocate inside a capture from the async memory
    pool that in-process ranks sharing a GPU use (deepep_cupy/gpu/device_pools.py)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "cupy"
    return "torch"


def decode_inputs(group, args, n: int, largest: int, lib: str) -> Tuple[Any, Any, Any, Any]:
    """This rank's ``x``, ``topk_idx``, ``topk_weights`` for ``n`` tokens and the experts' output
    rows ``y`` (BF16, sized for ``largest``), as ``lib``'s arrays on the current device."""
    import cupy

    from deepep_cupy.reference import intranode as ref

    from .calls import device_arrays

    R, rank, hidden, E, K = group.size, group.rank, args.hidden, args.num_experts, args.num_topk
    device = cupy.cuda.Device().id
    rng = np.random.default_rng(args.seed * 1000 + rank * 17 + n)
    a = device_arrays(lib, {"x": ref.float32_to_bfloat16_bits(rng.standard_normal((n, hidden), dtype=np.float32)),
                            "topk_idx": ref.random_routing(rng, n, E, K),
                            "topk_weights": rng.random((n, K), dtype=np.float32)}, device)
    # The experts' output rows (BF16, as device_arrays makes "x").
    y = device_arrays(lib, {"x": np.zeros((E // R, R * largest, hidden), np.uint16)}, device)["x"]
    return a["x"], a["topk_idx"], a["topk_weights"], y


def decode_graphs(group, buf, args, n: int, largest: int, lib: str) -> Tuple[Dict[str, Any], int]:
    """The captured calls of one row (``dispatch``, ``combine``, ``step``: :class:`.graphs.Replay`)
    on ``n`` tokens, sized for ``largest``, and the rows this rank receives."""
    import cupy

    from .graphs import Replay

    E = args.num_experts
    stream = cupy.cuda.get_current_stream()
    device = cupy.cuda.Device().id
    x, topk, weights, y = decode_inputs(group, args, n, largest, lib)
    state = {}

    def dispatch():
        state["out"] = buf.low_latency_dispatch(x, topk, largest, E, use_fp8=True)
        return state["out"]

    def combine():
        return buf.low_latency_combine(y, topk, weights, state["out"][2])

    def step():
        dispatch()
        return combine()

    graphs = {}
    for name, fn in (("dispatch", dispatch), ("combine", combine), ("step", step)):
        group.barrier()
        graphs[name] = Replay(lib, fn, device, thread_local=group.in_process)
        if name == "dispatch":
            # The captured dispatch's handle, which the combine graph reads, is written by a replay.
            group.barrier()
            graphs[name]()
            stream.synchronize()
    recv_rows = int(cupy.asnumpy(cupy.asarray(graphs["dispatch"].outputs[1])).sum())
    return graphs, recv_rows


def _measure(group, buf, args, n: int, largest: int, lib: str) -> Dict[str, Any]:
    """One row of the table on this rank: ``n`` tokens, calls sized for ``largest``."""
    import cupy

    from .calls import time_loop

    stream = cupy.cuda.get_current_stream()
    graphs, recv_rows = decode_graphs(group, buf, args, n, largest, lib)
    figures: Dict[str, float] = {"tokens": n}
    figures.update({f"{k}_bytes": v for k, v in decode_bytes(recv_rows, args.hidden).items()})
    for name in ("dispatch", "combine"):
        figures[f"{name}_us"] = time_loop(graphs[name], stream.ptr, args.warmup, args.iters, group.barrier)["loop_us"]
    figures["step_host_us"] = time_loop(graphs["step"], stream.ptr, args.warmup, args.iters, group.barrier)["host_us"]
    group.barrier()
    return figures


def _measure_eager(group, buf, args, n: int, largest: int, lib: str) -> Dict[str, Any]:
    """One row of the eager table on this rank: ``lib``'s arrays, ``n`` tokens, calls sized for
    ``largest``; the combines reuse one dispatch's handle."""
    import cupy

    from deepep_cupy import tensors

    from .calls import time_loop

    E = args.num_experts
    stream = tensors.library(lib).current_stream(cupy.cuda.Device().id)
    x, topk, weights, y = decode_inputs(group, args, n, largest, lib)

    def dispatch():
        out = buf.low_latency_dispatch(x, topk, largest, E, use_fp8=True, async_finish=True)
        out[3].current_stream_wait()
        return out

    group.barrier()
    handle = dispatch()[2]

    def combine():
        out = buf.low_latency_combine(y, topk, weights, handle, async_finish=True)
        out[1].current_stream_wait()
        return out

    figures: Dict[str, Any] = {"lib": lib, "tokens": n}
    for name, fn in (("dispatch", dispatch), ("combine", combine)):
        timed = time_loop(fn, stream, args.warmup, args.iters, group.barrier)
        figures[f"{name}_loop_us"], figures[f"{name}_host_us"] = timed["loop_us"], timed["host_us"]
        figures[f"{name}_host_alone_us"] = host_alone_us(group, fn, min(args.iters, HOST_ALONE_CALLS), stream)
    group.barrier()
    return figures


def host_alone_us(group, fn, iters: int, stream_ptr: int) -> float:
    """Median wall time (us) of ``iters`` calls of ``fn`` on this rank while the other ranks wait at
    a barrier: the ranks take turns, so every rank makes the same calls in the end."""
    import cupy

    hosts = []
    for turn in range(group.size):
        group.barrier()
        if group.rank == turn:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                hosts.append(time.perf_counter() - t0)
    group.barrier()
    cupy.cuda.runtime.streamSynchronize(stream_ptr)
    group.barrier()
    return float(np.median(hosts)) * 1e6


def eager_table(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> str:
    """The markdown table of the eager calls (medians over the ranks)."""
    columns = [f"{op}_{what}_us" for op in ("dispatch", "combine") for what in ("loop", "host", "host_alone")]
    lines = ["| library | tokens/rank | " + " | ".join(c[:-3].replace("_", " ") + " us" for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for i, first in enumerate(per_rank[0]):
        med = [statistics.median(r[i][c] for r in per_rank) for c in columns]
        lines.append(f"| {first['lib']} | {first['tokens']} | " + " | ".join(f"{v:.1f}" for v in med) + " |")
    return "\n".join(lines)


def decode_table(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> str:
    """The markdown table of :func:`run_decode`'s per-rank figures (medians over the ranks)."""
    lines = ["| tokens/rank | dispatch us (GPU) | combine us (GPU) | step host us/replay | dispatch bytes "
             "| combine bytes |", "|---|---|---|---|---|---|"]
    for i, first in enumerate(per_rank[0]):
        med = {k: statistics.median(r[i][k] for r in per_rank) for k in first}
        lines.append(f"| {first['tokens']} | {med['dispatch_us']:.1f} | {med['combine_us']:.1f} | "
                     f"{med['step_host_us']:.1f} | {int(med['dispatch_bytes'])} | {int(med['combine_bytes'])} |")
    return "\n".join(lines)


def run_decode(args) -> int:
    """``--decode``: print the table; 0 on success."""
    import cupy

    from deepep_cupy import run_local_group

    token_counts = args.decode_tokens or list(DEFAULT_DECODE_TOKENS)
    num_ranks = args.num_ranks or max(2, cupy.cuda.runtime.getDeviceCount())
    per_rank = run_local_group(lambda group: _rank(group, args, token_counts), num_ranks)
    print(f"decode: {num_ranks} ranks, hidden {args.hidden}, top-{args.num_topk} of {args.num_experts} experts, "
          f"FP8 dispatch, BF16 combine, CUDA-graph replays ({_graph_library()})")
    print(decode_table([r["graphs"] for r in per_rank]), flush=True)
    print("\ndecode, eager calls with async_finish=True (loop: GPU time per call back to back; host: the "
          "Python call)")
    print(eager_table([r["eager"] for r in per_rank]), flush=True)
    return 0
