"""The library benchmark: one rank's correctness check against :mod:`deepep_cupy.reference.intranode`,
timings, tokens sweep and tuning grid (all imports of cupy / the library happen inside functions)."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import config_to_dict
from .calls import bench_calls_rank
from .memory import PEAK_MEMORY_CALLS, peak_pool_bytes
from .report import op_stats, tune_grid
from .timing import _Progress, make_l2_flush, time_op
from .workload import dispatch_bytes, make_workload, recv_token_counts

# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _to_numpy(a: Any) -> Any:
    if a is None:
        return None
    if hasattr(a, "get") and not isinstance(a, dict):
        return a.get()
    return np.asarray(a)


def compare_exact(name: str, got: Any, want: Any) -> Tuple[bool, str]:
    """Bit-exact comparison (floats: equal values, NaN == NaN). Returns ``(ok, message)``."""
    if isinstance(want, (list, tuple)) and not isinstance(got, np.ndarray):
        ok = [int(v) for v in got] == [int(v) for v in want]
        return ok, f"{name}: {'ok' if ok else f'got {list(got)[:8]}.. want {list(want)[:8]}..'}"
    got, want = np.asarray(_to_numpy(got)), np.asarray(_to_numpy(want))
    if got.shape != want.shape:
        return False, f"{name}: shape {got.shape} != expected {want.shape}"
    if got.dtype.kind == "f" or want.dtype.kind == "f":
        eq = (got == want) | (np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64)))
    else:
        eq = got == want
    bad = np.flatnonzero(~np.asarray(eq).reshape(-1)) if eq.size else np.zeros(0, np.int64)
    if bad.size == 0:
        return True, f"{name}: ok"
    first = np.unravel_index(int(bad[0]), got.shape) if got.ndim else ()
    return False, (f"{name}: {bad.size} of {got.size} differ; first at {tuple(int(i) for i in first)}: "
                   f"got {got[first]!r} want {want[first]!r}")


# ----------------------------------------------------------------------------------------------
# GPU-side helpers (all imports of cupy / the library happen inside functions)
# ----------------------------------------------------------------------------------------------


def _import_library():
    try:
        import deepep_cupy as ep
        from deepep_cupy.reference import intranode as reference
    except Exception as exc:  # pragma: no cover - depends on the rest of the package
        raise SystemExit(f"deepep_cupy.bench: cannot import the library ({type(exc).__name__}: {exc})") from exc
    missing = [n for n in ("Buffer", "Config", "get_dispatch_config", "get_combine_config",
                           "get_nvl_buffer_size_hint") if not hasattr(ep, n)]
    if missing:
        raise SystemExit(f"deepep_cupy.bench: deepep_cupy lacks {missing}")
    return ep, reference


def device_name(device: int) -> str:
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def make_configs(ep: Any, num_ranks: int, args: argparse.Namespace) -> Tuple[Any, Any]:
    """Dispatch and combine :class:`Config` from ``--num-sms/--send-chunk/--recv-chunk`` over the recommended ones."""
    out = []
    for rec in (ep.get_dispatch_config(num_ranks), ep.get_combine_config(num_ranks)):
        out.append(ep.Config(args.num_sms,
                             args.send_chunk or rec.num_max_nvl_chunked_send_tokens,
                             args.recv_chunk or rec.num_max_nvl_chunked_recv_tokens))
    return out[0], out[1]


def swept_configs(ep: Any, num_ranks: int, args: argparse.Namespace) -> List[Any]:
    """Every config ``--tune`` and ``--sm-sweep`` run with (the Buffer must have room for each)."""
    configs = [ep.Config(*t) for t in tune_grid(args.tune_sms, args.tune_send, args.tune_recv)] if args.tune else []
    return configs + [sm_sweep_config(ep, num_ranks, n) for n in getattr(args, "sm_sweep", None) or ()]


def sm_sweep_config(ep: Any, num_ranks: int, num_sms: int) -> Any:
    """The recommended config with ``num_sms`` SMs."""
    rec = ep.get_dispatch_config(num_ranks)
    return ep.Config(num_sms, rec.num_max_nvl_chunked_send_tokens, rec.num_max_nvl_chunked_recv_tokens)


def nvl_buffer_bytes(ep: Any, args: argparse.Namespace, num_ranks: int, configs: Sequence[Any]) -> int:
    """The largest ``get_nvl_buffer_size_hint`` over every config this run uses (BF16 rows are the
    widest), for the most tokens a rank dispatches in it."""
    tokens = max([args.num_tokens, *(args.tokens_sweep or []), *(getattr(args, "calls_tokens", None) or [])])
    return max(int(ep.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks, c, num_topk=args.num_topk,
                                               num_max_tokens_per_rank=tokens, recv_x_in_buffer=in_buffer))
               for c in configs for in_buffer in (False, True))


# ----------------------------------------------------------------------------------------------
# The library benchmark (one call per rank)
# ----------------------------------------------------------------------------------------------


def reference_outputs(reference: Any, inputs: Sequence[Dict[str, np.ndarray]], num_experts: int,
                      num_channels: int, with_fp8: bool) -> Dict[str, Any]:
    """Reference dispatch (BF16, FP8) and combine of every rank, from all ranks' host inputs."""
    idxs = [w["topk_idx"] for w in inputs]
    weights = [w["topk_weights"] for w in inputs]
    bf16 = reference.dispatch([w["x"] for w in inputs], idxs, num_experts, num_channels, topk_weights=weights)
    out = {"bf16": bf16, "fp8": None}
    if with_fp8:
        out["fp8"] = reference.dispatch([w["x_fp8"] for w in inputs], idxs, num_experts, num_channels,
                                        topk_weights=weights, x_scales=[w["x_scales"] for w in inputs])
    out["combine"] = reference.combine([r["recv_x"] for r in bf16], bf16,
                                       topk_weights=[r["recv_topk_weights"] for r in bf16])
    return out


