"""What the scripts that measure a call's host time share: the ops they time on a small workload of
the reference shapes, the host time of each call, and timers around the host path's pieces
(imported as ``_host_timing``: a script's folder is on its path)."""
import collections
import functools
import inspect
import time
from typing import Callable, Dict

import cupy
import numpy as np
from _mpi_timing import HIDDEN, NUM_EXPERTS, NUM_TOPK, rank_buffer

import deepep_cupy as ep
from deepep_cupy.bench.calls import device_arrays
from deepep_cupy.reference import intranode as ref

#: What the scripts name the ops they time.
OPS = ("layout", "fresh", "fresh_fp8", "fresh_in_place", "cached", "combine")


def host_ops(buf, lib: str, num_tokens: int, config, seed: int) -> Dict[str, Callable[[], object]]:
    """``buf``'s calls on ``num_tokens`` tokens of hidden 7168, top-8 of 256 experts (uniform
    routing seeded by ``seed``) as ``lib``'s arrays, by :data:`OPS` name; the cached dispatch and
    the combine use the handle of one fresh dispatch made here (a collective call)."""
    rng = np.random.default_rng(seed)
    H, K, E, n = HIDDEN, NUM_TOPK, NUM_EXPERTS, num_tokens
    arrays = device_arrays(lib, {
        "topk_idx": ref.random_routing(rng, n, E, K),
        "x": ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32)),
        "x_fp8": rng.integers(0, 120, (n, H), dtype=np.uint8),
        "scales": rng.random((n, H // 128), dtype=np.float32),
        "topk_weights": rng.random((n, K), dtype=np.float32)}, cupy.cuda.Device().id)
    topk, x, weights = arrays["topk_idx"], arrays["x"], arrays["topk_weights"]
    x_fp8 = (arrays["x_fp8"], arrays["scales"])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk, topk_weights=weights, config=config)
    recv_x, _, recv_weights, _, handle, _ = buf.dispatch(x, **layout)
    return {"layout": lambda: buf.get_dispatch_layout(topk, E),
            "fresh": lambda: buf.dispatch(x, **layout),
            "fresh_fp8": lambda: buf.dispatch(x_fp8, **layout),
            "fresh_in_place": lambda: buf.dispatch(x, **layout, recv_x_in_buffer=True),
            "cached": lambda: buf.dispatch(x, handle=handle, config=config),
            "combine": lambda: buf.combine(recv_x, handle, topk_weights=recv_weights, config=config)}


def rank_host_ops(comm, lib: str, num_tokens: int):
    """Under mpirun: this rank's Buffer (on its own GPU, 24 SMs) and its :func:`host_ops`."""
    config = ep.Config(24, 4, 256)
    buf = rank_buffer(comm, config.num_sms, num_tokens, recv_x_in_buffer=True, timeout_s=20)
    return buf, host_ops(buf, lib, num_tokens, config, seed=comm.Get_rank())


def rank_host_ops_from_command_line(parser, default_lib: str):
    """Under mpirun: ``parser``'s arguments with ``--lib`` and ``--tokens`` added, MPI's world
    communicator, and this rank's :func:`rank_host_ops` for them: ``(args, comm, buf, ops)``."""
    from mpi4py import MPI

    parser.add_argument("--lib", default=default_lib, choices=("cupy", "torch"))
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    buf, ops = rank_host_ops(comm, args.lib, args.tokens)
    return args, comm, buf, ops


def host_times(fn: Callable[[], object], calls: int, warmup: int = 20, before: Callable[[], None] = None) -> np.ndarray:
    """Wall seconds of each of ``calls`` calls of ``fn`` back to back, after ``warmup`` calls, the
    device's work and ``before`` (a barrier of the ranks, under mpirun)."""
    for _ in range(warmup):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    if before is not None:
        before()
    times = np.empty(calls)
    for i in range(calls):
        start = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - start
    cupy.cuda.runtime.deviceSynchronize()
    return times


class PieceTimers:
    """Seconds spent in, and calls of, each wrapped piece, by label. A timer adds ~0.3 us per call."""

    def __init__(self):
        self.totals = collections.Counter()
        self.counts = collections.Counter()

    def wrap(self, owner, name: str, label: str = None) -> Callable[[], None]:
        """Time ``owner.name`` (a module's function, a class's method or static method) under
        ``label`` (default ``name``); return what undoes it."""
        label = label or name
        own = vars(owner).get(name)
        original = getattr(owner, name)
        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        totals, counts = self.totals, self.counts

        @functools.wraps(original)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                totals[label] += time.perf_counter() - t0
                counts[label] += 1
        setattr(owner, name, staticmethod(wrapper) if static else wrapper)
        return lambda: setattr(owner, name, own) if own is not None else delattr(owner, name)

    def wrap_host_path(self, libs, launch_label: str = "cuLaunchKernel") -> list:
        """Time the pieces of the host path every op goes through (the array libraries ``libs``'
        methods, launches, the handle, the slots, the stream order, a fresh dispatch's reads);
        return what undoes it."""
        from deepep_cupy.gpu import launch, slots, streams
        from deepep_cupy.intranode import dispatch as dispatch_path
        from deepep_cupy.intranode import handle

        undo = [self.wrap(launch, "launch", launch_label),
                self.wrap(launch.KernelCall, "run", "KernelCall.run (packing + launch)"),
                self.wrap(handle.DispatchHandle, "__init__", "DispatchHandle()"),
                self.wrap(slots.HostSlots, "start_dispatch", "slots.start_dispatch"),
                self.wrap(slots.HostSlots, "wait_for_count", "slots.wait_for_count"),
                self.wrap(slots.HostSlots, "expert_counts", "slots.expert_counts"),
                self.wrap(streams.StreamOrder, "begin", "order.begin"),
                self.wrap(streams.StreamOrder, "finish", "order.finish"),
                self.wrap(dispatch_path.DispatchPath, "_read_fresh", "DispatchPath._read_fresh (reads, plan lookup)")]
        for lib in libs:
            for name in ("empty", "trim", "carve", "current_stream", "read", "pointer"):
                undo.append(self.wrap(type(lib), name, f"{lib.name}.{name}"))
        return undo

    def print_per_call(self, calls: int, indent: str = "   ") -> None:
        """Each piece's time and calls per call of the op, over ``calls`` calls, most first."""
        for label, total in self.totals.most_common():
            print(f"{indent}{label:44s} {total / calls * 1e6:7.2f} us per call "
                  f"({self.counts[label] / calls:.1f} calls)")
