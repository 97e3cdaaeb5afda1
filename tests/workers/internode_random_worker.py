"""MPI worker running random internode cases (tests/workers/internode_cases.py), each collectively
on an internode Buffer over simulated nodes with the MPI rail transport, every result compared
bit-exactly with deepep_cupy.reference.internode.

Usage::

    mpiexec -n R python tests/workers/internode_random_worker.py --seed S --cases N [--timeout T] [--records]
    mpiexec -n R python tests/workers/internode_random_worker.py --seeds 3 17 42

(with ``DEEPEP_TEST_ONE_GPU_MPI=1`` the tests put ``one_gpu_ranks.py`` in front: every rank on GPU 0;
``make soak-internode`` starts it through tests/workers/internode_soak.py). ``R`` must be at least
the largest rank count among the cases; a case of more ranks fails, saying so.

Cases are grouped by node shape (nodes x ranks per node), in seed order within a shape. For each
shape the first ``nodes * ranks per node`` processes split off a communicator and make one Buffer
(``ranks_per_node``, ``internode_transport="mpi"``, sized for the largest case of the shape); the
others wait. After a case that fails on any rank the next case gets new Buffers (a Buffer that
cannot be made fails the case it was made for). Every rank computes the whole reference of a case
itself (the cases are capped to keep that cheap).

Output (``TAG {json}`` lines):
    RESULT   every rank, every case: rank, seed, shape, ok, error, seconds, rows received and sent
             to other nodes (tests/test_gpu_internode_random.py reads them)
    FAIL     a failing case (rank 0): seed, description, each failing rank's error, the command
             that runs it alone
    CASE     every case (rank 0, only with ``--records``)
    HANG     a case still running after ``--case-deadline`` seconds: that rank dumps its threads'
             stacks and exits with 3 (mpiexec then ends the job)
    SUMMARY  cases, failed seeds, seconds, cases and seconds per shape (rank 0)
then one plain line with the same summary (rank 0). Exit status 1 if any case failed.
"""

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import traceback

import internode_cases as ic
import numpy as np
from gpu_worker import Mismatch, device_array, draw_rows, expect_equal, to_numpy

#: Seconds the kernels and the rail transfers of a case may wait for a peer (the Buffer's timeout_s).
DEFAULT_TIMEOUT_S = 60.0
#: The skew of a "skewed" case's routing (reference.random_routing: low expert ids, node 0, are hot).
SKEW = 4.0


def emit(tag, record):
    print(f"{tag} {json.dumps(record)}", flush=True)


# ---------------------------------------------------------------------------------------------
# Inputs and reference


