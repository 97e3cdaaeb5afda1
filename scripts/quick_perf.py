"""Smoke timing of layout/dispatch/combine under mpirun (the real benchmark is deepep_cupy.bench).

    mpirun -n 2 python3 scripts/quick_perf.py [num_sms:send:recv ...]

Prints per op: event time per call (mean/min), host time per call, and with
DEEPEP_CUPY_PROFILE=1 the GPU time of each kernel. PERF_ALLOCATE_AHEAD=0 makes the Buffer wait
for the receive counts before a fresh dispatch; DEEPEP_CUPY_KERNEL_DIR picks kernel variants.
"""
import os, sys, time
import numpy as np
from mpi4py import MPI
import cupy
import deepep_cupy as ep
from deepep_cupy import kernels, reference as ref

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
N, H, K, E = 4096, 7168, 8, 256
configs = [tuple(int(v) for v in a.split(":")) for a in sys.argv[1:]] or [(24, 16, 256)]
rng = np.random.default_rng(rank)
topk = cupy.asarray(ref.random_routing(rng, N, E, K))
x = cupy.asarray(ref.float32_to_bfloat16_bits(rng.standard_normal((N, H), dtype=np.float32)))
x8 = cupy.asarray(rng.integers(0, 120, (N, H), dtype=np.uint8)); s8 = cupy.ones((N, H // 128), np.float32)
w = cupy.asarray(rng.random((N, K), dtype=np.float32))
size = max(ep.get_nvl_buffer_size_hint(H * 2, R, ep.Config(*c)) for c in configs)
buf = ep.Buffer(comm, size, timeout_s=20, allocate_ahead=os.environ.get("PERF_ALLOCATE_AHEAD", "1") != "0")
stream = cupy.cuda.get_current_stream()


def timed(fn, iters=int(os.environ.get("PERF_ITERS", "30"))):
    for _ in range(5):
        fn()
    stream.synchronize(); comm.Barrier(); kernels.profile.report()
    ts, hs = [], []
    for _ in range(iters):
        a = stream.record(); h0 = time.perf_counter(); fn(); hs.append(time.perf_counter() - h0)
        b = stream.record(); b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
    return np.mean(ts), np.min(ts), np.mean(hs) * 1e6, kernels.profile.report()


def host_profile(ops, iters=20):
    import cProfile, pstats, io
    prof = cProfile.Profile()
    for name, fn in ops.items():
        fn(); stream.synchronize()
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
        stream.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


for cfg_tuple in configs:
    cfg = ep.Config(*cfg_tuple)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=w, config=cfg)
    recv_x, handle = out[0], out[4]
    nrecv = recv_x.shape[0]
    ops = {
        "layout": lambda: buf.get_dispatch_layout(topk, E),
        "dispatch_bf16": lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg),
        "dispatch_fp8": lambda: buf.dispatch((x8, s8), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                             num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=cfg),
        "cached_bf16": lambda: buf.dispatch(x, handle=handle, config=cfg),
        "cached_fp8": lambda: buf.dispatch((x8, s8), handle=handle, config=cfg),
        "combine_bf16": lambda: buf.combine(recv_x, handle, config=cfg),
    }
    from deepep_cupy import buffer as buffer_module
    for name, fn in ops.items():
        buffer_module.host_trace.clear()
        mean, mn, host, prof = timed(fn)
        if rank == 0 and buffer_module.host_trace:
            last, sums = None, {}
            for stage, t, _ in buffer_module.host_trace:
                if stage != "start" and last is not None:
                    sums.setdefault(stage, []).append(t - last)
                last = t
            print("   host stages (us): " + ", ".join(f"{k} {np.mean(v) * 1e6:.1f}" for k, v in sums.items()))
        if rank == 0:
            gb = nrecv * H * 2 * ((1 + 4 / 128) / 2 if "fp8" in name else 1) / 1e9
            kern = " ".join(f"{k.replace('_kernel', '')}={v[1] * 1e3:.0f}" for k, v in prof.items())
            print(f"{cfg_tuple} {name:14s} mean {mean:7.1f} min {mn:7.1f} host {host:6.1f} us "
                  f"{gb / (mean * 1e-6):6.1f} GB/s | {kern}", flush=True)
    if os.environ.get("HOST_PROFILE"):
        text = host_profile(ops)
        if rank == 0:
            print(text)
buf.destroy()
