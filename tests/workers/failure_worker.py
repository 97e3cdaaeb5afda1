"""MPI worker for the failure-behaviour GPU tests (issue: bad input, ranks that disagree, hangs, leaks,
recovery after a timeout, calls that overlap).

Usage: ``mpiexec -n 2 python tests/workers/failure_worker.py [CASE ...]``. Every rank runs every
case (collectively) and prints one line ``RESULT {json}`` per case with ``ok``, ``error`` and
measurements; the test asserts on them. The cases from ``recovery_after_a_peer_never_joins`` on
take any rank group (an mpi4py communicator or a ``deepep_cupy.ThreadGroup``):
``local_failure_worker.py`` runs them with both ranks in one process.
"""

import json
import os
import resource
import sys
import time
import traceback

import numpy as np

CASES = ["argument_checks", "more_tokens_than_the_buffer_holds", "invalid_expert_ids", "rank_mismatch",
         "cached_rank_mismatch", "peer_never_joins", "many_iterations", "create_destroy_cycles",
         "recovery_after_a_peer_never_joins", "recovery_after_a_late_peer", "two_buffers_used_alternately",
         "dispatch_while_an_async_combine_is_in_flight", "recv_x_in_buffer_checks"]
#: The cases that take any rank group, not only an mpi4py communicator (local_failure_worker.py runs them).
GROUP_CASES = ["recovery_after_a_peer_never_joins", "recovery_after_a_late_peer", "two_buffers_used_alternately",
               "dispatch_while_an_async_combine_is_in_flight"]

N, H, E, K = 128, 1024, 16, 4
#: Buffer timeout of the recovery cases: short, and far above how fast a late rank must fail.
RECOVERY_TIMEOUT_S = 3.0
#: The most seconds a late rank's call may take to raise (a rank that waited out its own timeout
#: would take RECOVERY_TIMEOUT_S).
LATE_RAISE_LIMIT_S = 1.0
#: Dispatch + combine rounds, compared with the reference, on a new Buffer and in the concurrency cases.
ROUNDS = 3


def inputs(rng, num_ranks, num_tokens=N, hidden=H):
    from deepep_cupy.reference import intranode as ref

    topks = [ref.random_routing(rng, num_tokens, E, K) for _ in range(num_ranks)]
    xs = [ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32))
          for _ in range(num_ranks)]
    weights = [rng.random((num_tokens, K), dtype=np.float32) for _ in range(num_ranks)]
    return xs, topks, weights


class Round:
    """One fresh dispatch + combine of new routing on every rank, split into its calls so that a
    case can interleave them with other work. Making it draws every rank's inputs from ``rng``
    (the same on every rank) and runs this rank's layout."""

    def __init__(self, buf, rng, config):
        import cupy

        self.buf, self.config = buf, config
        self.xs, self.topks, self.weights = inputs(rng, buf.num_ranks)
        self.x, self.topk, self.w = (cupy.asarray(a[buf.rank]) for a in (self.xs, self.topks, self.weights))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(self.topk, E)
        self.layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        self.recv_x = self.handle = self.combined = self.combine_event = None

    def dispatch(self, **kwargs):
        self.recv_x, _, _, _, self.handle, _ = self.buf.dispatch(self.x, **self.layout, topk_idx=self.topk,
                                                                 topk_weights=self.w, config=self.config, **kwargs)

    def combine(self, **kwargs):
        self.combined, _, self.combine_event = self.buf.combine(self.recv_x, self.handle, config=self.config,
                                                                **kwargs)

    def mismatches(self):
        """What differs from the reference (bit-exact), as messages; empty when all is exact."""
        import cupy

        from deepep_cupy.reference import intranode as ref

        rank = self.buf.rank
        self.combine_event.current_stream_wait()  # nothing to wait for after a synchronous combine
        # The copies below may not run on the stream the calls ran on (in-process ranks have one each).
        cupy.cuda.get_current_stream().synchronize()
        results = ref.dispatch(self.xs, self.topks, E, self.config.num_channels, topk_weights=self.weights)
        want_combined = ref.combine([r["recv_x"] for r in results], results)[rank][0]
        found = []
        if not np.array_equal(cupy.asnumpy(self.recv_x), results[rank]["recv_x"]):
            found.append("recv_x differs from the reference")
        if not np.array_equal(cupy.asnumpy(self.combined), ref.round_to_dtype(want_combined, "bfloat16")):
            found.append("combined_x differs from the reference")
        return found

    def check(self):
        found = self.mismatches()
        if found:
            raise AssertionError("; ".join(found))


