"""Issue 36's steps A then B on one Buffer: what a fresh dispatch allocates stays bounded.

Usage::

    mpiexec -n 2 python tests/workers/bounded_memory_worker.py          # a process per rank
    DEEPEP_TEST_ONE_GPU_MPI=1 ... (tests/workers/one_gpu_ranks.py)       # both processes on GPU 0
    python tests/workers/bounded_memory_worker.py --in-process          # rank threads, run_local_group
    python tests/workers/bounded_memory_worker.py --list                # the steps; no GPU needed

Two ranks, PyTorch BF16 tensors, one Buffer with the default allocate-ahead, fresh dispatches
with top-8 of 256 experts and weights, each followed by a combine:

* ``A``: rank 0 sends 2,697 tokens and rank 1 one, every token routed to experts of rank 1 only:
  rank 1 receives 2,698 rows (hidden 1,240);
* ``B``: rank 1 sends 2,255 tokens (hidden 7,592, uniform routing), rank 0 none. Scaling A's
  receive count by rank 1's token count guessed 96.79 GiB here before the bound (issue 36);
* ``A_again``, then ``B_8192``: the same with 8,192 tokens.

Every step is compared bit-exactly with ``deepep_cupy.reference.intranode`` (received rows, top-k, weights,
expert counts, handle, combined rows and weights). Each rank checks that the rows its dispatch
allocated (``Buffer.last_dispatch_rows_allocated``) are within the bound computed from the
receive counts the worker itself knows (``memory_bounds.allowed_rows``), and measures the
device's peak PyTorch allocation during the dispatch (``torch.cuda.reset_peak_memory_stats``
before, ``max_memory_allocated`` after, per device: in-process ranks sharing a GPU share its
statistics, so the first rank on the device measures for all of them) against
``memory_bounds.peak_limit``. One ``RESULT {json}`` line per rank and step (fields: see
``step_record``); exit status 1 when a step failed.
"""

import argparse
import json
import sys
import threading
import time
import traceback
from typing import NamedTuple, Tuple

import numpy as np

#: Every rank's routing: experts of rank 1 only, or any expert.
TO_RANK_1, UNIFORM = "to_rank_1", "uniform"
NUM_RANKS = 2
NUM_EXPERTS = 256
NUM_TOPK = 8
MAX_TOKENS = 8192
SEED = 36


class Step(NamedTuple):
    name: str
    tokens: Tuple[int, int]  # per rank
    hidden: int
    routing: str


STEPS = (
    Step("A", (2697, 1), 1240, TO_RANK_1),
    Step("B", (0, 2255), 7592, UNIFORM),
    Step("A_again", (2697, 1), 1240, TO_RANK_1),
    Step("B_8192", (0, MAX_TOKENS), 7592, UNIFORM),
)
STEP_NAMES = tuple(s.name for s in STEPS)
#: The widest row of the steps (BF16): the NVLink buffer is sized for it and MAX_TOKENS tokens.
WIDEST_ROW_BYTES = max(s.hidden for s in STEPS) * 2


def describe_step(step: Step) -> str:
    routing = "every token to experts of rank 1" if step.routing == TO_RANK_1 else "uniform routing"
    return (f"{step.name}: tokens {step.tokens[0]}/{step.tokens[1]}, bfloat16 hidden {step.hidden}, "
            f"top-{NUM_TOPK} of {NUM_EXPERTS} experts, {routing}, fresh dispatch + combine")


