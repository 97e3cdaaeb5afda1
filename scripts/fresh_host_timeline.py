"""A fresh dispatch's host timeline around its count wait (mpirun -n 2).

    mpirun -n 2 python3 scripts/fresh_host_timeline.py [--lib cupy|torch] [--tokens 128,1024]

Stamps each call's start, the moment the count exchange is launched (notify_dispatch, or the
transfer kernel that makes it itself), the start and end of the wait for the receive count, and
the return; prints per rank the medians over ``--calls`` calls back to back, in us. What the host
does before that launch and after the count is on the call's critical path; what it does between
the launch and the wait (allocating ahead, launching the transfer) is hidden while it takes less
than the count exchange ("exchange -> count").
"""
import argparse
import time

import cupy
import numpy as np
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy.bench.calls import device_arrays
from deepep_cupy.gpu.check import exit_unless_gpu
from deepep_cupy.reference import intranode as ref

parser = argparse.ArgumentParser()
parser.add_argument("--lib", default="cupy", choices=("cupy", "torch"))
parser.add_argument("--tokens", default="128,1024")
parser.add_argument("--calls", type=int, default=200)
args = parser.parse_args()
exit_unless_gpu("scripts/fresh_host_timeline.py")

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
device = rank % cupy.cuda.runtime.getDeviceCount()
cupy.cuda.Device(device).use()
H, K, E = 7168, 8, 256
config = ep.Config(24, 4, 256)
buf = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config), timeout_s=20)

stamps = {}
wait_for_count = buf._engine.slots.wait_for_count


def timed_wait(*a, **k):
    stamps["wait"] = time.perf_counter()
    count = wait_for_count(*a, **k)
    stamps["count"] = time.perf_counter()
    return count


buf._engine.slots.wait_for_count = timed_wait
launch_notify, launch_transfer = type(buf)._launch_notify, type(buf)._launch_transfer


def timed_notify(self, *a, **k):
    launch_notify(self, *a, **k)
    stamps["exchange"] = time.perf_counter()


def timed_transfer(stream, kernel, call, *a):
    launch_transfer(stream, kernel, call, *a)
    if kernel is call.plan.main_for_host:
        stamps["exchange"] = time.perf_counter()


type(buf)._launch_notify = timed_notify
type(buf)._launch_transfer = staticmethod(timed_transfer)

for n in (int(v) for v in args.tokens.split(",")):
    rng = np.random.default_rng([rank, n])
    arrays = device_arrays(args.lib, {"topk_idx": ref.random_routing(rng, n, E, K),
                                      "x": ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32)),
                                      "topk_weights": rng.random((n, K), dtype=np.float32)}, device)
    topk, x, weights = arrays["topk_idx"], arrays["x"], arrays["topk_weights"]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk, topk_weights=weights, config=config)
    for _ in range(10):
        buf.dispatch(x, **layout)
    cupy.cuda.runtime.deviceSynchronize()
    comm.Barrier()
    rows = []
    for _ in range(args.calls):
        start = time.perf_counter()
        buf.dispatch(x, **layout)
        end = time.perf_counter()
        rows.append((stamps["exchange"] - start, stamps["wait"] - start, stamps["count"] - stamps["exchange"],
                     stamps["count"] - stamps["wait"], end - stamps["count"], end - start))
    medians = comm.gather(np.median(np.array(rows), axis=0) * 1e6, root=0)
    if rank == 0:
        for r, m in enumerate(medians):
            print(f"{args.lib} {n} tokens, rank {r}: start -> exchange launched {m[0]:.1f}, -> wait starts "
                  f"{m[1]:.1f}; exchange -> count {m[2]:.1f} (waited {m[3]:.1f}); after the count {m[4]:.1f}; "
                  f"whole {m[5]:.1f}",
                  flush=True)
buf.destroy()
