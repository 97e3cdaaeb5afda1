"""Where a call's host time goes, measured in place (mpirun -n 2).

    mpirun -n 2 python3 scripts/host_breakdown.py [--lib torch] [--tokens 128] [--op fresh]

Wraps the host path's pieces (allocation, slicing, launches, slots, stream order, argument reads)
with timers, runs the op back to back, and prints each piece's mean time per call next to the
whole call's: what a profile of a 30-us call cannot show.
"""
import argparse

import numpy as np
from _host_timing import OPS, PieceTimers, host_times, rank_host_ops
from mpi4py import MPI

from deepep_cupy import buffer as buffer_module
from deepep_cupy import handle as handle_module
from deepep_cupy import launch, slots, streams, tensors

parser = argparse.ArgumentParser()
parser.add_argument("--lib", default="torch", choices=("cupy", "torch"))
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--op", default="fresh", choices=OPS)
parser.add_argument("--iters", type=int, default=200)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
n = args.tokens
buf, ops = rank_host_ops(comm, args.lib, n)
op = ops[args.op]
for _ in range(20):
    op()

timers = PieceTimers()
timed = timers.wrap
lib_type = type(tensors.library(args.lib))
for name in ("empty", "trim", "current_stream", "read", "pointer"):
    timed(lib_type, name, f"lib.{name}")
timed(launch, "launch", "cuLaunchKernel")
timed(launch.KernelCall, "__call__", "KernelCall (set params + launch)")
timed(handle_module.DispatchHandle, "__init__", "DispatchHandle()")
timed(slots.HostSlots, "start_dispatch")
timed(slots.HostSlots, "wait_for_count")
timed(slots.HostSlots, "expert_counts")
timed(streams.StreamOrder, "begin", "order.begin")
timed(streams.StreamOrder, "finish", "order.finish")
timed(buffer_module.Buffer, "_read_fresh")
timed(buffer_module.Buffer, "_dispatch_outputs")
timed(buffer_module.Buffer, "_config")
timed(buffer_module.Buffer, "_exchange_and_transfer")
timed(buffer_module.Buffer, "_launch_transfer")

calls = host_times(op, args.iters, warmup=0, before=comm.Barrier)
if rank == 0:
    print(f"{args.lib} {args.op} {n} tokens: whole call median {np.median(calls) * 1e6:.1f} us, "
          f"mean {np.mean(calls) * 1e6:.1f} us")
    timers.print_per_call(args.iters)
buf.destroy()
