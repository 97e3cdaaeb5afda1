"""How many bytes per second a few SMs move: 16-byte register copies against bulk asynchronous
copies (TMA), for the two patterns of the in-place transfers (issue 12, docs/PERFORMANCE.md):

* fan-out: each row of x read once and stored to one or two destinations (the in-place dispatch
  writes a token to its own buffer and to the peer's);
* sum: two BF16 copies of each row read and summed in float32 into one output row (the in-place
  combine).

Every variant's output is checked bit for bit first. On one GPU every array is local; with
``--peer`` the second destination (fan-out) and the second copy (sum) live on GPU 1, reached over
NVLink with peer access, as in a 2-rank transfer.

    python3 scripts/sm_rates_probe.py [--rows 14336 7168] [--sms 4 8 16 24] [--peer]
"""
import argparse

import cupy
import numpy as np

from deepep_cupy.bench.own_kernels import read_source
from deepep_cupy.gpu.check import exit_unless_gpu

TOKENS = 4096
SHARED_BYTES = 200 * 1024  # of the 227 KiB an H100/H200 block may use


def bf16_rows(rng, rows, row_bytes):
    return (rng.standard_normal((rows, row_bytes // 2), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_sum(a, b):
    total = ((a.astype(np.uint32) << 16).view(np.float32) + (b.astype(np.uint32) << 16).view(np.float32))
    bits = total.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def on(device, array):
    with cupy.cuda.Device(device):
        return cupy.asarray(array)


def variants(module, row_bytes, second):
    """{name: (run(sms, x, d0, d1), what it checks)} for rows of ``row_bytes``."""
    hidden_int4 = row_bytes // 16
    fan_registers, fan_bulk = module.get_function("fan_out_registers"), module.get_function("fan_out_bulk")
    sum_registers, sum_bulk = module.get_function("sum_registers"), module.get_function("sum_bulk")
    fan_warps = 4
    fan_slots = max(2, min(8, SHARED_BYTES // (fan_warps * row_bytes)))
    sum_stages = max(2, min(8, SHARED_BYTES // (2 * row_bytes)))
    fan_shared = fan_warps * fan_slots * (row_bytes + 8)
    sum_shared = sum_stages * (2 * row_bytes + 16)
    fan_bulk.max_dynamic_shared_size_bytes = fan_shared
    sum_bulk.max_dynamic_shared_size_bytes = sum_shared
    n = np.int32(TOKENS)

    def fan(kernel, block, shared, *sizes):  # sizes: the kernel's parameters after n
        def run(sms, a, b, d0, d1, out):
            kernel((sms,), (block,), (a, d0, d1 if second else np.uint64(0), n, *sizes), shared_mem=shared)
        return run

    def total(kernel, block, shared, *sizes):
        def run(sms, a, b, d0, d1, out):
            kernel((sms,), (block,), (a, b, out, n, *sizes), shared_mem=shared)
        return run

    fans = "2" if second else "1"
    return {
        f"fan-out x{fans}, registers, 24 warps": (fan(fan_registers, 768, 0, np.int32(hidden_int4)), "fan"),
        f"fan-out x{fans}, bulk, {fan_warps} warps x {fan_slots} rows": (
            fan(fan_bulk, 32 * fan_warps, fan_shared, np.int32(row_bytes), np.int32(fan_slots)), "fan"),
        "sum of 2, registers, 24 warps": (total(sum_registers, 768, 0, np.int32(hidden_int4)), "sum"),
        f"sum of 2, bulk, 16 warps x {sum_stages} stages": (
            total(sum_bulk, 512, sum_shared, np.int32(row_bytes), np.int32(sum_stages)), "sum"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[14336, 7168], help="row bytes (multiples of 16)")
    parser.add_argument("--sms", type=int, nargs="+", default=[4, 8, 16, 24])
    parser.add_argument("--peer", action="store_true", help="second destination / second copy on GPU 1")
    parser.add_argument("--one-destination", action="store_true", help="fan-out to d0 only")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    exit_unless_gpu("scripts/sm_rates_probe.py")
    if args.peer:
        cupy.cuda.runtime.deviceEnablePeerAccess(1)
    far = 1 if args.peer else 0
    module = cupy.RawModule(code=read_source("probe_sm_rates.cu"), options=("-std=c++17",))
    rng = np.random.default_rng(0)
    for row_bytes in args.rows:
        host_a, host_b = bf16_rows(rng, TOKENS, row_bytes), bf16_rows(rng, TOKENS, row_bytes)
        a, b = on(0, host_a), on(far, host_b)
        d0, d1, out = cupy.zeros_like(a), on(far, np.zeros_like(host_a)), cupy.zeros_like(a)
        want_sum = bf16_sum(host_a, host_b)
        table = variants(module, row_bytes, not args.one_destination)
        for name, (run, kind) in table.items():
            for array in (d0, d1, out):
                with array.device:
                    array.fill(0)
            run(8, a, b, d0, d1, out)
            cupy.cuda.runtime.deviceSynchronize()
            if kind == "fan":
                ok = (d0 == a).all() and (args.one_destination or bool((cupy.asnumpy(d1) == host_a).all()))
            else:
                ok = bool((cupy.asnumpy(out) == want_sum).all())
            assert ok, f"{name}: wrong output"
        print(f"rows of {row_bytes} B, {TOKENS} tokens, {'second array on GPU 1' if args.peer else 'one GPU'}: "
              "us per call (GB/s per SM: bytes stored for a fan-out, read for a sum)", flush=True)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for sms in args.sms:
            for round_ in range(args.rounds):
                cells = []
                for name, (run, kind) in table.items():
                    run(sms, a, b, d0, d1, out)
                    start.record()
                    for _ in range(args.calls):
                        run(sms, a, b, d0, d1, out)
                    stop.record()
                    stop.synchronize()
                    us = cupy.cuda.get_elapsed_time(start, stop) * 1e3 / args.calls
                    moved = TOKENS * row_bytes * (1 if kind == "fan" and args.one_destination else 2)
                    cells.append(f"{name}: {us:.0f} ({moved / us / 1e3 / sms:.0f})")
                print(f"  {sms:2d} SMs, round {round_}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
