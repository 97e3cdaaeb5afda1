"""In-process worker for the GPU tests: the scenarios of gpu_worker.py with every rank in one process.

Usage::

    python tests/workers/local_gpu_worker.py --ranks N [--gpus G] [--num-sms K] [NAME ...]
    mpiexec -n N python tests/workers/local_gpu_worker.py --mpi [NAME ...]

The first form runs N ranks as threads of this process (``deepep_cupy.run_local_group``), rank
``r`` on GPU ``r % G`` (G: ``--gpus``, default every visible GPU), so ranks share GPUs when N > G.
Scenarios whose ``num_sms`` does not fit on a shared GPU (``ranks_on_gpu * num_sms`` > SMs) run
with the largest even ``num_sms`` that fits (the RESULT line says which), and ``num_experts`` is
rounded up to a multiple of N (3 and 6 ranks). The second form runs the
same code path over MPI (one process per GPU), for comparing the two transports.

Each rank runs ``gpu_worker.run_scenario`` unchanged (outputs compared with the NumPy reference
bit-exactly) through a thin proxy of its Buffer that records the dispatch/combine outputs, and
prints one line ``RESULT {json}`` per scenario with ``call_hashes``: per dispatch, cached dispatch
and combine of the scenario, in call order, its kind and the sha256 (first 16 hex digits) of what it
returned on that rank (received rows, scales, top-k and weights; combined rows and weights), taken
right after the call: a later call overwrites outputs that are views of the NVLink buffer. These do
not depend on ``num_sms``, so the in-process and MPI runs of one rank count must print the same
hashes, call for call.

In-process, the ranks share one NumPy reference per scenario (computed by the first rank that
needs it) instead of each computing every rank's: the reference of an 8-rank reference workload
takes ~30 s of CPU, and 8 threads doing it at once under the GIL would keep some ranks away from
their kernels for longer than the Buffer timeout.

``DEEPEP_TEST_DUMP_AFTER=S`` (a debugging aid): S seconds into each scenario, dump every thread's
Python stack to stderr (faulthandler), to see where a hung rank waits.

``--inject-failure R``: rank R raises right before its first scenario while the others run it, to
check that a failing rank ends the whole job (the others time out in their kernels, or are aborted
in a collective) instead of hanging it; the job then prints ``ERROR {json}`` and exits with 1.
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import traceback

import gpu_worker  # run as a script: its folder is on sys.path
import numpy as np
from gpu_scenarios import SCENARIOS

from deepep_cupy.gpu.sm_budget import largest_num_sms, sm_count_of

_print_lock = threading.Lock()


def emit(tag, record):
    """One whole line per record, even with several rank threads printing at once."""
    line = f"{tag} {json.dumps(record)}\n"
    with _print_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Recording what the Buffer returned


def _flatten(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        else:
            yield item


def digest(arrays):
    """sha256 (16 hex digits) of arrays' dtypes, shapes and bytes (``None`` entries count too)."""
    h = hashlib.sha256()
    for a in _flatten(arrays):
        if a is None:
            h.update(b"None;")
            continue
        host = np.ascontiguousarray(gpu_worker.to_numpy(a))
        h.update(f"{host.dtype.str}{host.shape};".encode())
        h.update(host.tobytes())
    return h.hexdigest()[:16]


def defined_rows_of_worst_case(outputs, num_recv):
    """What a ``num_worst_tokens`` dispatch defines: the received rows of ``recv_x`` (and scales) and
    of the weights, and every row of ``recv_topk_idx`` (-1 past the received ones). The rows past
    ``num_recv`` of the others hold whatever the allocator left there, which differs between runs."""
    recv_x, recv_topk, recv_weights = outputs[:3]
    if isinstance(recv_x, tuple):
        recv_x = tuple(part[:num_recv] for part in recv_x)
    else:
        recv_x = recv_x[:num_recv]
    return recv_x, recv_topk, None if recv_weights is None else recv_weights[:num_recv]


