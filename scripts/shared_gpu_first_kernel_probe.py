"""Does a kernel used for the first time wait for a co-located in-process peer's kernel?

    CUDA_MODULE_LOADING=LAZY|EAGER python3 scripts/shared_gpu_first_kernel_probe.py --use cupy|torch

Two in-process ranks on GPU 0 (``run_local_group``). Rank 0 enters ``Buffer.barrier()`` at once,
so its barrier kernel waits for rank 1. Rank 1 first (0.3 s later) uses a kernel this process
never used: a new CuPy ``RawKernel`` (compiled, loaded, launched), or PyTorch ``cumprod`` and
``sort`` on int16; it prints when the kernel was launched and when it had run, then enters the
barrier. If those times reach the Buffer's timeout (8 s), loading or first running the kernel
waited for rank 0's kernel, which waits for rank 1: the hazard the README names for ranks
sharing a GPU (docs/PERF_NOTES.md, 2026-12-01 midday: 7.7 s in every case but eager loading's
launch, whose kernel still ran only after 7.7 s).
"""
import argparse
import os
import sys
import time

import cupy

import deepep_cupy as ep

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--use", choices=("cupy", "torch"), default="cupy")
args = parser.parse_args()


def say(line: str) -> None:
    """One whole line per write: the ranks are threads, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


say(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING')}, first use: {args.use}")
if args.use == "torch":
    import torch

    torch.zeros(4, device="cuda:0")  # the context and PyTorch's basic kernels, before the ranks start


def first_use() -> None:
    start = time.perf_counter()
    if args.use == "cupy":
        kernel = cupy.RawKernel('extern "C" __global__ void first_use(int* p) { p[threadIdx.x] = 7; }', "first_use")
        out = cupy.zeros(32, cupy.int32)
        kernel((1,), (32,), (out,))
        say(f"rank 1: new kernel launched after {(time.perf_counter() - start) * 1e3:.1f} ms")
        cupy.cuda.get_current_stream().synchronize()
    else:
        x = torch.arange(1000, device="cuda:0", dtype=torch.int16)
        y = torch.cumprod(x, 0).sort()
        say(f"rank 1: new kernels launched after {(time.perf_counter() - start) * 1e3:.1f} ms")
        torch.cuda.current_stream().synchronize()
        del y
    say(f"rank 1: new kernels ran after {(time.perf_counter() - start) * 1e3:.1f} ms")


def rank(group):
    buf = ep.Buffer(group, 1 << 24, 0, timeout_s=8.0)
    buf.barrier()  # both ranks are set up
    if group.rank == 1:
        time.sleep(0.3)
        first_use()
    start = time.perf_counter()
    try:
        buf.barrier()
        say(f"rank {group.rank}: barrier passed in {(time.perf_counter() - start) * 1e3:.1f} ms")
    except ep.DeepEPError as exc:
        say(f"rank {group.rank}: barrier failed after {time.perf_counter() - start:.1f} s: {exc}"[:240])


try:
    ep.run_local_group(rank, 2, devices=[0, 0], timeout_s=30)
except Exception as exc:  # a rank's failure is printed above; the group's summary follows
    say(f"group: {type(exc).__name__}: {exc}"[:300])
