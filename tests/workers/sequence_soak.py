"""The sequence soak: random sequences of calls on one Buffer (sequence_cases.py), every step
checked against the NumPy reference and against the memory bound (issue 36).

Usage::

    python tests/workers/sequence_soak.py --sequences N --steps S --seed S0 [--gpus G] [--records]
    python tests/workers/sequence_soak.py --seed S0 --sequences 1 --steps S     # one sequence alone
    python tests/workers/sequence_soak.py --seed S0 --sequences N --list         # print them; no GPU

Runs the sequences of seeds ``S0 .. S0+N-1``, each ``S`` steps long, with every rank a thread of
this process (``deepep_cupy.run_local_group``, rank ``r`` on GPU ``r % G``; G: ``--gpus``, default
every visible GPU; on one GPU all ranks share it). Sequences are grouped by rank count (one group
per rank count); each sequence gets a new Buffer per rank, sized for its widest row and 8,192
tokens per rank, and runs its steps in order on it. A step is a fresh, cached or
``num_worst_tokens`` dispatch followed by a combine where the dtype allows; every output (rows,
scales, top-k, weights, expert counts, the handle of a fresh dispatch, the combined rows and
weights) is compared bit-exactly with ``deepep_cupy.reference.intranode``.

Memory, per step: each rank's ``Buffer.last_dispatch_rows_allocated`` of a fresh dispatch against
``memory_bounds.allowed_rows`` (from the receive counts the soak itself knows; the largest count
is also checked against the Buffer's ``_capacity_guess``), and each device's peak allocation
during the dispatch (CuPy: the ranks' allocators wrapped by one ``memory_bounds.CupyMemoryCounter``
per device, as ranks sharing a GPU share its pool; PyTorch: ``torch.cuda.max_memory_allocated``
per device) against ``memory_bounds.peak_limit`` of the sum of its ranks' exact outputs and bounds.
A step above either bound fails like a wrong result.

A sequence that fails stops there (the next one goes on with new Buffers). A sequence still
running after ``--sequence-deadline`` seconds is a hang: ``HANG {json}`` names it, every thread's
stack is dumped and the process exits with 3.

Output, one line each (``TAG {json}``):
    FAIL      a failing sequence: seed, the failing step and its description, each failing rank's
              error, the command that runs it alone
    STEP      every step (only with ``--records``): per rank the receive count, the rows allocated,
              how, the bound; per device the peak, the exact outputs' bytes and the limit
    SEQUENCE  every sequence (only with ``--records``): ok, steps run, worst ratios
    ERROR     a rank count's group broke down outside any step
    SUMMARY   sequences, failed seeds, steps, the worst ratio of rows allocated to exact rows, of
              peak memory to exact outputs and of peak memory to its limit, seconds
then one plain line with the same summary. Exit status 1 if any sequence failed.
"""

import argparse
import functools
import sys
import time
import traceback

import gpu_worker  # run as a script: its folder is on sys.path
import numpy as np
import random_soak
from local_gpu_worker import Memo, emit
from memory_bounds import (
    CupyMemoryCounter,
    TorchPeak,
    ahead_bound,
    allowed_rows,
    exact_output_bytes,
    most_rows,
    output_row_bytes,
    peak_limit,
)
from random_soak import (
    Watchdog,
    add_run_options,
    by_rank_count,
    check_run_options,
    run_local_batch,
    warm_combine_kernels,
)
from sequence_cases import (
    DEFAULT_GPUS,
    DEFAULT_SM_COUNT,
    DEFAULT_STEPS,
    config_of,
    describe_sequence,
    describe_step,
    nvl_bytes_needed,
    random_sequences,
    step_inputs,
)

#: Seconds a step may take before its sequence counts as hung (on top of 3 timeouts + 30 s).
STEP_ALLOWANCE_S = 4.0
#: Exact outputs smaller than this are left out of the worst peak ratio (allocator rounding).
RATIO_FLOOR_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=200, help="how many sequences (default 200)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"steps per sequence (default {DEFAULT_STEPS})")
    add_run_options(parser, "sequence")
    parser.add_argument("--sequence-deadline", type=float, default=None,
                        help=f"seconds after which a sequence counts as hung (default 3 x timeout + 30 + "
                             f"{STEP_ALLOWANCE_S:g} per step)")
    parser.add_argument("--records", action="store_true", help="print STEP and SEQUENCE records")
    parser.add_argument("--list", action="store_true",
                        help="print the sequences (as drawn for --gpus GPUs, default 2, of 132 SMs) and run nothing")
    args = parser.parse_args(argv)
    if args.sequences < 1:
        parser.error(f"--sequences: expected at least 1, got {args.sequences}")
    if args.steps < 1:
        parser.error(f"--steps: expected at least 1, got {args.steps}")
    check_run_options(parser, args)
    if args.sequence_deadline is None:
        args.sequence_deadline = 3 * args.timeout + 30 + STEP_ALLOWANCE_S * args.steps
    return args


