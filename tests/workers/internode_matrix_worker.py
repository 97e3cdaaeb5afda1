"""MPI worker for the internode matrix: every node shape of one job, with CuPy and PyTorch inputs,
on the caller's default stream and on a side stream, as ordinary callers make them.

Usage: ``mpiexec -n R python tests/workers/internode_matrix_worker.py L [L ...]`` (one Buffer per
ranks per node ``L``, MPI rail transport). Each row a rank dispatches names its source rank and
token index in its first three columns, so that the checks compare what arrived as a set of
(source, token) pairs with the reference (deepep_cupy.reference.internode), whatever the order;
every row's bytes, top-k ids and weights are then compared with the source's, the order with
DeepEP's (by source rank, then token), and the combine bit for bit. Fresh, cached and
``num_worst_tokens`` dispatches, combine, and two failures (a bad argument on one rank, before the
count exchange; too few ``num_worst_tokens`` for one rank, after it), after each of which every rank
must have raised and the communicator's own allgather must be in step. Prints one ``RESULT {json}``
line per rank and case, ``case`` = ``"{N}x{L} {framework} {stream} {scenario}"``.
"""

import contextlib
import json
import os
import sys
import time
import traceback

import numpy as np

HIDDEN = 256
NUM_TOPK = 4
#: Only the fresh dispatch's rows, as sets (DEEPEP_TEST_MATRIX_SETS_ONLY=1): what an older tree,
#: with another receive order and handle, can be held to.
SETS_ONLY = os.environ.get("DEEPEP_TEST_MATRIX_SETS_ONLY") == "1"


class Mismatch(AssertionError):
    pass


def bf16(values):
    from deepep_cupy.reference import intranode as ref

    return ref.float32_to_bfloat16_bits(np.asarray(values, np.float32))


def make_inputs(seed, R, E):
    """Every rank's rows, routing and weights (every rank makes all of them from the seed)."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(seed)
    inputs = []
    for r in range(R):
        n = int(rng.integers(0, 200))
        rows = rng.standard_normal((n, HIDDEN), dtype=np.float32)
        t = np.arange(n)
        rows[:, 0], rows[:, 1], rows[:, 2] = r, t // 64, t % 64   # exact in BF16: the row's name
        topk = ref.random_routing(rng, n, E, NUM_TOPK, drop_fraction=0.1)
        inputs.append(dict(x=bf16(rows), topk=topk, weights=rng.random(topk.shape, dtype=np.float32) + 0.5))
    return inputs


def names_of(rows):
    """(source rank, token) of each received BF16 row."""
    from deepep_cupy.reference import intranode as ref

    head = ref.bfloat16_bits_to_float32(np.asarray(rows)[:, :3]).astype(np.int64)
    return head[:, 0], head[:, 1] * 64 + head[:, 2]


def y_rows(sources, tokens, receiver):
    """The rows a receiver gives back to combine, a function of (source, token, receiver) alone."""
    base = ((sources * 131 + tokens * 17 + receiver * 7) % 97) / 8.0 - 6.0
    return bf16(base[:, None] + (np.arange(HIDDEN) % 5)[None, :] * 0.25)


class Framework:
    """CuPy or PyTorch arrays on the caller's default stream or a side stream."""

    def __init__(self, name, stream):
        import cupy

        self.name, self.stream_name = name, stream
        self.cupy = cupy
        if name == "torch":
            import torch

            self.torch = torch
            self._stream = torch.cuda.Stream() if stream == "side" else None
        else:
            self._stream = cupy.cuda.Stream(non_blocking=True) if stream == "side" else None

    def on_stream(self):
        if self._stream is None:  # PyTorch's legacy default stream; CuPy's null stream
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self._stream) if self.name == "torch" else self._stream

    def device(self, a):
        a = np.ascontiguousarray(a)
        if self.name == "cupy":
            return self.cupy.asarray(a)
        if a.dtype == np.uint16:
            return self.torch.from_numpy(a.view(np.int16)).cuda().view(self.torch.bfloat16)
        return self.torch.from_numpy(a).cuda()

    def host(self, a):
        if self.name == "cupy":
            return self.cupy.asnumpy(a)   # on the current stream, as a user reads results
        if a.dtype == self.torch.bfloat16:
            return a.view(self.torch.int16).cpu().numpy().view(np.uint16)
        return a.cpu().numpy()