def make_inputs(case):
    """Every rank's x (storage dtype), scales (None but for FP8), topk_idx and topk_weights."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(case["seed"])
    L, N = case["ranks_per_node"], case["num_nodes"]
    E, K, H, dtype = case["num_experts"], case["num_topk"], case["hidden"], case["dtype"]
    experts_per_node = E // N
    drop = ic.DROP_FRACTION if case["drop"] else 0.0
    inputs = []
    for r, n in enumerate(ic.token_counts(case)):
        if case["routing"] in ("one_node", "own_node"):
            node = case["node"] if case["routing"] == "one_node" else r // L
            topk = ref.random_routing(rng, n, experts_per_node, K, drop_fraction=drop)
            topk = np.where(topk >= 0, topk + node * experts_per_node, -1).astype(np.int64)
        else:
            topk = ref.random_routing(rng, n, E, K, skew=SKEW if case["routing"] == "skewed" else 0.0,
                                      drop_fraction=drop)
        weights = rng.random((n, K), dtype=np.float32) + 0.5
        x, scales = draw_rows(rng, n, H, dtype)
        inputs.append(dict(x=x, scales=scales, topk=topk, weights=weights))
    return inputs


def reference_dispatch(case, inputs):
    from deepep_cupy.reference import internode as iref

    fp8 = inputs[0]["scales"] is not None
    return iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], case["num_experts"],
                         case["ranks_per_node"],
                         topk_weights=[i["weights"] for i in inputs] if case["with_weights"] else None,
                         x_scales=[i["scales"] for i in inputs] if fp8 else None,
                         expert_alignment=case["expert_alignment"])


def combine_inputs(case, want):
    """Per rank: the rows combine takes (receive order, the combine dtype's storage), their top-k
    weights (None without weights) and the biases (a tuple of 0..2 arrays like x)."""
    from deepep_cupy.reference import intranode as ref

    dtype, H, K = ic.combine_dtype(case), case["hidden"], case["num_topk"]
    rng = np.random.default_rng([case["seed"], 1])
    ys = [ref.round_to_dtype(rng.standard_normal((len(w["recv_x"]), H), dtype=np.float32), dtype) for w in want]
    yw = [rng.random((len(w["recv_x"]), K), dtype=np.float32) for w in want] if case["with_weights"] else None
    biases = [tuple(ref.round_to_dtype(rng.standard_normal((n, H), dtype=np.float32), dtype)
                    for _ in range(case["bias"])) for n in ic.token_counts(case)]
    return ys, yw, biases


# ---------------------------------------------------------------------------------------------
# One case on one rank


def run_case(buf, case):
    """Layout, fresh dispatch, cached dispatch and combine of ``case`` on this rank, each output
    compared with the reference; raises :class:`Mismatch` naming every difference. Returns
    ``{"received": rows, "internode_rows": rows sent to other nodes}``."""
    import cupy

    from deepep_cupy.reference import internode as iref
    from deepep_cupy.reference import intranode as ref

    R, L, N = case["num_ranks"], case["ranks_per_node"], case["num_nodes"]
    rank = buf.rank
    if buf.num_ranks != R or buf.topology.ranks_per_node != L:
        raise Mismatch(f"the Buffer has {buf.num_ranks} ranks of {buf.topology.ranks_per_node} per node; the case "
                       f"wants {N}x{L}")
    E, H = case["num_experts"], case["hidden"]
    config = ic.config_of(case)
    inputs = make_inputs(case)
    mine = inputs[rank]
    fp8 = mine["scales"] is not None
    want_all = reference_dispatch(case, inputs)
    want = want_all[rank]
    torch_mode = case["framework"] == "torch"

    def device(a):
        return device_array(a, torch_mode)

    x = device(mine["x"])
    if fp8:
        scales = device(mine["scales"])
        if case["scales_layout"] == "column":  # DeepEP's own test passes them so
            scales = scales.T.contiguous().T if torch_mode else cupy.asfortranarray(scales)
        if torch_mode:
            import torch

            x = x.view(torch.float8_e4m3fn)
        x = (x, scales)
    topk = device(mine["topk"])
    weights = device(mine["weights"]) if case["with_weights"] else None
    asynchronous = case["mode"] == "async"

    def call(operation, *args, **kwargs):
        if not asynchronous:
            return operation(*args, **kwargs)
        # The job's stream, which PyTorch cases use too: Buffer.capture() alone records on PyTorch's
        # current stream once this process has used PyTorch, not on CuPy's (where the inputs were made).
        out = operation(*args, previous_event=buf.capture(cupy.cuda.get_current_stream()), async_finish=True,
                        allocate_on_comm_stream=True, **kwargs)
        out[-1].current_stream_wait()
        return out

    # Every rank goes through every step whatever it finds (a rank that stopped at its first
    # mismatch would leave its peers waiting in the next call); the differences are raised at the end.
    problems = []

    def check(what, got, want_value):
        try:
            expect_equal(what, got, want_value)
        except Mismatch as exc:
            problems.append(str(exc))

    fail = problems.append

    # Layout
    per_rank, per_node, per_expert, in_rank, _ = call(buf.get_dispatch_layout, topk, E)
    w_rank, w_node, w_expert, w_in = iref.get_dispatch_layout(mine["topk"], E, R, L)
    check("num_tokens_per_rank", to_numpy(per_rank), w_rank)
    check("num_tokens_per_rdma_rank", to_numpy(per_node), w_node)
    check("num_tokens_per_expert", to_numpy(per_expert), w_expert)
    check("is_token_in_rank", to_numpy(in_rank), w_in)

    # Fresh dispatch
    n = len(want["recv_x"])
    worst = ic.worst_rows([len(w["recv_x"]) for w in want_all]) if case["worst"] else 0
    rows = worst or n

    def check_received_rows(what, received):
        """``rows`` rows (and FP8 scales), the first ``n`` the reference's."""
        got_x = received[0] if fp8 else received
        if got_x.shape[0] != rows:
            fail(f"{what}: {got_x.shape[0]} rows, expected {rows}")
        check(what, to_numpy(got_x)[:n], want["recv_x"])
        if fp8:
            check(f"{what}_scales", to_numpy(received[1])[:n], want["recv_x_scales"])

    recv_x, recv_topk, recv_w, experts, handle, _ = call(
        buf.dispatch, x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
        expert_alignment=case["expert_alignment"], num_worst_tokens=worst, config=config)
    check_received_rows("recv_x", recv_x)
    got_topk = to_numpy(recv_topk)
    check("recv_topk_idx", got_topk[:n], want["recv_topk_idx"])
    if not (got_topk[n:] == -1).all():
        fail("recv_topk_idx: rows past the received ones are not -1")
    if want["recv_topk_weights"] is None:
        if recv_w is not None:
            fail("recv_topk_weights: returned without topk_weights")
    else:
        check("recv_topk_weights", to_numpy(recv_w)[:n], want["recv_topk_weights"])
    if experts != ([] if worst else want["num_recv_tokens_per_expert_list"]):
        fail(f"expert counts {experts}, expected {want['num_recv_tokens_per_expert_list']}")
    # A dispatch in fixed-size blocks (num_worst_tokens over a transport a graph can hold) sends every
    # node a block of the group's largest token count, whatever the routing.
    blocks = getattr(handle, "block_tokens", 0)
    counts = ((blocks,) * len(want["send_counts"]),) * 2 if blocks else \
        (tuple(want["send_counts"]), tuple(want["recv_counts"]))
    if (handle.send_counts, handle.recv_counts) != counts:
        fail(f"handle counts {handle.send_counts}/{handle.recv_counts}, expected {counts[0]}/{counts[1]}")

    # Cached dispatch
    if case["cached"]:
        cached, none_topk, _, _, _, _ = call(buf.dispatch, x, handle=handle, config=config)
        if none_topk is not None:
            fail("cached dispatch returned top-k")
        check_received_rows("cached recv_x", cached)

    # Combine
    if case["combine"]:
        dtype = ic.combine_dtype(case)
        ys, yw, biases = combine_inputs(case, want_all)
        combined = iref.combine(ys, want_all, dtype, topk_weights=yw, bias=biases)
        y = np.zeros((rows, H), ys[rank].dtype)
        y[:n] = ys[rank]
        y_w = None
        if yw is not None:
            y_w = np.zeros((rows, case["num_topk"]), np.float32)
            y_w[:n] = yw[rank]
        mine_biases = tuple(device(b) for b in biases[rank])
        bias = mine_biases[0] if len(mine_biases) == 1 else (mine_biases or None)  # DeepEP: an array or a pair
        out, out_w, _ = call(buf.combine, device(y), handle, topk_weights=device(y_w), bias=bias, config=config)
        check("combined_x", to_numpy(out), ref.round_to_dtype(combined[rank][0], dtype))
        if yw is None:
            if out_w is not None:
                fail("combined_topk_weights: returned without topk_weights")
        else:
            check("combined_topk_weights", to_numpy(out_w), combined[rank][1])
    if problems:
        raise Mismatch("; ".join(problems))
    return {"received": n, "internode_rows": sum(want["send_counts"]) - want["send_counts"][rank // L]}


# ---------------------------------------------------------------------------------------------
# The job


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", help="the seeds to run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case (with --cases)")
    parser.add_argument("--cases", type=int, default=None, help="run seeds --seed .. --seed + N - 1")
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("DEEPEP_TEST_TIMEOUT_S",
                                                                              DEFAULT_TIMEOUT_S)),
                        help=f"Buffer timeout_s, seconds (default $DEEPEP_TEST_TIMEOUT_S or {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--case-deadline", type=float, default=None,
                        help="seconds after which a case counts as hung (default 3 x timeout + 60)")
    parser.add_argument("--records", action="store_true", help="print a CASE record for every case")
    args = parser.parse_args(argv)
    if (args.seeds is None) == (args.cases is None):
        parser.error("give either --seeds S [S ...] or --seed S --cases N")
    if args.cases is not None:
        if args.cases < 1:
            parser.error(f"--cases: expected at least 1, got {args.cases}")
        args.seeds = list(range(args.seed, args.seed + args.cases))
    if min(args.seeds) < 0:
        parser.error(f"seeds: expected non-negative seeds, got {min(args.seeds)}")
    if not args.timeout > 0:
        parser.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    if args.case_deadline is None:
        args.case_deadline = 3 * args.timeout + 60
    return args


def by_shape(cases):
    """``{(nodes, ranks per node): [cases in seed order]}``, by rank count, then ranks per node."""
    batches = {}
    for case in cases:
        batches.setdefault((case["num_nodes"], case["ranks_per_node"]), []).append(case)
    return dict(sorted(batches.items(), key=lambda item: (item[0][0] * item[0][1], item[0][1])))


def reproduce_command(seed):
    return f"make soak-internode SOAK_INTERNODE_SEED={seed} SOAK_INTERNODE_CASES=1"


def case_record(case, errors, seconds):
    """What the job reports of one case (``errors``: ``{rank: error}`` of the failing ranks)."""
    return {"seed": case["seed"], "shape": f"{case['num_nodes']}x{case['ranks_per_node']}", "ok": not errors,
            "seconds": round(seconds, 3), "case": ic.describe_case(case), "errors": errors,
            "reproduce": reproduce_command(case["seed"])}


def report(record, records_wanted):
    if not record["ok"]:
        emit("FAIL", record)
    if records_wanted:
        emit("CASE", record)


class CaseWatchdog:
    """Names a case that runs past the deadline, dumps this process's stacks and ends it (exit 3)."""

    def __init__(self, deadline_s, rank):
        self.deadline_s, self.rank = deadline_s, rank
        self._timer = None

    def start(self, case):
        self._timer = threading.Timer(self.deadline_s, self._hang, (case,))
        self._timer.daemon = True
        self._timer.start()

    def end(self):
        if self._timer is not None:
            self._timer.cancel()

    def _hang(self, case):
        emit("HANG", {"rank": self.rank, "seed": case["seed"], "case": ic.describe_case(case),
                      "deadline_s": self.deadline_s})
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(3)


def run_on_rank(buf, case, stream):
    """``(ok, error, info)`` of one case on this rank, on the case's stream: the job's side stream,
    or its library's default stream (PyTorch's legacy default stream, CuPy's null stream); without
    PyTorch, with CuPy arrays, ``info["framework"]`` saying so."""
    import cupy

    side = case.get("stream", "side") == "side"
    context, note = (contextlib.nullcontext() if stream is None else stream) if side else cupy.cuda.Stream.null, {}
    if case["framework"] == "torch":
        try:
            import torch
        except ImportError:
            case, note = dict(case, framework="cupy"), {"framework": "cupy: PyTorch is not installed"}
        else:
            torch_stream = torch.cuda.ExternalStream(stream.ptr) if side else torch.cuda.default_stream()
            context = _both(context, torch.cuda.stream(torch_stream))
    try:
        with context:
            return True, None, {**run_case(buf, case), **note}
    except Exception as exc:  # reported with the case; the job goes on
        return False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", note


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def run_shape(comm, batch, args, stream, watchdog):
    """Run one shape's cases on the ranks of ``comm``; returns the records (on rank 0 of ``comm``).
    The Buffer is made before the first case and again before the case after a failing one; a
    Buffer that cannot be made fails the case it was made for."""
    from mpi4py import MPI

    import deepep_cupy as ep

    rank, L = comm.Get_rank(), batch[0]["ranks_per_node"]
    nvl_bytes = max(ic.nvl_bytes_needed(c) for c in batch)
    rdma_bytes = max(ic.rdma_bytes_needed(c) for c in batch)

    def new_buffer():
        """``(Buffer, None)``, or ``(None, why not)``."""
        try:
            return ep.Buffer(comm, nvl_bytes, rdma_bytes, ranks_per_node=L, internode_transport="mpi",
                             timeout_s=args.timeout), None
        except Exception as exc:  # reported as the case's error
            return None, f"the Buffer: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"

    records, buf = [], None
    try:
        for case in batch:
            comm.Barrier()
            watchdog.start(case)  # Buffer creation and clean-up included: they are collective too
            start = time.monotonic()
            if buf is None:
                buf, error = new_buffer()
            ok, info = False, {}
            if buf is not None:
                ok, error, info = run_on_rank(buf, case, stream)
            seconds = time.monotonic() - start
            emit("RESULT", {"rank": rank, "size": comm.Get_size(), "seed": case["seed"],
                            "shape": f"{case['num_nodes']}x{L}", "ok": ok, "error": error,
                            "seconds": round(seconds, 3), **info})
            outcomes = comm.gather(error if not ok else None, root=0)
            if rank == 0:
                errors = {str(r): e for r, e in enumerate(outcomes) if e is not None}
                records.append(case_record(case, errors, seconds))
                report(records[-1], args.records)
            if not comm.allreduce(ok, op=MPI.LAND) and buf is not None:
                buf.destroy()  # a kernel may have timed out: such a Buffer is not usable
                buf = None
            watchdog.end()
    finally:
        if buf is not None:
            buf.destroy()
    return records


def summarize(records, seeds, seconds, per_shape):
    failed = sorted(r["seed"] for r in records if not r["ok"])
    summary = {"cases": len(records), "passed": len(records) - len(failed), "failed": failed,
               "seeds": [min(seeds), max(seeds)], "seconds": round(seconds, 1), "per_shape": per_shape}
    shapes = ", ".join(f"{s}: {b['cases']} in {b['seconds']:.1f} s" for s, b in per_shape.items())
    line = (f"internode soak: {len(records)} cases, seeds {min(seeds)}..{max(seeds)}, {len(failed)} failed"
            f"{' ' + str(failed) if failed else ''}, {seconds:.1f} s ({shapes})")
    return summary, line


def use_gpu(rank):
    """This rank's GPU (rank ``r`` on GPU ``r % count``) and the non-blocking stream the cases run on."""
    import cupy

    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy.cuda.Stream(non_blocking=True)


def main(argv):
    from mpi4py import MPI

    args = parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    stream = use_gpu(rank)
    watchdog = CaseWatchdog(args.case_deadline, rank)
    cases = [ic.internode_case(s) for s in args.seeds]
    start = time.monotonic()
    records, per_shape = [], {}
    for (N, L), batch in by_shape(cases).items():
        shape_start = time.monotonic()
        if N * L > size:
            if rank == 0:
                for case in batch:
                    records.append(case_record(case, {"all": f"not run: needs {N * L} ranks, the job has {size}"},
                                               0.0))
                    report(records[-1], args.records)
            continue
        comm = world.Split(0 if rank < N * L else MPI.UNDEFINED, rank)
        if comm != MPI.COMM_NULL:
            with stream:
                records += run_shape(comm, batch, args, stream, watchdog)
            comm.Free()
        world.Barrier()  # the next shape starts once every rank is done with this one
        per_shape[f"{N}x{L}"] = {"cases": len(batch), "seconds": round(time.monotonic() - shape_start, 1)}
    if rank != 0:
        return 0
    summary, line = summarize(records, args.seeds, time.monotonic() - start, per_shape)
    emit("SUMMARY", summary)
    print(line, flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
