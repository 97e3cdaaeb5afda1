"""The failure worker's recovery and concurrency cases with both ranks in one process.

Usage: ``python tests/workers/local_failure_worker.py [CASE ...]`` (default: every case of
``failure_worker.GROUP_CASES``, those that take any rank group). Runs each case on an in-process
group of two ranks (``deepep_cupy.run_local_group``), rank ``r`` on GPU ``r`` (both on GPU 0 of a
one-GPU machine), and prints one ``RESULT {json}`` line per rank and case with the fields the MPI
run prints, plus ``"in_process": true``. A rank catches what its case raises (reported in the
record), so the group stays healthy for the next case, as the README asks of in-process jobs that
go on after a timeout. Exits with 1 when a case failed on any rank, or (with an ``ERROR {json}``
line) when a rank raised out of the group.
"""

import sys
import time
import traceback

import failure_worker  # run as a script: its folder is on sys.path
from local_gpu_worker import emit

NUM_RANKS = 2
#: How long a rank waits in a collective of the group (the cases' own waits are far shorter).
GROUP_TIMEOUT_S = 120.0

def rank_main(group, names):
    """Run the cases ``names`` on this rank; return how many failed here."""
    import cupy

    import deepep_cupy as ep

    failures = 0
    for name in names:
        group.barrier()  # every case starts on all ranks together, as under mpiexec
        start = time.time()
        try:
            info, ok, error = getattr(failure_worker, f"case_{name}")(group, ep, cupy), True, None
        except Exception as exc:
            info = getattr(exc, "info", {})  # a failure_worker.CaseFailed keeps the measurements
            ok, error = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failures += 1
        emit("RESULT", {"rank": group.rank, "case": name, "ok": ok, "error": error, "in_process": True,
                        "seconds": round(time.time() - start, 3), **info})
    return failures


def main(names):
    import deepep_cupy as ep

    cases = failure_worker.GROUP_CASES
    unknown = sorted(set(names) - set(cases))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {cases}")
    names = names or cases
    try:
        failures = ep.run_local_group(lambda group: rank_main(group, names), NUM_RANKS, timeout_s=GROUP_TIMEOUT_S)
    except ep.RankFailed as exc:
        emit("ERROR", {"rank": exc.rank, "message": str(exc), "stuck": exc.stuck})
        return 1
    return 1 if any(failures) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