def expected_pairs(inputs, rank, epr):
    """The (source, token) pairs a rank must receive: tokens with an expert of its own (brute force)."""
    return sorted((s, t) for s, p in enumerate(inputs) for t in range(len(p["x"]))
                  if ((p["topk"][t] >= rank * epr) & (p["topk"][t] < (rank + 1) * epr)).any())


def check_dispatch(what, fw, out, want, inputs, rank, rows):
    recv_x, recv_topk, recv_w = out
    x = fw.host(recv_x)
    want_pairs = expected_pairs(inputs, rank, want["epr"])
    n = len(want_pairs)
    if x.shape[0] != rows:
        raise Mismatch(f"{what}: {x.shape[0]} rows, expected {rows}")
    src, tok = names_of(x[:n])
    got_pairs = sorted(zip(src.tolist(), tok.tolist()))
    if got_pairs != want_pairs:
        raise Mismatch(f"{what}: received {len(got_pairs)} rows {got_pairs[:6]}..., expected {len(want_pairs)} "
                       f"{want_pairs[:6]}...")
    for i, (s, t) in enumerate(zip(src, tok)):
        if not np.array_equal(x[i], inputs[s]["x"][t]):
            raise Mismatch(f"{what}: the row of source {s} token {t} differs")
    if recv_topk is not None:
        epr = want["epr"]
        topk, weights = fw.host(recv_topk), fw.host(recv_w)
        for i, (s, t) in enumerate(zip(src, tok)):
            g = inputs[s]["topk"][t]
            mine = (g >= rank * epr) & (g < (rank + 1) * epr)
            if not np.array_equal(topk[i], np.where(mine, g - rank * epr, -1)) or \
                    not np.array_equal(weights[i], np.where(mine, inputs[s]["weights"][t], np.float32(0))):
                raise Mismatch(f"{what}: top-k or weights of source {s} token {t} differ")
        if (topk[n:] != -1).any():
            raise Mismatch(f"{what}: padding rows with top-k ids other than -1")
    if not SETS_ONLY and not (np.diff(src * (1 << 20) + tok) > 0).all():
        raise Mismatch(f"{what}: rows not in DeepEP's order (by source rank, then token)")


def run_case(buf, fw, inputs, want, rank, E, L, size):
    from deepep_cupy.reference import internode as iref
    from deepep_cupy.reference import intranode as ref

    mine, w = inputs[rank], want[rank]
    with fw.on_stream():
        x, topk, weights = fw.device(mine["x"]), fw.device(mine["topk"]), fw.device(mine["weights"])
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        args = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights)
        recv_x, recv_topk, recv_w, experts, handle, _ = buf.dispatch(x, **args)
        n = len(expected_pairs(inputs, rank, w["epr"]))
        check_dispatch("fresh", fw, (recv_x, recv_topk, recv_w), w, inputs, rank, n)
        if SETS_ONLY:
            return {"received": n}
        if experts != w["num_recv_tokens_per_expert_list"]:
            raise Mismatch(f"expert counts {experts}, expected {w['num_recv_tokens_per_expert_list']}")
        prefix = fw.host(handle[-4])
        if not np.array_equal(prefix, w["recv_gbl_rank_prefix_sum"]):
            raise Mismatch(f"recv_gbl_rank_prefix_sum {prefix}, expected {w['recv_gbl_rank_prefix_sum']}")
        cached = buf.dispatch(x, handle=handle)[0]
        check_dispatch("cached", fw, (cached, None, None), w, inputs, rank, n)
        worst = sum(len(i["x"]) for i in inputs)
        padded = buf.dispatch(x, num_worst_tokens=worst, **args)
        check_dispatch("num_worst_tokens", fw, padded[:3], w, inputs, rank, worst)

        src, tok = names_of(fw.host(recv_x))
        y = fw.device(y_rows(src, tok, rank))
        bias = fw.device(bf16(np.full((len(mine["x"]), HIDDEN), 0.5)))
        out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w, bias=bias)
        ys = [y_rows(want[d]["recv_src"][:, 0], want[d]["recv_src"][:, 1], d) for d in range(size)]
        yw = [want[d]["recv_topk_weights"] for d in range(size)]
        biases = [(bf16(np.full((len(inputs[r]["x"]), HIDDEN), 0.5)),) for r in range(size)]
        combined = iref.combine(ys, want, "bfloat16", topk_weights=yw, bias=biases)[rank]
        if not np.array_equal(fw.host(out), ref.round_to_dtype(combined[0], "bfloat16")):
            raise Mismatch("combined_x differs from the reference")
        if not np.array_equal(fw.host(out_w), combined[1]):
            raise Mismatch("combined_topk_weights differ from the reference")
        return {"received": n}


