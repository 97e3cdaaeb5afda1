"""Where a call's host time goes, measured in place (mpirun -n 2).

    mpirun -n 2 python3 scripts/host_breakdown.py [--lib torch] [--tokens 128] [--op fresh]

Wraps the host path's pieces (allocation, slicing, launches, slots, stream order, argument reads)
with timers, runs the op back to back, and prints each piece's mean time per call next to the
whole call's: what a profile of a 30-us call cannot show.
"""
import argparse

import numpy as np
from _host_timing import OPS, PieceTimers, host_times, rank_host_ops_from_command_line

from deepep_cupy import tensors
from deepep_cupy.intranode import dispatch as dispatch_path
from deepep_cupy.intranode import engine as engine_module

parser = argparse.ArgumentParser()
parser.add_argument("--op", default="fresh", choices=OPS)
parser.add_argument("--iters", type=int, default=200)
args, comm, buf, ops = rank_host_ops_from_command_line(parser, default_lib="torch")
op = ops[args.op]
for _ in range(20):
    op()

timers = PieceTimers()
timers.wrap_host_path([tensors.library(args.lib)])
timers.wrap(engine_module.IntranodeEngine, "config")
timers.wrap(dispatch_path, "dispatch_outputs")
for name in ("_exchange_and_transfer", "_launch_transfer"):
    timers.wrap(dispatch_path.DispatchPath, name)

calls = host_times(op, args.iters, warmup=0, before=comm.Barrier)
if comm.Get_rank() == 0:
    print(f"{args.lib} {args.op} {args.tokens} tokens: whole call median {np.median(calls) * 1e6:.1f} us, "
          f"mean {np.mean(calls) * 1e6:.1f} us")
    timers.print_per_call(args.iters)
buf.destroy()
