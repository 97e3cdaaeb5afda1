"""GPU worker for the low-latency (decode) calls: every case against the NumPy model, bit for bit.

Usage::

    python tests/workers/low_latency_worker.py --local N [CASE ...]   # N rank threads, GPUs shared
    mpiexec -n N python tests/workers/low_latency_worker.py [CASE ...]  # one process per rank

``--ranks-per-node P`` splits the ranks into simulated nodes of ``P`` (every Buffer of the run:
the decode calls across nodes, checked against deepep_cupy/reference/low_latency_nodes.py).

(``DEEPEP_TEST_ONE_GPU_MPI=1`` makes the test harness run the second form through
tests/workers/one_gpu_ranks.py on a one-GPU machine.) One ``RESULT {json}`` line per rank and case
(``case``, ``rank``, ``ok``, ``error``); exit status 1 when a case failed on any rank. A case that
fails is followed by a new Buffer on every rank.

Inputs are drawn from a seed that every rank shares, so every rank knows every rank's inputs and
computes the reference (deepep_cupy/reference/low_latency.py) of its own outputs. Token counts
differ per rank (1 to 128, ``num_max_dispatch_tokens_per_rank`` = 128) and top-k rows hold -1s.

Ranks sharing a GPU in one process meet (a group barrier) before each call: a rank that checks the
last results may load a CuPy or PyTorch kernel for the first time, and loading waits for the
kernels running on the GPU, among them a peer's that waits for this rank.
"""

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import traceback

import numpy as np
from gpu_worker import Mismatch, expect_equal, to_numpy
from local_gpu_worker import RankBuffer

M, H, K = 128, 1024, 4
EXPERTS_PER_RANK = 4
BIG_HIDDEN = 7168  # the decode shape of the anchors, in the cases that name it
TIMEOUT_S = float(os.environ.get("DEEPEP_TEST_LL_TIMEOUT_S", "30"))
#: Replays of each captured decode step, each with new routing.
GRAPH_REPLAYS = 5
#: Ranks per simulated node (``--ranks-per-node``); None: one node.
RANKS_PER_NODE = None
FP8_MODES = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
             "fp8_round_scale": dict(use_fp8=True, round_scale=True), "fp8_ue8m0": dict(use_fp8=True, use_ue8m0=True)}
CASES = ("bf16_eager", "bf16_hook", "fp8_eager", "fp8_hook", "fp8_round_scale_eager", "fp8_round_scale_hook",
         "fp8_ue8m0_eager", "fp8_ue8m0_hook", "token_counts_1_to_128", "two_calls_in_flight", "zero_copy", "stats",
         "hidden_7168_fp8", "async_finish", "clean_then_calls", "bad_expert_id_is_reported", "graph_cupy",
         "graph_torch", "graph_torch_hook_fp8", "deepep_style_torch", "lone_call_times_out",
         "two_zero_copy_combines_in_flight_async", "two_zero_copy_combines_in_flight_hook", "graph_torch_async",
         "graph_cupy_async", "logfmt_hidden_2048", "logfmt_hidden_1536_hook", "logfmt_hidden_7168_fp8",
         "masked_rank_shrink", "combine_wait_stats", "random_calls")
assert set(CASES) >= {f"{mode}_{hook}" for mode in FP8_MODES for hook in ("eager", "hook")}


def emit(tag, record):
    sys.stdout.write(f"{tag} {json.dumps(record)}\n")
    sys.stdout.flush()


class Skip(Exception):
    """A case that cannot run in this setting (the reason is reported, the case counts as passed)."""


class Ctx:
    """One rank's state for the cases."""

    def __init__(self, group, buf, sharing):
        import cupy

        self.group, self.buf, self.sharing = group, buf, sharing
        self.rank, self.R = group.rank, group.size
        self.E = EXPERTS_PER_RANK * self.R
        self.L = EXPERTS_PER_RANK
        self.device = cupy.cuda.Device().id

    def together(self):
        """Ranks sharing a GPU in one process meet before a call (see the module docstring)."""
        if self.sharing:
            self.group.barrier()

    def synchronize(self):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------------------------------
# Inputs and checks


class ExpertRows:
    """Rank ``owner``'s expert outputs, BF16 bits ``[L, R * M, hidden]``: a hash of each element's
    index, so that the reference reads the few rows it needs without drawing them all."""

    def __init__(self, seed, owner, L, rows, hidden):
        self.seed, self.owner, self.shape = seed, owner, (L, rows, hidden)

    def _bits(self, first, count):
        u32 = np.uint32
        v = np.arange(first, first + count, dtype=np.uint32) ^ u32((self.seed * 977 + self.owner * 7919) & 0xFFFFFFFF)
        v *= u32(0x9E3779B1)
        v ^= v >> u32(15)
        v *= u32(0x85EBCA77)
        v ^= v >> u32(13)
        sign = (v & u32(1)) << u32(15)
        exponent = (u32(120) + (v >> u32(8)) % u32(10)) << u32(7)
        return (sign | exponent | ((v >> u32(20)) & u32(0x7F))).astype(np.uint16)

    def __getitem__(self, index):
        local, row = index
        L, rows, hidden = self.shape
        return self._bits((local * rows + row) * hidden, hidden)

    def full(self):
        L, rows, hidden = self.shape
        return self._bits(0, L * rows * hidden).reshape(self.shape)