def routing(rng, num_tokens: int, kind: str) -> np.ndarray:
    """int64 [num_tokens, NUM_TOPK]: distinct experts per token, of rank 1 only or of any rank."""
    first, count = (NUM_EXPERTS // NUM_RANKS, NUM_EXPERTS // NUM_RANKS) if kind == TO_RANK_1 else (0, NUM_EXPERTS)
    keys = rng.random((num_tokens, count))
    chosen = np.sort(np.argpartition(keys, NUM_TOPK - 1, axis=1)[:, :NUM_TOPK], axis=1) if num_tokens else \
        np.zeros((0, NUM_TOPK), np.int64)
    return (chosen + first).astype(np.int64)


def step_inputs(step: Step):
    """Both ranks' ``dict(x=BF16 bits, topk, weights)`` of ``step``, the same in every process."""
    from deepep_cupy.reference import intranode as ref

    inputs = []
    for rank, n in enumerate(step.tokens):
        rng = np.random.default_rng([SEED, STEP_NAMES.index(step.name), rank])
        topk = routing(rng, n, step.routing)
        weights = rng.random((n, NUM_TOPK), dtype=np.float32) + 0.5
        x = ref.float32_to_bfloat16_bits(rng.standard_normal((n, step.hidden), dtype=np.float32))
        inputs.append(dict(x=x, topk=topk, weights=weights))
    return inputs


def step_reference(step: Step, num_channels: int):
    """``(inputs, dispatch results, combine results)`` of ``step`` for every rank."""
    from deepep_cupy.reference import intranode as ref

    inputs = step_inputs(step)
    results = ref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], NUM_EXPERTS, num_channels,
                           topk_weights=[i["weights"] for i in inputs])
    combined = ref.combine([r["recv_x"] for r in results], results,
                           topk_weights=[r["recv_topk_weights"] for r in results])
    return inputs, results, combined


class SharedReferences:
    """One reference per step for the rank threads of this process (computed by the first)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done = {}

    def get(self, step: Step, num_channels: int):
        with self._lock:
            if step.name not in self._done:
                self._done[step.name] = step_reference(step, num_channels)
            return self._done[step.name]

    def drop(self, step: Step):
        with self._lock:
            self._done.pop(step.name, None)


def config_for(ranks_on_gpu: int, sm_count: int):
    import deepep_cupy as ep
    from deepep_cupy.config import RECOMMENDED_RECV_CHUNK, RECOMMENDED_SEND_CHUNK
    from deepep_cupy.gpu.sm_budget import largest_num_sms

    return ep.Config(min(24, largest_num_sms(ranks_on_gpu, sm_count)), RECOMMENDED_SEND_CHUNK,
                     RECOMMENDED_RECV_CHUNK)


# ---------------------------------------------------------------------------------------------
# One rank


def torch_stream_context(device: int):
    """PyTorch work on this thread's CuPy stream (in-process ranks each have their own)."""
    import contextlib

    import cupy
    import torch

    stream = cupy.cuda.get_current_stream()
    if stream.ptr == 0:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{device}"))


def run_rank(group, mode: str, config, nvl_bytes: int, timeout_s: float, shared: SharedReferences):
    """Run every step on this rank; returns the number of steps that failed here."""
    import cupy
    from local_gpu_worker import RankBuffer

    import deepep_cupy as ep

    device = cupy.cuda.Device().id
    devices = group.allgather(device)
    # In-process ranks on one GPU share PyTorch's statistics of it: the first of them measures.
    sharing = bool(getattr(group, "in_process", False))
    same_device = [r for r, d in enumerate(devices) if d == device] if sharing else [group.rank]
    leader = same_device[0] == group.rank
    def new_buffer():
        return ep.Buffer(group, nvl_bytes, timeout_s=timeout_s)

    failures = 0
    largest = 0  # the largest receive count of this Buffer's fresh dispatches so far
    with RankBuffer(group, new_buffer) as rank_buf, torch_stream_context(device):
        for step in STEPS:
            start = time.time()
            info = {}
            try:
                info = run_step(rank_buf.buf, group, step, config, nvl_bytes, shared, largest, same_device, leader)
                largest = max(largest, info["recv"])
                ok, error = info["rows_within_bound"] and info["peak_within_limit"], None
                if not ok:
                    error = (f"allocated {info['rows_allocated']} rows (at most {info['allowed_rows']}), "
                             f"device peak {info['device_peak_bytes']} bytes (at most "
                             f"{info['peak_limit_bytes']})")
            except Exception as exc:  # reported; the next step goes on
                import gpu_worker

                ok = False
                error = f"{type(exc).__name__}: {exc}{gpu_worker.kernel_error(rank_buf.buf)}\n{traceback.format_exc()}"
            failures += not ok
            all_ok = all(group.allgather(ok))
            print("RESULT " + json.dumps(step_record(mode, group, step, ok, all_ok, error, time.time() - start,
                                                     device, info)), flush=True)
            shared.drop(step)  # every rank has it (the allgather above): no step uses it again
            if rank_buf.renew_unless(all_ok):
                largest = 0
    return failures