def reproduce_command(seed, args):
    """The command that runs sequence ``seed`` alone on this machine."""
    extra = f" SOAK_SEQUENCE_ARGS='--gpus {args.gpus}'" if args.gpus else ""
    return f"make soak-sequences SOAK_SEQUENCE_SEED={seed} SOAK_SEQUENCES=1 SOAK_STEPS={args.steps}{extra}"


# ---------------------------------------------------------------------------------------------
# One step on one rank


def step_reference(seq, step, num_channels):
    """``(inputs, dispatch results, combine results or None, num_worst_tokens or 0)``."""
    from deepep_cupy.reference import intranode as ref

    inputs = step_inputs(seq, step)
    fp8 = step["dtype"] == "float8_e4m3fn"
    results = ref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], seq["num_experts"], num_channels,
                           topk_weights=[i["weights"] for i in inputs] if seq["with_weights"] else None,
                           x_scales=[i["scales"] for i in inputs] if fp8 else None,
                           expert_alignment=seq["expert_alignment"])
    combined = None
    if step["combine"]:
        # After a cached dispatch nothing returns weights: its combine has none.
        weighted = seq["with_weights"] and step["kind"] != "cached"
        combined = ref.combine([r["recv_x"] for r in results], results,
                               topk_weights=[r["recv_topk_weights"] for r in results] if weighted else None)
    worst = 0
    if step["kind"] == "worst":
        most = max(r["recv_x"].shape[0] for r in results) if step["worst_rows"] == "most_received" \
            else sum(step["tokens"])
        worst = max(1, most + step["worst_spare"])  # 0 would be a dispatch without num_worst_tokens
    return inputs, results, combined, worst


class RankState:
    """What one rank keeps across the steps of a sequence."""

    def __init__(self, buf):
        self.buf = buf
        self.handle = None             # the last fresh dispatch's (cached steps use it)
        self.largest = 0               # the largest receive count of the Buffer's fresh dispatches
        self.last_fresh = None         # (dtype, hidden, tokens) of the last fresh dispatch: steady calls


class Phases:
    """A step's phases on every rank, with an allgather between each two: a rank whose phase
    failed takes part in the rest only to stop with the others (no rank waits in a kernel for one
    that gave up)."""

    def __init__(self, group, buf):
        self.group, self.buf = group, buf
        self.ok, self.error = True, None

    def run(self, phase, *args):
        if self.ok:
            try:
                phase(*args)
            except Exception as exc:  # reported with the step
                self.ok = False
                self.error = f"{type(exc).__name__}: {exc}{gpu_worker.kernel_error(self.buf)}\n" \
                             f"{traceback.format_exc()}"
        return all(self.group.allgather(self.ok))


