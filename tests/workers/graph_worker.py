"""CUDA graphs: one step (layout, a dispatch with ``num_worst_tokens``, a cached dispatch, a combine)
captured once and replayed with new inputs and new routing written into the same buffers.

Usage: ``mpiexec -n R python tests/workers/graph_worker.py [--local] [CASE ...]`` (``--local``: one
process, rank r a thread on GPU r, for 2 ranks). Cases:

* ``replay_torch``, ``replay_cupy``: capture with ``torch.cuda.graph`` / CuPy's stream capture,
  replay REPLAYS times; after each replay every output (layout, received rows, top-k, weights, the
  handle's device counts, the cached dispatch's rows, the combined rows and weights) is compared
  bit-exactly with the NumPy reference of that replay's inputs.
* ``lone_replay_times_out``: rank 0 replays a captured step that the other ranks never replay; its
  host must learn of it as a :class:`deepep_cupy.DeepEPTimeoutError` after the Buffer's timeout
  (not hang); then every rank destroys the Buffer and checks an eager step on a new one.
* ``bench``: per token count, eager calls against replays of the same step (PyTorch tensors, the
  reference workload's shape): GPU time per step over back-to-back steps, and median host time.

One ``RESULT {json}`` line per rank and case; exit status 1 when a case failed on any rank.
"""

import json
import os
import statistics
import sys
import time
import traceback

import numpy as np
from gpu_worker import Mismatch, expect_equal, to_numpy

from deepep_cupy.bench.graphs import Replay

CASES = ("replay_torch", "replay_cupy", "lone_replay_times_out")
REPLAYS = 6
N, H, K, E = 256, 1024, 4, 32
TIMEOUT_S = 4.0
BENCH_TOKENS = (128, 4096)


def emit(tag, record):
    print(f"{tag} {json.dumps(record)}", flush=True)


class Step:
    """A rank's fixed input buffers and the step that a graph captures, in one array library."""

    def __init__(self, buf, framework, num_tokens=N, hidden=H, num_topk=K, num_experts=E, with_cached=True):
        import cupy

        self.buf, self.framework, self.with_cached = buf, framework, with_cached
        self.num_tokens, self.hidden, self.num_topk, self.num_experts = num_tokens, hidden, num_topk, num_experts
        self.worst = num_tokens * buf.num_ranks  # every token of every rank
        self.device_id = cupy.cuda.Device().id
        zeros = np.zeros
        self.x = self._device(zeros((num_tokens, hidden), np.uint16))
        self.x2 = self._device(zeros((num_tokens, hidden), np.uint16))
        self.topk = self._device(np.full((num_tokens, num_topk), -1, np.int64))
        self.weights = self._device(zeros((num_tokens, num_topk), np.float32))

    def _device(self, a):
        import cupy

        d = cupy.asarray(a)
        if self.framework != "torch":
            return d
        import torch

        t = torch.as_tensor(d, device=f"cuda:{self.device_id}").clone()
        return t.view(torch.bfloat16) if a.dtype == np.uint16 else t

    def write(self, inputs):
        """Copy this rank's new inputs into the fixed buffers (outside any capture), and wait for it."""
        import cupy

        for name in ("x", "x2", "topk", "weights"):
            target, values = getattr(self, name), inputs[name]
            if self.framework == "torch":
                import torch

                source = torch.from_numpy(values.view(np.int16) if values.dtype == np.uint16 else values)
                target.view(torch.int16 if values.dtype == np.uint16 else target.dtype).copy_(source)
            else:
                target.set(values, stream=cupy.cuda.get_current_stream())
        self.synchronize()

    def synchronize(self):
        """Wait for the work queued on the current stream of the step's library (a replay's too)."""
        import cupy

        if self.framework == "torch":
            import torch

            torch.cuda.current_stream().synchronize()
        else:
            cupy.cuda.get_current_stream().synchronize()

    def capture(self, in_process):
        """The step captured once (threads of one process capture in thread-local mode)."""
        return Replay(self.framework, self, self.device_id, thread_local=in_process)

    def __call__(self):
        buf = self.buf
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(self.topk, self.num_experts)
        recv_x, recv_topk, recv_weights, _, handle, _ = buf.dispatch(
            self.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=self.topk, topk_weights=self.weights, num_worst_tokens=self.worst)
        cached_x = buf.dispatch(self.x2, handle=handle)[0] if self.with_cached else None
        combined, combined_weights, _ = buf.combine(recv_x, handle, topk_weights=recv_weights)
        return dict(per_rank=per_rank, per_expert=per_expert, in_rank=in_rank, recv_x=recv_x, recv_topk=recv_topk,
                    recv_weights=recv_weights, handle=handle, cached_x=cached_x, combined=combined,
                    combined_weights=combined_weights)


