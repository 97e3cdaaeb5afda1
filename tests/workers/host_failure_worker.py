"""GPU worker: a host that fails during a call, and what every rank sees (issue: bounded memory).

Usage::

    mpiexec -n R python tests/workers/host_failure_worker.py [CASE ...]       # one process per rank
    python tests/workers/host_failure_worker.py --in-process R [CASE ...]      # R ranks in one process

Every rank runs every case (collectively) and prints one ``RESULT {json}`` line per case with
``rank``, ``case``, ``ok``, ``error``, what its failing call raised and how long it took. The
failing rank is rank 1. Its host failure is forced in the Buffer's own allocation or count wait,
raising what the array library raises for an allocation that does not fit (CuPy's
``OutOfMemoryError``) or ``KeyboardInterrupt``:

* before the count exchange (``out_of_memory_before_the_count_exchange``,
  ``interrupted_while_allocating``): the failing rank takes part only to refuse the dispatch, so
  every rank raises from the same call within :data:`RAISE_LIMIT_S`, nothing moves, and the next
  dispatch of the same Buffer is exact on every rank;
* after it (``failure_after_the_count_exchange``, ``interrupted_while_waiting_for_the_counts``):
  the failing rank gives up on the Buffer, so every other rank raises ``PeerAbortedError`` naming
  it and what failed, from that call or the next, within :data:`RAISE_LIMIT_S`; then every rank
  destroys the Buffer and a new one is exact.
"""

import argparse
import sys
import time
import traceback

import numpy as np
from failure_worker import ROUNDS, Round, _exact_rounds_on_a_new_buffer, attempt, raise_problems
from local_gpu_worker import emit

CASES = ["out_of_memory_before_the_count_exchange", "interrupted_while_allocating",
         "failure_after_the_count_exchange", "interrupted_while_waiting_for_the_counts"]
FAILING_RANK = 1
#: The most seconds any rank's failing call may take to raise (its Buffer's timeout is far longer).
RAISE_LIMIT_S = 1.0
TIMEOUT_S = 30.0


def _setting(ep, group):
    config = ep.Config(8, 16, 256)
    return config, ep.get_nvl_buffer_size_hint(1024 * 2, group.size, config)


def _out_of_memory():
    import cupy

    return cupy.cuda.memory.OutOfMemoryError(96 << 30, 140 << 30, 0)


class _Once:
    """Stands in for one of the Buffer's own functions: the first call raises ``failure``, later
    ones are the original's."""

    def __init__(self, original, failure):
        self.original, self.failure, self.fired = original, failure, False

    def __call__(self, *args, **kwargs):
        if not self.fired:
            self.fired = True
            raise self.failure
        return self.original(*args, **kwargs)


def _fail_allocating(buf, failure):
    """Make the Buffer's next allocation of a dispatch's handle raise ``failure``."""
    dispatch = buf._engine.dispatch_path
    dispatch._allocate_handle = _Once(dispatch._allocate_handle, failure)


def _timed(call):
    """``(exception or None, seconds)`` of ``call()``."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # KeyboardInterrupt too: it is what the case forces
        return exc, round(time.monotonic() - start, 3)
    return None, round(time.monotonic() - start, 3)


def _refused_on_every_rank(group, ep, failure, force):
    """The failing rank's host fails before the count exchange (``force(buf)`` arranges it): every
    rank raises from the same dispatch, fast; then the same Buffer's next round is exact."""
    config, size = _setting(ep, group)
    rng = np.random.default_rng(90)
    problems, info = [], {"raise_limit_s": RAISE_LIMIT_S}
    with ep.Buffer(group, size, timeout_s=TIMEOUT_S) as buf:
        attempt(problems, "first round", lambda: _round(buf, rng, config))
        one = Round(buf, rng, config)
        if group.rank == FAILING_RANK:
            force(buf)
        group.barrier()
        raised, info["seconds"] = _timed(one.dispatch)
        info["raised"] = None if raised is None else f"{type(raised).__name__}: {raised}"
        if group.rank == FAILING_RANK:
            if not isinstance(raised, type(failure)):
                problems.append(f"the failing rank raised {info['raised']}, not its own {type(failure).__name__}")
        elif not isinstance(raised, ep.PeerFailedError) or raised.peer != FAILING_RANK:
            problems.append(f"expected PeerFailedError naming rank {FAILING_RANK}, got {info['raised']}")
        if info["seconds"] > RAISE_LIMIT_S:
            problems.append(f"the failing call took {info['seconds']} s to raise, limit {RAISE_LIMIT_S}")
        group.barrier()
        exact = 0
        for i in range(ROUNDS):  # the same Buffer goes on
            exact += attempt(problems, f"round {i} after the refusal", lambda: _round(buf, rng, config)) is True
        info["exact_rounds_after"] = exact
    raise_problems(problems, info)
    return info


