"""The random-case soak: seeded cases (random_cases.py) checked against the NumPy reference.

Usage::

    python tests/workers/random_soak.py --cases N --seed S [--gpus G] [--timeout T] [--records]
    python tests/workers/random_soak.py --seed S --cases 1            # one case alone (a failing seed)
    python tests/workers/random_soak.py --seed S --cases N --list     # print the cases; no GPU needed

Runs the cases of seeds ``S .. S+N-1`` with every rank a thread of this process
(``deepep_cupy.run_local_group``, rank ``r`` on GPU ``r % G``; G: ``--gpus``, default every
visible GPU). Cases are grouped by rank count: one group per rank count, one Buffer per rank for
all its cases (sized for the largest of them), the kernels compiled before the first case. Each
case runs through ``gpu_worker.run_scenario`` unchanged (layout, two fresh dispatches, cached
dispatch, combine; every output and handle field compared bit-exactly with the reference), the
reference computed once per case for all rank threads (``local_gpu_worker.SharedReference``).

The kernels give up after ``--timeout`` seconds (the Buffer's ``timeout_s``); a case that fails
replaces the Buffers and the next case goes on. A case still running after ``--case-deadline``
seconds is a hang: ``HANG {json}`` names it, every thread's stack is dumped (faulthandler) and the
process exits with 3.

Output, one line each (``TAG {json}``, as the other workers print):
    FAIL     a failing case: its seed, its description, each failing rank's error, the command
             that runs it alone
    CASE     every case (only with ``--records``; tests/test_gpu_random.py reads them)
    BATCH    a rank count done: its cases, set-up and case seconds
    ERROR    a rank count's group broke down outside any case (its remaining cases count as failed)
    SUMMARY  cases, failed seeds, seed range, wall seconds, cases and seconds per rank count
then one plain line with the same summary. Exit status 1 if any case failed, 2 (and one sentence on
stderr) when no GPU can be used.

A case depends on its seed, on the number of GPUs and on their SM count (which bound
``num_sms``): reproduce a seed on the same machine, or with the same ``--gpus``.
"""

import argparse
import faulthandler
import os
import sys
import threading
import time
import traceback

import gpu_worker  # run as a script: its folder is on sys.path
from local_gpu_worker import RankBuffer, SharedReference, emit
from random_cases import DEFAULT_GPUS, DEFAULT_SM_COUNT, describe_case, nvl_bytes_needed, random_cases, ranks_per_gpu

from deepep_cupy.gpu.check import exit_unless_gpu

#: Seconds the kernels may wait for a peer (the Buffer's timeout_s), here and in sequence_soak.py.
DEFAULT_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------------------------
# Arguments


def add_run_options(parser, item):
    """The options both in-process soaks take (this one and sequence_soak.py): ``--seed`` of the
    first ``item`` ("case", "sequence"), ``--gpus``, ``--timeout``."""
    parser.add_argument("--seed", type=int, default=0, help=f"seed of the first {item} (default 0)")
    parser.add_argument("--gpus", type=int, default=None, help="use GPUs 0..G-1 (default: all visible)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"Buffer timeout_s: kernel and host waits, seconds (default {DEFAULT_TIMEOUT_S:g})")


def check_run_options(parser, args):
    """Refuse (``parser.error``) values of :func:`add_run_options`' options that no run can use."""
    if args.seed < 0:
        parser.error(f"--seed: expected a non-negative seed, got {args.seed}")
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus: expected at least 1, got {args.gpus}")
    if not args.timeout > 0:
        parser.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="how many cases (default 1000)")
    add_run_options(parser, "case")
    parser.add_argument("--case-deadline", type=float, default=None,
                        help="seconds after which a case counts as hung (default 3 x timeout + 30)")
    parser.add_argument("--records", action="store_true", help="print a CASE record for every case")
    parser.add_argument("--list", action="store_true",
                        help="print the cases (as drawn for --gpus GPUs, default 2, of 132 SMs) and run nothing")
    parser.add_argument("--exchange-in-transfer", action="store_true",
                        help="in-process ranks too make the count exchange of a fresh dispatch with rows in place "
                             "in its transfer kernel")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error(f"--cases: expected at least 1, got {args.cases}")
    check_run_options(parser, args)
    if args.case_deadline is None:
        args.case_deadline = 3 * args.timeout + 30
    return args


def reproduce_command(seed, args):
    """The command that runs case ``seed`` alone on this machine."""
    extra = f" SOAK_ARGS='--gpus {args.gpus}'" if args.gpus else ""
    return f"make soak-cases SOAK_SEED={seed} SOAK_CASES=1{extra}"


def by_rank_count(items):
    """``{num_ranks: [items in seed order]}``, rank counts ascending (cases here, sequences in
    sequence_soak.py)."""
    batches = {}
    for item in items:
        batches.setdefault(item["num_ranks"], []).append(item)
    return dict(sorted(batches.items()))