def draw_inputs(seed, num_ranks, num_tokens=N, hidden=H, num_topk=K, num_experts=E):
    """Every rank's inputs of one replay (seeded: every rank draws the same)."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(seed)
    inputs = []
    for _ in range(num_ranks):
        inputs.append(dict(
            x=ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32)),
            x2=ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32)),
            topk=ref.random_routing(rng, num_tokens, num_experts, num_topk, skew=float(rng.integers(0, 5)),
                                    drop_fraction=0.2),
            weights=rng.random((num_tokens, num_topk), dtype=np.float32) + 0.5))
    return inputs


def check_replay(out, inputs, rank, num_channels, what):
    """Every output of one step against the reference of its inputs."""
    from deepep_cupy.reference import intranode as ref

    R = len(inputs)
    mine = inputs[rank]
    per_rank, per_expert, in_rank = ref.get_dispatch_layout(mine["topk"], E, R)
    expect_equal(f"{what}: num_tokens_per_rank", to_numpy(out["per_rank"]), per_rank)
    expect_equal(f"{what}: num_tokens_per_expert", to_numpy(out["per_expert"]), per_expert)
    expect_equal(f"{what}: is_token_in_rank", to_numpy(out["in_rank"]), in_rank)
    results = ref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, num_channels,
                           topk_weights=[i["weights"] for i in inputs])
    want = results[rank]
    valid = want["recv_x"].shape[0]
    handle = out["handle"]
    expect_equal(f"{what}: handle.recv_count", to_numpy(handle.recv_count), np.array([valid], np.int32))
    expect_equal(f"{what}: handle.recv_expert_counts", to_numpy(handle.recv_expert_counts),
                 np.array(want["num_recv_tokens_per_expert_list"], np.int32))
    expect_equal(f"{what}: recv_x", to_numpy(out["recv_x"])[:valid], want["recv_x"])
    topk = to_numpy(out["recv_topk"])
    expect_equal(f"{what}: recv_topk_idx", topk[:valid], want["recv_topk_idx"])
    if not np.all(topk[valid:] == -1):
        raise Mismatch(f"{what}: recv_topk_idx past the {valid} received rows is not all -1")
    expect_equal(f"{what}: recv_topk_weights", to_numpy(out["recv_weights"])[:valid], want["recv_topk_weights"])
    cached = ref.dispatch([i["x2"] for i in inputs], [i["topk"] for i in inputs], E, num_channels)[rank]
    expect_equal(f"{what}: cached recv_x", to_numpy(out["cached_x"])[:valid], cached["recv_x"])
    want_x, want_w = ref.combine([r["recv_x"] for r in results], results,
                                 topk_weights=[r["recv_topk_weights"] for r in results])[rank]
    expect_equal(f"{what}: combined_x", to_numpy(out["combined"]), ref.round_to_dtype(want_x, "bfloat16"))
    expect_equal(f"{what}: combined_topk_weights", to_numpy(out["combined_weights"]), want_w)
    return valid


def new_buffer(ep, group, hidden=H, timeout_s=TIMEOUT_S):
    return ep.Buffer(group, ep.get_nvl_buffer_size_hint(hidden * 2, group.size), timeout_s=timeout_s)


def _replay_case(framework):
    def case(group, ep, in_process):
        buf = new_buffer(ep, group)
        try:
            step = Step(buf, framework)
            step.write(draw_inputs(0, buf.num_ranks)[buf.rank])
            graph = step.capture(in_process)
            num_channels = ep.Buffer.get_dispatch_config(buf.num_ranks).num_channels
            received = []
            for replay in range(1, REPLAYS + 1):
                inputs = draw_inputs(replay, buf.num_ranks)
                step.write(inputs[buf.rank])
                group.barrier()
                graph()
                step.synchronize()
                buf.check_kernel_errors()
                received.append(check_replay(graph.outputs, inputs, buf.rank, num_channels, f"replay {replay}"))
                group.barrier()  # no rank overwrites inputs that a peer's replay still reads
            return {"replays": REPLAYS, "received": received}
        finally:
            buf.destroy()
    return case


def case_lone_replay_times_out(group, ep, in_process):
    buf = new_buffer(ep, group)
    step = Step(buf, "cupy")
    step.write(draw_inputs(0, buf.num_ranks)[buf.rank])
    graph = step.capture(in_process)
    group.barrier()
    info = {}
    try:
        if buf.rank == 0:
            start = time.monotonic()
            graph()
            step.synchronize()  # the kernels end by themselves: every wait has a deadline
            info["replay_seconds"] = round(time.monotonic() - start, 2)
            try:
                buf.check_kernel_errors()
            except ep.DeepEPTimeoutError as exc:
                info["raised"] = type(exc).__name__
            else:
                raise Mismatch("a replay that no peer joined raised nothing")
            if not TIMEOUT_S * 0.9 <= info["replay_seconds"] <= TIMEOUT_S + 10:
                raise Mismatch(f"the lone replay took {info['replay_seconds']} s, expected about {TIMEOUT_S} s")
        group.barrier()
    finally:
        del graph
        buf.destroy()
    buf = new_buffer(ep, group)
    try:
        step = Step(buf, "cupy")
        inputs = draw_inputs(99, buf.num_ranks)
        step.write(inputs[buf.rank])
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        group.barrier()
        out = step()
        cupy.cuda.get_current_stream().synchronize()
        check_replay(out, inputs, buf.rank, ep.Buffer.get_dispatch_config(buf.num_ranks).num_channels,
                     "eager step on a new Buffer")
    finally:
        buf.destroy()
    return info


def case_bench(group, ep, in_process, calls=50):
    """Eager steps against replays, PyTorch tensors, hidden 7168, top-8 of 256 (no check)."""
    import torch

    rows = []
    for num_tokens in BENCH_TOKENS:
        hidden, topk, experts = 7168, 8, 256
        R = group.size
        buf = new_buffer(ep, group, hidden, timeout_s=30)
        try:
            step = Step(buf, "torch", num_tokens, hidden, topk, experts, with_cached=False)
            step.write(draw_inputs(7, R, num_tokens, hidden, topk, experts)[buf.rank])
            graph = step.capture(in_process)
            for variant in ("eager", "graph", "eager", "graph"):  # alternated
                run = graph if variant == "graph" else step
                stream = torch.cuda.current_stream()
                torch.cuda.synchronize()
                group.barrier()
                host = []
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(calls):
                    t0 = time.perf_counter()
                    run()
                    host.append(time.perf_counter() - t0)
                end.record(stream)
                end.synchronize()
                rows.append({"tokens": num_tokens, "variant": variant,
                             "loop_us": round(start.elapsed_time(end) * 1000 / calls, 1),
                             "host_us": round(statistics.median(host) * 1e6, 1)})
            buf.check_kernel_errors()
            del graph
        finally:
            buf.destroy()
    return {"rows": rows}


def run_cases(group, names, in_process):
    import deepep_cupy as ep

    rank = group.rank
    failures = 0
    for name in names:
        group.barrier()
        start = time.time()
        case = _replay_case(name.split("_")[1]) if name.startswith("replay_") else globals()[f"case_{name}"]
        try:
            info, ok, error = case(group, ep, in_process), True, None
        except Exception as exc:
            info, ok, error = {}, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failures += 1
        emit("RESULT", {"rank": rank, "case": name, "ok": ok, "error": error, "in_process": in_process,
                        "seconds": round(time.time() - start, 2), **info})
    return failures


def main(argv):
    in_process = "--local" in argv
    names = [a for a in argv if not a.startswith("--")] or list(CASES)
    unknown = sorted(set(names) - set(CASES) - {"bench"})
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {CASES + ('bench',)}")
    if in_process:
        import deepep_cupy as ep

        def rank_main(group):
            import torch

            torch.cuda.set_device(group.rank)
            return run_cases(group, names, True)

        failures = ep.run_local_group(rank_main, 2, devices=[0, 1], timeout_s=300)
        return 1 if any(failures) else 0
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.Get_rank()))
    device = local % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    import torch

    torch.cuda.set_device(device)
    failures = run_cases(comm, names, False)
    return 1 if comm.allreduce(failures) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
