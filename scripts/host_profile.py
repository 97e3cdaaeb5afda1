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

import cupy
import numpy as np
from _host_timing import OPS, host_times, rank_host_ops_from_command_line

parser = argparse.ArgumentParser()
parser.add_argument("--op", default=",".join(OPS))
parser.add_argument("--calls", type=int, default=1000)
parser.add_argument("--top", type=int, default=30)
args, comm, buf, ops = rank_host_ops_from_command_line(parser, default_lib="cupy")
rank, n = comm.Get_rank(), args.tokens

for name in args.op.split(","):
    op = ops[name]
    times = host_times(op, args.calls, warmup=50, before=comm.Barrier)
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
