"""Where a decode call's time goes: globaltimer stamps in the low-latency kernels, ranks sharing a GPU.

    python3 scripts/decode_timeline.py [--tokens 1,128] [--num-sms 32,66] [--rounds 2] [--calls 50]
                                       [--define LL_POLL_SLEEP_NS=100 ...]

The ranks are threads of this process on one GPU (``run_local_group``), so every stamp is read
from the same clock and ranks compare with each other. The kernels are compiled from their source
with ``LL_STAMP`` defined (kernels/low_latency.cu leaves it empty), and the ``--define`` macros
(the kernels' tuning knobs, e.g. ``LL_POLL_SLEEP_NS``): per rank, op and call, the
earliest and the latest warp to reach each point (atomicMin / atomicMax of its lane 0). Each op is
captured as the decode benchmark captures it (:func:`deepep_cupy.bench.decode.decode_graphs`) and
replayed ``--calls`` times back to back. Per token count, ``num_sms`` (blocks per launch; the
variants alternate over ``--rounds``), op and rank, medians over the calls, in us:

    loop      GPU time per call (events around the replays), as the decode table gives it
    host      wall time of one replay's launch
    entry     the first block's entry minus the peer's first entry of the same call (+: this rank late)
    released  first entry -> the last warp past the wait for the peers' release of its half
    placed    first entry -> the last dispatch piece whose places (earlier tokens per expert) are known
    written   first entry -> the last piece (dispatch) or team (combine) whose rows are written
    sent      first entry -> the last warp's send done (dispatch: its count signals too)
    seen      first entry -> the last warp to see the peers' signals (counts or flags)
    done      first entry -> the last warp done (before the exit count)
    gap       the last warp done -> the next call's first entry (launch and host)
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Sequence

import numpy as np

from deepep_cupy.gpu.check import exit_unless_gpu

MAX_RANKS_STAMPED, CALLS_KEPT, SLOTS = 8, 64, 7
OPS = ("dispatch", "combine")
STAMPS = f"""
extern "C" __device__ unsigned long long ll_first[{MAX_RANKS_STAMPED * 2 * CALLS_KEPT * SLOTS}];
extern "C" __device__ unsigned long long ll_last[{MAX_RANKS_STAMPED * 2 * CALLS_KEPT * SLOTS}];
#define LL_STAMP(op, call, slot) do {{ if (threadIdx.x % 32 == 0) {{ \\
    unsigned long long t_; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); \\
    const int i_ = ((rank * 2 + (op)) * {CALLS_KEPT} + ((call) & {CALLS_KEPT - 1})) * {SLOTS} + (slot); \\
    atomicMin(ll_first + i_, t_); atomicMax(ll_last + i_, t_); }} }} while (0)
