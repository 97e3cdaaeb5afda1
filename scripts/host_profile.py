"""Which functions a call's host time goes to (mpirun -n 2): cProfile over calls back to back.

    mpirun -n 2 python3 scripts/host_profile.py [--lib cupy|torch] [--tokens 128] [--op fresh,cached]

Per op, rank 0 prints the unprofiled median host time per call, then the functions with the most
own time per call under the profiler (which adds ~0.1-0.3 us per function call: compare functions
with each other, not with the unprofiled figure). Library calls (driver, allocator, tensor
methods) show as ``{method ...}`` / ``<built-in ...>`` rows: that is time outside our Python.
"""
import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np
from _mpi_timing import HIDDEN, NUM_EXPERTS, NUM_TOPK, rank_buffer
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy import reference as ref
from deepep_cupy.bench.calls import device_arrays

parser = argparse.ArgumentParser()
parser.add_argument("--lib", default="cupy", choices=("cupy", "torch"))
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--op", default="fresh,fresh_fp8,cached,combine,layout")
parser.add_argument("--calls", type=int, default=1000)
parser.add_argument("--top", type=int, default=30)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
H, K, E, n = HIDDEN, NUM_TOPK, NUM_EXPERTS, args.tokens
config = ep.Config(24, 4, 256)
buf = rank_buffer(comm, config.num_sms, n, timeout_s=20)
device = cupy.cuda.Device().id

rng = np.random.default_rng(rank)
arrays = device_arrays(args.lib, {
    "topk_idx": ref.random_routing(rng, n, E, K),
    "x": ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32)),
    "x_fp8": rng.integers(0, 120, (n, H), dtype=np.uint8),
    "scales": rng.random((n, H // 128), dtype=np.float32),
    "topk_weights": rng.random((n, K), dtype=np.float32)}, device)
topk, x, weights = arrays["topk_idx"], arrays["x"], arrays["topk_weights"]
x8 = (arrays["x_fp8"], arrays["scales"])
per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=topk, topk_weights=weights, config=config)
recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
ops = {"fresh": lambda: buf.dispatch(x, **layout),
       "fresh_fp8": lambda: buf.dispatch(x8, **layout),
       "cached": lambda: buf.dispatch(x, handle=handle, config=config),
       "combine": lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=config),
       "layout": lambda: buf.get_dispatch_layout(topk, E)}

for name in args.op.split(","):
    op = ops[name]
    for _ in range(50):
        op()
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        op()
    profiler.disable()
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    if rank == 0:
        print(f"\n== {args.lib} {name}, {n} tokens: unprofiled host median {np.median(times) * 1e6:.1f} us "
              f"(mean {np.mean(times) * 1e6:.1f}); per call under the profiler:", flush=True)
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:args.top]
        total = sum(v[2] for v in stats.stats.values())
        print(f"   total own time {total / args.calls * 1e6:.1f} us")
        for (path, line, func), (_, nc, tt, ct, _) in rows:
            where = f"{path.split('/')[-1]}:{line}" if path != "~" else ""
            print(f"   {tt / args.calls * 1e6:6.2f} own {ct / args.calls * 1e6:6.2f} cum "
                  f"{nc / args.calls:4.1f}x  {func} {where}", flush=True)
buf.destroy()