def run_step(ctx, state, seq, step, memo):
    """One step on this rank; returns ``(ok, error, info)`` (the same ``ok`` on every rank)."""
    import cupy

    from deepep_cupy.reference import intranode as ref

    buf, group, rank = state.buf, ctx["group"], ctx["group"].rank
    config = config_of(seq)
    torch_arrays = seq["framework"] == "torch"
    phases = Phases(group, buf)
    work = {}

    def to_device(a):
        return gpu_worker.device_array(a, torch_arrays)

    def prepare():
        inputs, results, combined, worst = memo.get((seq["seed"], step["index"]),
                                                    lambda: step_reference(seq, step, config.num_channels))
        mine = inputs[rank]
        x = to_device(mine["x"])
        if mine["scales"] is not None:
            if torch_arrays:
                import torch

                x = x.view(torch.float8_e4m3fn)
            x = (x, to_device(mine["scales"]))
        work.update(inputs=inputs, results=results, want=results[rank], combined=combined, worst=worst, x=x)
        if step["kind"] != "cached":
            topk = to_device(mine["topk"])
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, seq["num_experts"])
            want_rank, want_expert, want_in_rank = ref.get_dispatch_layout(mine["topk"], seq["num_experts"],
                                                                           seq["num_ranks"])
            gpu_worker.expect_equal("num_tokens_per_rank", gpu_worker.to_numpy(per_rank), want_rank)
            gpu_worker.expect_equal("num_tokens_per_expert", gpu_worker.to_numpy(per_expert), want_expert)
            gpu_worker.expect_equal("is_token_in_rank", gpu_worker.to_numpy(in_rank), want_in_rank)
            work["kwargs"] = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                  num_tokens_per_expert=per_expert, topk_idx=topk,
                                  topk_weights=to_device(mine["weights"]), expert_alignment=seq["expert_alignment"],
                                  config=config)
        elif state.handle is None:
            raise AssertionError("a cached step without a fresh dispatch before it")
        synchronize()

    def synchronize():
        cupy.cuda.get_current_stream().synchronize()

    def reset_peak():
        if ctx["leader"]:
            work["before"] = ctx["meter"].reset_peak()

    def call():
        if step["kind"] == "cached":
            work["out"] = buf.dispatch(work["x"], handle=state.handle, config=config)
        elif step["kind"] == "worst":
            work["out"] = buf.dispatch(work["x"], num_worst_tokens=work["worst"], **work["kwargs"])
        else:
            work["out"] = buf.dispatch(work["x"], **work["kwargs"])
        synchronize()

    def read_peak():
        work["peak"] = ctx["meter"].peak - work["before"] if ctx["leader"] else None
        work["rows_allocated"] = buf.last_dispatch_rows_allocated
        work["allocation"] = buf.last_dispatch_allocation

    def check_call():
        check_dispatch(step, seq, work, state)

    def combine():
        recv_x, _, recv_weights, _, handle, _ = work["out"]
        handle = state.handle if step["kind"] == "cached" else handle
        weights = recv_weights if seq["with_weights"] and step["kind"] != "cached" else None
        combined_x, combined_w, _ = buf.combine(recv_x, handle, topk_weights=weights, config=config)
        want_x, want_w = work["combined"][rank]
        gpu_worker.expect_equal("combined x", gpu_worker.to_numpy(combined_x),
                                ref.round_to_dtype(want_x, step["dtype"]))
        if weights is not None:
            gpu_worker.expect_equal("combined topk_weights", gpu_worker.to_numpy(combined_w), want_w)
        elif combined_w is not None:
            raise gpu_worker.Mismatch("combine without topk_weights returned weights")
        synchronize()
        buf.check_kernel_errors()

    for phase in (prepare, reset_peak, call, read_peak, check_call):
        if not phases.run(phase):
            return False, phases.error, {}
    if step["combine"] and not phases.run(combine):
        return False, phases.error, {}
    return True, None, rank_memory(ctx, state, seq, step, work, config)


def check_dispatch(step, seq, work, state):
    """The dispatch's outputs against the reference (and, fresh, the handle and expert counts)."""
    expect_equal, to_numpy, Mismatch = gpu_worker.expect_equal, gpu_worker.to_numpy, gpu_worker.Mismatch
    want, kind = work["want"], step["kind"]
    recv_x, recv_topk, recv_weights, per_expert_list, handle, _ = work["out"]
    num_recv = want["recv_x"].shape[0]
    fp8 = step["dtype"] == "float8_e4m3fn"
    rows, scales = recv_x if fp8 else (recv_x, None)
    got_rows = to_numpy(rows)
    if kind == "worst":
        if got_rows.shape[0] != work["worst"]:
            raise Mismatch(f"num_worst_tokens={work['worst']}: {got_rows.shape[0]} rows")
        got_rows = got_rows[:num_recv]
        expect_equal("worst: handle.recv_count", to_numpy(handle.recv_count), np.array([num_recv], np.int32))
        expect_equal("worst: handle.recv_expert_counts", to_numpy(handle.recv_expert_counts),
                     np.array(want["num_recv_tokens_per_expert_list"], np.int32))
    expect_equal(f"{kind}: recv_x", got_rows, want["recv_x"])
    if fp8:
        expect_equal(f"{kind}: recv_x scales", to_numpy(scales)[:num_recv], want["recv_x_scales"])
    if kind == "cached":
        return
    topk = to_numpy(recv_topk)
    expect_equal(f"{kind}: recv_topk_idx", topk[:num_recv], want["recv_topk_idx"])
    if kind == "worst" and not np.all(topk[num_recv:] == -1):
        raise Mismatch("worst: recv_topk_idx past the received rows is not all -1")
    if seq["with_weights"]:
        expect_equal(f"{kind}: recv_topk_weights", to_numpy(recv_weights)[:num_recv], want["recv_topk_weights"])
    elif recv_weights is not None:
        raise Mismatch(f"{kind}: weights returned without topk_weights")
    if kind == "worst":
        return
    gpu_worker.check_fresh_handle(per_expert_list, handle, want)
    state.handle = handle