_memo = {}
_memo_lock = threading.Lock()


def _memoized(key, make):
    """``make()`` once per key for all rank threads of this process (inputs and references are read only)."""
    with _memo_lock:
        if key not in _memo:
            if len(_memo) > 16:
                _memo.clear()
            _memo[key] = make()
        return _memo[key]


class Drawn(list):
    """Every rank's inputs (a list, one dict per rank) and the key they were drawn with."""

    key = None


def draw(seed, R, E, counts=None, hidden=H, num_topk=K):
    """Every rank's inputs: BF16 x (magnitudes varied per token, a zero group), routing with -1s,
    float32 weights, expert outputs y (:class:`ExpertRows`)."""
    counts = tuple([128, 1, 77, 5, 128, 33, 2, 100][r % 8] for r in range(R)) if counts is None else tuple(counts)
    key = ("draw", seed, R, E, counts, hidden, num_topk)
    return _memoized(key, lambda: _draw(key, seed, R, E, counts, hidden, num_topk))


def _draw(key, seed, R, E, counts, hidden, num_topk):
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(seed)
    inputs = Drawn()
    inputs.key = key
    for r in range(R):
        n = counts[r]
        x = rng.standard_normal((n, hidden), dtype=np.float32) * np.exp(rng.uniform(-6, 6, (n, 1))).astype(np.float32)
        if n > 1:
            x[1, :128] = 0.0  # amax floored at 1e-4
        topk = ref.random_routing(rng, n, E, num_topk, drop_fraction=0.2)
        inputs.append(dict(x=ref.float32_to_bfloat16_bits(x), topk=topk,
                           weights=rng.random((n, num_topk), dtype=np.float32),
                           y=ExpertRows(seed, r, E // R, R * M, hidden)))
    return inputs


def to_device(a, lib="cupy"):
    import cupy

    if isinstance(a, ExpertRows):
        a = a.full()
    d = cupy.asarray(a)
    if lib == "cupy":
        return d
    import torch

    t = torch.as_tensor(d, device=f"cuda:{cupy.cuda.Device().id}").clone()
    if a.dtype == np.uint16:
        return t.view(torch.bfloat16)
    return t


def reference(inputs, E, mode):
    from deepep_cupy.reference import low_latency as ll
    from deepep_cupy.reference import low_latency_nodes as lln

    xs, topks = [i["x"] for i in inputs], [i["topk"] for i in inputs]
    if RANKS_PER_NODE is None:
        def make():
            return ll.dispatch(xs, topks, M, E, **FP8_MODES[mode])
    else:
        def make():
            return lln.dispatch(xs, topks, M, E, RANKS_PER_NODE, **FP8_MODES[mode])
    # Keyed by what the inputs were drawn from (an id could be a freed list's, reused).
    return _memoized(("reference", inputs.key, E, mode, RANKS_PER_NODE), make)


def check_dispatch(out, want, mode, what):
    recv, recv_count, handle, _, _ = out
    counts = want["recv_count"]
    expect_equal(f"{what}: recv_count", to_numpy(recv_count), counts)
    expect_equal(f"{what}: layout_range", to_numpy(handle[1]), want["layout_range"])
    src_info = to_numpy(handle[0])
    fp8 = FP8_MODES[mode]["use_fp8"]
    data = to_numpy(recv[0] if fp8 else recv)
    scales = to_numpy(recv[1]) if fp8 else None
    for local, c in enumerate(counts):
        expect_equal(f"{what}: src_info[{local}]", src_info[local, :c], want["src_info"][local, :c])
        expect_equal(f"{what}: recv_x[{local}]", data[local, :c], want["recv_x"][local, :c])
        if fp8:
            expect_equal(f"{what}: scales[{local}]", scales[local, :c], want["scales"][local, :c])


def check_combine(combined, inputs, results, rank, what, ys=None, use_logfmt=False):
    from deepep_cupy.reference import low_latency as ll
    from deepep_cupy.reference import low_latency_nodes as lln

    ys = [i["y"] for i in inputs] if ys is None else ys
    topks, weights = [i["topk"] for i in inputs], [i["weights"] for i in inputs]
    if RANKS_PER_NODE is None:
        want = ll.combine(ys, topks, weights, results, ranks=[rank], use_logfmt=use_logfmt)[rank]
    else:
        ys = [y.full() if isinstance(y, ExpertRows) else y for y in ys]
        want = lln.combine(ys, topks, weights, results, RANKS_PER_NODE, ranks=[rank], use_logfmt=use_logfmt)[rank]
    expect_equal(f"{what}: combined_x", to_numpy(combined), want)


# ---------------------------------------------------------------------------------------------
# Cases


def rank_arrays(ctx, inputs):
    """This rank's x, topk, weights and y of ``inputs``, on its device."""
    return tuple(to_device(inputs[ctx.rank][k]) for k in ("x", "topk", "weights", "y"))


def checked_round_trip(ctx, inputs, arrays, mode, what):
    """A plain dispatch and combine of this rank's device ``arrays`` (x, topk, weights, y) of
    ``inputs`` in ``mode``, each output checked against the reference (``what`` names the checks)."""
    x, topk, weights, y = arrays
    results = reference(inputs, ctx.E, mode)
    ctx.together()
    out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, **FP8_MODES[mode])
    ctx.synchronize()
    check_dispatch(out, results[ctx.rank], mode, what)
    ctx.together()
    combined = ctx.buf.low_latency_combine(y, topk, weights, out[2])[0]
    ctx.synchronize()
    check_combine(combined, inputs, results, ctx.rank, what)


def dispatch_and_combine(ctx, mode, hook, seed):
    inputs = draw(seed, ctx.R, ctx.E)
    x, topk, weights, y = rank_arrays(ctx, inputs)
    results = reference(inputs, ctx.E, mode)
    ctx.together()
    out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, return_recv_hook=hook, **FP8_MODES[mode])
    if hook:
        out[4]()
    ctx.synchronize()
    check_dispatch(out, results[ctx.rank], mode, "dispatch")
    ctx.together()
    combined, _, combine_hook = ctx.buf.low_latency_combine(y, topk, weights, out[2], return_recv_hook=hook)
    if hook:
        combine_hook()
    ctx.synchronize()
    check_combine(combined, inputs, results, ctx.rank, "combine")


def case_token_counts(ctx):
    for seed, n in enumerate((1, 2, 31, 64, 127, 128)):
        counts = [max(1, n - 3 * r) for r in range(ctx.R)]
        for mode in ("bf16", "fp8"):
            inputs = draw(100 + seed, ctx.R, ctx.E, counts)
            checked_round_trip(ctx, inputs, rank_arrays(ctx, inputs), mode, f"{n} tokens {mode}")


def case_two_in_flight(ctx):
    # Two sends, then the two receives: both halves of the buffer in use at once (DeepEP's overlap
    # of two micro-batches).
    batches = [draw(200 + b, ctx.R, ctx.E) for b in range(2)]
    modes = ("fp8", "bf16")
    devs = [{k: to_device(inputs[ctx.rank][k]) for k in ("x", "topk", "weights", "y")} for inputs in batches]
    ctx.together()
    outs = [ctx.buf.low_latency_dispatch(d["x"], d["topk"], M, ctx.E, return_recv_hook=True, **FP8_MODES[m])
            for d, m in zip(devs, modes)]
    for out in outs:
        out[4]()
    ctx.synchronize()
    results = [reference(inputs, ctx.E, m) for inputs, m in zip(batches, modes)]
    for b in range(2):
        check_dispatch(outs[b], results[b][ctx.rank], modes[b], f"batch {b} dispatch")
    ctx.together()
    combines = [ctx.buf.low_latency_combine(d["y"], d["topk"], d["weights"], out[2], return_recv_hook=True)
                for d, out in zip(devs, outs)]
    for _, _, hook in combines:
        hook()
    ctx.synchronize()
    for b in range(2):
        check_combine(combines[b][0], batches[b], results[b], ctx.rank, f"batch {b} combine")


def case_zero_copy(ctx):
    inputs = draw(300, ctx.R, ctx.E)
    x, topk, weights, y = rank_arrays(ctx, inputs)
    results = reference(inputs, ctx.E, "bf16")
    ctx.together()
    out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, use_fp8=False)
    ctx.synchronize()
    area = ctx.buf.get_next_low_latency_combine_buffer(out[2])
    area[...] = y
    decoy = to_device(np.zeros(y.shape, np.uint16))  # x of a zero-copy combine: only its shape counts
    ctx.synchronize()
    ctx.together()
    combined = ctx.buf.low_latency_combine(decoy, topk, weights, out[2], zero_copy=True)[0]
    ctx.synchronize()
    check_combine(combined, inputs, results, ctx.rank, "zero-copy combine")