def dispatch_and_check(buf, rng, config):
    """One fresh dispatch + combine on new routing, compared with the reference bit-exactly."""
    one = Round(buf, rng, config)
    one.dispatch()
    one.combine()
    one.check()


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


def case_more_tokens_than_the_buffer_holds(comm, ep, cupy):
    """A Buffer sized for N tokens per rank: a dispatch of more, and a BF16 combine of the rows of an
    FP8 dispatch that fitted (its rows are half as wide), are refused on every rank, naming
    num_nvl_bytes; then a dispatch + combine of N tokens is exact."""
    R, rank = comm.Get_size(), comm.Get_rank()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(4)
    size = ep.get_nvl_buffer_size_hint(H * 2, R, config, num_topk=K, num_max_tokens_per_rank=N)
    many = N * 9 // 5  # more than N reach the other rank, fewer than twice N
    with ep.Buffer(comm, size, timeout_s=20) as buf:
        xs, topks, weights = inputs(rng, R, num_tokens=many)
        x, topk, w = (cupy.asarray(a[rank]) for a in (xs, topks, weights))
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        dispatch_message = expect(ValueError, "num_nvl_bytes", lambda: buf.dispatch(
            x, **layout, topk_idx=topk, topk_weights=w, config=config))
        fp8 = (x.view(cupy.uint8)[:, :H].copy(), cupy.ones((many, H // 128), cupy.float32))
        recv, _, _, _, handle, _ = buf.dispatch(fp8, **layout, topk_idx=topk, topk_weights=w, config=config)
        buf.combine(cupy.zeros((recv[0].shape[0], H), cupy.uint16), handle, config=config)
        cupy.cuda.get_current_stream().synchronize()
        combine_message = expect(ValueError, "num_nvl_bytes", buf.check_kernel_errors)
        dispatch_and_check(buf, rng, config)  # still usable after both refusals
    return {"dispatch": dispatch_message, "combine": combine_message}


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


def case_recv_x_in_buffer_checks(comm, ep, cupy):
    """recv_x_in_buffer: ranks that disagree on it (fresh: raised at once; cached: at the next call),
    a combine of part of the in-buffer recv_x, and ranks that disagree on combining it in place (at
    the next call) are refused, and the Buffer stays usable."""
    R, rank = comm.Get_size(), comm.Get_rank()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(7)
    messages = {}
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config, recv_x_in_buffer=True), timeout_s=20) as buf:
        xs, topks, _ = inputs(np.random.default_rng(70), R)
        x, topk = cupy.asarray(xs[rank]), cupy.asarray(topks[rank])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk, config=config)
        messages["fresh"] = expect(ep.RankMismatchError, "differ", lambda: buf.dispatch(
            x, **layout, recv_x_in_buffer=rank == 0))
        recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout, recv_x_in_buffer=True)
        messages["combine"] = expect(ValueError, "NVLink buffer",
                                     lambda: buf.combine(recv_x[1:], handle, config=config))
        buf.combine(recv_x if rank == 0 else recv_x.copy(), handle, config=config)  # in place on rank 0 only
        cupy.cuda.get_current_stream().synchronize()
        messages["combine_in_place"] = expect(ep.RankMismatchError, "differ between rank 0 and rank 1",
                                              lambda: buf.get_dispatch_layout(topk, E))
        buf.dispatch(x, handle=handle, config=config, recv_x_in_buffer=rank == 0)
        cupy.cuda.get_current_stream().synchronize()
        messages["cached"] = expect(ep.RankMismatchError, "differ between rank 0 and rank 1",
                                    lambda: buf.get_dispatch_layout(topk, E))
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


def _device_free_bytes(comm, cupy):
    """The GPU's free bytes, with every rank's pool emptied first (collective): where ranks share
    the GPU (tests/workers/one_gpu_ranks.py), each one's reading includes the others' memory."""
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    comm.Barrier()
    free = cupy.cuda.runtime.memGetInfo()[0]
    comm.Barrier()
    return free


