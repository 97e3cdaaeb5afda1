"""GPU worker: an internode MoE step with num_worst_tokens captured in a CUDA graph and replayed
with new routing, bit for bit against deepep_cupy.reference.internode and against eager calls.

Usage::

    python tests/workers/internode_graph_worker.py NODES RANKS_PER_NODE [--replays N] [--dtype D]
        [--transport local|nccl]

The ranks are threads of this process (``run_local_group``) on simulated nodes
(``ranks_per_node``), sharing the machine's GPUs (all of them on one GPU where there is one), with
the "local" rail transport, or "nccl" (NCCL refuses two ranks on one GPU: one GPU per rank, e.g.
``2 1 --transport nccl`` on two GPUs). Each rank captures one step (layout, dispatch with num_worst_tokens,
combine) on PyTorch tensors in ``torch.cuda.CUDAGraph`` (thread-local capture, after one eager
step), then, per replay, writes new inputs into the captured tensors, replays, and checks the
dispatch and combine outputs against the reference and against an eager step on the same inputs.
Then a dispatch with too few rows (``num_worst_tokens=1``) must make itself or the next call raise
on every rank, and the call after it work. One ``RESULT {json}`` line per rank: ``ok``, ``error``,
``replays``, ``too_few_rows`` (what the rank raised) and the rail's bytes of the
last replay's dispatch, sent (``N * block_tokens`` records) and needed (the records of the tokens
routed to each node), all nodes and between nodes.

Ranks sharing a GPU in one process meet (a group barrier) before each call: a rank that checks the
last results may load a PyTorch kernel for the first time, and loading waits for the kernels running
on the GPU, among them a peer's that waits for this rank.
"""

import argparse
import json
import sys
import traceback

import numpy as np
from gpu_worker import Mismatch, draw_rows, expect_equal, to_numpy

H, T, K, EXPERTS_PER_RANK = 512, 48, 4, 4


def emit(record):
    sys.stdout.write(f"RESULT {json.dumps(record)}\n")
    sys.stdout.flush()