def case_two_zero_copy_in_flight(ctx, hook):
    """Two zero-copy combines in flight (async, or sends before their hooks): B's rows are written into
    get_next_low_latency_combine_buffer(handle_B) before A is over; both come back right (DeepEP's
    halves alternate per call, so A's and B's rows never share memory)."""
    batches = [draw(1000 + b, ctx.R, ctx.E) for b in range(2)]
    devs = [{k: to_device(inputs[ctx.rank][k]) for k in ("x", "topk", "weights", "y")} for inputs in batches]
    results = [reference(inputs, ctx.E, "bf16") for inputs in batches]
    handles = []
    for d in devs:
        ctx.together()
        out = ctx.buf.low_latency_dispatch(d["x"], d["topk"], M, ctx.E, use_fp8=False)
        ctx.synchronize()
        handles.append(out[2])
    decoy = to_device(np.zeros(devs[0]["y"].shape, np.uint16))  # x of a zero-copy combine: only its shape counts
    ctx.synchronize()
    ctx.together()
    combines = []
    for d, handle in zip(devs, handles):
        # No wait for the previous combine: its send may still read its own area.
        ctx.buf.get_next_low_latency_combine_buffer(handle)[...] = d["y"]
        combines.append(ctx.buf.low_latency_combine(decoy, d["topk"], d["weights"], handle, zero_copy=True,
                                                    async_finish=not hook, return_recv_hook=hook))
    for _, event, recv_hook in combines:
        recv_hook() if hook else event.current_stream_wait()
    ctx.synchronize()
    for b in range(2):
        check_combine(combines[b][0], batches[b], results[b], ctx.rank, f"zero-copy combine {b}")


