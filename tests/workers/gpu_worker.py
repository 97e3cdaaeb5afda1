"""MPI worker for the GPU tests: runs scenarios (see gpu_scenarios.py) on every rank.

Usage: ``mpiexec -n R python tests/workers/gpu_worker.py [NAME ...]``. Each rank uses GPU
``local_rank % device_count``, builds every rank's inputs from the scenario's seed (so the
NumPy reference sees all of them without communication), runs layout, dispatch, cached dispatch
and combine, and compares every output with the reference bit-exactly. One line
``RESULT {json}`` per rank and scenario; a failing scenario does not stop the others (a Buffer
that timed out is replaced).
"""

import json
import os
import sys
import time
import traceback

import numpy as np


def make_inputs(sc, num_ranks):
    """Every rank's x (storage dtype), scales, topk_idx, topk_weights for scenario ``sc``."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(sc["seed"])
    counts = sc["num_tokens"] if isinstance(sc["num_tokens"], tuple) else (sc["num_tokens"],) * num_ranks
    counts = tuple(counts) + (counts[-1],) * (num_ranks - len(counts))
    E, K, H = sc["num_experts"], sc["num_topk"], sc["hidden"]
    inputs = []
    for r in range(num_ranks):
        n = counts[r]
        routing = sc["routing"]
        if routing == "avoid_last_rank":
            # Only experts of ranks 0..R-2: the last rank receives nothing.
            topk = ref.random_routing(rng, n, E - E // num_ranks, K)
        else:
            topk = ref.random_routing(rng, n, E, K, skew=4.0 if routing == "skewed" else 0.0,
                                      drop_fraction=0.3 if routing == "drop" else 0.0)
        weights = rng.random((n, K), dtype=np.float32) + 0.5
        x, scales = draw_rows(rng, n, H, sc["dtype"])
        inputs.append(dict(x=x, scales=scales, topk=topk, weights=weights))
    return inputs


def draw_rows(rng, n, H, dtype):
    """``(x in its storage dtype, FP8 scales or None)``: ``n`` random rows of ``H`` elements of
    ``dtype`` (``float8_e4m3fn`` with per-block scales, ``float8_e4m3fn_1d`` with one per token)."""
    from deepep_cupy.constants import FP8_SCALE_BLOCK
    from deepep_cupy.reference import intranode as ref

    if dtype.startswith("float8"):
        # A per-token scale ("_1d") only needs 16-byte rows: draw whole 128-column blocks and
        # keep the first H columns (H a multiple of 128 draws exactly as before).
        blocks = -(-H // FP8_SCALE_BLOCK)
        x, scales = ref.fp8_e4m3_scaled_random(rng, n, blocks * FP8_SCALE_BLOCK)
        if blocks * FP8_SCALE_BLOCK != H:
            x = np.ascontiguousarray(x[:, :H])
        return x, scales[:, 0].copy() if dtype.endswith("_1d") else scales
    if dtype == "bfloat16":
        return ref.float32_to_bfloat16_bits(rng.standard_normal((n, H), dtype=np.float32)), None
    if dtype == "float16":
        return rng.standard_normal((n, H), dtype=np.float32).astype(np.float16), None
    return rng.standard_normal((n, H), dtype=np.float32), None


def device_array(a, torch_arrays=False):
    """``a`` (a NumPy array, or None) on the current GPU: a CuPy array, or with ``torch_arrays`` a
    PyTorch tensor (BF16 bits as torch.bfloat16)."""
    import cupy

    if a is None:
        return None
    d = cupy.asarray(a)
    if not torch_arrays:
        return d
    import torch

    t = torch.as_tensor(d, device=f"cuda:{d.device.id}")
    return t.view(torch.bfloat16) if a.dtype == np.uint16 else t


class Mismatch(AssertionError):
    pass


def expect_equal(what, got, want):
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape}, expected {want.shape}")
    if got.dtype != want.dtype:
        raise Mismatch(f"{what}: dtype {got.dtype}, expected {want.dtype}")
    if got.dtype.kind == "f":
        # Bit patterns, so that -0.0 / NaN payloads count as differences too.
        bits = np.dtype(f"u{got.dtype.itemsize}")
        same = got.view(bits) == want.view(bits)
    else:
        same = got == want
    if not np.all(same):
        bad = np.argwhere(~same)
        first = tuple(bad[0])
        raise Mismatch(f"{what}: {len(bad)} of {same.size} elements differ; first at {first}: "
                       f"got {got[first]!r}, expected {want[first]!r}")


def to_numpy(a):
    import cupy

    if a is None:
        return None
    if type(a).__module__.startswith("torch"):
        import torch

        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        elif a.dtype == torch.float8_e4m3fn:
            a = a.view(torch.uint8)
        torch.cuda.current_stream().synchronize()  # PyTorch's stream may not be CuPy's
        a = cupy.asarray(a)
        if a.dtype == np.int16:
            a = a.view(np.uint16)
    # Wait first (without the GIL): with ranks sharing a GPU in one process, a host copy that
    # waits in the driver for this rank's kernels also holds up the other ranks' copies.
    cupy.cuda.get_current_stream().synchronize()
    return cupy.asnumpy(a)


def check_fresh_handle(per_expert_list, handle, want, call=""):
    """A fresh dispatch's expert counts and handle against the reference's ``want`` (``call``, when
    given, starts each message)."""
    from deepep_cupy.reference import intranode as ref

    prefix = f"{call}: " if call else ""
    if per_expert_list != want["num_recv_tokens_per_expert_list"]:
        raise Mismatch(f"{prefix}num_recv_tokens_per_expert_list: {per_expert_list}, expected "
                       f"{want['num_recv_tokens_per_expert_list']}")
    for name, got, expected in zip(("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                    "recv_src_idx", "is_token_in_rank", "send_head"), handle, ref.handle_of(want)):
        expect_equal(f"{prefix}handle.{name}", to_numpy(got), expected)


def check_expanded(out, want, num_local_experts, alignment):
    """A dispatch with expand=True against reference.expand of the reference's received rows."""
    from deepep_cupy.reference import intranode as ref

    rows, recv_topk, _, per_expert_list, handle, _ = out
    want_rows, want_sources, want_offsets = ref.expand(want["recv_x"], want["recv_topk_idx"], num_local_experts,
                                                       alignment)
    if want["recv_x_scales"] is not None:
        rows, scales = rows
        want_scales = ref.expand(want["recv_x_scales"], want["recv_topk_idx"], num_local_experts, alignment)[0]
        expect_equal("expanding dispatch: expanded scales", to_numpy(scales), want_scales)
    expect_equal("expanding dispatch: expanded rows", to_numpy(rows), want_rows)
    expect_equal("expanding dispatch: handle.expanded_rows", to_numpy(handle.expanded_rows), want_sources)
    expect_equal("expanding dispatch: recv_topk_idx", to_numpy(recv_topk), want["recv_topk_idx"])
    if handle.expert_offsets != want_offsets or per_expert_list != want["num_recv_tokens_per_expert_list"]:
        raise Mismatch(f"expanding dispatch: expert offsets {handle.expert_offsets}, expected {want_offsets}")


