"""MPI worker for the failure-behaviour GPU tests (issue: bad input, ranks that disagree, hangs, leaks).

Usage: ``mpiexec -n 2 python tests/workers/failure_worker.py [CASE ...]``. Every rank runs every
case (collectively) and prints one line ``RESULT {json}`` per case with ``ok``, ``error`` and
measurements; the test asserts on them.
"""

import json
import os
import resource
import sys
import time
import traceback

import numpy as np

CASES = ["argument_checks", "invalid_expert_ids", "rank_mismatch", "cached_rank_mismatch", "peer_never_joins",
         "many_iterations", "create_destroy_cycles"]

N, H, E, K = 128, 1024, 16, 4


def inputs(rng, num_ranks, num_tokens=N, hidden=H):
    from deepep_cupy import reference as ref

    topks = [ref.random_routing(rng, num_tokens, E, K) for _ in range(num_ranks)]
    xs = [ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32))
          for _ in range(num_ranks)]
    weights = [rng.random((num_tokens, K), dtype=np.float32) for _ in range(num_ranks)]
    return xs, topks, weights


def dispatch_and_check(buf, rng, config):
    """One fresh dispatch + combine on new routing, compared with the reference bit-exactly."""
    import cupy

    from deepep_cupy import reference as ref

    R, rank = buf.num_ranks, buf.rank
    xs, topks, weights = inputs(rng, R)
    x, topk, w = (cupy.asarray(a[rank]) for a in (xs, topks, weights))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=topk,
                                                   topk_weights=w, config=config)
    combined, _, _ = buf.combine(recv_x, handle, config=config)
    results = ref.dispatch(xs, topks, E, config.num_channels, topk_weights=weights)
    want_combined = ref.combine([r["recv_x"] for r in results], results)[rank][0]
    if not np.array_equal(cupy.asnumpy(recv_x), results[rank]["recv_x"]):
        raise AssertionError("recv_x differs from the reference")
    if not np.array_equal(cupy.asnumpy(combined), ref.round_to_dtype(want_combined, "bfloat16")):
        raise AssertionError("combined_x differs from the reference")


def expect(exc_type, fragment, call):
    try:
        call()
    except exc_type as exc:
        if fragment not in str(exc):
            raise AssertionError(f"{exc_type.__name__} without {fragment!r}: {exc}") from exc
        return str(exc)
    except Exception as exc:
        raise AssertionError(f"expected {exc_type.__name__} ({fragment!r}), got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {exc_type.__name__} ({fragment!r}), nothing was raised")