def logfmt_rows(y):
    """Expert rows whose 128-channel groups mix what LogFMT casts (every value below 1) and what it
    sends as BF16: the first half of every row scaled down by 2**-10 (exponent field - 10), every
    fourth row's first group zero, and a group with a single zero value."""
    bits = y.full().copy()
    half = bits.shape[-1] // 2
    bits[..., :half] -= np.uint16(10 << 7)
    bits[:, ::4, :128] = 0
    bits[:, 1::4, 128] = 0
    return bits


def case_logfmt(ctx, hidden, hook, mode):
    """A LogFMT combine (DeepEP's LogFMT-10) bit-exact against the model: rows whose chunks are cast
    and rows sent as BF16, with unroll 4 (hidden a multiple of 1024) and 2."""
    inputs = draw(1100 + hidden, ctx.R, ctx.E, hidden=hidden)
    ys = [logfmt_rows(i["y"]) for i in inputs]
    x, topk, weights = (to_device(inputs[ctx.rank][k]) for k in ("x", "topk", "weights"))
    y = to_device(ys[ctx.rank])
    results = reference(inputs, ctx.E, mode)
    ctx.together()
    out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, **FP8_MODES[mode])
    ctx.synchronize()
    check_dispatch(out, results[ctx.rank], mode, "dispatch")
    ctx.together()
    combined, _, recv_hook = ctx.buf.low_latency_combine(y, topk, weights, out[2], use_logfmt=True,
                                                         return_recv_hook=hook)
    if hook:
        recv_hook()
    ctx.synchronize()
    check_combine(combined, inputs, results, ctx.rank, f"LogFMT combine, hidden {hidden}", ys, use_logfmt=True)