def compare_rank(reference: Any, gpu: Dict[str, Any], ref: Dict[str, Any], host: Dict[str, np.ndarray],
                 rank: int, num_experts: int, num_ranks: int) -> Dict[str, List[Tuple[bool, str]]]:
    """Compare one rank's GPU outputs (already NumPy) with the reference. Returns op -> [(ok, msg)]."""
    checks: Dict[str, List[Tuple[bool, str]]] = {}
    per_rank, per_expert, in_rank = reference.get_dispatch_layout(host["topk_idx"], num_experts, num_ranks)
    lay = gpu["layout"]
    checks["layout"] = [compare_exact("num_tokens_per_rank", lay[0], per_rank),
                        compare_exact("num_tokens_per_expert", lay[1], per_expert),
                        compare_exact("is_token_in_rank", lay[2], in_rank)]
    r = ref["bf16"][rank]
    d = gpu["bf16"]
    checks["dispatch BF16"] = [
        compare_exact("recv_x", d["recv_x"], r["recv_x"]),
        compare_exact("recv_topk_idx", d["recv_topk_idx"], r["recv_topk_idx"]),
        compare_exact("recv_topk_weights", d["recv_topk_weights"], r["recv_topk_weights"]),
        compare_exact("recv_src_idx", d["recv_src_idx"], r["recv_src_idx"]),
        compare_exact("rank_prefix_matrix", d["rank_prefix_matrix"], r["rank_prefix_matrix"]),
        compare_exact("num_recv_tokens_per_expert_list", d["num_recv_tokens_per_expert_list"],
                      list(r["num_recv_tokens_per_expert_list"]))]
    if gpu.get("fp8") is not None:
        f, rf = gpu["fp8"], ref["fp8"][rank]
        checks["dispatch FP8"] = [
            compare_exact("recv_x (fp8 bytes)", f["recv_x"], rf["recv_x"]),
            compare_exact("recv_x_scales", f["recv_x_scales"], rf["recv_x_scales"]),
            compare_exact("recv_topk_idx", f["recv_topk_idx"], rf["recv_topk_idx"]),
            compare_exact("recv_src_idx", f["recv_src_idx"], rf["recv_src_idx"])]
    checks["cached dispatch BF16"] = [compare_exact("recv_x", gpu["cached_recv_x"], r["recv_x"])]
    want_x, want_w = ref["combine"][rank]
    checks["combine BF16"] = [
        compare_exact("combined_x", gpu["combined_x"], reference.round_to_dtype(np.asarray(want_x), "bfloat16")),
        compare_exact("combined_topk_weights", gpu["combined_topk_weights"], want_w)]
    return checks