# ---------------------------------------------------------------------------------------------
# Hang detection


class Watchdog:
    """Names what runs past the deadline, dumps every thread's stack and ends the process (exit 3).

    A Python thread does the naming (a ``HANG`` record: what :meth:`start` was given, as
    :meth:`note` updated it); faulthandler's own timer (which needs no GIL) is armed a little later
    as a backstop, for a hang that holds the GIL. The random soak watches cases, the sequence soak
    sequences (and notes their step).
    """

    BACKSTOP_S = 30.0

    def __init__(self, deadline_s):
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._running = None  # (hang record, start time)
        threading.Thread(target=self._watch, name="soak-watchdog", daemon=True).start()

    def start(self, record):
        with self._lock:
            self._running = (dict(record), time.monotonic())
        faulthandler.dump_traceback_later(self.deadline_s + self.BACKSTOP_S, exit=True)

    def note(self, **fields):
        with self._lock:
            if self._running is not None:
                self._running[0].update(fields)

    def end(self):
        faulthandler.cancel_dump_traceback_later()
        with self._lock:
            self._running = None

    def _watch(self):
        while True:
            time.sleep(0.5)
            with self._lock:
                running = self._running
                record = None if running is None else dict(running[0])
            if running is not None and time.monotonic() - running[1] > self.deadline_s:
                emit("HANG", {**record, "deadline_s": self.deadline_s})
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(3)


# ---------------------------------------------------------------------------------------------
# One rank count


def warm_combine_kernels(num_ranks):
    """Compile combine for every dtype now: a compile inside a case would hold a rank away from the
    kernels its peers already wait in (Buffer creation compiles the rest)."""
    from deepep_cupy.gpu import kernels

    for element in kernels.COMBINE_ELEMENTS.values():
        kernels.get_kernel(kernels.name_expression("combine_kernel", (element, num_ranks)))


def run_case(buf, case):
    """``(ok, error)`` of one case on this rank."""
    try:
        gpu_worker.run_scenario(buf, case)
        return True, None
    except Exception as exc:  # reported with the case; the soak goes on
        return False, f"{type(exc).__name__}: {exc}{gpu_worker.kernel_error(buf)}\n{traceback.format_exc()}"


def case_record(case, outcomes, seconds, args):
    """What the soak reports of one case, from every rank's ``(ok, error)``."""
    errors = {str(rank): error for rank, (ok, error) in enumerate(outcomes) if not ok}
    return {"seed": case["seed"], "ranks": case["num_ranks"], "ok": not errors, "seconds": round(seconds, 3),
            "case": describe_case(case), "errors": errors, "reproduce": reproduce_command(case["seed"], args)}


def not_run_record(case, why, args):
    record = case_record(case, [], 0.0, args)
    record.update(ok=False, errors={"all": f"not run: {why}"})
    return record


def report(record, args):
    if not record["ok"]:
        emit("FAIL", record)
    if args.records:
        emit("CASE", record)


def rank_loop(group, cases, nvl_bytes, args, shared, watchdog, reported):
    """Run ``cases`` on this rank; rank 0 reports each case (and appends it to ``reported``)."""
    import deepep_cupy as ep

    rank = group.rank

    def new_buffer():
        buf = ep.Buffer(group, nvl_bytes, timeout_s=args.timeout)
        # The path of ranks with processes of their own (a fresh dispatch with rows in place in
        # one launch), which in-process ranks then take, polling their slots for the counts.
        if args.exchange_in_transfer:
            buf._engine.ctx.exchange_in_transfer = True
        return buf

    with RankBuffer(group, new_buffer) as rank_buf:
        warm_combine_kernels(group.size)
        for case in cases:
            group.barrier()  # nobody uses the previous case's reference any more
            if rank == 0:
                shared.clear()
                watchdog.start({"seed": case["seed"], "case": describe_case(case)})
            group.barrier()  # start together: see local_gpu_worker.rank_main
            start = time.monotonic()
            outcome = run_case(rank_buf.buf, case)
            outcomes = group.allgather(outcome)
            if rank == 0:
                watchdog.end()
                record = case_record(case, outcomes, time.monotonic() - start, args)
                reported.append(record)
                report(record, args)
            rank_buf.renew_unless(all(ok for ok, _ in outcomes))


def run_rank_count(num_ranks, cases, num_gpus, args, shared, watchdog):
    """Run one rank count's cases; returns ``(records of every case, the group broke down and left
    threads behind)``."""
    nvl_bytes = max(nvl_bytes_needed(c) for c in cases)

    def not_run(case, why):
        record = not_run_record(case, why, args)
        report(record, args)
        return record

    return run_local_batch(num_ranks, cases, num_gpus, args.case_deadline, watchdog, not_run,
                           lambda group, reported: rank_loop(group, cases, nvl_bytes, args, shared, watchdog,
                                                             reported))