def case_many_iterations(comm, ep, cupy):
    R = comm.Get_size()
    config = ep.Config(24, 16, 256)
    rng = np.random.default_rng(5)
    iterations = int(os.environ.get("DEEPEP_TEST_ITERATIONS", "2000"))
    with ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, R, config), timeout_s=20) as buf:
        for i in range(iterations):
            dispatch_and_check(buf, rng, config)
            if i == 99:
                # The outputs a call prepares for the next one vary with its count: not a leak.
                buf._engine.dispatch_path._next_outputs.drop()
                used_early = cupy.get_default_memory_pool().used_bytes()
                free_early = _device_free_bytes(comm, cupy)
        buf._engine.dispatch_path._next_outputs.drop()
        used_late = cupy.get_default_memory_pool().used_bytes()
        free_late = _device_free_bytes(comm, cupy)
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
    free_before, rss_before = _device_free_bytes(comm, cupy), _rss_bytes()
    for _ in range(cycles):
        cycle()
    free_after, rss_after = _device_free_bytes(comm, cupy), _rss_bytes()
    if free_before - free_after > (16 << 20):
        raise AssertionError(f"device memory leaked: free {free_before} -> {free_after} B over {cycles} cycles")
    if rss_after - rss_before > (64 << 20):
        raise AssertionError(f"host memory grew: peak RSS {rss_before} -> {rss_after} B over {cycles} cycles")
    return {"cycles": cycles, "buffer_bytes": size, "free_bytes": [free_before, free_after],
            "peak_rss_bytes": [rss_before, rss_after]}


# ---------------------------------------------------------------------------------------------
# Recovery after a timeout, and calls that overlap. These take any rank group (``comm``: an mpi4py
# communicator or a ThreadGroup) and keep every rank in the same sequence of collectives even when
# a check fails on one of them (a rank that left it would hang the others): failures are collected
# and raised at the end.


def attempt(problems, what, call):
    """``call()``, or None with the failure appended to ``problems`` instead of raised."""
    try:
        return call()
    except Exception as exc:
        problems.append(f"{what}: {type(exc).__name__}: {exc}")
        return None


class CaseFailed(AssertionError):
    """Some of a case's checks failed; ``info`` holds its measurements all the same (they go into
    its RESULT record)."""

    def __init__(self, problems, info):
        super().__init__("; ".join(problems))
        self.info = info


def raise_problems(problems, info):
    if problems:
        raise CaseFailed(problems, info)


def _recovery_setting(ep, group):
    config = ep.Config(24, 16, 256)
    return config, ep.get_nvl_buffer_size_hint(H * 2, group.size, config)


def _destroy_timed(buf):
    start = time.monotonic()
    buf.destroy()
    return round(time.monotonic() - start, 3)


def _exact_rounds_on_a_new_buffer(ep, group, size, rng, config, problems):
    """A new Buffer on ``group``: ROUNDS dispatch + combine rounds compared with the reference; returns
    how many were exact (the rounds are all run, whatever the results)."""
    exact = 0
    with ep.Buffer(group, size, timeout_s=RECOVERY_TIMEOUT_S) as buf:
        for i in range(ROUNDS):
            one = Round(buf, rng, config)
            one.dispatch()
            one.combine()
            found = one.mismatches()
            problems += [f"new Buffer, round {i}: {m}" for m in found]
            exact += not found
    return exact


def case_recovery_after_a_peer_never_joins(comm, ep, cupy):
    """Rank 0 dispatches, the others never do: rank 0 times out; every rank destroys its Buffer and
    creates a new one on the same group, whose results are exact."""
    from deepep_cupy.groups.group import as_group

    group = as_group(comm)
    config, size = _recovery_setting(ep, group)
    rng = np.random.default_rng(60)
    problems, info = [], {"timeout_s": RECOVERY_TIMEOUT_S, "rounds": ROUNDS}
    buf = ep.Buffer(group, size, timeout_s=RECOVERY_TIMEOUT_S)
    attempt(problems, "first round", lambda: dispatch_and_check(buf, rng, config))
    alone = Round(buf, rng, config)
    if group.rank == 0:
        start = time.monotonic()
        info["message"] = attempt(problems, "rank 0 alone", lambda: expect(
            ep.DeepEPTimeoutError, "notify_dispatch timed out after", alone.dispatch))
        info["raise_seconds"] = round(time.monotonic() - start, 3)
    info["destroy_seconds"] = _destroy_timed(buf)
    info["exact_rounds"] = _exact_rounds_on_a_new_buffer(ep, group, size, rng, config, problems)
    raise_problems(problems, info)
    return info


