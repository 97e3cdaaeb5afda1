"""Smoke timing of layout/dispatch/combine under mpirun (the real benchmark is deepep_cupy.bench).

    mpirun -n 2 python3 scripts/quick_perf.py [--tokens 128,4096] [--libs cupy,torch] [--iters 40]

Per op, token count and array library: loop time (GPU time per call over ``--iters`` calls
issued back to back, no L2 flush) and median host time of the Python call. With
DEEPEP_CUPY_PROFILE=1 also the GPU time of each kernel;
with HOST_PROFILE=1 a cProfile of the host path (scripts/host_breakdown.py times the pieces in place).
"""
import argparse
import os
import time

import cupy
import numpy as np
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy.gpu import launch
from deepep_cupy.gpu.check import exit_unless_gpu
from deepep_cupy.reference import intranode as ref

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", default="128,4096")
parser.add_argument("--libs", default="cupy,torch")
parser.add_argument("--iters", type=int, default=40)
parser.add_argument("--config", default="24:4:256")
args = parser.parse_args()
exit_unless_gpu("scripts/quick_perf.py")

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
H, K, E = 7168, 8, 256
cfg = ep.Config(*(int(v) for v in args.config.split(":")))
buf = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, cfg), timeout_s=20,
                allocate_ahead=os.environ.get("PERF_ALLOCATE_AHEAD", "1") != "0")


def arrays(lib, n, rng):
    topk = ref.random_routing(rng, n, E, K)
    x = ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32))
    x8 = rng.integers(0, 120, (n, H), dtype=np.uint8)
    s8 = np.ones((n, H // 128), np.float32)
    w = rng.random((n, K), dtype=np.float32)
    if lib == "cupy":
        return tuple(cupy.asarray(a) for a in (topk, x, x8, s8, w))
    import torch
    dev = f"cuda:{cupy.cuda.Device().id}"
    t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    return (t(topk), t(x.view(np.int16)).view(torch.bfloat16), t(x8).view(torch.float8_e4m3fn), t(s8), t(w))


def caller_stream(lib):
    if lib == "torch":
        import torch
        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return cupy.cuda.get_current_stream()


def timed(fn, stream, iters):
    for _ in range(5):
        fn()
    stream.synchronize()
    comm.Barrier()
    launch.profile.report()
    hosts = []
    start = stream.record()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        hosts.append(time.perf_counter() - t0)
    end = stream.record()
    end.synchronize()
    loop = cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters
    return loop, float(np.median(hosts)) * 1e6, launch.profile.report()


def host_profile(ops, iters=20):
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    for fn in ops.values():
        fn()
        cupy.cuda.get_current_stream().synchronize()
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


results = []
for lib in args.libs.split(","):
    stream = caller_stream(lib)
    for n in (int(v) for v in args.tokens.split(",")):
        topk, x, x8, s8, w = arrays(lib, n, np.random.default_rng([rank, n]))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk, topk_weights=w, config=cfg)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **layout)
        ops = {
            "layout": lambda: buf.get_dispatch_layout(topk, E),
            "dispatch BF16": lambda: buf.dispatch(x, **layout),
            "dispatch FP8": lambda: buf.dispatch((x8, s8), **layout),
            "cached BF16": lambda: buf.dispatch(x, handle=handle, config=cfg),
            "cached FP8": lambda: buf.dispatch((x8, s8), handle=handle, config=cfg),
            "combine BF16": lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=cfg),
        }
        for name, fn in ops.items():
            loop, host, kernels_ms = timed(fn, stream, args.iters)
            kern = " ".join(f"{k.replace('_kernel', '')}={v[1] * 1e3:.0f}" for k, v in kernels_ms.items())
            loops = comm.gather(loop, root=0)
            hosts_all = comm.gather(host, root=0)
            if rank == 0:
                print(f"{lib:5s} {n:5d} {name:14s} loop {max(loops):7.1f} us  host {max(hosts_all):6.1f} us"
                      f"{(' | ' + kern) if kern else ''}", flush=True)
        if os.environ.get("HOST_PROFILE") and n == int(args.tokens.split(",")[0]):
            text = host_profile(ops)
            if rank == 0:
                print(text)
buf.destroy()