def run_local_batch(num_ranks, items, num_gpus, deadline_s, watchdog, not_run, rank_loop):
    """Run ``rank_loop(group, reported)`` on ``num_ranks`` in-process ranks (rank ``r`` on GPU
    ``r % num_gpus``), which appends a record per item (a case, a sequence) to ``reported``;
    returns ``(records of every item, the group broke down and left threads behind)``. When the
    group breaks down, an ``ERROR`` record says why and ``not_run(item, why)`` makes the record of
    each item that did not report."""
    import deepep_cupy as ep

    devices = [r % num_gpus for r in range(num_ranks)]
    reported, stuck = [], False
    try:
        ep.run_local_group(lambda group: rank_loop(group, reported), num_ranks, devices, timeout_s=deadline_s + 30,
                           num_sms=max(item["num_sms"] for item in items))
    except ep.RankFailed as exc:
        watchdog.end()
        stuck = bool(exc.stuck)
        emit("ERROR", {"ranks": num_ranks, "rank": exc.rank, "message": str(exc), "stuck": exc.stuck,
                       "traceback": "".join(traceback.format_exception(type(exc.exception), exc.exception,
                                                                       exc.exception.__traceback__))})
        done = {r["seed"] for r in reported}
        reported += [not_run(item, f"the {num_ranks}-rank group broke down: {exc}") for item in items
                     if item["seed"] not in done]
    return reported, stuck


# ---------------------------------------------------------------------------------------------
# The soak


def summarize(records, args, seconds, batches):
    failed = sorted(r["seed"] for r in records if not r["ok"])
    summary = {"cases": len(records), "passed": len(records) - len(failed), "failed": failed,
               "seeds": [args.seed, args.seed + args.cases - 1], "seconds": round(seconds, 1),
               "per_rank_count": batches}
    per_count = ", ".join(f"{r} ranks: {b['cases']} in {b['seconds']:.1f} s" for r, b in batches.items())
    line = (f"soak: {len(records)} cases, seeds {args.seed}..{args.seed + args.cases - 1}, {len(failed)} failed"
            f"{' ' + str(failed) if failed else ''}, {seconds:.1f} s ({per_count})")
    return summary, line


def list_cases(args):
    for case in random_cases(args.seed, args.cases, args.gpus or DEFAULT_GPUS, DEFAULT_SM_COUNT):
        print(describe_case(case))
    return 0


def visible_gpus(args, program: str = "the random-case soak (tests/workers/random_soak.py)"):
    """``(GPUs to use, the smallest SM count among them)``; without a usable GPU, one sentence
    naming ``program`` and exit status 2."""
    exit_unless_gpu(program)
    return gpus_to_use(args)


def gpus_to_use(args):
    """``(GPUs to use: --gpus or every visible one, the smallest SM count among them)``."""
    import cupy

    from deepep_cupy.gpu.sm_budget import sm_count_of

    count = cupy.cuda.runtime.getDeviceCount()
    gpus = args.gpus or count
    if gpus > count:
        raise SystemExit(f"--gpus {gpus}: {count} GPUs are visible")
    return gpus, min(sm_count_of(d) for d in range(gpus))


def main(argv):
    args = parse_args(argv)
    if args.list:
        return list_cases(args)
    start = time.monotonic()
    num_gpus, sm_count = visible_gpus(args)
    cases = random_cases(args.seed, args.cases, num_gpus, sm_count)
    shared = SharedReference()
    shared.install()
    watchdog = Watchdog(args.case_deadline)
    records, batches, stuck = [], {}, False
    for num_ranks, batch in by_rank_count(cases).items():
        if stuck:
            # Rank threads of an earlier group still run (GPU work too, maybe): no clean start.
            for case in batch:
                records.append(not_run_record(case, "an earlier group left rank threads behind", args))
                report(records[-1], args)
            continue
        batch_start = time.monotonic()
        reported, stuck = run_rank_count(num_ranks, batch, num_gpus, args, shared, watchdog)
        records += reported
        batches[num_ranks] = {"cases": len(batch), "seconds": round(time.monotonic() - batch_start, 1),
                              "case_seconds": round(sum(r["seconds"] for r in reported), 1),
                              "ranks_per_gpu": ranks_per_gpu(num_ranks, num_gpus)}
        emit("BATCH", {"ranks": num_ranks, **batches[num_ranks]})
    summary, line = summarize(records, args, time.monotonic() - start, batches)
    emit("SUMMARY", summary)
    print(line, flush=True)
    return 1 if summary["failed"] or summary["cases"] != args.cases else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
