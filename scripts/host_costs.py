"""What the host path's building blocks cost on this machine (median wall time per call, us).

    python3 scripts/host_costs.py

Each primitive a Buffer call uses (allocations, launches, event operations, stream look-ups) is
timed alone, 2000 calls after a warm-up, so that a host-path profile can be read against them.
"""
import ctypes
import time

import cupy
import numpy as np
from cupy.cuda import driver, runtime

from deepep_cupy.gpu.check import exit_unless_gpu

N = 2000


def cost(fn, n=N):
    for _ in range(100):
        fn()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e6


def main():
    exit_unless_gpu("scripts/host_costs.py")
    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    event = cupy.cuda.Event(disable_timing=True)
    kernel = cupy.RawKernel(r'extern "C" __global__ void noop(const int* a, int n) {}', "noop")
    kernel((1,), (32,), (cupy.zeros(1, cupy.int32), np.int32(0)))
    fn = kernel.kernel.ptr
    params = (ctypes.c_uint64 * 32)()
    table = (ctypes.c_void_p * 32)(*[ctypes.addressof(params) + 8 * i for i in range(32)])
    table_address = ctypes.addressof(table)
    rows = []
    rows.append(("perf_counter pair", cost(lambda: None)))
    rows.append(("runtime.getDevice", cost(runtime.getDevice)))
    rows.append(("cupy.get_current_stream().ptr", cost(lambda: cupy.cuda.get_current_stream().ptr)))
    rows.append(("cupy.empty 128x7168 uint16", cost(lambda: cupy.empty((128, 7168), dtype=np.uint16))))
    rows.append(("cupy.empty (2,) int32", cost(lambda: cupy.empty((2,), dtype=np.int32))))
    a = cupy.empty((256, 8), cupy.int64)
    rows.append(("cupy read (ptr, shape, dtype, contiguous)",
                 cost(lambda: (a.data.ptr, a.shape, a.dtype, a._c_contiguous, a.data.device_id))))
    rows.append(("cupy a[:100]", cost(lambda: a[:100])))
    rows.append(("eventRecord", cost(lambda: runtime.eventRecord(event.ptr, stream.ptr))))
    rows.append(("streamWaitEvent", cost(lambda: runtime.streamWaitEvent(stream.ptr, event.ptr, 0))))
    rows.append(("launchKernel noop (32 params)",
                 cost(lambda: driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream.ptr, table_address, 0))))
    rows.append(("launchKernel noop 24 blocks x 512",
                 cost(lambda: driver.launchKernel(fn, 24, 1, 1, 512, 1, 1, 0, stream.ptr, table_address, 0))))
    stream.synchronize()
    pinned = cupy.cuda.alloc_pinned_memory(64)
    view = np.frombuffer(pinned, dtype=np.int32, count=16)
    rows.append(("pinned slot read", cost(lambda: int(view[3]))))
    try:
        import torch

        dev = torch.device("cuda", 0)
        t = torch.empty((256, 8), dtype=torch.int64, device=dev)
        raw = torch._C._cuda_getCurrentRawStream
        rows.append(("torch._cuda_getCurrentRawStream", cost(lambda: raw(0))))
        rows.append(("torch.cuda.current_stream().cuda_stream", cost(lambda: torch.cuda.current_stream(0).cuda_stream)))
        rows.append(("torch.empty 128x7168 bf16", cost(lambda: torch.empty((128, 7168), dtype=torch.bfloat16,
                                                                            device=dev))))
        rows.append(("torch.empty (2,) int32", cost(lambda: torch.empty((2,), dtype=torch.int32, device=dev))))
        rows.append(("template.new_empty (2,)", cost(lambda: t.new_empty((2,)))))
        rows.append(("torch.empty positional size", cost(lambda: torch.empty(128, 7168, dtype=torch.bfloat16,
                                                                              device=dev))))
        rows.append(("t.resize_ (in place)", cost(lambda: t.resize_(256, 8))))
        rows.append(("torch read (ptr, shape, dtype, contiguous, device)",
                     cost(lambda: (t.data_ptr(), t.shape, t.dtype, t.is_contiguous(), t.get_device()))))
        rows.append(("torch t[:100]", cost(lambda: t[:100])))
        rows.append(("torch t.narrow(0, 0, 100)", cost(lambda: t.narrow(0, 0, 100))))
    except ImportError:
        pass
    for name, us in rows:
        print(f"{name:52s} {us:7.2f} us")


if __name__ == "__main__":
    main()