def rank_memory(ctx, state, seq, step, work, config):
    """This rank's rows and bytes of the step (and the Buffer's bookkeeping moved on)."""
    rank, kind = ctx["group"].rank, step["kind"]
    num_recv = int(work["want"]["recv_x"].shape[0])
    fresh = kind != "cached"
    row_bytes = output_row_bytes(step["dtype"], step["hidden"], seq["num_topk"] if fresh else 0,
                                 seq["with_weights"] and fresh)
    if not fresh:
        row_bytes -= 4  # a cached dispatch allocates no source indices
    info = {"rank": rank, "recv": num_recv, "allocation": work["allocation"] if fresh else "cached",
            "device": ctx["device"], "peak": work["peak"]}
    if kind == "fresh":
        most = most_rows(seq["num_ranks"], config, step["dtype"], step["hidden"], seq["num_topk"], ctx["nvl_bytes"])
        shape = (step["dtype"], step["hidden"], step["tokens"][rank])
        steady = state.last_fresh == shape
        bound = ahead_bound(state.largest, most, steady)
        info.update(rows_allocated=work["rows_allocated"], largest_before=state.largest, most_rows=most,
                    steady=steady, bound=bound, allowed=allowed_rows(num_recv, state.largest, most, steady),
                    guess_largest=state.buf._engine.dispatch_path._capacity_guess.largest_received)
        exact = exact_output_bytes(num_recv, row_bytes, seq["num_ranks"], config.num_channels, step["tokens"][rank])
        state.largest = max(state.largest, num_recv)
        state.last_fresh = shape
    elif kind == "worst":
        exact = exact_output_bytes(work["worst"], row_bytes, seq["num_ranks"], config.num_channels,
                                   step["tokens"][rank])
        bound = 0
        info.update(num_worst_tokens=work["worst"])
    else:
        exact, bound = num_recv * row_bytes, 0
    info.update(exact_bytes=exact, bound_bytes=bound * row_bytes)
    return info


def check_step_memory(infos, devices):
    """``(errors by rank, per-device records)`` of a step from every rank's info."""
    errors = {}
    for info in infos:
        if "rows_allocated" not in info:
            continue
        if info["rows_allocated"] is None or info["rows_allocated"] > info["allowed"]:
            errors[str(info["rank"])] = (f"bound: allocated {info['rows_allocated']} rows for {info['recv']} received, "
                                         f"at most {info['allowed']} (largest before {info['largest_before']})")
        elif info["guess_largest"] != max(info["largest_before"], info["recv"]):
            errors[str(info["rank"])] = (f"bookkeeping: the Buffer's largest receive count is {info['guess_largest']}, "
                                         f"the soak's {max(info['largest_before'], info['recv'])}")
    records = []
    for device in sorted(set(devices)):
        ranks = [r for r, d in enumerate(devices) if d == device]
        exact = sum(infos[r]["exact_bytes"] for r in ranks)
        bound = sum(infos[r]["bound_bytes"] for r in ranks)
        peak = infos[ranks[0]]["peak"]
        limit = peak_limit(exact, bound, len(ranks))
        records.append({"device": device, "ranks": ranks, "peak_bytes": peak, "exact_bytes": exact,
                        "bound_bytes": bound, "limit_bytes": limit})
        if peak > limit:
            errors[str(ranks[0])] = (f"bound: device {device} peaked at {peak} bytes during the dispatch, at most "
                                     f"{limit} ({exact} of exact outputs)")
    return errors, records


# ---------------------------------------------------------------------------------------------
# Sequences on one rank count