class RecordingBuffer:
    """A Buffer that hashes the outputs of every dispatch / cached dispatch / combine as it returns.

    The hash is taken at once, after waiting for the call (its event when it is asynchronous, then
    the current stream): outputs that are views of the NVLink buffer (``recv_x_in_buffer``) are
    overwritten by the next call.

    With ``sharing_gpu`` (ranks of this process share its GPU) every dispatch and combine starts
    with a barrier of the ranks: a rank checking the last call's outputs may use a PyTorch or CuPy
    kernel for the first time, and loading it waits until the GPU's running kernels end, among
    them a peer's next call waiting for this rank (docs/GROUPS.md, "Ranks sharing a GPU").
    """

    def __init__(self, buf, sharing_gpu=False):
        self._buf = buf
        self._calls = []
        self._sharing_gpu = sharing_gpu

    def __getattr__(self, name):
        return getattr(self._buf, name)

    def __setattr__(self, name, value):  # settings such as allocate_ahead go to the Buffer
        if name in ("_buf", "_calls", "_sharing_gpu"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._buf, name, value)

    def _start_together(self):
        if self._sharing_gpu:
            self._buf.group.barrier()

    def _record(self, kind, outputs, event):
        event.synchronize()  # an asynchronous call's outputs are ready when its event is
        self._calls.append({"call": len(self._calls), "kind": kind, "hash": digest(outputs)})

    def dispatch(self, x, handle=None, **kwargs):
        self._start_together()
        out = self._buf.dispatch(x, handle=handle, **kwargs)
        recorded = out[:3]
        if kwargs.get("num_worst_tokens"):
            out[-1].synchronize()
            recorded = defined_rows_of_worst_case(out, int(gpu_worker.to_numpy(out[4].recv_count)[0]))
        self._record("cached_dispatch" if handle is not None else "dispatch", recorded, out[-1])
        return out

    def combine(self, x, handle, **kwargs):
        self._start_together()
        out = self._buf.combine(x, handle, **kwargs)
        self._record("combine", out[:2], out[-1])
        return out

    def call_hashes(self):
        """``[{"call": i, "kind": ..., "hash": ...}]``: the calls since the last time, in order."""
        calls, self._calls = self._calls, []
        return calls


# ---------------------------------------------------------------------------------------------
# One reference per scenario, shared by the rank threads