"""
COLUMNS = ("loop", "host", "entry", "released", "placed", "written", "sent", "seen", "done", "gap")
#: The stamp slot of each column measured from the first entry (kernels/low_latency.cu, LL_STAMP).
SLOT_OF = {"released": 1, "placed": 5, "written": 6, "sent": 2, "seen": 3, "done": 4}


def patch_source(name: str, text: str, defines: Sequence[str] = ()) -> str:
    """The kernel source ``name`` with the stamps and ``defines`` (``NAME=VALUE``) defined (only the
    low-latency kernels have them)."""
    if name != "low_latency.cu":
        return text
    macros = "".join(f"#define {d.partition('=')[0]} {d.partition('=')[2]}\n" for d in defines)
    return macros + STAMPS + text


def phases(first: np.ndarray, last: np.ndarray, num_ranks: int, op: int) -> Dict[int, Dict[str, float]]:
    """Per rank, the medians (us) of the stamp columns over the calls stamped (tables of ns)."""
    first = first.reshape(MAX_RANKS_STAMPED, 2, CALLS_KEPT, SLOTS).astype(np.float64)
    last = last.reshape(MAX_RANKS_STAMPED, 2, CALLS_KEPT, SLOTS).astype(np.float64)
    out = {}
    for r in range(num_ranks):
        calls = sorted((c for c in range(CALLS_KEPT) if last[r, op, c, 4] > 0), key=lambda c: first[r, op, c, 0])
        cols: Dict[str, List[float]] = {k: [] for k in COLUMNS[2:]}
        for i, c in enumerate(calls):
            f, end = first[r, op, c], last[r, op, c]
            peers = [first[p, op, c, 0] for p in range(num_ranks) if p != r and last[p, op, c, 4] > 0]
            if peers:
                cols["entry"].append(f[0] - min(peers))
            for name, slot in SLOT_OF.items():
                if end[slot] > 0:
                    cols[name].append(end[slot] - f[0])
            if i + 1 < len(calls):
                cols["gap"].append(first[r, op, calls[i + 1], 0] - end[4])
        out[r] = {k: statistics.median(v) / 1e3 if v else float("nan") for k, v in cols.items()}
    return out


def main() -> None:  # pragma: no cover - needs a GPU
    import cupy
    from _stamped_kernels import compile_patched

    import deepep_cupy as ep
    from deepep_cupy import run_local_group
    from deepep_cupy.bench.calls import _lib_stream
    from deepep_cupy.bench.decode import _graph_library, decode_graphs
    from deepep_cupy.low_latency import path as ll_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,128")
    parser.add_argument("--num-sms", default="32,66")
    parser.add_argument("--num-ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="a macro of kernels/low_latency.cu to set (repeatable)")
    args = parser.parse_args()
    args.seed, args.timeout = 0, 10.0
    exit_unless_gpu("scripts/decode_timeline.py")
    tokens = [int(n) for n in args.tokens.split(",")]

    modules = compile_patched(lambda name, text: patch_source(name, text, args.define))
    size = MAX_RANKS_STAMPED * 2 * CALLS_KEPT * SLOTS

    def tables(op: str):
        module = modules[ll_path.DISPATCH_KERNEL if op == "dispatch" else ll_path.COMBINE_KERNEL]
        return (cupy.ndarray((size,), cupy.uint64, module.get_global("ll_first")),
                cupy.ndarray((size,), cupy.uint64, module.get_global("ll_last")))

    def rank_main(group) -> List[Dict]:
        R = group.size
        stream = cupy.cuda.get_current_stream()
        buf = ep.Buffer(group, 0, ep.Buffer.get_low_latency_rdma_size_hint(max(tokens), args.hidden, R,
                                                                            args.num_experts),
                        low_latency_mode=True, timeout_s=args.timeout)
        lib = _graph_library()
        rows = []
        try:
            with _lib_stream(lib, cupy.cuda.Device().id):
                stream = cupy.cuda.get_current_stream()
                for n in tokens:
                    graphs, _ = decode_graphs(group, buf, args, n, max(tokens), lib)
                    for op_index, op in enumerate(OPS):
                        replay = graphs[op]
                        for _ in range(5):
                            replay()
                        stream.synchronize()
                        group.barrier()
                        if group.rank == 0:
                            first, last = tables(op)
                            first.fill(np.uint64(2**64 - 1))
                            last.fill(0)
                            cupy.cuda.Device().synchronize()
                        group.barrier()
                        start, end = cupy.cuda.Event(), cupy.cuda.Event()
                        start.record(stream)
                        hosts = []
                        for _ in range(args.calls):
                            t0 = time.perf_counter()
                            replay()
                            hosts.append(time.perf_counter() - t0)
                        end.record(stream)
                        end.synchronize()
                        loop = cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.calls
                        group.barrier()
                        row = {"tokens": n, "op": op, "rank": group.rank, "loop": loop,
                               "host": statistics.median(hosts) * 1e6}
                        if group.rank == 0:
                            first, last = tables(op)
                            row["phases"] = phases(first.get(), last.get(), R, op_index)
                        group.barrier()
                        rows.append(row)
        finally:
            group.barrier()
            buf.destroy()
        return rows

    variants = [int(v) for v in args.num_sms.split(",")]
    results: Dict[tuple, List[Dict[str, float]]] = {}
    for round_index in range(args.rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for num_sms in order:
            ll_path.DEFAULT_NUM_SMS = num_sms
            per_rank = run_local_group(rank_main, args.num_ranks)
            stamped = {(row["tokens"], row["op"]): row["phases"] for row in per_rank[0]}
            for rank_rows in per_rank:
                for row in rank_rows:
                    figures = {"loop": row["loop"], "host": row["host"],
                               **stamped[row["tokens"], row["op"]][row["rank"]]}
                    results.setdefault((row["tokens"], row["op"], num_sms, row["rank"]), []).append(figures)
    print(f"decode timeline: {args.num_ranks} in-process ranks on one GPU, hidden {args.hidden}, "
          f"top-{args.num_topk} of {args.num_experts}, FP8 dispatch, BF16 combine, {args.calls} replays x "
          f"{args.rounds} rounds (medians over rounds), us" + (f", {' '.join(args.define)}" if args.define else ""))
    print(f"{'tokens':>6s} {'op':9s} {'num_sms':>7s} {'rank':>4s} " + " ".join(f"{c:>8s}" for c in COLUMNS))
    for (n, op, num_sms, rank), runs in sorted(results.items()):
        med = {c: statistics.median(r[c] for r in runs) for c in COLUMNS}
        print(f"{n:6d} {op:9s} {num_sms:7d} {rank:4d} " + " ".join(f"{med[c]:8.1f}" for c in COLUMNS))


if __name__ == "__main__":
    main()
