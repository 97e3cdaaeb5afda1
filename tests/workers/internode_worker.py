"""MPI worker for the internode GPU tests: an internode Buffer over simulated nodes, every result
compared bit-exactly with deepep_cupy.reference.internode.

Usage: ``mpiexec -n R python tests/workers/internode_worker.py L [L ...]`` (one Buffer per ranks
per node ``L``, in turn). Every rank builds every rank's inputs from the scenario's seed, runs
layout, dispatch, cached dispatch and combine, and prints one ``RESULT {json}`` line per
scenario with ``case`` = ``"{N}x{L} {scenario}"``.
"""

import json
import os
import sys
import time
import traceback

import numpy as np
from gpu_worker import Mismatch, device_array, draw_rows, expect_equal, to_numpy  # a script: its folder on sys.path

HIDDEN = 128
#: FP8 rows: two 128-column scale blocks.
FP8_HIDDEN = 256
SCENARIOS = [
    dict(name="bf16", dtype="bfloat16"),
    dict(name="fp16", dtype="float16"),
    dict(name="fp32", dtype="float32"),
    dict(name="fp8", dtype="float8_e4m3fn"),
    dict(name="fp8 column scales", dtype="float8_e4m3fn", column_scales=True),
    dict(name="topk -1 aligned", dtype="bfloat16", drop=0.3, alignment=8),
    dict(name="uneven and zero", dtype="bfloat16", counts=(0, 37, 1, 0, 5, 0)),
    dict(name="all to one node", dtype="float32", only_node=1),
    dict(name="num_worst_tokens", dtype="bfloat16", worst=400, bias=False),
    dict(name="async previous_event", dtype="bfloat16", asynchronous=True),
    dict(name="torch bf16", dtype="bfloat16", framework="torch"),
    dict(name="torch fp8", dtype="float8_e4m3fn", framework="torch"),
]


def make_inputs(sc, R, num_nodes, E, K, seed):
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(seed)
    counts = sc.get("counts") or tuple(int(rng.integers(1, 48)) for _ in range(R))
    counts = tuple(counts[r % len(counts)] for r in range(R))
    inputs = []
    for r in range(R):
        n = counts[r]
        if sc.get("only_node") is not None:
            epn = E // num_nodes
            topk = sc["only_node"] * epn + ref.random_routing(rng, n, epn, min(K, epn))
        else:
            topk = ref.random_routing(rng, n, E, K, drop_fraction=sc.get("drop", 0.0))
        x, scales = draw_rows(rng, n, FP8_HIDDEN if sc["dtype"] == "float8_e4m3fn" else HIDDEN, sc["dtype"])
        inputs.append(dict(x=x, scales=scales, topk=topk, weights=rng.random(topk.shape, dtype=np.float32) + 0.5))
    return inputs