def case_masked_rank(ctx):
    """enable_shrink=True (DeepEP's shrink mode): the last rank stops calling; the others' first
    dispatch times out on it (5 s) and masks it; their results then cover the other ranks (the
    model with the stopped rank's routing empty and the experts it owns dropped), the mask query
    names it, a clean (device barrier) and more calls, with hooks, go on without waiting for it."""
    import deepep_cupy as ep

    if RANKS_PER_NODE is not None:
        raise Skip("shrink mode is not available across nodes (the Buffer refuses it)")
    stopped = ctx.R - 1
    num_bytes = ep.Buffer.get_low_latency_rdma_size_hint(M, H, ctx.R, ctx.E)
    shrink = ep.Buffer(ctx.group, 0, num_bytes, low_latency_mode=True, timeout_s=5.0, enable_shrink=True)
    try:
        if ctx.rank != stopped:
            inputs = draw(1200, ctx.R, ctx.E)
            live = Drawn(dict(i) for i in inputs)
            live.key = inputs.key + ("rank stopped", stopped)
            L = ctx.E // ctx.R
            for r, entry in enumerate(live):
                topk = entry["topk"].copy()
                topk[(topk // L) == stopped] = -1  # experts of the stopped rank: dropped by the combine
                if r == stopped:
                    topk[...] = -1  # the stopped rank sends nothing
                entry["topk"] = topk
            mine = inputs[ctx.rank]
            x, topk, weights = (to_device(mine[k]) for k in ("x", "topk", "weights"))
            y = to_device(mine["y"])
            results = reference(live, ctx.E, "bf16")
            status = to_device(np.zeros(ctx.R, np.int32))
            for round_, hook in enumerate((False, True, False)):
                out = shrink.low_latency_dispatch(x, topk, M, ctx.E, use_fp8=False, return_recv_hook=hook)
                if hook:
                    out[4]()
                ctx.synchronize()
                check_dispatch(out, results[ctx.rank], "bf16", f"round {round_} dispatch")
                combined, _, recv_hook = shrink.low_latency_combine(y, topk, weights, out[2], return_recv_hook=hook)
                if hook:
                    recv_hook()
                ctx.synchronize()
                check_combine(combined, live, results, ctx.rank, f"round {round_} combine")
                shrink.low_latency_query_mask_buffer(status)
                ctx.synchronize()
                want = np.zeros(ctx.R, np.int32)
                want[stopped] = 1
                expect_equal(f"round {round_} mask", to_numpy(status), want)
                if round_ == 0:
                    shrink.clean_low_latency_buffer(M, H, ctx.E)  # the masked barrier: no wait for it
            shrink.low_latency_clean_mask_buffer()
            shrink.low_latency_query_mask_buffer(status)
            ctx.synchronize()
            expect_equal("mask after clean", to_numpy(status), np.zeros(ctx.R, np.int32))
            shrink.low_latency_update_mask_buffer(stopped, True)
            shrink.low_latency_query_mask_buffer(status)
            ctx.synchronize()
            expect_equal("mask after update", to_numpy(status), want)
    finally:
        shrink.destroy()  # every rank, the stopped one too (it waits there for the others)


def case_combine_wait_stats(ctx):
    """combine_wait_recv_cost_stats: int64 per source rank, clock64 cycles added (DeepEP's meaning)."""
    inputs = draw(1300, ctx.R, ctx.E)
    x, topk, weights, y = rank_arrays(ctx, inputs)
    results = reference(inputs, ctx.E, "bf16")
    waited = to_device(np.zeros((ctx.R,), np.int64))
    ctx.together()
    out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, use_fp8=False)
    ctx.synchronize()
    ctx.together()
    combined = ctx.buf.low_latency_combine(y, topk, weights, out[2], combine_wait_recv_cost_stats=waited)[0]
    ctx.synchronize()
    check_combine(combined, inputs, results, ctx.rank, "combine with statistics")
    w = to_numpy(waited)
    if w.shape != (ctx.R,) or (w < 0).any() or w.max() > 4e9 * TIMEOUT_S * ctx.E:
        raise Mismatch(f"combine_wait_recv_cost_stats: expected R non-negative cycle sums, got {w}")


def case_random_calls(ctx):
    """Calls of drawn settings, the same on every rank: 1 to M tokens per rank, hidden 1024 or 2048,
    top-1 to top-8, each FP8 mode, with or without the receive hook, CuPy or PyTorch arrays."""
    rng = np.random.default_rng(5000)
    libs = ["cupy"] + (["torch"] if _has_torch() else [])
    for i in range(6):
        counts = [int(c) for c in rng.integers(1, M + 1, ctx.R)]
        hidden = int(rng.choice([1024, 2048]))
        num_topk = int(rng.integers(1, min(8, ctx.E) + 1))
        mode = str(rng.choice(list(FP8_MODES)))
        hook = bool(rng.integers(2))
        lib = str(rng.choice(libs))
        inputs = draw(5000 + i, ctx.R, ctx.E, counts, hidden=hidden, num_topk=num_topk)
        x, topk, weights, y = (to_device(inputs[ctx.rank][k], lib) for k in ("x", "topk", "weights", "y"))
        results = reference(inputs, ctx.E, mode)
        what = f"call {i} ({lib}, {mode}, hook={hook}, hidden {hidden}, top-{num_topk}, tokens {counts})"
        ctx.together()
        out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, return_recv_hook=hook, **FP8_MODES[mode])
        if hook:
            out[4]()
        ctx.synchronize()
        check_dispatch(out, results[ctx.rank], mode, f"{what} dispatch")
        ctx.together()
        combined, _, combine_hook = ctx.buf.low_latency_combine(y, topk, weights, out[2], return_recv_hook=hook)
        if hook:
            combine_hook()
        ctx.synchronize()
        check_combine(combined, inputs, results, ctx.rank, f"{what} combine")


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def case_stats(ctx):
    inputs = draw(400, ctx.R, ctx.E)
    mine = inputs[ctx.rank]
    x, topk = to_device(mine["x"]), to_device(mine["topk"])
    results = reference(inputs, ctx.E, "fp8")
    cumulative = to_device(np.full((ctx.L,), 5, np.int32))
    waited = to_device(np.zeros((ctx.R,), np.int64))
    for _ in range(2):
        ctx.together()
        ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, cumulative_local_expert_recv_stats=cumulative,
                                     dispatch_wait_recv_cost_stats=waited)
        ctx.synchronize()
    expect_equal("cumulative_local_expert_recv_stats", to_numpy(cumulative), 5 + 2 * results[ctx.rank]["recv_count"])
    w = to_numpy(waited)
    if w.shape != (ctx.R,) or (w < 0).any() or w.max() > 2 * ctx.L * TIMEOUT_S * 4e9:
        raise Mismatch(f"dispatch_wait_recv_cost_stats: expected R non-negative clock64 cycle sums, got {w}")