def _dispatch_np(out: Tuple, fp8: bool) -> Dict[str, Any]:
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle, _ = out
    res = {"recv_topk_idx": _to_numpy(recv_topk_idx), "recv_topk_weights": _to_numpy(recv_topk_weights),
           "num_recv_tokens_per_expert_list": list(per_expert), "rank_prefix_matrix": _to_numpy(handle[0]),
           "recv_src_idx": _to_numpy(handle[3])}
    if fp8:
        res["recv_x"], res["recv_x_scales"] = _to_numpy(recv_x[0]), _to_numpy(recv_x[1])
    else:
        res["recv_x"] = _to_numpy(recv_x)
    return res


def use_local_gpu(world: Any) -> int:
    """Make the GPU of this MPI rank's local rank (modulo the visible GPUs) current; return it."""
    import cupy
    from mpi4py import MPI

    dev = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank() % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    return dev


def bench_library_rank(group: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """Everything one rank does for the library: check, timings, tokens sweep, tuning.

    Runs on the rank's thread (in-process) or process (mpirun) with its device current.
    Returns a picklable dict of host values only.
    """
    import cupy
    ep, reference = _import_library()
    rank, num_ranks = group.rank, group.size
    dev = cupy.cuda.Device().id
    cupy.cuda.Device(dev).use()
    stream = cupy.cuda.get_current_stream()
    lead = rank == 0
    E, H = args.num_experts, args.hidden
    dcfg, ccfg = make_configs(ep, num_ranks, args)
    nvl_bytes = nvl_buffer_bytes(ep, args, num_ranks, [dcfg, ccfg] + swept_configs(ep, num_ranks, args))
    want_fp8 = args.dtype in ("fp8", "both")
    want_bf16 = args.dtype in ("bf16", "both")
    result: Dict[str, Any] = {"rank": rank, "device": dev, "device_name": device_name(dev),
                              "nvl_bytes": nvl_bytes, "dispatch_config": config_to_dict(dcfg),
                              "combine_config": config_to_dict(ccfg)}
    flush = make_l2_flush(args.flush_l2)

    with ep.Buffer(group, nvl_bytes, timeout_s=args.timeout, allocate_ahead=args.allocate_ahead) as buf:
        host = make_workload(reference, args, rank, args.num_tokens, with_fp8=want_fp8 or args.check)
        topk_idx = cupy.asarray(host["topk_idx"])
        topk_w = cupy.asarray(host["topk_weights"])
        x = cupy.asarray(host["x"])
        x_fp8 = (cupy.asarray(host["x_fp8"]), cupy.asarray(host["x_scales"])) if "x_fp8" in host else None

        per_rank_t, _, per_expert_t, in_rank_t, _ = buf.get_dispatch_layout(topk_idx, E)
        layout_kw = dict(num_tokens_per_rank=per_rank_t, is_token_in_rank=in_rank_t,
                         num_tokens_per_expert=per_expert_t, topk_idx=topk_idx, topk_weights=topk_w)
        out_bf16 = buf.dispatch(x, config=dcfg, **layout_kw)
        recv_x, _, recv_w, _, handle, _ = out_bf16
        out_fp8 = buf.dispatch(x_fp8, config=dcfg, **layout_kw) if x_fp8 is not None else None
        cached_x = buf.dispatch(x, handle=handle, config=dcfg)[0]
        combined_x, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=ccfg)
        stream.synchronize()

        # --- correctness ---------------------------------------------------------------------
        if args.check:
            gpu = {"layout": (_to_numpy(per_rank_t), _to_numpy(per_expert_t), _to_numpy(in_rank_t)),
                   "bf16": _dispatch_np(out_bf16, False),
                   "fp8": _dispatch_np(out_fp8, True) if out_fp8 is not None else None,
                   "cached_recv_x": _to_numpy(cached_x), "combined_x": _to_numpy(combined_x),
                   "combined_topk_weights": _to_numpy(combined_w)}
            num_channels = dcfg.num_channels
            inputs = group.allgather(host)
            if getattr(group, "in_process", False):   # compute once, share the objects
                ref = group.allgather(reference_outputs(reference, inputs, E, num_channels, True) if lead else None)[0]
            else:
                ref = reference_outputs(reference, inputs, E, num_channels, True)
            del inputs
            result["checks"] = compare_rank(reference, gpu, ref, host, rank, E, num_ranks)
            del ref, gpu
        host.pop("x", None), host.pop("x_fp8", None)

        # --- timings -------------------------------------------------------------------------
        rpm = _to_numpy(handle[0])
        total, cross = recv_token_counts(rpm, rank)
        result["recv_tokens"], result["recv_tokens_cross"] = total, cross
        # (name, the timed call, the dtype of the rows it moves: None for no rows)
        ops: List[Tuple[str, Callable[[], Any], Optional[str]]] = [
            ("layout", lambda: buf.get_dispatch_layout(topk_idx, E), None)]
        if want_bf16:
            ops.append(("dispatch BF16", lambda: buf.dispatch(x, config=dcfg, **layout_kw), "bf16"))
        if want_fp8:
            ops.append(("dispatch FP8", lambda: buf.dispatch(x_fp8, config=dcfg, **layout_kw), "fp8"))
        if want_bf16:
            ops.append(("cached dispatch BF16", lambda: buf.dispatch(x, handle=handle, config=dcfg), "bf16"))
        ops.append(("combine BF16", lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=ccfg), "bf16"))
        result["ops"] = {}
        for name, fn, dt in ops:
            group.barrier()
            times = time_op(fn, args.warmup, args.iters, stream, flush)
            # Apart from the timed calls: the hook's Python runs at every allocation.
            with peak_pool_bytes() as memory:
                for _ in range(PEAK_MEMORY_CALLS):
                    fn()
                stream.synchronize()
            nb = None if dt is None else dispatch_bytes(total, H, dt)
            cb = None if dt is None else dispatch_bytes(cross, H, dt)
            result["ops"][name] = op_stats(times, nb, cb, memory.peak_bytes)
            if name.startswith("dispatch"):  # how the last timed fresh dispatch sized its outputs
                result.setdefault("dispatch_allocation", {})[name] = buf.last_dispatch_allocation
        del out_bf16, out_fp8, cached_x, combined_x

        # --- what a training loop sees ---------------------------------------------------------
        if args.calls:
            result["calls"] = bench_calls_rank(buf, group, args, reference, dcfg, ccfg)

        # --- tokens sweep --------------------------------------------------------------------
        if args.tokens_sweep:
            result["sweep"] = _library_sweep(buf, group, args, reference, dcfg, ccfg, stream, flush)

        # --- SM sweep ------------------------------------------------------------------------
        if getattr(args, "sm_sweep", None):
            result["sm_sweep"] = _library_sm_sweep(ep, buf, group, args, x, x_fp8, layout_kw, stream, flush)

        # --- tuning --------------------------------------------------------------------------
        if args.tune:
            result["tune"] = _library_tune(ep, buf, group, args, x, layout_kw, stream, flush, lead)
        group.barrier()
    return result