def case_argument_checks(comm, ep, cupy):
    R, rank = comm.Get_size(), comm.Get_rank()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(1)
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 4, R, config), timeout_s=20) as buf, \
            ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 4, R, config), timeout_s=20) as other:
        xs, topks, weights = inputs(rng, R)
        x, topk, w = (cupy.asarray(a[rank]) for a in (xs, topks, weights))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

        def dispatch(x_arg=x, **changes):
            kwargs = {**layout, "topk_idx": topk, "topk_weights": w, "config": config, **changes}
            return lambda: buf.dispatch(x_arg, **kwargs)

        messages = {
            "dtype": expect(TypeError, "x: expected dtype bfloat16 or float16 or float32, got float64",
                            dispatch(x.astype(cupy.float64))),
            "ndim": expect(ValueError, "x: expected 2 dimensions", dispatch(x[:, 0].copy())),
            "layout": expect(ValueError, "contiguous", dispatch(cupy.asfortranarray(x))),
            "host": expect(TypeError, "NumPy array on the host", dispatch(xs[rank])),
            "row_bytes": expect(ValueError, "multiple of 16", dispatch(x[:, :1004].copy())),  # 2008 B
            "in_rank_shape": expect(ValueError, "is_token_in_rank", dispatch(is_token_in_rank=in_rank[:-1].copy())),
            "topk_dtype": expect(TypeError, "topk_idx: expected dtype int64",
                                 dispatch(topk_idx=topk.astype(cupy.int32))),
            "weights_alone": expect(ValueError, "topk_weights", dispatch(topk_idx=None)),
            "experts": expect(ValueError, "num_experts", dispatch(num_tokens_per_expert=per_expert[:-1].copy())),
            "scales": expect(ValueError, "x[1]", dispatch((x.view(cupy.uint8)[:, :H].copy(),
                                                          cupy.ones((N + 1, H // 128), cupy.float32)))),
            "too_small": expect(ValueError, "num_nvl_bytes", dispatch(config=ep.Config(48, 16, 4096))),
        }
        if cupy.cuda.runtime.getDeviceCount() > 1:
            with cupy.cuda.Device((cupy.cuda.Device().id + 1) % cupy.cuda.runtime.getDeviceCount()):
                elsewhere = cupy.asarray(xs[rank])
            messages["device"] = expect(ValueError, "GPU", dispatch(elsewhere))
        recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout, topk_idx=topk, topk_weights=w, config=config)
        _, _, _, _, foreign, _ = other.dispatch(x, **layout, topk_idx=topk, topk_weights=w, config=config)
        messages["foreign_handle"] = expect(ValueError, "another Buffer", lambda: buf.combine(recv_x, foreign,
                                                                                             config=config))
        messages["handle_sms"] = expect(ValueError, "same num_sms",
                                        lambda: buf.combine(recv_x, handle, config=ep.Config(8, 16, 256)))
        messages["combine_rows"] = expect(ValueError, "rows", lambda: buf.combine(recv_x[1:].copy(), handle,
                                                                                 config=config))
        dispatch_and_check(buf, rng, config)  # still usable after every refusal
    return {"checked": sorted(messages)}


def case_invalid_expert_ids(comm, ep, cupy):
    R, rank = comm.Get_size(), comm.Get_rank()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(2)
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config), timeout_s=20) as buf:
        xs, topks, weights = inputs(rng, R)
        x, topk, w = (cupy.asarray(a[rank]) for a in (xs, topks, weights))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        bad = topk.copy()
        if rank == R - 1:
            bad[3, 1] = E + 100  # only the last rank's input is bad; every rank must refuse
        message = expect(ValueError, f"rank {R - 1} passed expert ids", lambda: buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=bad, topk_weights=w, config=config))
        dispatch_and_check(buf, rng, config)
    return {"message": message}


def case_rank_mismatch(comm, ep, cupy):
    R, rank = comm.Get_size(), comm.Get_rank()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(3)
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 4, R, config), timeout_s=20) as buf:
        hidden = H if rank == 0 else 2 * H  # rank 0 disagrees with the others
        # Its own generator: `rng` must stay in step on every rank for the check that follows.
        xs, topks, weights = inputs(np.random.default_rng(30), R, hidden=hidden)
        x, topk = cupy.asarray(xs[rank]), cupy.asarray(topks[rank])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        message = expect(ep.RankMismatchError, "differ", lambda: buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, config=config))
        dispatch_and_check(buf, rng, config)
    return {"message": message}


def case_cached_rank_mismatch(comm, ep, cupy):
    """Cached dispatch and combine with chunk sizes that differ between ranks: found on the device,
    nothing moves, the next call raises on every rank, and the Buffer stays usable."""
    R, rank = comm.Get_size(), comm.Get_rank()
    config = ep.Config(24, 16, 256)
    other = ep.Config(24, 16 if rank == 0 else 32, 256)  # same num_sms: no local check can see it
    rng = np.random.default_rng(5)
    messages = []
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config), timeout_s=20) as buf:
        xs, topks, _ = inputs(np.random.default_rng(50), R)
        x, topk = cupy.asarray(xs[rank]), cupy.asarray(topks[rank])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=topk, config=config)
        for call in (lambda: buf.dispatch(x, handle=handle, config=other),
                     lambda: buf.combine(recv_x, handle, config=other)):
            start = time.monotonic()
            call()
            cupy.cuda.get_current_stream().synchronize()
            messages.append(expect(ep.RankMismatchError, "differ between rank 0 and rank 1",
                                   lambda: buf.get_dispatch_layout(topk, E)))
            if time.monotonic() - start > 10:
                raise AssertionError("the disagreement took longer than 10 s to surface (a timeout?)")
            dispatch_and_check(buf, rng, config)
    return {"messages": messages}