def step_record(mode, group, step, ok, all_ok, error, seconds, device, info):
    """One rank's ``RESULT`` of one step: ``info`` is :func:`run_step`'s (empty when it raised)."""
    return {"mode": mode, "rank": group.rank, "size": group.size, "step": step.name, "ok": ok, "all_ok": all_ok,
            "error": error, "seconds": round(seconds, 3), "device": device,
            "num_tokens": step.tokens[group.rank], "hidden": step.hidden, **info}


def run_step(buf, group, step, config, nvl_bytes, shared, largest, same_device, leader):
    import cupy
    import torch
    from gpu_worker import check_fresh_handle, expect_equal, to_numpy
    from memory_bounds import (
        TorchPeak,
        ahead_bound,
        allowed_rows,
        exact_output_bytes,
        most_rows,
        output_row_bytes,
        peak_limit,
    )

    from deepep_cupy.reference import intranode as ref

    rank, device = group.rank, cupy.cuda.Device().id
    inputs, results, combined = shared.get(step, config.num_channels)
    mine, want = inputs[rank], results[rank]
    on = f"cuda:{device}"
    x = torch.as_tensor(mine["x"].view(np.int16), device=on).view(torch.bfloat16)
    topk = torch.as_tensor(mine["topk"], device=on)
    weights = torch.as_tensor(mine["weights"], device=on)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, NUM_EXPERTS)

    # The device's peak during the dispatch alone: every rank on it starts after the reset.
    peak = TorchPeak(device)
    torch.cuda.current_stream(device).synchronize()
    group.barrier()
    before = peak.reset_peak() if leader else 0
    group.barrier()
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=weights, config=config)
    torch.cuda.current_stream(device).synchronize()
    group.barrier()
    device_peak = peak.peak - before if leader else None
    rows_allocated, allocation = buf.last_dispatch_rows_allocated, buf.last_dispatch_allocation

    recv_x, recv_topk, recv_weights, per_expert_list, handle, _ = out
    expect_equal("recv_x", to_numpy(recv_x), want["recv_x"])
    expect_equal("recv_topk_idx", to_numpy(recv_topk), want["recv_topk_idx"])
    expect_equal("recv_topk_weights", to_numpy(recv_weights), want["recv_topk_weights"])
    check_fresh_handle(per_expert_list, handle, want)

    group.barrier()  # ranks sharing a GPU start each call together (local_gpu_worker.RecordingBuffer)
    combined_x, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_weights, config=config)
    want_x, want_w = combined[rank]
    expect_equal("combined_x", to_numpy(combined_x), ref.round_to_dtype(want_x, "bfloat16"))
    expect_equal("combined_topk_weights", to_numpy(combined_w), want_w)
    torch.cuda.current_stream(device).synchronize()
    buf.check_kernel_errors()

    recv = int(want["recv_x"].shape[0])
    row_bytes = output_row_bytes("bfloat16", step.hidden, NUM_TOPK, True)
    most = most_rows(NUM_RANKS, config, "bfloat16", step.hidden, NUM_TOPK, nvl_bytes)
    bound = ahead_bound(largest, most)  # no step has the token count of the one before: none is steady
    allowed = allowed_rows(recv, largest, most)
    exact_bytes = exact_output_bytes(recv, row_bytes, NUM_RANKS, config.num_channels, step.tokens[rank])
    # Device totals over the ranks that share its statistics (this rank alone under mpiexec).
    everyone = group.allgather((exact_bytes, bound * row_bytes, device_peak))
    device_exact = sum(everyone[r][0] for r in same_device)
    device_bound = sum(everyone[r][1] for r in same_device)
    device_peak = everyone[same_device[0]][2]
    limit = peak_limit(device_exact, device_bound, len(same_device))
    return {"recv": recv, "rows_allocated": rows_allocated, "allocation": allocation, "largest_before": largest,
            "most_rows": most, "bound": bound, "allowed_rows": allowed,
            "rows_within_bound": rows_allocated is not None and rows_allocated <= allowed,
            "row_bytes": row_bytes, "exact_bytes": exact_bytes, "buffers_on_device": len(same_device),
            "device_exact_bytes": device_exact, "device_bound_bytes": device_bound,
            "device_peak_bytes": device_peak, "peak_limit_bytes": limit, "peak_within_limit": device_peak <= limit}