def run_scenario(buf, sc, seed):
    import cupy

    from deepep_cupy.reference import internode as iref
    from deepep_cupy.reference import intranode as ref

    R, L = buf.num_ranks, buf.topology.ranks_per_node
    N, rank = R // L, buf.rank
    E, K = 4 * R, 4
    inputs = make_inputs(sc, R, N, E, K, seed)
    mine = inputs[rank]
    fp8 = mine["scales"] is not None
    alignment = sc.get("alignment", 1)
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, L,
                         topk_weights=[i["weights"] for i in inputs],
                         x_scales=[i["scales"] for i in inputs] if fp8 else None, expert_alignment=alignment)
    combine_dtype = "bfloat16" if fp8 else sc["dtype"]
    rng = np.random.default_rng(seed + 1)

    def cast(a):
        return ref.round_to_dtype(a, combine_dtype)

    ys = [cast(rng.standard_normal((len(w["recv_x"]), HIDDEN), dtype=np.float32)) for w in want]
    yw = [rng.random((len(w["recv_x"]), K), dtype=np.float32) for w in want]
    with_bias = sc.get("bias", True)
    biases = [(cast(rng.standard_normal((len(i["x"]), HIDDEN), dtype=np.float32)),) if with_bias else ()
              for i in inputs]
    combined = iref.combine(ys, want, combine_dtype, topk_weights=yw, bias=biases)
    torch_mode = sc.get("framework") == "torch"

    def device(a):
        return device_array(a, torch_mode)

    x = device(mine["x"])
    if fp8:
        scales = device(mine["scales"])
        if sc.get("column_scales"):
            scales = cupy.asfortranarray(scales)
        if torch_mode:
            import torch

            x = x.view(torch.float8_e4m3fn)
        x = (x, scales)
    topk, weights = device(mine["topk"]), device(mine["weights"])
    asynchronous = sc.get("asynchronous", False)

    def wait(event):
        if asynchronous:
            event.current_stream_wait()

    def previous():
        # Buffer.capture() records on PyTorch's current stream once this process has used PyTorch;
        # CuPy inputs were made on CuPy's.
        if not asynchronous:
            return None
        return buf.capture() if torch_mode else buf.capture(cupy.cuda.get_current_stream())

    per_rank, per_node, per_expert, in_rank, event = buf.get_dispatch_layout(
        topk, E, previous_event=previous(), async_finish=asynchronous)
    wait(event)
    w_rank, w_node, w_expert, w_in = iref.get_dispatch_layout(mine["topk"], E, R, L)
    expect_equal("num_tokens_per_rank", to_numpy(per_rank), w_rank)
    expect_equal("num_tokens_per_rdma_rank", to_numpy(per_node), w_node)
    expect_equal("num_tokens_per_expert", to_numpy(per_expert), w_expert)
    expect_equal("is_token_in_rank", to_numpy(in_rank), w_in)

    worst = sc.get("worst", 0)
    recv_x, recv_topk, recv_w, experts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights, expert_alignment=alignment,
        num_worst_tokens=worst, previous_event=previous(), async_finish=asynchronous)
    wait(event)
    w = want[rank]
    n = len(w["recv_x"])
    rows = worst or n
    got_x = recv_x[0] if fp8 else recv_x
    if got_x.shape[0] != rows:
        raise Mismatch(f"recv_x: {got_x.shape[0]} rows, expected {rows}")
    expect_equal("recv_x", to_numpy(got_x)[:n], w["recv_x"])
    if fp8:
        expect_equal("recv_x_scales", to_numpy(recv_x[1])[:n], w["recv_x_scales"])
    got_topk = to_numpy(recv_topk)
    expect_equal("recv_topk_idx", got_topk[:n], w["recv_topk_idx"])
    if not (got_topk[n:] == -1).all():
        raise Mismatch("recv_topk_idx: rows past the received ones are not -1")
    expect_equal("recv_topk_weights", to_numpy(recv_w)[:n], w["recv_topk_weights"])
    if experts != ([] if worst else w["num_recv_tokens_per_expert_list"]):
        raise Mismatch(f"expert counts {experts}, expected {w['num_recv_tokens_per_expert_list']}")
    if handle.send_counts != tuple(w["send_counts"]) or handle.recv_counts != tuple(w["recv_counts"]):
        raise Mismatch(f"handle counts {handle.send_counts}/{handle.recv_counts}")

    cached, none_topk, _, _, _, event = buf.dispatch(x, handle=handle, async_finish=asynchronous)
    wait(event)
    if none_topk is not None:
        raise Mismatch("cached dispatch returned top-k")
    expect_equal("cached recv_x", to_numpy(cached[0] if fp8 else cached)[:n], w["recv_x"])
    if fp8:
        expect_equal("cached recv_x_scales", to_numpy(cached[1])[:n], w["recv_x_scales"])

    y = np.zeros((rows, HIDDEN), ys[rank].dtype)
    y[:n] = ys[rank]
    y_w = np.zeros((rows, K), np.float32)
    y_w[:n] = yw[rank]
    bias = device(biases[rank][0]) if with_bias else None
    out, out_w, event = buf.combine(device(y), handle, topk_weights=device(y_w), bias=bias, async_finish=asynchronous)
    wait(event)
    expect_equal("combined_x", to_numpy(out), ref.round_to_dtype(combined[rank][0], combine_dtype))
    expect_equal("combined_topk_weights", to_numpy(out_w), combined[rank][1])
    return {"received": n, "internode_rows": sum(w["send_counts"]) - w["send_counts"][rank // L]}


def main(ranks_per_node):
    import cupy
    from mpi4py import MPI

    import deepep_cupy as ep

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    timeout_s = float(os.environ.get("DEEPEP_TEST_TIMEOUT_S", "60"))
    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    failures = 0
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for L in ranks_per_node:
            nvl_bytes = ep.get_nvl_buffer_size_hint(HIDDEN * 4, max(L, 2), num_max_tokens_per_rank=2048)

            def new_buffer(nvl_bytes=nvl_bytes, L=L):
                return ep.Buffer(comm, nvl_bytes, 1, ranks_per_node=L, internode_transport="mpi", timeout_s=timeout_s)

            buf = new_buffer()
            for i, sc in enumerate(SCENARIOS):
                if sc.get("framework") == "torch" and not has_torch:
                    continue
                case = f"{size // L}x{L} {sc['name']}"
                start = time.time()
                if sc.get("framework") == "torch":
                    import torch

                    context = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr))
                else:
                    import contextlib

                    context = contextlib.nullcontext()
                try:
                    with context:
                        info = run_scenario(buf, sc, seed=1000 * L + i)
                    ok, error = True, None
                except Exception as exc:  # report and go on
                    ok, error, info = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", {}
                    failures += 1
                all_ok = comm.allreduce(ok, op=MPI.LAND)
                print("RESULT " + json.dumps({"rank": rank, "size": size, "case": case, "ok": ok, "error": error,
                                              "seconds": round(time.time() - start, 3), **info}), flush=True)
                if not all_ok:
                    buf.destroy()
                    buf = new_buffer()
            buf.destroy()
    return failures


if __name__ == "__main__":
    sys.exit(1 if main([int(a) for a in sys.argv[1:]] or [1]) else 0)
