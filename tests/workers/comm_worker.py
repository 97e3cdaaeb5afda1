"""MPI worker for tests/test_comm_mpi.py: exercises MPIGroup on MPI.COMM_WORLD.

Every rank prints one line ``RESULT {json}`` with what it saw; the test checks the lines. On any
error the rank prints the traceback and aborts the whole job (so that no peer hangs in a
collective waiting for it).
"""

import json
import sys
import time
import traceback


def main() -> dict:
    from mpi4py import MPI

    from deepep_cupy.groups.group import Group, MPIGroup, as_group

    comm = MPI.COMM_WORLD
    group = MPIGroup(comm)
    wrapped = as_group(comm)
    rank, size = group.rank, group.size

    # allgather: a different, non-trivial object per rank; it must come back in rank order.
    mine = {"rank": rank, "items": list(range(rank)), "tag": ("r", rank), "blob": bytes([rank]) * 3}
    gathered = group.allgather(mine)
    allgather_ok = (
        isinstance(gathered, list) and len(gathered) == size
        and all(g == {"rank": i, "items": list(range(i)), "tag": ("r", i), "blob": bytes([i]) * 3}
                for i, g in enumerate(gathered)))

    # barrier: nobody may leave before the last rank has entered. One rank arrives late (first
    # rank 0, then the last rank); all ranks share one clock since they share one host.
    barrier_rounds = []
    for late in sorted({0, size - 1}):
        comm.Barrier()
        if rank == late:
            time.sleep(0.2)
        entered = time.time()
        group.barrier()
        left = time.time()
        barrier_rounds.append({"late": late, "entered": entered, "left": left})

    hosts = group.allgather(group.host_name())

    return {
        "rank": rank,
        "size": size,
        "comm_rank": comm.Get_rank(),
        "comm_size": comm.Get_size(),
        "is_group": isinstance(group, Group),
        "in_process": group.in_process,
        "comm_is_same": group.comm is comm,
        "as_group_type": type(wrapped).__name__,
        "as_group_idempotent": as_group(group) is group,
        "allgather_ok": allgather_ok,
        "gathered_ranks": [g.get("rank") if isinstance(g, dict) else None for g in gathered],
        "barrier_rounds": barrier_rounds,
        "host": group.host_name(),
        "hosts": hosts,
    }


def report_or_abort(run):
    """Print ``RESULT {json}`` of ``run()``; if it raises, print the traceback and abort the whole
    job (so that no peer hangs in a collective waiting for this rank). The MPI workers' entry point."""
    try:
        result = run()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    # One write per line: the launcher interleaves the ranks' output at write boundaries.
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    report_or_abort(main)