# ---------------------------------------------------------------------------------------------
# The two ways to run


def nvl_bytes_for(config) -> int:
    import deepep_cupy as ep

    return ep.get_nvl_buffer_size_hint(WIDEST_ROW_BYTES, NUM_RANKS, config, num_topk=NUM_TOPK,
                                       num_max_tokens_per_rank=MAX_TOKENS)


def main_mpi(args) -> int:
    import cupy
    from mpi4py import MPI

    from deepep_cupy.gpu.sm_budget import sm_count_of
    from deepep_cupy.groups.group import MPIGroup

    comm = MPI.COMM_WORLD
    if comm.Get_size() != NUM_RANKS:
        raise SystemExit(f"run with {NUM_RANKS} ranks (mpiexec -n {NUM_RANKS}), got {comm.Get_size()}")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    device = local % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    import torch

    torch.cuda.set_device(device)
    config = config_for(1, sm_count_of(device))
    try:
        failures = run_rank(MPIGroup(comm), "mpi", config, nvl_bytes_for(config), args.timeout, SharedReferences())
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    return 1 if failures else 0


def main_in_process(args) -> int:
    import cupy

    import deepep_cupy as ep
    from deepep_cupy.gpu.sm_budget import sm_count_of

    count = cupy.cuda.runtime.getDeviceCount()
    devices = [r % count for r in range(NUM_RANKS)]
    ranks_on_gpu = max(devices.count(d) for d in devices)
    config = config_for(ranks_on_gpu, min(sm_count_of(d) for d in set(devices)))
    nvl_bytes = nvl_bytes_for(config)
    shared = SharedReferences()

    def rank_main(group):
        import torch

        torch.cuda.set_device(cupy.cuda.Device().id)
        return run_rank(group, "in_process", config, nvl_bytes, args.timeout, shared)

    try:
        failures = ep.run_local_group(rank_main, NUM_RANKS, devices, timeout_s=args.timeout * 3 + 60,
                                      num_sms=config.num_sms)
    except ep.RankFailed as exc:
        print("ERROR " + json.dumps({"rank": exc.rank, "message": str(exc)}), flush=True)
        return 1
    return 1 if any(failures) else 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-process", action="store_true", help="both ranks as threads of this process")
    parser.add_argument("--list", action="store_true", help="print the steps and run nothing")
    parser.add_argument("--timeout", type=float, default=60.0, help="the Buffer's timeout_s (default 60)")
    return parser.parse_args(argv)


def main(argv) -> int:
    args = parse_args(argv)
    if args.list:
        for step in STEPS:
            print(describe_step(step))
        return 0
    return main_in_process(args) if args.in_process else main_mpi(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
