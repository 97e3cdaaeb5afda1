"""Where a call's host time goes, measured in place (mpirun -n 2).

    mpirun -n 2 python3 scripts/host_breakdown.py [--lib torch] [--tokens 128] [--op fresh]

Wraps the host path's pieces (allocation, slicing, launches, slots, stream order, argument reads)
with timers, runs the op back to back, and prints each piece's mean time per call next to the
whole call's: what a profile of a 30-us call cannot show.
"""
import argparse
import time

import cupy
import numpy as np
from _piece_timers import PieceTimers
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy import buffer as buffer_module
from deepep_cupy import handle as handle_module
from deepep_cupy import launch, slots, streams, tensors
from deepep_cupy import reference as ref

parser = argparse.ArgumentParser()
parser.add_argument("--lib", default="torch")
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--op", default="fresh", choices=("fresh", "cached", "combine", "layout"))
parser.add_argument("--iters", type=int, default=200)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
cupy.cuda.Device(rank).use()
H, K, E, n = 7168, 8, 256, args.tokens
cfg = ep.Config(24, 4, 256)
buf = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, cfg), timeout_s=20)

timers = PieceTimers()
timed = timers.wrap


rng = np.random.default_rng(rank)
topk = ref.random_routing(rng, n, E, K)
x = ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32))
w = rng.random((n, K), dtype=np.float32)
if args.lib == "torch":
    import torch
    dev = f"cuda:{rank}"
    topk, w = torch.from_numpy(topk).to(dev), torch.from_numpy(w).to(dev)
    x = torch.from_numpy(x.view(np.int16)).to(dev).view(torch.bfloat16)
    lib = tensors.lib_of(x)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
else:
    topk, x, w = cupy.asarray(topk), cupy.asarray(x), cupy.asarray(w)
    lib = tensors.lib_of(x)
    stream = cupy.cuda.get_current_stream()

per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
          topk_weights=w, config=cfg)
recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **kw)
op = {"fresh": lambda: buf.dispatch(x, **kw), "cached": lambda: buf.dispatch(x, handle=handle, config=cfg),
      "combine": lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg),
      "layout": lambda: buf.get_dispatch_layout(topk, E)}[args.op]
for _ in range(20):
    op()

lib_type = type(lib)
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

stream.synchronize()
comm.Barrier()
calls = []
for _ in range(args.iters):
    t0 = time.perf_counter()
    op()
    calls.append(time.perf_counter() - t0)
stream.synchronize()
if rank == 0:
    print(f"{args.lib} {args.op} {n} tokens: whole call median {np.median(calls) * 1e6:.1f} us, "
          f"mean {np.mean(calls) * 1e6:.1f} us")
    for name, total in timers.totals.most_common():
        calls_per_call = timers.counts[name] / args.iters
        print(f"   {name:36s} {total / args.iters * 1e6:7.2f} us per call ({calls_per_call:.1f} calls)")
buf.destroy()
