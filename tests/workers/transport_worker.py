"""MPI worker for the MPI rail transport (tests/test_transports.py, tests/test_gpu_transports.py).

Modes (first argument):

* ``host``: host memory stands in for device memory (tests/transport_fakes.py); random byte
  counts (zeros included) through the staged and the CUDA-aware paths; ``RESULT`` has the cases
  whose bytes differ from the expected ones.
* ``gpu``: the same with device buffers (CuPy) and the real copies, staged through pinned memory.
* ``timeout``: the last rank never calls; rank 0 reports the error it got.

Every rank prints one ``RESULT {json}`` line; on an unexpected error it aborts the job.
"""

import os
import sys
import time

import numpy as np
from comm_worker import report_or_abort  # run as a script: its folder is on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _transport(mode, cuda_aware, timeout_s=60.0):
    """The MPI transport of this rank's rail, made by make_transport: with 4 ranks, simulated nodes
    of 2 (rails [0, 2] and [1, 3]); otherwise one rank per node (one rail of every rank)."""
    from mpi4py import MPI
    from transport_fakes import HostMemory

    from deepep_cupy.groups.group import MPIGroup
    from deepep_cupy.transports import make_transport

    world = MPIGroup(MPI.COMM_WORLD)
    per_node = 2 if world.size == 4 else 1
    rail = list(range(world.rank % per_node, world.size, per_node))
    if mode == "gpu":
        import cupy

        t = make_transport("mpi", world, rail, cupy.cuda.Device().id, timeout_s)   # CuPy's copies, pinned memory
    else:
        t = make_transport("mpi", world, rail, 0, timeout_s, memory=HostMemory())
    t.cuda_aware = cuda_aware
    return t


def _cases(size):
    from transport_fakes import random_counts

    rng = np.random.default_rng(1234)      # the same matrices on every rank
    cases = [[[0] * size for _ in range(size)], [[1] * size for _ in range(size)]]
    cases += [random_counts(rng, size, max_bytes=5000) for _ in range(6)]
    cases += [random_counts(rng, size, max_bytes=3 << 20, zero_fraction=0.5)]   # past the staging granule
    return cases


def _select_gpu():
    """One GPU per rank where there are enough; else every rank on GPU 0 (one_gpu_ranks.py)."""
    import cupy
    from mpi4py import MPI

    cupy.cuda.Device(MPI.COMM_WORLD.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()


def run_cases(mode):
    from transport_fakes import expected_recv, packed_send

    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    mismatches, done, extra = [], 0, {}
    if mode == "gpu":
        from mpi4py import MPI

        from deepep_cupy.groups.group import MPIGroup
        from deepep_cupy.groups.nodes import discover_topology

        _select_gpu()
        # The real P2P probe: one host, GPUs that map each other (or one GPU shared) -> one node.
        extra["ranks_per_node"] = discover_topology(MPIGroup(MPI.COMM_WORLD)).ranks_per_node
    paths = [False, True] if mode == "host" else [False]
    for cuda_aware in paths:
        t = _transport(mode, cuda_aware)
        me = t.rank
        for i, counts in enumerate(_cases(t.size)):
            seed = 1000 * int(cuda_aware) + i
            send = packed_send(me, counts, seed)
            recv_bytes = [counts[p][me] for p in range(t.size)]
            want = expected_recv(me, counts, seed)
            if mode == "gpu":
                got = _move_on_gpu(t, send, counts[me], recv_bytes)
            else:
                recv = np.full(sum(recv_bytes) + 1, 0xEE, np.uint8)
                t.alltoallv(send.ctypes.data, counts[me], recv.ctypes.data, recv_bytes, 0)
                got = recv
            if got[-1] != 0xEE:
                mismatches.append({"cuda_aware": cuda_aware, "case": i, "what": "wrote past the end"})
            if not np.array_equal(got[:-1], want):
                mismatches.append({"cuda_aware": cuda_aware, "case": i, "counts": counts})
            done += 1
        ints = t.alltoall_ints([100 * me + p for p in range(t.size)])
        rail_rank, rail_size, rail = t.rank, t.size, t.rail
        t.close()
    return {"rank": rank, "rail_rank": rail_rank, "rail_size": rail_size, "rail": rail, "mismatches": mismatches,
            "cases": done, "ints": ints, **extra}


def _move_on_gpu(t, send, send_bytes, recv_bytes):
    """alltoallv on device buffers, everything on one non-blocking stream; the bytes received plus one."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        d_send = cupy.asarray(send) if send.size else cupy.empty(1, cupy.uint8)
        d_recv = cupy.full(sum(recv_bytes) + 1, 0xEE, cupy.uint8)
        t.alltoallv(d_send.data.ptr, send_bytes, d_recv.data.ptr, recv_bytes, stream.ptr)
        got = cupy.asnumpy(d_recv, stream=stream)
    stream.synchronize()
    return got


def run_timeout():
    from deepep_cupy.errors import DeepEPError

    t = _transport("host", cuda_aware=False, timeout_s=1.0)
    assert t.size == t.rail[-1] + 1, "the timeout case wants every rank on one rail"
    error, kind = None, None
    buf = np.zeros(16, np.uint8)
    if t.rank != t.size - 1:
        try:
            t.alltoallv(buf.ctypes.data, [1] * t.size, buf.ctypes.data, [1] * t.size, 0)
        except DeepEPError as exc:
            error, kind = str(exc), type(exc).__name__
    else:
        # Come late, once the others gave up: the abandoned requests then complete, and every
        # rank can finalize MPI cleanly.
        time.sleep(3.0)
        t.alltoallv(buf.ctypes.data, [1] * t.size, buf.ctypes.data, [1] * t.size, 0)
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    return {"rank": t.rank, "error": error, "type": kind}


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "host"
    report_or_abort(lambda: run_timeout() if mode == "timeout" else run_cases(mode))