def _library_sweep(buf, group, args, reference, dcfg, ccfg, stream, flush) -> Dict[str, Any]:
    """Dispatch BF16 and combine at each ``--tokens-sweep`` size; per size the rank's op_stats."""
    import cupy
    rank, E, H = group.rank, args.num_experts, args.hidden
    points = []
    for n in args.tokens_sweep:
        host = make_workload(reference, args, rank, n, with_fp8=False)
        topk_idx, topk_w, x = (cupy.asarray(host[k]) for k in ("topk_idx", "topk_weights", "x"))
        per_rank_t, _, per_expert_t, in_rank_t, _ = buf.get_dispatch_layout(topk_idx, E)
        kw = dict(num_tokens_per_rank=per_rank_t, is_token_in_rank=in_rank_t,
                  num_tokens_per_expert=per_expert_t, topk_idx=topk_idx, topk_weights=topk_w)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, config=dcfg, **kw)
        total, cross = recv_token_counts(_to_numpy(handle[0]), rank)
        nb, cb = dispatch_bytes(total, H, "bf16"), dispatch_bytes(cross, H, "bf16")
        group.barrier()
        td = time_op(lambda: buf.dispatch(x, config=dcfg, **kw), min(args.warmup, 10), args.sweep_iters,
                     stream, flush)
        group.barrier()
        tc = time_op(lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=ccfg),
                     min(args.warmup, 10), args.sweep_iters, stream, flush)
        points.append({"num_tokens": n, "dispatch BF16": op_stats(td, nb, cb),
                       "combine BF16": op_stats(tc, nb, cb)})
    return {"points": points}


#: How the SM sweep names a dispatch with ``recv_x_in_buffer``.
IN_PLACE = "in place"