def run_scenario(buf, sc):
    import contextlib

    import cupy

    stream = cupy.cuda.get_current_stream()
    if sc["framework"] == "torch" and stream.ptr != 0:
        # PyTorch work must run on this rank's stream too (ranks sharing a GPU in one process).
        import torch

        context = torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=f"cuda:{cupy.cuda.Device().id}"))
    else:
        context = contextlib.nullcontext()
    with context:
        return _run_scenario(buf, sc)


def _run_scenario(buf, sc):
    import cupy

    import deepep_cupy as ep
    from deepep_cupy.reference import intranode as ref

    R, rank = buf.num_ranks, buf.rank
    if sc["framework"] == "torch" and buf.get_comm_stream().cuda_stream != buf.comm_stream.ptr:
        raise Mismatch("get_comm_stream: not the communication stream as a torch stream")
    inputs = make_inputs(sc, R)
    mine = inputs[rank]
    config = ep.Config(sc["num_sms"],
                       sc["send_chunk"] or ep.get_dispatch_config(R).num_max_nvl_chunked_send_tokens,
                       sc["recv_chunk"] or ep.get_dispatch_config(R).num_max_nvl_chunked_recv_tokens)
    combine_config = ep.Config(sc["num_sms"],
                               sc["send_chunk"] or ep.get_combine_config(R).num_max_nvl_chunked_send_tokens,
                               sc["recv_chunk"] or ep.get_combine_config(R).num_max_nvl_chunked_recv_tokens)
    E = sc["num_experts"]
    results = ref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], E, config.num_channels,
                           topk_weights=[i["weights"] for i in inputs] if sc["with_weights"] else None,
                           x_scales=[i["scales"] for i in inputs] if mine["scales"] is not None else None,
                           expert_alignment=sc["expert_alignment"])
    want = results[rank]

    def device(a):
        return device_array(a, sc["framework"] == "torch")

    x = device(mine["x"])
    if mine["scales"] is not None:
        scales = device(mine["scales"])
        if sc["scales_layout"] == "column":  # DeepEP's own test passes them so
            scales = scales.T.contiguous().T if sc["framework"] == "torch" else cupy.asfortranarray(scales)
        x = (device(mine["x"]), scales)
        if sc["framework"] == "torch":
            import torch
            x = (x[0].view(torch.float8_e4m3fn), x[1])
    topk = device(mine["topk"])
    weights = device(mine["weights"])
    biases = make_biases(sc, inputs)
    mine_biases = tuple(device(b) for b in biases[rank])
    bias_in = mine_biases[0] if len(mine_biases) == 1 else (mine_biases or None)  # DeepEP: an array or a pair
    if getattr(buf.group, "in_process", False):
        # Every rank's inputs exist before any rank's kernels start waiting for the others: an
        # allocation (cudaMalloc) waits for the kernels already running on its GPU, and ranks
        # sharing a GPU would wait for each other (README, in-process ranks).
        cupy.cuda.get_current_stream().synchronize()
        buf.group.barrier()

    # Layout
    per_rank, none, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    assert none is None
    want_per_rank, want_per_expert, want_in_rank = ref.get_dispatch_layout(mine["topk"], E, R)
    expect_equal("num_tokens_per_rank", to_numpy(per_rank), want_per_rank)
    expect_equal("num_tokens_per_expert", to_numpy(per_expert), want_per_expert)
    expect_equal("is_token_in_rank", to_numpy(in_rank), want_in_rank)

    # Dispatch
    kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  expert_alignment=sc["expert_alignment"], config=config)
    in_buffer = dict(recv_x_in_buffer=True) if sc["recv_in_buffer"] else {}
    kwargs.update(in_buffer)
    if sc["with_topk"]:
        kwargs["topk_idx"] = topk
        if sc["with_weights"]:
            kwargs["topk_weights"] = weights

    def capture():
        # DeepEP's Buffer.capture() records on PyTorch's current stream: torch scenarios only.
        if sc["framework"] == "torch":
            return ep.Buffer.capture()
        return ep.EventOverlap(cupy.cuda.get_current_stream().record())

    def fresh_dispatch(**extra):
        if sc["mode"] == "async":
            out = buf.dispatch(x, previous_event=capture(), async_finish=True, allocate_on_comm_stream=True,
                               **kwargs, **extra)
            assert out[-1].event is not None, "async dispatch returned no event"
            out[-1].current_stream_wait()
        else:
            out = buf.dispatch(x, **kwargs, **extra)
        return kept(out, expanded=extra.get("expand", False))

    def copied(a):
        """A copy of ``a`` made without a kernel (PyTorch's clone of a contiguous tensor is a memory
        copy): a kernel's first launch loads its module, which waits for the kernels running on the
        GPU, among them those of co-located ranks that wait for this one (README, in-process ranks)."""
        if sc["framework"] == "torch":
            return a.clone()
        out = cupy.empty_like(a)
        out.data.copy_from_device_async(a.data, a.nbytes, cupy.cuda.get_current_stream())
        return out

    def kept(out, expanded=False):
        """A dispatch's result, its arrays copied when they are views of the NVLink buffer (checked
        to be: recv_x_in_buffer), which the next call overwrites."""
        if not in_buffer:
            return out
        recv_x, recv_topk, recv_weights = out[:3]
        arrays = [*(recv_x if isinstance(recv_x, tuple) else (recv_x,)), recv_topk, recv_weights]
        torch_arrays = sc["framework"] == "torch"
        for i, a in enumerate(arrays):
            if a is None or (a.numel() if torch_arrays else a.size) == 0:
                continue  # an empty tensor's data_ptr() is 0: nothing to check
            address = a.data_ptr() if torch_arrays else a.data.ptr
            inside = buf._engine.nvl.local_ptr <= address < buf._engine.nvl.local_ptr + buf._engine.nvl.num_bytes
            # Expanded rows (and scales) are allocated: only the top-k stays in the buffer.
            if inside != (not expanded or i >= len(arrays) - 2):
                raise Mismatch(f"recv_x_in_buffer: output {i} {'inside' if inside else 'outside'} the NVLink buffer")
        arrays = [None if a is None else copied(a) for a in arrays]
        rows = tuple(arrays[:2]) if isinstance(recv_x, tuple) else arrays[0]
        return (rows, *arrays[-2:], *out[3:])

    def check_fresh(out, call):
        recv_x, recv_topk, recv_weights, per_expert_list, handle, _ = out
        if sc["framework"] == "torch":
            import torch
            first = recv_x[0] if isinstance(recv_x, tuple) else recv_x
            assert isinstance(first, torch.Tensor), f"torch input gave {type(first).__name__} output"
        if mine["scales"] is not None:
            assert isinstance(recv_x, tuple), "FP8 dispatch must return (x, scales)"
            expect_equal(f"{call}: recv_x (fp8)", to_numpy(recv_x[0]), want["recv_x"])
            expect_equal(f"{call}: recv_x_scales", to_numpy(recv_x[1]), want["recv_x_scales"])
        else:
            expect_equal(f"{call}: recv_x", to_numpy(recv_x), want["recv_x"])
        if sc["with_topk"]:
            expect_equal(f"{call}: recv_topk_idx", to_numpy(recv_topk), want["recv_topk_idx"])
            if sc["with_weights"]:
                expect_equal(f"{call}: recv_topk_weights", to_numpy(recv_weights), want["recv_topk_weights"])
            else:
                assert recv_weights is None
        else:
            assert recv_topk is None and recv_weights is None
        check_fresh_handle(per_expert_list, handle, want, call)

    def check_allocation(call, expected):
        if buf.last_dispatch_allocation != expected:
            raise Mismatch(f"{call}: outputs sized {buf.last_dispatch_allocation!r}, expected {expected!r}")

    # The first call sizes its outputs as the scenario asks (or as the last scenario left the
    # Buffer's guess); the second, with the same routing, must fit the rows allocated ahead.
    buf.allocate_ahead = sc["allocation"] != "exact"
    try:
        if sc["allocation"] == "retried":
            buf._engine.dispatch_path._capacity_guess.observe(len(mine["topk"]), 0)  # a guess of 64 rows: too few
        elif sc["allocation"] == "ahead":
            # A guess of every rank's tokens (plus headroom): no rank can receive more.
            buf._engine.dispatch_path._capacity_guess.observe(len(mine["topk"]), sum(len(i["topk"]) for i in inputs))
        out = fresh_dispatch()
        if sc["allocation"] != "any":
            check_allocation("first dispatch", sc["allocation"])
        check_fresh(out, "first dispatch")
        again = fresh_dispatch()
        check_allocation("second dispatch", "exact" if sc["allocation"] == "exact" else "ahead")
        check_fresh(again, "second dispatch")
        del again
        if sc["allocation"] != "exact":
            # The second, like the first, made the third's outputs while it waited for its counts
            # (next_outputs.py); the third moves its tokens into them (in one launch where ranks
            # have processes of their own, or where a test forces that path).
            next_outputs = buf._engine.dispatch_path._next_outputs
            if next_outputs.ready is None and not next_outputs.over_limit:
                raise Mismatch("second dispatch: no outputs made for the next one (and not over the byte limit)")
            third = fresh_dispatch()
            check_allocation("third dispatch", "ahead")
            check_fresh(third, "third dispatch")
            del third
    finally:
        buf.allocate_ahead = True
    recv_x, recv_topk, recv_weights, per_expert_list, handle, _ = out
    if sc["expand"]:
        check_expanded(fresh_dispatch(expand=True), want, E // R, sc["expert_alignment"])
    if sc["worst"]:
        worst_x, worst_topk, worst_weights, worst_handle = check_worst_case(fresh_dispatch, want, per_expert_list,
                                                                            to_numpy, sc)

    # Cached dispatch: same routing, fresh payload
    if sc["cached"]:
        if sc["mode"] == "async":
            previous = ep.EventOverlap(cupy.cuda.get_current_stream().record())
            again = buf.dispatch(x, handle=handle, config=config, previous_event=previous, async_finish=True,
                                 **in_buffer)
            again[-1].current_stream_wait()
        else:
            again = buf.dispatch(x, handle=handle, config=config, **in_buffer)
        again = kept(again)
        if mine["scales"] is not None:
            expect_equal("cached recv_x (fp8)", to_numpy(again[0][0]), want["recv_x"])
            expect_equal("cached recv_x_scales", to_numpy(again[0][1]), want["recv_x_scales"])
        else:
            expect_equal("cached recv_x", to_numpy(again[0]), want["recv_x"])

    # Combine the dispatched rows back (FP8 has no combine: combine takes 16/32-bit floats)
    if sc["combine"] and mine["scales"] is None:
        sources = [(recv_x, recv_weights, handle, "combined")]
        if sc["worst"]:  # the fixed-size rows of num_worst_tokens, as they are
            sources.append((worst_x, worst_weights, worst_handle, "combined (num_worst_tokens)"))
        for rows_in, weights_from, combine_handle, call in sources:
            weights_in = weights_from if sc["with_topk"] and sc["with_weights"] else None
            if sc["mode"] == "async":
                combined, combined_weights, event = buf.combine(rows_in, combine_handle, topk_weights=weights_in,
                                                                bias=bias_in, config=combine_config,
                                                                previous_event=capture(), async_finish=True)
                event.current_stream_wait()
            else:
                combined, combined_weights, _ = buf.combine(rows_in, combine_handle, topk_weights=weights_in,
                                                            bias=bias_in, config=combine_config)
            ref_weights = [r["recv_topk_weights"] for r in results] if weights_in is not None else None
            combined_ref = ref.combine([r["recv_x"] for r in results], results, topk_weights=ref_weights,
                                       bias=biases if sc["bias"] else None)
            want_x, want_w = combined_ref[rank]
            expect_equal(f"{call}_x", to_numpy(combined), ref.round_to_dtype(want_x, sc["dtype"]))
            if weights_in is not None:
                expect_equal(f"{call}_topk_weights", to_numpy(combined_weights), want_w)
            else:
                assert combined_weights is None
    # Combine in place: recv_x of a dispatch with rows in place overwritten where it lies (without a
    # kernel: see copied), then combined from there.
    if sc["combine_in_place"] and in_buffer and mine["scales"] is None:
        view_x, _, view_w, _, view_handle, _ = buf.dispatch(x, **kwargs)
        flipped = [flip_sign(r["recv_x"]) for r in results]
        source = device(flipped[rank])
        if sc["framework"] == "torch":
            view_x.copy_(source)
        else:
            view_x.data.copy_from_device_async(source.data, source.nbytes)
        weights_in = view_w if sc["with_topk"] and sc["with_weights"] else None
        combined, combined_weights, _ = buf.combine(view_x, view_handle, topk_weights=weights_in, bias=bias_in,
                                                    config=combine_config)
        ref_weights = [r["recv_topk_weights"] for r in results] if weights_in is not None else None
        want_x, want_w = ref.combine(flipped, results, topk_weights=ref_weights,
                                     bias=biases if sc["bias"] else None)[rank]
        expect_equal("combined in place: x", to_numpy(combined), ref.round_to_dtype(want_x, sc["dtype"]))
        if weights_in is not None:
            expect_equal("combined in place: topk_weights", to_numpy(combined_weights), want_w)
    cupy.cuda.get_current_stream().synchronize()  # not the device: ranks may share it
    buf.check_kernel_errors()  # a device-side timeout must not pass unnoticed
    return {"recv_tokens": int(want["recv_x"].shape[0])}


def flip_sign(rows):
    """``rows`` (BF16 bits, FP16 or FP32) with every value's sign flipped: exact, bit by bit."""
    bits = {2: np.uint16, 4: np.uint32}[rows.dtype.itemsize]
    return (rows.view(bits) ^ bits(1 << (8 * rows.dtype.itemsize - 1))).view(rows.dtype)


def make_biases(sc, inputs):
    """Per rank, ``sc["bias"]`` arrays like that rank's x (storage dtype), from the scenario's seed."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng(sc["seed"] + 1000)
    biases = []
    for mine in inputs:
        shape = mine["x"].shape
        values = [rng.standard_normal(shape, dtype=np.float32) for _ in range(sc["bias"])]
        if sc["dtype"] == "bfloat16":
            values = [ref.float32_to_bfloat16_bits(v) for v in values]
        elif sc["dtype"] == "float16":
            values = [v.astype(np.float16) for v in values]
        biases.append(tuple(values))
    return biases


def check_worst_case(fresh_dispatch, want, want_per_expert, to_numpy, sc):
    """A fresh dispatch with ``num_worst_tokens``: fixed-size outputs, the received rows first (as
    the exact dispatch returns them), top-k ids -1 past them, no expert counts in the list (DeepEP's)
    but the received and per-expert counts (those of the exact dispatch) in the handle's device arrays."""
    from random_cases import WORST_SPARE_ROWS  # this script's folder is on sys.path

    num_recv = want["recv_x"].shape[0]
    worst = num_recv + WORST_SPARE_ROWS
    recv_x, recv_topk, recv_weights, per_expert_list, handle, _ = fresh_dispatch(num_worst_tokens=worst)
    rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    if rows.shape[0] != worst or per_expert_list != [] or handle.num_recv_tokens is not None:
        raise Mismatch(f"num_worst_tokens={worst}: {rows.shape[0]} rows, expert counts {per_expert_list}, "
                       f"handle receives {handle.num_recv_tokens} (expected {worst}, [], None)")
    expect_equal("worst: handle.recv_count", to_numpy(handle.recv_count), np.array([num_recv], np.int32))
    expect_equal("worst: handle.recv_expert_counts", to_numpy(handle.recv_expert_counts),
                 np.array(want_per_expert, np.int32))
    expect_equal("worst: recv_x", to_numpy(rows)[:num_recv], want["recv_x"])
    if isinstance(recv_x, tuple):
        expect_equal("worst: recv_x_scales", to_numpy(recv_x[1])[:num_recv], want["recv_x_scales"])
    if sc["with_topk"]:
        topk = to_numpy(recv_topk)
        expect_equal("worst: recv_topk_idx", topk[:num_recv], want["recv_topk_idx"])
        if not np.all(topk[num_recv:] == -1):
            raise Mismatch("worst: recv_topk_idx past the received rows is not all -1")
        if sc["with_weights"]:
            expect_equal("worst: recv_topk_weights", to_numpy(recv_weights)[:num_recv], want["recv_topk_weights"])
    return recv_x, recv_topk, recv_weights, handle


def kernel_error(buf):
    """What the Buffer's kernels reported, if anything: a wrong result can come from a kernel that
    timed out, which the Buffer only raises at its next call."""
    try:
        buf.comm_stream.synchronize()   # the kernels end by themselves: they have a timeout
        buf.check_kernel_errors()
    except Exception as exc:  # noqa: BLE001 - reported, not handled
        return f" [kernel error: {type(exc).__name__}: {exc}]"
    return ""


def main(names):
    # gpu_scenarios is found because a script's folder is on sys.path; imported here, not at the
    # top, so that the CPU tests can import this module as workers.gpu_worker.
    import cupy
    from gpu_scenarios import SCENARIOS
    from mpi4py import MPI

    import deepep_cupy as ep

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    timeout_s = float(os.environ.get("DEEPEP_TEST_TIMEOUT_S", "30"))
    nvl_bytes = ep.get_nvl_buffer_size_hint(7168 * 4, size, ep.Config(48, 16, 256))

    def new_buffer():
        return ep.Buffer(comm, nvl_bytes, timeout_s=timeout_s)

    # Experts must split evenly over the ranks: round up for 3, 5, 6, 7 ranks.
    selected = [dict(s, num_experts=-(-s["num_experts"] // size) * size)
                for s in SCENARIOS if not names or s["name"] in names]
    return run_and_report(new_buffer, selected, rank, size, lambda ok: comm.allreduce(ok, op=MPI.LAND))


def run_and_report(new_buffer, scenarios, rank, size, everyone_ok):
    """Run ``scenarios`` in order on a Buffer from ``new_buffer()``, one ``RESULT`` line each.

    ``everyone_ok(ok)``: whether every rank's scenario passed (a collective). A failed scenario does
    not stop the others: every rank then replaces its Buffer (one that timed out is unusable).
    Returns how many scenarios failed on this rank.
    """
    buf = new_buffer()
    failures = 0
    for sc in scenarios:
        start = time.time()
        try:
            info = run_scenario(buf, sc)
            ok, error = True, None
        except Exception as exc:  # report and go on with the next scenario
            ok, error, info = False, f"{type(exc).__name__}: {exc}{kernel_error(buf)}\n{traceback.format_exc()}", {}
            failures += 1
        all_ok = everyone_ok(ok)
        print("RESULT " + json.dumps({"rank": rank, "size": size, "scenario": sc["name"], "ok": ok,
                                      "all_ok": all_ok, "error": error, "seconds": round(time.time() - start, 3),
                                      **info}), flush=True)
        if not all_ok:
            buf.destroy()
            buf = new_buffer()
    buf.destroy()
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