class Worst:
    """The worst ratios seen: rows allocated / exact rows (fresh dispatches receiving rows), peak
    device bytes / exact output bytes (steps with at least RATIO_FLOOR_BYTES of outputs), and peak
    device bytes / their limit (every step: how close a step came to failing)."""

    def __init__(self):
        self.rows = {"ratio": 0.0}
        self.peak = {"ratio": 0.0}
        self.of_limit = {"ratio": 0.0}

    def note(self, seed, step, infos, devices):
        for info in infos:
            if info.get("rows_allocated") and info["recv"]:
                ratio = info["rows_allocated"] / info["recv"]
                if ratio > self.rows["ratio"]:
                    self.rows = {"ratio": round(ratio, 3), "seed": seed, "step": step, "rank": info["rank"],
                                 "rows": info["rows_allocated"], "recv": info["recv"]}
        for device in devices:
            ratio = device["peak_bytes"] / device["limit_bytes"]
            if ratio > self.of_limit["ratio"]:
                self.of_limit = {"ratio": round(ratio, 3), "seed": seed, "step": step, "device": device["device"],
                                 "peak_bytes": device["peak_bytes"], "limit_bytes": device["limit_bytes"]}
            if device["exact_bytes"] >= RATIO_FLOOR_BYTES:
                ratio = device["peak_bytes"] / device["exact_bytes"]
                if ratio > self.peak["ratio"]:
                    self.peak = {"ratio": round(ratio, 3), "seed": seed, "step": step, "device": device["device"],
                                 "peak_bytes": device["peak_bytes"], "exact_bytes": device["exact_bytes"]}

    def merge(self, other):
        if other.rows["ratio"] > self.rows["ratio"]:
            self.rows = other.rows
        if other.peak["ratio"] > self.peak["ratio"]:
            self.peak = other.peak
        if other.of_limit["ratio"] > self.of_limit["ratio"]:
            self.of_limit = other.of_limit


def run_sequence(ctx, seq, memo, watchdog, args):
    """Run ``seq`` on this rank with a new Buffer; rank 0 returns its record (others None)."""
    import deepep_cupy as ep

    group, rank = ctx["group"], ctx["group"].rank
    ctx["nvl_bytes"] = nvl_bytes_needed(seq)
    state = RankState(ep.Buffer(group, ctx["nvl_bytes"], timeout_s=args.timeout))
    worst = Worst()
    failure, steps_run = None, 0
    try:
        for step in seq["steps"]:
            group.barrier()  # nobody uses the previous step's reference any more
            if rank == 0:
                memo.clear()
                watchdog.note(step=step["index"])
            group.barrier()  # nobody asks for this step's before it is cleared
            ok, error, info = run_step(ctx, state, seq, step, memo)
            everyone = group.allgather((ok, error, info))
            steps_run += 1
            if rank == 0:
                errors = {str(r): e for r, (good, e, _) in enumerate(everyone) if not good}
                devices_info = []
                if not errors:
                    infos = [i for _, _, i in everyone]
                    errors, devices_info = check_step_memory(infos, ctx["devices"])
                    worst.note(seq["seed"], step["index"], infos, devices_info)
                if args.records:
                    emit("STEP", {"seed": seq["seed"], "step": step["index"], "kind": step["kind"],
                                  "ok": not errors, "ranks": [i for _, _, i in everyone], "devices": devices_info})
                if errors:
                    failure = {"step": step["index"], "step_description": describe_step(step), "errors": errors}
            if not group.allgather(failure is None)[0]:
                break
    finally:
        state.buf.destroy()
    if rank != 0:
        return None
    return {"seed": seq["seed"], "ranks": seq["num_ranks"], "ok": failure is None, "steps": steps_run,
            "failure": failure, "worst": worst}


def rank_loop(group, sequences, args, memo, watchdog, devices, meters, reported):
    import cupy

    rank = group.rank
    device = devices[rank]
    ctx = {"group": group, "device": device, "devices": devices, "leader": devices.index(device) == rank}
    counter = meters["cupy"][device]
    try:
        with cupy.cuda.using_allocator(counter.wrap(cupy.cuda.get_allocator())):
            warm_combine_kernels(group.size)
            for seq in sequences:
                group.barrier()
                if rank == 0:
                    watchdog.start({"seed": seq["seed"], "sequence": describe_sequence(seq), "step": None})
                ctx["meter"] = meters["torch"][device] if seq["framework"] == "torch" else counter
                with torch_stream(seq, device):
                    record = run_sequence(ctx, seq, memo, watchdog, args)
                if rank == 0:
                    watchdog.end()
                    reported.append(record)
                    report(record, seq, args)
    except BaseException as exc:
        group.abort(f"failed: {type(exc).__name__}: {exc}")
        raise


def torch_stream(seq, device):
    """PyTorch work of a torch sequence on this rank thread's CuPy stream."""
    import contextlib

    if seq["framework"] != "torch":
        return contextlib.nullcontext()
    import cupy
    import torch

    torch.cuda.set_device(device)
    return torch.cuda.stream(torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr, device=f"cuda:{device}"))


