"""Minimal timing of layout/dispatch/combine under mpirun (a smoke check; the benchmark is deepep_cupy.bench)."""
import sys, time
import numpy as np
from mpi4py import MPI
import cupy
import deepep_cupy as ep
from deepep_cupy import reference as ref

comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
N, H, K, E = 4096, 7168, 8, 256
num_sms = int(sys.argv[1]) if len(sys.argv) > 1 else 24
rng = np.random.default_rng(rank)
topk = cupy.asarray(ref.random_routing(rng, N, E, K))
x = cupy.asarray(ref.float32_to_bfloat16_bits(rng.standard_normal((N, H), dtype=np.float32)))
x8 = cupy.asarray(rng.integers(0, 120, (N, H), dtype=np.uint8)); s8 = cupy.ones((N, H // 128), np.float32)
w = cupy.asarray(rng.random((N, K), dtype=np.float32))
for send in (6, 16):
    cfg = ep.Config(num_sms, send, 256)
    buf = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, cfg), timeout_s=20)
    stream = cupy.cuda.get_current_stream()
    def timed(fn, iters=30):
        for _ in range(5): fn()
        comm.Barrier(); stream.synchronize()
        ts = []
        for _ in range(iters):
            a = stream.record(); fn(); b = stream.record(); b.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
        return np.mean(ts), np.min(ts)
    layout = buf.get_dispatch_layout(topk, E)
    out = buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                       topk_idx=topk, topk_weights=w, config=cfg)
    recv_x, handle = out[0], out[4]
    nrecv = recv_x.shape[0]
    res = {}
    res["layout"] = timed(lambda: buf.get_dispatch_layout(topk, E))
    res["dispatch_bf16"] = timed(lambda: buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                      num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=w, config=cfg))
    res["dispatch_fp8"] = timed(lambda: buf.dispatch((x8, s8), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                                     num_tokens_per_expert=layout[2], topk_idx=topk, topk_weights=w, config=cfg))
    res["cached_bf16"] = timed(lambda: buf.dispatch(x, handle=handle, config=cfg))
    res["combine_bf16"] = timed(lambda: buf.combine(recv_x, handle, config=cfg))
    if rank == 0:
        for k, (mean, mn) in res.items():
            gb = nrecv * H * 2 * ((1 + 4 / 128) / 2 if "fp8" in k else 1) / 1e9
            print(f"sms={num_sms} send={send} {k:14s} mean {mean:8.1f} us  min {mn:8.1f} us  {gb / (mean * 1e-6):7.1f} GB/s (recv {nrecv})", flush=True)
    buf.destroy()