def draw(seed, R, E, dtype):
    """Every rank's inputs (every rank draws all of them from the shared seed)."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(seed)
    inputs = []
    for _ in range(R):
        topk = ref.random_routing(rng, T, E, K, drop_fraction=0.1)
        x, scales = draw_rows(rng, T, H, dtype)
        inputs.append(dict(x=x, scales=scales, topk=topk, weights=rng.random(topk.shape, dtype=np.float32) + 0.5))
    return inputs


def reference(inputs, E, L, ys=None):
    """The dispatch's and the combine's expected outputs; combine takes the received rows, or the
    first rows of ``ys`` (BF16 bits per rank) after an FP8 dispatch."""
    from deepep_cupy.reference import internode as iref

    fp8 = inputs[0]["scales"] is not None
    want = iref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, L,
                         topk_weights=[i["weights"] for i in inputs],
                         x_scales=[i["scales"] for i in inputs] if fp8 else None)
    rows = [w["recv_x"] if ys is None else ys[r][:len(w["recv_x"])] for r, w in enumerate(want)]
    combined = iref.combine(rows, want, "bfloat16", topk_weights=[w["recv_topk_weights"] for w in want])
    return want, combined


def to_torch(a):
    """A NumPy array as a tensor on the current GPU, copied on the current PyTorch stream (BF16
    bits as torch.bfloat16)."""
    import torch

    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


class Step:
    """The captured step over tensors that stay (the graph reads and writes them on every replay)."""

    def __init__(self, buf, E, worst, fp8):
        import torch

        self.buf, self.E, self.worst, self.fp8 = buf, E, worst, fp8
        dev = torch.cuda.current_device()
        x_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self.x = torch.zeros((T, H), dtype=x_dtype, device=dev)
        self.scales = torch.zeros((T, H // 128), dtype=torch.float32, device=dev) if fp8 else None
        self.topk = torch.zeros((T, K), dtype=torch.int64, device=dev)
        self.weights = torch.zeros((T, K), dtype=torch.float32, device=dev)
        self.y = torch.zeros((worst, H), dtype=torch.bfloat16, device=dev) if fp8 else None

    def write(self, mine, y=None):
        import torch

        x = to_torch(mine["x"])
        self.x.copy_(x.view(torch.float8_e4m3fn) if self.fp8 else x)
        if self.fp8:
            self.scales.copy_(to_torch(mine["scales"]))
            self.y.copy_(to_torch(y))
        self.topk.copy_(to_torch(mine["topk"]))
        self.weights.copy_(to_torch(mine["weights"]))

    def __call__(self):
        buf = self.buf
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(self.topk, self.E)
        recv_x, recv_topk, recv_w, _, handle, _ = buf.dispatch(
            (self.x, self.scales) if self.fp8 else self.x, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=self.topk, topk_weights=self.weights, num_worst_tokens=self.worst)
        combined, combined_w, _ = buf.combine(self.y if self.fp8 else recv_x, handle, topk_weights=recv_w)
        rows, scales = recv_x if self.fp8 else (recv_x, None)
        return dict(recv_x=rows, recv_x_scales=scales, recv_topk_idx=recv_topk, recv_topk_weights=recv_w,
                    prefix=handle[6], combined=combined, combined_w=combined_w)


def as_numpy(outputs):
    return {k: None if v is None else to_numpy(v) for k, v in outputs.items()}


def check(got, want, combined, rank, what):
    n = len(want["recv_x"])
    for key in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"):
        if want.get(key) is not None:
            expect_equal(f"{what} {key}", got[key][:n], want[key])
    if not (got["recv_topk_idx"][n:] == -1).all():
        raise Mismatch(f"{what}: padding rows past the {n} received have top-k ids other than -1")
    expect_equal(f"{what} recv_gbl_rank_prefix_sum", got["prefix"], want["recv_gbl_rank_prefix_sum"])
    from deepep_cupy.reference import intranode as ref

    expect_equal(f"{what} combined_x", got["combined"], ref.round_to_dtype(combined[rank][0], "bfloat16"))
    expect_equal(f"{what} combined_topk_weights", got["combined_w"], combined[rank][1])


def same_defined_rows(replayed, eager, n, what):
    """The replay's outputs equal the eager step's, in the rows both define."""
    for key, value in replayed.items():
        if value is None:
            continue
        rows = n if key.startswith("recv_") else len(value)
        expect_equal(f"{what} {key} (replay against eager)", value[:rows], eager[key][:rows])


def rank_main(group, num_nodes, L, replays, dtype, transport="local"):
    import cupy
    import torch

    import deepep_cupy as ep
    from deepep_cupy.bench.graphs import Replay
    from deepep_cupy.internode.records import RecordLayout

    torch.cuda.set_device(cupy.cuda.Device().id)
    R, rank = group.size, group.rank
    E, worst = EXPERTS_PER_RANK * R, T * R
    fp8 = dtype == "float8_e4m3fn"
    nvl = ep.get_nvl_buffer_size_hint(H * 4, max(L, 2), num_max_tokens_per_rank=T * num_nodes)
    buf = ep.Buffer(group, nvl, 1, ranks_per_node=L, internode_transport=transport, timeout_s=60)
    record = dict(rank=rank, shape=f"{num_nodes}x{L}", dtype=dtype, transport=transport, ok=False, error=None,
                  replays=0)
    stream = torch.cuda.Stream()
    try:
        with torch.cuda.stream(stream):
            step = Step(buf, E, worst, fp8)
            rng = np.random.default_rng(1000)
            ys = [ref_bf16(rng.standard_normal((worst, H), dtype=np.float32)) for _ in range(R)] if fp8 else None
            step.write(draw(1, R, E, dtype)[rank], None if ys is None else ys[rank])
            group.barrier()
            graph = Replay("torch", step, torch.cuda.current_device(), thread_local=True)
            for replay in range(replays):
                inputs = draw(100 + replay, R, E, dtype)
                want, combined = reference(inputs, E, L, ys)
                step.write(inputs[rank], None if ys is None else ys[rank])
                group.barrier()
                graph()
                stream.synchronize()
                got = as_numpy(graph.outputs)
                group.barrier()
                check(got, want[rank], combined, rank, f"replay {replay}")
                group.barrier()
                eager = as_numpy(step())
                stream.synchronize()
                group.barrier()
                check(eager, want[rank], combined, rank, f"eager {replay}")
                same_defined_rows(got, eager, len(want[rank]["recv_x"]), f"replay {replay}")
                record["replays"] = replay + 1
            buf.check_kernel_errors()
            record["too_few_rows"] = too_few_rows_raise_on_every_rank(step, group)
            eager = as_numpy(step())
            stream.synchronize()
            group.barrier()
            check(eager, want[rank], combined, rank, "the call after the one that raised")
            layout = RecordLayout(H * (1 if fp8 else 2), 4 * (H // 128) if fp8 else 0, K, K, R)
            sends = want[rank]["send_counts"]
            record.update(ok=True, record_bytes=layout.bytes, block_tokens=T,
                          bytes_sent=num_nodes * T * layout.bytes, bytes_needed=int(sum(sends)) * layout.bytes,
                          bytes_sent_between_nodes=(num_nodes - 1) * T * layout.bytes,
                          bytes_needed_between_nodes=int(sum(sends) - sends[rank // L]) * layout.bytes)
            group.barrier()
            del graph
    except Exception as exc:  # reported; the other ranks may be left waiting in a collective
        record["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        emit(record)
        buf.destroy()
    return record["ok"]


def too_few_rows_raise_on_every_rank(step, group):
    """A dispatch with num_worst_tokens=1 returns (it never waits for the host), or raises where
    the node's host learns of it within the call (ranks sharing a GPU wait for their node's
    kernels); the call, or else the next one, raises on every rank (ValueError where the rows did
    not fit, PeerFailedError elsewhere). The name of what this rank raised."""
    import torch

    import deepep_cupy as ep

    buf = step.buf
    x = (step.x, step.scales) if step.fp8 else step.x
    per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(step.topk, step.E)
    try:
        for worst in (1, step.worst):
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=step.topk, num_worst_tokens=worst)
            torch.cuda.current_stream().synchronize()
            group.barrier()
    except (ValueError, ep.PeerFailedError) as exc:
        if "num_worst_tokens" not in str(exc) and not isinstance(exc, ep.PeerFailedError):
            raise
        return type(exc).__name__
    finally:
        torch.cuda.current_stream().synchronize()
        group.barrier()
    raise Mismatch("a dispatch with num_worst_tokens=1 was not reported by the next call")


def ref_bf16(values):
    from deepep_cupy.reference import intranode as ref

    return ref.float32_to_bfloat16_bits(values)


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("num_nodes", type=int)
    parser.add_argument("ranks_per_node", type=int)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"))
    parser.add_argument("--transport", default="local", choices=("local", "nccl"))
    args = parser.parse_args(argv)
    import cupy

    import deepep_cupy as ep

    R = args.num_nodes * args.ranks_per_node
    devices = [r % cupy.cuda.runtime.getDeviceCount() for r in range(R)]
    if args.transport == "nccl" and len(set(devices)) < R:
        raise SystemExit(f"--transport nccl: NCCL needs one GPU per rank ({R} ranks, {len(set(devices))} GPUs)")
    oks = ep.run_local_group(lambda group: rank_main(group, args.num_nodes, args.ranks_per_node, args.replays,
                                                     args.dtype, args.transport), R, devices=devices, timeout_s=120)
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
