"""What a gather costs the copy engine: the rows of x that a rank keeps for itself, copied into one
contiguous block, as one copy per run of kept rows (issue 12, docs/PERF_NOTES.md).

An in-place dispatch at 8 SMs is bound by what its SMs store: its own rows and the rows it pushes
to the peers. The copy engine could write the own rows if a gather were cheap. Here x (4096 rows of
14336 bytes) is copied with N - 1 rows left out at random (N runs), through one
``cuMemcpyBatchAsync`` of the N runs and through one ``cuMemcpyAsync`` per run, on one GPU; the
destination is checked against NumPy after each way's timing. Prints, per run count, the GPU time
per gather (events around 20 gathers back to back) and the host time per call.

    python3 scripts/copy_engine_gather_probe.py [--runs 1 4 17 64 256 1024] [--rounds 2] [--prefer-overlap]

Two ranks with top-8 of 256 uniform routing leave about 16 of 4096 rows out (17 runs); eight ranks
about a third (hundreds of runs).
"""
import argparse
import ctypes
import time

import cupy
import numpy as np

ROWS, ROW_BYTES = 4096, 14336
CALLS = 20
SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


def driver_entry(libcuda, name: str, prototype):
    """``name`` as the driver of CUDA 13 defines it (cuGetProcAddress picks the version)."""
    address, status = ctypes.c_void_p(), ctypes.c_int()
    get = libcuda.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                    ctypes.POINTER(ctypes.c_int)]
    result = get(name.encode(), ctypes.byref(address), 13000, 0, ctypes.byref(status))
    if result or not address.value:
        raise RuntimeError(f"cuGetProcAddress({name}) = {result}, status {status.value}: needs a CUDA 13 driver")
    return prototype(address.value)


def kept_runs(rng, runs: int):
    """``(first row, end row, destination row)`` of ``runs`` runs: ``runs - 1`` rows left out."""
    left_out = np.sort(rng.choice(np.arange(1, ROWS - 1), runs - 1, replace=False))
    starts = np.concatenate([[0], left_out + 1])
    ends = np.concatenate([left_out, [ROWS]])
    keep = ends > starts  # neighbouring rows left out make no empty run
    starts, ends = starts[keep], ends[keep]
    return starts, ends, np.concatenate([[0], np.cumsum(ends - starts)[:-1]])


def gpu_and_host_us(gather, stream):
    gather()
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    host = []
    start.record(stream)
    for _ in range(CALLS):
        t = time.perf_counter()
        gather()
        host.append(time.perf_counter() - t)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / CALLS, float(np.median(host)) * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[1, 4, 17, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefer-overlap", action="store_true", help="CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE")
    args = parser.parse_args()

    libcuda = ctypes.CDLL("libcuda.so.1")
    P = ctypes.POINTER
    batch_copy = driver_entry(libcuda, "cuMemcpyBatchAsync", ctypes.CFUNCTYPE(
        ctypes.c_int, P(ctypes.c_uint64), P(ctypes.c_uint64), P(ctypes.c_size_t), ctypes.c_size_t,
        P(MemcpyAttributes), P(ctypes.c_size_t), ctypes.c_size_t, ctypes.c_void_p))
    copy = libcuda.cuMemcpyAsync
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

    cupy.cuda.Device(0).use()
    rng = np.random.default_rng(0)
    x_host = rng.integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8)
    x = cupy.asarray(x_host)
    out = cupy.zeros_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    attributes = (MemcpyAttributes * 1)()
    attributes[0].srcAccessOrder = SRC_ACCESS_ORDER_STREAM
    attributes[0].srcLocHint = MemLocation(LOCATION_DEVICE, 0)
    attributes[0].dstLocHint = MemLocation(LOCATION_DEVICE, 0)
    attributes[0].flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE if args.prefer_overlap else 0
    first_attribute = (ctypes.c_size_t * 1)(0)

    print(f"x: {ROWS} rows of {ROW_BYTES} B; {CALLS} gathers per figure")
    print("round  runs   MB | batch: GPU us  host us  GB/s | one call per run: GPU us  host us")
    for round_ in range(args.rounds):
        for runs in args.runs:
            starts, ends, dst_rows = kept_runs(rng, runs)
            count = len(starts)
            dsts = (out.data.ptr + dst_rows * ROW_BYTES).tolist()
            srcs = (x.data.ptr + starts * ROW_BYTES).tolist()
            sizes = ((ends - starts) * ROW_BYTES).tolist()
            c_dsts, c_srcs = (ctypes.c_uint64 * count)(*dsts), (ctypes.c_uint64 * count)(*srcs)
            c_sizes = (ctypes.c_size_t * count)(*sizes)

            def batched():
                result = batch_copy(c_dsts, c_srcs, c_sizes, count, attributes, first_attribute, 1, stream.ptr)
                if result:
                    raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {result}")

            def one_per_run():
                for dst, src, size in zip(dsts, srcs, sizes):
                    result = copy(dst, src, size, stream.ptr)
                    if result:
                        raise RuntimeError(f"cuMemcpyAsync: CUresult {result}")

            figures = []
            for gather in (batched, one_per_run):
                out.fill(0)
                cupy.cuda.Device(0).synchronize()
                figures.append(gpu_and_host_us(gather, stream))
                got = cupy.asnumpy(out)
                for start, end, dst in zip(starts, ends, dst_rows):
                    assert np.array_equal(got[dst:dst + end - start], x_host[start:end]), (gather.__name__, runs)
            total = sum(sizes)
            (batch_gpu, batch_host), (each_gpu, each_host) = figures
            print(f"{round_:5d} {count:5d} {total / 1e6:5.1f} | {batch_gpu:12.1f} {batch_host:8.1f} "
                  f"{total / batch_gpu / 1e3:5.0f} | {each_gpu:23.1f} {each_host:8.1f}", flush=True)


if __name__ == "__main__":
    main()
