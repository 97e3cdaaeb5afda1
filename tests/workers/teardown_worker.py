"""MPI worker: a Buffer's results outlive it, in any order of teardown, and the process exits cleanly.

Usage: ``mpiexec -n R python tests/workers/teardown_worker.py PATH FRAMEWORK GROUP`` with PATH
``intranode``, ``internode`` (2 ranks per node) or ``low_latency``, FRAMEWORK ``cupy`` or
``torch``, GROUP ``mpi`` or ``torch`` (a ``torch.distributed`` group, destroyed before the
results are freed). Each rank makes asynchronous calls (so that PyTorch records their tensors'
use of the Buffer's communication stream), destroys the Buffer, frees half of the results, and
keeps the rest until the interpreter exits. It prints ``TEARDOWN ok`` before it exits; the test
checks that every process exits with status 0.
"""

import gc
import os
import sys

import numpy as np

#: Results kept until the interpreter exits (freed after every CUDA object of the library).
KEPT = []


def torch_group(comm):
    import torch.distributed as dist

    port = comm.bcast(int(os.environ.get("DEEPEP_TEST_PORT", "29653")) if comm.Get_rank() == 0 else None)
    backend = "gloo" if os.environ.get("DEEPEP_TEST_ONE_GPU_MPI") == "1" else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    return dist.group.WORLD


def main(path, framework, group_kind):
    import cupy
    from mpi4py import MPI

    import deepep_cupy as ep

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    if framework == "torch":
        import torch

        torch.cuda.set_device(cupy.cuda.Device().id)

        def device(a):
            a = np.ascontiguousarray(a)
            if a.dtype == np.uint16:  # BF16 bits
                return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
            return torch.from_numpy(a).cuda()
    else:
        def device(a):
            return cupy.asarray(a)
    group = torch_group(comm) if group_kind == "torch" else comm
    rng = np.random.default_rng(rank)
    T, H, E = 64, 2048 if path == "low_latency" else 256, 4 * size
    topk = device(np.stack([rng.permutation(E)[:4] for _ in range(T)]).astype(np.int64))
    x = device(rng.integers(0, 1 << 14, (T, H)).astype(np.uint16))
    results = []
    if path == "low_latency":
        rdma = ep.Buffer.get_low_latency_rdma_size_hint(T, H, size, E)
        buf = ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E // size)
        recv_x, count, handle, event, _ = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False, async_finish=True)
        event.current_stream_wait()
        weights = device(rng.random((T, 4), dtype=np.float32))
        out, event, _ = buf.low_latency_combine(recv_x, topk, weights, handle, async_finish=True)
        event.current_stream_wait()
        results += [recv_x, count, out]
    else:
        internode = path == "internode"
        buf = ep.Buffer(group, ep.get_nvl_buffer_size_hint(H * 2, size, num_max_tokens_per_rank=T * size),
                        1 << 20 if internode else 0, **(dict(ranks_per_node=2) if internode else {}))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        recv_x, recv_topk, _, _, handle, event = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, async_finish=True)
        event.current_stream_wait()
        out, _, event = buf.combine(recv_x, handle, async_finish=True)
        event.current_stream_wait()
        results += [recv_x, recv_topk, out, handle]
    buf.destroy()
    if group_kind == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    KEPT.extend(results[::2])
    del results, buf
    gc.collect()
    comm.Barrier()
    print(f"TEARDOWN ok rank {rank}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