def case_hidden_7168(ctx):
    inputs = draw(500, ctx.R, ctx.E, hidden=BIG_HIDDEN, num_topk=8 if ctx.E >= 8 else ctx.E)
    arrays = rank_arrays(ctx, inputs)
    for mode in ("fp8", "fp8_ue8m0"):
        checked_round_trip(ctx, inputs, arrays, mode, f"hidden 7168 {mode}")


def case_async_finish(ctx):
    inputs = draw(600, ctx.R, ctx.E)
    x, topk, weights, y = rank_arrays(ctx, inputs)
    results = reference(inputs, ctx.E, "fp8_round_scale")
    ctx.together()
    out = ctx.buf.low_latency_dispatch(x, topk, M, ctx.E, async_finish=True, **FP8_MODES["fp8_round_scale"])
    out[3].current_stream_wait()
    ctx.synchronize()
    check_dispatch(out, results[ctx.rank], "fp8_round_scale", "async dispatch")
    ctx.together()
    combined, event, _ = ctx.buf.low_latency_combine(y, topk, weights, out[2], async_finish=True)
    event.current_stream_wait()
    ctx.synchronize()
    check_combine(combined, inputs, results, ctx.rank, "async combine")


def case_clean(ctx):
    ctx.together()
    ctx.buf.clean_low_latency_buffer(M, H, ctx.E)
    dispatch_and_combine(ctx, "fp8", False, seed=900)
    dispatch_and_combine(ctx, "bf16", True, seed=901)


def case_bad_expert_id(ctx):
    """Rank 0 names expert E (out of range) once: sent nowhere, reported by a ValueError on rank 0
    alone (by the call itself where ranks share a GPU in one process, which waits; else by the next
    check), and the Buffer goes on."""
    inputs = draw(800, ctx.R, ctx.E)
    fixed = Drawn(dict(i, topk=i["topk"].copy()) for i in inputs)
    fixed.key = inputs.key + ("first id of rank 0 dropped",)
    fixed[0]["topk"][0, 0] = -1
    bad = fixed[ctx.rank]["topk"].copy()
    if ctx.rank == 0:
        bad[0, 0] = ctx.E
    mine = fixed[ctx.rank]
    x, weights, y = (to_device(mine[k]) for k in ("x", "weights", "y"))
    raised = []
    ctx.together()
    try:
        ctx.buf.low_latency_dispatch(x, to_device(bad), M, ctx.E, use_fp8=False)
        ctx.synchronize()
        ctx.buf.check_kernel_errors()
    except ValueError as exc:
        raised.append(str(exc))
    if len(raised) != (ctx.rank == 0) or (raised and f"rank 0 passed expert ids outside [-1, num_experts) (such as "
                                          f"{ctx.E})" not in raised[0]):
        raise Mismatch(f"rank {ctx.rank}: expected {int(ctx.rank == 0)} ValueError naming id {ctx.E}, got {raised}")
    ctx.synchronize()
    checked_round_trip(ctx, fixed, (x, to_device(mine["topk"]), weights, y), "bf16", "after the refused id")


def case_lone_call_times_out(ctx):
    """Rank 0 dispatches alone on a Buffer with a 2 s timeout: a DeepEPTimeoutError naming the stage
    and rank 0, then every rank destroys that Buffer."""
    import deepep_cupy as ep

    num_bytes = ep.Buffer.get_low_latency_rdma_size_hint(M, H, ctx.R, ctx.E)
    short = ep.Buffer(ctx.group, 0, num_bytes, low_latency_mode=True, timeout_s=2.0)
    try:
        if ctx.rank == 0:
            mine = draw(810, ctx.R, ctx.E)[0]
            start = time.time()
            try:
                short.low_latency_dispatch(to_device(mine["x"]), to_device(mine["topk"]), M, ctx.E, use_fp8=False)
                ctx.synchronize()
                short.check_kernel_errors()
            except ep.DeepEPTimeoutError as exc:
                # Across nodes the rail's wait (for the other nodes) may be the one reported.
                want = "rank 0: low-latency dispatch receive timed out" if RANKS_PER_NODE is None else "timed out"
                if want not in str(exc) or time.time() - start > 30:
                    raise Mismatch(f"unexpected timeout report after {time.time() - start:.1f} s: {exc}") from exc
            else:
                raise Mismatch("a dispatch that no other rank joined did not time out")
        ctx.group.barrier()
    finally:
        short.destroy()