def _library_sm_sweep(ep, buf, group, args, x, x_fp8, layout_kw, stream, flush) -> Dict[str, Any]:
    """Cached dispatch BF16 and FP8 (allocating recv_x, and writing it in place: ``recv_x_in_buffer``)
    and combine BF16 (of a copy of recv_x, and of recv_x where a dispatch with rows in place left it)
    at each ``--sm-sweep`` SM count (the handle of a fresh dispatch with that many SMs); per count
    the rank's op_stats."""
    H = args.hidden
    points = []
    for num_sms in args.sm_sweep:
        config = sm_sweep_config(ep, group.size, num_sms)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, config=config, **layout_kw)
        total, cross = recv_token_counts(_to_numpy(handle[0]), group.rank)
        ops = {"cached dispatch BF16": (lambda: buf.dispatch(x, handle=handle, config=config), "bf16"),
               "combine BF16": (lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=config), "bf16")}
        if x_fp8 is not None:
            ops["cached dispatch FP8"] = (lambda: buf.dispatch(x_fp8, handle=handle, config=config), "fp8")
        ops[f"cached dispatch BF16 {IN_PLACE}"] = (
            lambda: buf.dispatch(x, handle=handle, config=config, recv_x_in_buffer=True), "bf16")
        if x_fp8 is not None:
            ops[f"cached dispatch FP8 {IN_PLACE}"] = (
                lambda: buf.dispatch(x_fp8, handle=handle, config=config, recv_x_in_buffer=True), "fp8")
        point = {"num_sms": num_sms}

        def measure(name, fn, dtype):
            group.barrier()
            times = time_op(fn, args.tune_warmup, args.tune_iters, stream, flush)
            point[name] = op_stats(times, dispatch_bytes(total, H, dtype), dispatch_bytes(cross, H, dtype))

        for name, (fn, dtype) in ops.items():
            measure(name, fn, dtype)
        # Last: the calls above overwrite the rows this one leaves in the buffer.
        in_x, _, in_w, _, in_handle, _ = buf.dispatch(x, config=config, recv_x_in_buffer=True, **layout_kw)
        measure(f"combine BF16 {IN_PLACE}", lambda: buf.combine(in_x, in_handle, topk_weights=in_w, config=config),
                "bf16")
        points.append(point)
    return {"points": points}


def _library_tune(ep, buf, group, args, x, layout_kw, stream, flush, lead) -> List[Dict[str, Any]]:
    """Time dispatch BF16 and combine for every ``tune_grid`` config; entries hold this rank's figures."""
    rank, H = group.rank, args.hidden
    grid = tune_grid(args.tune_sms, args.tune_send, args.tune_recv)
    progress = _Progress(len(grid), "tune", lead)
    entries: List[Dict[str, Any]] = []
    rec_d = ep.get_dispatch_config(group.size)
    handles: Dict[int, Any] = {}
    for sms, send, recv in grid:
        cfg = {"num_sms": sms, "num_max_nvl_chunked_send_tokens": send, "num_max_nvl_chunked_recv_tokens": recv}
        if sms not in handles:  # combine needs a handle made with the same channel count
            try:
                base = ep.Config(sms, rec_d.num_max_nvl_chunked_send_tokens, rec_d.num_max_nvl_chunked_recv_tokens)
                rx, _, rw, _, h, _ = buf.dispatch(x, config=base, **layout_kw)
                handles[sms] = (rx, rw, h, recv_token_counts(_to_numpy(h[0]), rank))
            except ValueError as exc:
                handles[sms] = exc
        for op in ("dispatch", "combine"):
            entry = {"op": op, **cfg}
            base = handles[sms]
            if isinstance(base, ValueError):
                entry["error"] = str(base)
                entries.append(entry)
                continue
            rx, rw, h, (total, cross) = base
            try:
                config = ep.Config(sms, send, recv)
                if op == "dispatch":
                    fn = lambda: buf.dispatch(x, config=config, **layout_kw)  # noqa: E731
                else:
                    fn = lambda: buf.combine(rx, h, topk_weights=rw, config=config)  # noqa: E731
                group.barrier()
                times = time_op(fn, args.tune_warmup, args.tune_iters, stream, flush)
                entry.update(op_stats(times, dispatch_bytes(total, H, "bf16"), dispatch_bytes(cross, H, "bf16")))
                entry.pop("times_us")
            except ValueError as exc:  # a config the library rejects (same on every rank)
                entry["error"] = str(exc)
            entries.append(entry)
        progress.update(f"sms={sms} send={send} recv={recv}")
    progress.close()
    return entries