def _given_up_on_every_rank(group, ep, failure, what):
    """The failing rank's host fails once its dispatch has launched (in its count wait): it raises
    and gives up on the Buffer; every other rank raises PeerAbortedError naming it and ``what``,
    from that call or the next, fast; a new Buffer after destroy() is exact."""
    config, size = _setting(ep, group)
    rng = np.random.default_rng(91)
    problems, info = [], {"raise_limit_s": RAISE_LIMIT_S}
    buf = ep.Buffer(group, size, timeout_s=TIMEOUT_S)
    attempt(problems, "first round", lambda: _round(buf, rng, config))
    one, after = Round(buf, rng, config), Round(buf, rng, config)
    if group.rank == FAILING_RANK:
        buf._engine.slots.wait_for_count = _Once(buf._engine.slots.wait_for_count, failure)
    group.barrier()
    raised, info["seconds"] = _timed(one.dispatch)
    if raised is None and group.rank != FAILING_RANK:
        group.barrier()  # the failing rank has given up by now: the next call must see it at once
        raised, info["seconds"] = _timed(after.dispatch)
    else:
        group.barrier()
    info["raised"] = None if raised is None else f"{type(raised).__name__}: {raised}"
    if group.rank == FAILING_RANK:
        if not isinstance(raised, type(failure)):
            problems.append(f"the failing rank raised {info['raised']}, not its own {type(failure).__name__}")
    elif not isinstance(raised, ep.PeerAbortedError) or raised.peer != FAILING_RANK or what not in str(raised):
        problems.append(f"expected PeerAbortedError naming rank {FAILING_RANK} and {what!r}, got {info['raised']}")
    if info["seconds"] > RAISE_LIMIT_S:
        problems.append(f"the call took {info['seconds']} s to raise, limit {RAISE_LIMIT_S}")
    buf.destroy()
    info["exact_rounds"] = _exact_rounds_on_a_new_buffer(ep, group, size, rng, config, problems)
    raise_problems(problems, info)
    return info


def _round(buf, rng, config):
    one = Round(buf, rng, config)
    one.dispatch()
    one.combine()
    one.check()
    return True


def case_out_of_memory_before_the_count_exchange(group, ep):
    failure = _out_of_memory()
    return _refused_on_every_rank(group, ep, failure, lambda buf: _fail_allocating(buf, failure))


def case_interrupted_while_allocating(group, ep):
    failure = KeyboardInterrupt()
    return _refused_on_every_rank(group, ep, failure, lambda buf: _fail_allocating(buf, failure))


def case_failure_after_the_count_exchange(group, ep):
    return _given_up_on_every_rank(group, ep, _out_of_memory(), "a Python exception in the call")


def case_interrupted_while_waiting_for_the_counts(group, ep):
    return _given_up_on_every_rank(group, ep, KeyboardInterrupt(), "interrupted (KeyboardInterrupt)")


def run_cases(group, names, in_process):
    import deepep_cupy as ep

    failures = 0
    for name in names:
        group.barrier()
        start = time.time()
        try:
            info, ok, error = globals()[f"case_{name}"](group, ep), True, None
        except Exception as exc:
            info = getattr(exc, "info", {})
            ok, error = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failures += 1
        emit("RESULT", {"rank": group.rank, "num_ranks": group.size, "case": name, "ok": ok, "error": error,
                        "in_process": in_process, "case_seconds": round(time.time() - start, 3), **info})
    return failures


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-process", type=int, metavar="R", default=0, help="run R ranks as threads of this process")
    parser.add_argument("cases", nargs="*", help=f"cases to run (default all: {', '.join(CASES)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {CASES}")
    names = args.cases or CASES
    import deepep_cupy as ep

    if args.in_process:
        try:
            failures = ep.run_local_group(lambda group: run_cases(group, names, True), args.in_process,
                                          timeout_s=300)
        except ep.RankFailed as exc:
            emit("ERROR", {"rank": exc.rank, "message": str(exc)})
            return 1
        return 1 if any(failures) else 0
    import cupy
    from mpi4py import MPI

    from deepep_cupy.groups.group import as_group

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    return 1 if run_cases(as_group(comm), names, False) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