class GraphStep:
    """Fixed input buffers and the decode step a graph captures: dispatch, a stand-in expert (the
    received BF16 rows as they are, or the fixed rows y after an FP8 dispatch), combine."""

    def __init__(self, ctx, lib, mode, hook, num_tokens, async_finish=False):
        self.ctx, self.lib, self.mode, self.hook, self.async_finish = ctx, lib, mode, hook, async_finish
        zeros = np.zeros
        self.x = to_device(zeros((num_tokens, H), np.uint16), lib)
        self.topk = to_device(np.full((num_tokens, K), -1, np.int64), lib)
        self.weights = to_device(zeros((num_tokens, K), np.float32), lib)
        self.y = to_device(zeros((ctx.L, ctx.R * M, H), np.uint16), lib)
        self.num_tokens = num_tokens

    def write(self, inputs):
        import cupy

        for name in ("x", "topk", "weights", "y"):
            target, values = getattr(self, name), inputs[name]
            values = values.full() if isinstance(values, ExpertRows) else values
            if self.lib == "torch":
                import torch

                source = torch.from_numpy(values.view(np.int16) if values.dtype == np.uint16 else values)
                target.view(torch.int16 if values.dtype == np.uint16 else target.dtype).copy_(source)
                torch.cuda.current_stream().synchronize()
            else:
                target.set(values, stream=cupy.cuda.get_current_stream())
                cupy.cuda.get_current_stream().synchronize()

    def __call__(self):
        buf, E = self.ctx.buf, self.ctx.E
        out = buf.low_latency_dispatch(self.x, self.topk, M, E, return_recv_hook=self.hook,
                                       async_finish=self.async_finish, **FP8_MODES[self.mode])
        if self.hook:
            out[4]()
        if self.async_finish:
            out[3].current_stream_wait()
        rows = self.y if FP8_MODES[self.mode]["use_fp8"] else out[0]
        combined, event, hook = buf.low_latency_combine(rows, self.topk, self.weights, out[2],
                                                        return_recv_hook=self.hook, async_finish=self.async_finish)
        if self.hook:
            hook()
        if self.async_finish:
            event.current_stream_wait()
        return out, combined


def graph_case(ctx, lib, mode, hook, seed, async_finish=False):
    from deepep_cupy.bench.graphs import Replay

    if lib == "cupy" and ctx.sharing:
        # Measured on the H200 (2026-12-01): ranks sharing a GPU in one process allocate from
        # CuPy's MemoryAsyncPool (deepep_cupy/gpu/device_pools.py), whose malloc asks the pool's size
        # (cudaMemPoolGetAttribute), which a capturing stream refuses. PyTorch's graphs capture there.
        raise Skip("CuPy cannot allocate during a capture with the async memory pool of ranks sharing a GPU")

    counts = [64] * ctx.R  # a captured step has a fixed token count
    step = GraphStep(ctx, lib, mode, hook, counts[0], async_finish)
    step.write(draw(seed, ctx.R, ctx.E, counts)[ctx.rank])
    ctx.together()
    graph = Replay(lib, step, ctx.device, thread_local=ctx.group.in_process)
    for replay in range(GRAPH_REPLAYS):
        inputs = draw(seed + 1 + replay, ctx.R, ctx.E, counts)
        step.write(inputs[ctx.rank])
        ctx.together()
        graph()
        ctx.synchronize()
        if lib == "torch":
            import torch

            torch.cuda.current_stream().synchronize()
        results = reference(inputs, ctx.E, mode)
        out, combined = graph.outputs
        check_dispatch(out, results[ctx.rank], mode, f"replay {replay} dispatch")
        ys = None if FP8_MODES[mode]["use_fp8"] else [r["recv_x"] for r in results]
        check_combine(combined, inputs, results, ctx.rank, f"replay {replay} combine", ys)
    ctx.together()
    del graph


def case_deepep_style(ctx):
    import deepep_style_low_latency

    calls = deepep_style_low_latency.test_loop(ctx.group, ctx.together)
    if calls != 16:
        raise Mismatch(f"the DeepEP-style test made {calls} dispatch settings, expected 16")