class Memo:
    """Values computed once for all the rank threads of this process: the first thread that asks
    for a key computes it, the others wait on a lock (not in a GPU collective). ``clear()`` when no
    rank is using them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries = {}

    def get(self, key, compute):
        with self._lock:
            entry = self._entries.setdefault(key, {"lock": threading.Lock(), "done": False, "value": None})
        with entry["lock"]:
            if not entry["done"]:
                entry["value"] = compute()
                entry["done"] = True
        return entry["value"]

    def clear(self):
        with self._lock:
            self._entries = {}


class SharedReference(Memo):
    """Memoizes make_inputs and the reference dispatch/combine across the rank threads.

    Keys are the identities of the (memoized, hence kept alive) input arrays, so every rank of one
    scenario gets the same objects. ``clear()`` between scenarios.
    """

    def install(self):
        """Route gpu_worker.make_inputs and reference.dispatch/combine through the memo."""
        from deepep_cupy.reference import intranode as ref

        make_inputs, dispatch, combine = gpu_worker.make_inputs, ref.dispatch, ref.combine

        def ids(arrays):
            return None if arrays is None else tuple(id(a) for a in arrays)

        def shared_make_inputs(sc, num_ranks):
            return self.get(("inputs", sc["name"], sc["seed"], num_ranks), lambda: make_inputs(sc, num_ranks))

        def shared_dispatch(xs, topk_idxs, num_experts, num_channels, **kwargs):
            key = ("dispatch", ids(xs), ids(topk_idxs), num_experts, num_channels,
                   ids(kwargs.get("topk_weights")), ids(kwargs.get("x_scales")), kwargs.get("expert_alignment"))
            return self.get(key, lambda: dispatch(xs, topk_idxs, num_experts, num_channels, **kwargs))

        def shared_combine(xs, results, **kwargs):
            key = ("combine", ids(xs), id(results), ids(kwargs.get("topk_weights")))
            return self.get(key, lambda: combine(xs, results, **kwargs))

        gpu_worker.make_inputs = shared_make_inputs
        ref.dispatch = shared_dispatch
        ref.combine = shared_combine


# ---------------------------------------------------------------------------------------------
# The per-rank loop (any Group: ThreadGroup in-process, MPIGroup under mpiexec)


class RankBuffer:
    """This rank's Buffer (``.buf``, made by ``make()``) through a run of cases: replaced after a
    case that failed on any rank, destroyed at the end. As a context manager it releases the other
    ranks (``group.abort``) before destroying the Buffer when the run raises: destroy ends with a
    barrier they would wait in."""

    def __init__(self, group, make):
        self.group, self._make = group, make
        self.buf = make()

    def renew_unless(self, all_ok):
        """A new Buffer unless ``all_ok`` (a kernel may have timed out: such a Buffer is not
        usable); returns whether it made one."""
        if all_ok:
            return False
        self.buf.destroy()
        self.buf = self._make()
        return True

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        try:
            if exc is not None and hasattr(self.group, "abort"):
                self.group.abort(f"failed: {kind.__name__}: {exc}")
        finally:
            self.buf.destroy()
        return False


def rank_main(group, scenarios, args, shared=None):
    """Run ``scenarios`` on this rank; return the number of failed scenarios."""
    import cupy

    import deepep_cupy as ep

    rank, size = group.rank, group.size
    device = cupy.cuda.Device().id
    nvl_bytes = ep.get_nvl_buffer_size_hint(7168 * 4, size, ep.Config(48, 16, 256))
    on_device = group.ranks_on_device(device) if hasattr(group, "ranks_on_device") else 1

    def new_buffer():
        buf = ep.Buffer(group, nvl_bytes, timeout_s=args.timeout)
        # The path of ranks with processes of their own (a fresh dispatch with rows in place in
        # one launch), which in-process ranks then take, polling their slots for the counts.
        if args.exchange_in_transfer:
            buf._engine.ctx.exchange_in_transfer = True
        return buf

    failures = 0
    with RankBuffer(group, new_buffer) as rank_buf:
        for index, sc in enumerate(scenarios):
            if shared is not None:
                group.barrier()      # nobody uses the previous scenario's reference any more
                if rank == 0:
                    shared.clear()
            # Start together: a co-located rank must not synchronize the device while another
            # already waits in this scenario's kernels for it.
            group.barrier()
            if index == 0 and args.inject_failure == rank:
                raise RuntimeError(f"injected failure on rank {rank} (--inject-failure)")
            start = time.time()
            if os.environ.get("DEEPEP_TEST_DUMP_AFTER") and rank == 0:
                import faulthandler
                faulthandler.dump_traceback_later(float(os.environ["DEEPEP_TEST_DUMP_AFTER"]), exit=False)
            recorder = RecordingBuffer(rank_buf.buf, sharing_gpu=on_device > 1)
            try:
                info = gpu_worker.run_scenario(recorder, sc)
                info["call_hashes"] = recorder.call_hashes()
                ok, error = True, None
            except Exception as exc:  # report and go on with the next scenario
                error = f"{type(exc).__name__}: {exc}{gpu_worker.kernel_error(rank_buf.buf)}\n{traceback.format_exc()}"
                ok, info = False, {}
                failures += 1
            recorder = None
            all_ok = all(group.allgather(ok))
            emit("RESULT", {"rank": rank, "size": size, "scenario": sc["name"], "ok": ok, "all_ok": all_ok,
                            "error": error, "seconds": round(time.time() - start, 3), "device": device,
                            "ranks_on_device": on_device, "num_sms": sc["num_sms"], "num_experts": sc["num_experts"],
                            "in_process": bool(group.in_process), **info})
            rank_buf.renew_unless(all_ok)
    return failures


def for_rank_count(scenarios, num_ranks):
    """Scenarios with ``num_experts`` rounded up to a multiple of ``num_ranks`` (3 and 6 ranks: the
    scenarios' 32/64/256 experts do not split evenly; the Buffer requires it)."""
    return [dict(sc, num_experts=-(-sc["num_experts"] // num_ranks) * num_ranks) for sc in scenarios]


def fit_scenarios(scenarios, ranks_per_gpu, sm_count, num_sms=None):
    """Scenarios with ``num_sms`` set to ``num_sms`` or lowered to what fits ``ranks_per_gpu`` ranks."""
    cap = largest_num_sms(ranks_per_gpu, sm_count)
    fitted = []
    for sc in scenarios:
        want = num_sms if num_sms is not None else sc["num_sms"]
        fitted.append(dict(sc, num_sms=max(2, min(want, cap))))
    return fitted


def main_threads(args, scenarios):
    import cupy

    import deepep_cupy as ep

    count = cupy.cuda.runtime.getDeviceCount()
    gpus = args.gpus or count
    if not 1 <= gpus <= count:
        raise SystemExit(f"--gpus {gpus}: {count} GPUs are visible")
    devices = [r % gpus for r in range(args.ranks)]
    ranks_per_gpu = max(devices.count(d) for d in set(devices))
    sm_count = min(sm_count_of(d) for d in set(devices))
    scenarios = fit_scenarios(scenarios, ranks_per_gpu, sm_count, args.num_sms)
    emit("CONFIG", {"ranks": args.ranks, "devices": devices, "ranks_per_gpu": ranks_per_gpu, "sm_count": sm_count,
                    "num_sms": {sc["name"]: sc["num_sms"] for sc in scenarios}})
    shared = SharedReference()
    shared.install()
    try:
        results = ep.run_local_group(lambda group: rank_main(group, scenarios, args, shared), args.ranks, devices,
                                     timeout_s=args.group_timeout,
                                     num_sms=max(sc["num_sms"] for sc in scenarios))
    except ep.RankFailed as exc:
        emit("ERROR", {"rank": exc.rank, "message": str(exc), "stuck": exc.stuck,
                       "failures": {str(r): f"{type(e).__name__}: {e}" for r, e in exc.failures.items()},
                       "traceback": "".join(traceback.format_exception(type(exc.exception), exc.exception,
                                                                       exc.exception.__traceback__))})
        return 1
    return 1 if any(results) else 0


def main_mpi(args, scenarios):
    import cupy
    from mpi4py import MPI

    from deepep_cupy.groups.group import MPIGroup

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    scenarios = for_rank_count(scenarios, comm.Get_size())
    if args.num_sms is not None:
        scenarios = [dict(sc, num_sms=args.num_sms) for sc in scenarios]
    try:
        failures = rank_main(MPIGroup(comm), scenarios, args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    return 1 if failures else 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="scenarios to run (default: all)")
    parser.add_argument("--ranks", type=int, help="ranks (threads) in the in-process group")
    parser.add_argument("--gpus", type=int, default=None, help="use GPUs 0..G-1 (default: all visible)")
    parser.add_argument("--num-sms", type=int, default=None, help="num_sms for every scenario (capped to fit)")
    parser.add_argument("--mpi", action="store_true", help="run under mpiexec, one process per rank")
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("DEEPEP_TEST_TIMEOUT_S", "60")),
                        help="Buffer timeout in seconds (kernels and host waits)")
    parser.add_argument("--group-timeout", type=float, default=300.0, help="in-process collective timeout")
    parser.add_argument("--inject-failure", type=int, default=None, metavar="RANK")
    parser.add_argument("--exchange-in-transfer", action="store_true",
                        help="in-process ranks too make the count exchange of a fresh dispatch with rows in place "
                             "in its transfer kernel")
    args = parser.parse_args(argv)
    if not args.mpi and not args.ranks:
        parser.error("--ranks N is required (or --mpi under mpiexec)")
    unknown = sorted(set(args.names) - {sc["name"] for sc in SCENARIOS})
    if unknown:
        parser.error(f"unknown scenarios {unknown}")
    return args


def main(argv):
    args = parse_args(argv)
    scenarios = [sc for sc in SCENARIOS if not args.names or sc["name"] in args.names]
    return main_mpi(args, scenarios) if args.mpi else main_threads(args, for_rank_count(scenarios, args.ranks))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