def case_peer_never_joins(comm, ep, cupy):
    R, rank = comm.Get_size(), comm.Get_rank()
    timeout_s = 2.0
    config = ep.Config(24, 16, 256)
    info = {"timeout_s": timeout_s}
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config), timeout_s=timeout_s) as buf:
        if rank == 0:  # the others never call dispatch
            xs, topks, _ = inputs(np.random.default_rng(4), R)
            x, topk = cupy.asarray(xs[0]), cupy.asarray(topks[0])
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
            start = time.monotonic()
            info["message"] = expect(ep.DeepEPTimeoutError, "timed out", lambda: buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, config=config))
            info["seconds"] = time.monotonic() - start
            if info["seconds"] > timeout_s + 1.0:
                raise AssertionError(f"raised after {info['seconds']:.2f} s, limit {timeout_s + 1.0} s")
            expect(ep.DeepEPError, "unusable", lambda: buf.get_dispatch_layout(topk, E))
    return info


def _device_free_bytes(cupy):
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    return cupy.cuda.runtime.memGetInfo()[0]


def case_many_iterations(comm, ep, cupy):
    R = comm.Get_size()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(5)
    iterations = int(os.environ.get("DEEPEP_TEST_ITERATIONS", "2000"))
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config), timeout_s=20) as buf:
        for i in range(iterations):
            dispatch_and_check(buf, rng, config)
            if i == 99:
                used_early = cupy.get_default_memory_pool().used_bytes()
                free_early = _device_free_bytes(cupy)
        used_late = cupy.get_default_memory_pool().used_bytes()
        free_late = _device_free_bytes(cupy)
    if used_late > used_early or free_early - free_late > (16 << 20):
        raise AssertionError(f"device memory grew: pool in use {used_early} -> {used_late} B, "
                             f"free {free_early} -> {free_late} B")
    return {"iterations": iterations, "pool_used_bytes": [used_early, used_late],
            "free_bytes": [free_early, free_late]}


def _rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def case_create_destroy_cycles(comm, ep, cupy):
    R = comm.Get_size()
    config = ep.Config(24, 16, 256)
    size = ep.get_nvl_buffer_size_hint(7168 * 2, R, config)
    cycles = int(os.environ.get("DEEPEP_TEST_CYCLES", "50"))

    def cycle():
        with ep.Buffer(comm, size, timeout_s=20) as buf:
            buf.barrier()

    cycle()  # first one pays for compilation and CUDA's own allocations
    free_before, rss_before = _device_free_bytes(cupy), _rss_bytes()
    for _ in range(cycles):
        cycle()
    free_after, rss_after = _device_free_bytes(cupy), _rss_bytes()
    if free_before - free_after > (16 << 20):
        raise AssertionError(f"device memory leaked: free {free_before} -> {free_after} B over {cycles} cycles")
    if rss_after - rss_before > (64 << 20):
        raise AssertionError(f"host memory grew: peak RSS {rss_before} -> {rss_after} B over {cycles} cycles")
    return {"cycles": cycles, "buffer_bytes": size, "free_bytes": [free_before, free_after],
            "peak_rss_bytes": [rss_before, rss_after]}


def main(names):
    import cupy
    from mpi4py import MPI

    import deepep_cupy as ep

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
    failures = 0
    for name in [c for c in CASES if not names or c in names]:
        start = time.time()
        try:
            info, ok, error = globals()[f"case_{name}"](comm, ep, cupy), True, None
        except Exception as exc:
            info, ok, error = {}, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failures += 1
        sys.stdout.write("RESULT " + json.dumps({"rank": rank, "case": name, "ok": ok, "error": error,
                                                 "seconds": round(time.time() - start, 3), **info}) + "\n")
        sys.stdout.flush()
        comm.Barrier()
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