def sequence_record(record, seq, args):
    failure = record["failure"] or {}
    return {"seed": record["seed"], "ranks": record["ranks"], "ok": record["ok"], "steps": record["steps"],
            "sequence": describe_sequence(seq), "failed_step": failure.get("step"),
            "step_description": failure.get("step_description"), "errors": failure.get("errors", {}),
            "worst_rows": record["worst"].rows, "worst_peak": record["worst"].peak,
            "worst_peak_of_limit": record["worst"].of_limit,
            "reproduce": reproduce_command(record["seed"], args)}


def report(record, seq, args):
    out = sequence_record(record, seq, args)
    if not record["ok"]:
        emit("FAIL", out)
    if args.records:
        emit("SEQUENCE", out)


def not_run_record(seq, why):
    return {"seed": seq["seed"], "ranks": seq["num_ranks"], "ok": False, "steps": 0,
            "failure": {"step": None, "step_description": None, "errors": {"all": f"not run: {why}"}},
            "worst": Worst()}


def run_rank_count(num_ranks, sequences, num_gpus, args, memo, watchdog, meters):
    """Run one rank count's sequences; returns ``(records, the group broke down leaving threads)``."""
    devices = [r % num_gpus for r in range(num_ranks)]

    def not_run(seq, why):
        record = not_run_record(seq, why)
        report(record, seq, args)
        return record

    return run_local_batch(num_ranks, sequences, num_gpus, args.sequence_deadline, watchdog, not_run,
                           lambda group, reported: rank_loop(group, sequences, args, memo, watchdog, devices, meters,
                                                             reported))


# ---------------------------------------------------------------------------------------------
# The soak


def summarize(records, args, seconds):
    failed = sorted(r["seed"] for r in records if not r["ok"])
    worst = Worst()
    for record in records:
        worst.merge(record["worst"])
    summary = {"sequences": len(records), "passed": len(records) - len(failed), "failed": failed,
               "steps": sum(r["steps"] for r in records), "steps_per_sequence": args.steps,
               "seeds": [args.seed, args.seed + args.sequences - 1], "worst_rows": worst.rows,
               "worst_peak": worst.peak, "worst_peak_of_limit": worst.of_limit, "seconds": round(seconds, 1)}
    line = (f"sequence soak: {len(records)} sequences of {args.steps} steps, seeds {args.seed}.."
            f"{args.seed + args.sequences - 1}, {len(failed)} failed{' ' + str(failed) if failed else ''}; worst rows "
            f"allocated / received {worst.rows['ratio']}, worst peak / exact outputs {worst.peak['ratio']}, "
            f"worst peak / limit {worst.of_limit['ratio']}; "
            f"{seconds:.1f} s")
    return summary, line


def list_sequences(args):
    for seq in random_sequences(args.seed, args.sequences, args.steps, args.gpus or DEFAULT_GPUS, DEFAULT_SM_COUNT):
        print(describe_sequence(seq))
        for step in seq["steps"]:
            print("  " + describe_step(step))
    return 0


visible_gpus = functools.partial(random_soak.visible_gpus,
                                 program="the sequence soak (tests/workers/sequence_soak.py)")


def make_meters(num_gpus):
    """One CuPy counter and one PyTorch statistics reader per device."""
    return {"cupy": {d: CupyMemoryCounter() for d in range(num_gpus)},
            "torch": {d: TorchPeak(d) for d in range(num_gpus)}}


def main(argv):
    args = parse_args(argv)
    if args.list:
        return list_sequences(args)
    start = time.monotonic()
    num_gpus, sm_count = visible_gpus(args)
    sequences = random_sequences(args.seed, args.sequences, args.steps, num_gpus, sm_count)
    memo, watchdog, meters = Memo(), Watchdog(args.sequence_deadline), make_meters(num_gpus)
    records, stuck = [], False
    for num_ranks, batch in by_rank_count(sequences).items():
        if stuck:
            for seq in batch:
                records.append(not_run_record(seq, "an earlier group left rank threads behind"))
                report(records[-1], seq, args)
            continue
        batch_start = time.monotonic()
        reported, stuck = run_rank_count(num_ranks, batch, num_gpus, args, memo, watchdog, meters)
        records += reported
        emit("BATCH", {"ranks": num_ranks, "sequences": len(batch),
                       "seconds": round(time.monotonic() - batch_start, 1)})
    summary, line = summarize(records, args, time.monotonic() - start)
    emit("SUMMARY", summary)
    print(line, flush=True)
    return 1 if summary["failed"] or summary["sequences"] != args.sequences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