def case_recovery_after_a_late_peer(comm, ep, cupy):
    """Rank 0 dispatches and times out; only then do the others make the same call: it must raise
    PeerAbortedError at once (not return, not wait out its own timeout). Then every rank destroys its
    Buffer and creates a new one on the same group, whose results are exact."""
    from deepep_cupy.groups.group import as_group

    group = as_group(comm)
    config, size = _recovery_setting(ep, group)
    rng = np.random.default_rng(70)
    problems, info = [], {"timeout_s": RECOVERY_TIMEOUT_S, "rounds": ROUNDS, "late_limit_s": LATE_RAISE_LIMIT_S}
    buf = ep.Buffer(group, size, timeout_s=RECOVERY_TIMEOUT_S)
    attempt(problems, "first round", lambda: dispatch_and_check(buf, rng, config))
    late = Round(buf, rng, config)
    if group.rank == 0:
        info["message"] = attempt(problems, "rank 0 alone", lambda: expect(
            ep.DeepEPTimeoutError, "notify_dispatch timed out after", late.dispatch))
    group.barrier()  # rank 0 has given up: only now do the others come
    if group.rank != 0:
        start = time.monotonic()
        try:
            late.dispatch()
            info["late_error"] = None
            problems.append("the late rank's dispatch returned instead of raising")
        except Exception as exc:
            info["late_error"], info["message"] = type(exc).__name__, str(exc)
            if not isinstance(exc, ep.PeerAbortedError) or "rank 0 had given up" not in str(exc):
                problems.append(f"the late rank raised {type(exc).__name__}: {exc}")
        info["late_seconds"] = round(time.monotonic() - start, 3)
        if info["late_seconds"] > LATE_RAISE_LIMIT_S:
            problems.append(f"the late rank's call took {info['late_seconds']} s to fail, limit {LATE_RAISE_LIMIT_S}")
    attempt(problems, "the Buffer after the failure",
            lambda: expect(ep.DeepEPError, "unusable", lambda: buf.get_dispatch_layout(late.topk, E)))
    info["destroy_seconds"] = _destroy_timed(buf)
    info["exact_rounds"] = _exact_rounds_on_a_new_buffer(ep, group, size, rng, config, problems)
    raise_problems(problems, info)
    return info


def case_two_buffers_used_alternately(comm, ep, cupy):
    """Two Buffers on one group, their calls interleaved: dispatch on A, dispatch on B, combine on A,
    combine on B; every round's results exact."""
    from deepep_cupy.groups.group import as_group

    group = as_group(comm)
    config, size = _recovery_setting(ep, group)
    rng = np.random.default_rng(80)
    problems, exact = [], 0
    with ep.Buffer(group, size, timeout_s=20) as a, ep.Buffer(group, size, timeout_s=20) as b:
        for i in range(ROUNDS):
            on_a, on_b = Round(a, rng, config), Round(b, rng, config)
            on_a.dispatch()
            on_b.dispatch()
            on_a.combine()
            on_b.combine()
            for name, one in (("A", on_a), ("B", on_b)):
                found = one.mismatches()
                problems += [f"round {i}, Buffer {name}: {m}" for m in found]
                exact += not found
    info = {"rounds": 2 * ROUNDS, "exact_rounds": exact}
    raise_problems(problems, info)
    return info


def case_dispatch_while_an_async_combine_is_in_flight(comm, ep, cupy):
    """Each round's combine is asynchronous (async_finish=True) and the next round's fresh dispatch is
    issued before its event is waited for; every round's results exact."""
    from deepep_cupy.groups.group import as_group

    group = as_group(comm)
    config, size = _recovery_setting(ep, group)
    rng = np.random.default_rng(90)
    problems, exact, asynchronous = [], 0, 0
    with ep.Buffer(group, size, timeout_s=20) as buf:
        previous = Round(buf, rng, config)
        previous.dispatch()
        for i in range(ROUNDS + 1):
            current = Round(buf, rng, config) if i < ROUNDS else None  # its layout runs before the combine
            previous.combine(async_finish=True)
            asynchronous += previous.combine_event.event is not None
            if current is not None:
                current.dispatch()  # the combine may still run on the communication stream
            found = previous.mismatches()  # waits for the combine's event first
            problems += [f"round {i}: {m}" for m in found]
            exact += not found
            previous = current
    if asynchronous != ROUNDS + 1:
        problems.append(f"{ROUNDS + 1 - asynchronous} async combines returned no event")
    info = {"rounds": ROUNDS + 1, "exact_rounds": exact, "async_combines": asynchronous}
    raise_problems(problems, info)
    return info


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
            info = getattr(exc, "info", {})  # a CaseFailed keeps the measurements
            ok, error = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failures += 1
        sys.stdout.write("RESULT " + json.dumps({"rank": rank, "case": name, "ok": ok, "error": error,
                                                 "seconds": round(time.time() - start, 3), **info}) + "\n")
        sys.stdout.flush()
        comm.Barrier()
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