def run_failures(buf, comm, fw, inputs, rank, E):
    """Two calls that must raise on every rank, each followed by the communicator's own allgather
    (in step: every rank's own value) and a call that works."""
    import deepep_cupy as ep

    outcomes = []
    mine = inputs[rank]
    with fw.on_stream():
        x, topk = fw.device(mine["x"]), fw.device(mine["topk"])
        per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        for what in ("bad expert id on rank 1", "num_worst_tokens too small"):
            bad = topk
            kwargs = {}
            if what.startswith("bad") and rank == 1:
                bad = fw.device(np.full(mine["topk"].shape, E, np.int64))
            if what.startswith("num_worst"):
                kwargs["num_worst_tokens"] = 1
            try:
                buf.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=bad, **kwargs)
                raised = None
            except (ValueError, ep.PeerFailedError) as exc:
                raised = type(exc).__name__
            gathered = comm.allgather(rank)
            if raised is None or gathered != list(range(comm.Get_size())):
                raise Mismatch(f"{what}: raised {raised}, then the communicator's allgather gave {gathered}")
            outcomes.append(raised)
            buf.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=topk, is_token_in_rank=in_rank)
    return {"raised": outcomes}


def main(ranks_per_node):
    import cupy
    from mpi4py import MPI

    import deepep_cupy as ep
    from deepep_cupy.reference import internode as iref

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    timeout_s = float(os.environ.get("DEEPEP_TEST_TIMEOUT_S", "60"))
    try:
        import torch

        torch.cuda.set_device(cupy.cuda.Device().id)
        frameworks = ("cupy", "torch")
    except ImportError:
        frameworks = ("cupy",)
    failures = 0
    for L in ranks_per_node:
        E = 4 * size
        buf = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(HIDDEN * 2, max(L, 2), num_max_tokens_per_rank=4096), 1,
                        ranks_per_node=L, internode_transport="mpi", timeout_s=timeout_s)
        for i, (name, stream) in enumerate((f, s) for f in frameworks for s in ("default", "side")):
            fw = Framework(name, stream)
            inputs = make_inputs(100 * L + i, size, E)
            want = [{} for _ in range(size)] if SETS_ONLY else \
                iref.dispatch([p["x"] for p in inputs], [p["topk"] for p in inputs], E, L,
                              topk_weights=[p["weights"] for p in inputs])
            for w in want:
                w["epr"] = E // size
            scenarios = (("calls", run_case, (buf, fw, inputs, want, rank, E, L, size)),
                         ("failures", run_failures, (buf, comm, fw, inputs, rank, E)))
            for scenario, body, body_args in scenarios[:1 if SETS_ONLY else 2]:
                start = time.time()
                try:
                    info, ok, error = body(*body_args), True, None
                except Exception as exc:  # report and go on
                    info, ok, error = {}, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                    failures += 1
                case = f"{size // L}x{L} {name} {stream} {scenario}"
                print("RESULT " + json.dumps({"rank": rank, "case": case, "ok": ok, "error": error,
                                              "seconds": round(time.time() - start, 3), **info}), flush=True)
                if not comm.allreduce(ok, op=MPI.LAND):
                    buf.destroy()
                    buf = ep.Buffer(comm, buf.num_nvl_bytes, 1, ranks_per_node=L, internode_transport="mpi",
                                    timeout_s=timeout_s)
        buf.destroy()
    return failures


if __name__ == "__main__":
    sys.exit(1 if main([int(a) for a in sys.argv[1:]] or [2]) else 0)