def run_case(ctx, name):
    for mode in FP8_MODES:
        for hook in ("eager", "hook"):
            if name == f"{mode}_{hook}":
                return dispatch_and_combine(ctx, mode, hook == "hook", seed=CASES.index(name))
    cases = {"token_counts_1_to_128": case_token_counts, "two_calls_in_flight": case_two_in_flight,
             "zero_copy": case_zero_copy, "stats": case_stats, "hidden_7168_fp8": case_hidden_7168,
             "async_finish": case_async_finish, "clean_then_calls": case_clean,
             "bad_expert_id_is_reported": case_bad_expert_id, "lone_call_times_out": case_lone_call_times_out,
             "graph_cupy": lambda c: graph_case(c, "cupy", "bf16", False, 700),
             "graph_torch": lambda c: graph_case(c, "torch", "bf16", False, 710),
             "graph_torch_hook_fp8": lambda c: graph_case(c, "torch", "fp8_ue8m0", True, 720),
             "deepep_style_torch": case_deepep_style,
             "two_zero_copy_combines_in_flight_async": lambda c: case_two_zero_copy_in_flight(c, False),
             "two_zero_copy_combines_in_flight_hook": lambda c: case_two_zero_copy_in_flight(c, True),
             # async_finish=True inside the capture: the outputs come from the capturing stream's pool
             "graph_torch_async": lambda c: graph_case(c, "torch", "fp8", False, 730, async_finish=True),
             "graph_cupy_async": lambda c: graph_case(c, "cupy", "bf16", False, 740, async_finish=True),
             "logfmt_hidden_2048": lambda c: case_logfmt(c, 2048, False, "bf16"),
             "logfmt_hidden_1536_hook": lambda c: case_logfmt(c, 1536, True, "bf16"),
             "logfmt_hidden_7168_fp8": lambda c: case_logfmt(c, BIG_HIDDEN, False, "fp8"),
             "masked_rank_shrink": case_masked_rank, "combine_wait_stats": case_combine_wait_stats,
             "random_calls": case_random_calls}
    return cases[name](ctx)


# ---------------------------------------------------------------------------------------------
# The per-rank loop


def torch_stream_context():
    """PyTorch work on this rank's CuPy stream (ranks sharing a GPU in one process need their own)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if stream.ptr == 0:
        return contextlib.nullcontext()
    try:
        import torch
    except ImportError:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{cupy.cuda.Device().id}"))


def rank_main(group, names):
    import cupy

    import deepep_cupy as ep

    R = group.size
    device = cupy.cuda.Device().id
    sharing = bool(group.in_process) and group.ranks_on_device(device) > 1
    num_bytes = ep.Buffer.get_low_latency_rdma_size_hint(M, BIG_HIDDEN, R, EXPERTS_PER_RANK * R)

    def new_buffer():
        return ep.Buffer(group, 0, num_bytes, low_latency_mode=True, num_qps_per_rank=EXPERTS_PER_RANK,
                         allow_nvlink_for_low_latency_mode=True, timeout_s=TIMEOUT_S)

    failures = 0
    with RankBuffer(group, new_buffer) as rank_buf, torch_stream_context():
        for name in names:
            group.barrier()
            start = time.time()
            skipped = None
            try:
                run_case(Ctx(group, rank_buf.buf, sharing), name)
                ok, error = True, None
            except Skip as exc:
                ok, error, skipped = True, None, str(exc)
            except Exception as exc:  # report, then go on with the next case
                ok, error = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                failures += 1
                # At once: a rank that fails mid-case leaves the others in its collectives, and the
                # group may abort before the RESULT below is printed.
                emit("CASE_ERROR", {"case": name, "rank": group.rank, "error": error})
            all_ok = all(group.allgather(ok))
            emit("RESULT", {"case": name, "rank": group.rank, "size": R, "ok": ok, "all_ok": all_ok,
                            "error": error, "skipped": skipped, "seconds": round(time.time() - start, 3),
                            "in_process": bool(group.in_process)})
            rank_buf.renew_unless(all_ok)
    return failures


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--local", type=int, default=0, help="rank threads in this process (0: under mpiexec)")
    parser.add_argument("--ranks-per-node", type=int, default=0, help="ranks per simulated node (0: one node)")
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args(argv)
    if args.ranks_per_node:
        global RANKS_PER_NODE
        from deepep_cupy.groups.nodes import RANKS_PER_NODE_ENV

        RANKS_PER_NODE = args.ranks_per_node
        os.environ[RANKS_PER_NODE_ENV] = str(args.ranks_per_node)  # every Buffer of the run, DeepEP-style too
    names = args.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {CASES}")
    import deepep_cupy as ep

    if args.local:
        failures = ep.run_local_group(lambda group: rank_main(group, names), args.local, timeout_s=300)
        return sum(failures)
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    failures = rank_main(ep.as_group(comm), names)
    return comm.allreduce(failures)


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
