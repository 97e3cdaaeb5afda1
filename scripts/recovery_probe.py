"""Probe: a rank skips (or is late for) a dispatch; then every rank destroys its Buffer and makes a new one.

Usage: mpirun -n 2 python3 scripts/recovery_probe.py {never,late} [--allocate-ahead 0|1]
Prints each step with its time; a hang dumps every thread's stack after --dump-after seconds.
"""
import argparse
import faulthandler
import sys
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["never", "late"])
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--dump-after", type=float, default=30.0)
    p.add_argument("--allocate-ahead", type=int, default=1)
    a = p.parse_args()
    import cupy
    from mpi4py import MPI

    import deepep_cupy as ep
    from deepep_cupy import reference as ref

    comm = MPI.COMM_WORLD
    rank, R = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    faulthandler.dump_traceback_later(a.dump_after, exit=True)
    t0 = time.monotonic()

    def say(what):
        print(f"rank {rank} {time.monotonic() - t0:7.2f}s {what}", flush=True)

    E, N, H, K = 16, 256, 1024, 4
    rng = np.random.default_rng(rank)
    topk = cupy.asarray(ref.random_routing(rng, N, E, K))
    x = cupy.asarray(ref.float32_to_bfloat16_bits(rng.standard_normal((N, H), dtype=np.float32)))

    def dispatch(buf):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk)
        cupy.cuda.get_current_stream().synchronize()
        return out

    size = ep.get_nvl_buffer_size_hint(H * 2, R)
    buf = ep.Buffer(comm, size, timeout_s=a.timeout, allocate_ahead=bool(a.allocate_ahead))
    dispatch(buf)
    say("first dispatch ok")
    if rank == 0:
        try:
            dispatch(buf)
            say("UNEXPECTED: dispatch returned")
        except Exception as exc:
            say(f"raised {type(exc).__name__}: {str(exc)[:160]}")
    elif a.mode == "late":
        time.sleep(a.timeout + 1.0)
        try:
            dispatch(buf)
            say("late dispatch returned (no error)")
        except Exception as exc:
            say(f"late dispatch raised {type(exc).__name__}: {str(exc)[:160]}")
    say("destroy")
    buf.destroy()
    say("destroyed; new Buffer")
    buf = ep.Buffer(comm, size, timeout_s=a.timeout, allocate_ahead=bool(a.allocate_ahead))
    say("new Buffer made")
    for _ in range(3):
        dispatch(buf)
    say("three dispatches on the new Buffer ok")
    buf.destroy()
    faulthandler.cancel_dump_traceback_later()
    say("done")


if __name__ == "__main__":
    sys.exit(main())
