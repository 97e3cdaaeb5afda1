"""The NCCL baseline: the same routing moved by an NCCL all-to-all (torch.distributed or
``cupy.cuda.nccl``), timed in steps (index build, count exchange, permute, transfer, transfer back)."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import NcclUnavailable
from ..gpu.sm_budget import sm_count_of
from ..transports.nccl_library import load_nccl
from .library import _import_library
from .own_kernels import raw_kernel
from .report import op_stats
from .timing import make_l2_flush, time_ops_multi
from .workload import (
    build_send_index,
    dispatch_bytes,
    expected_recv_sources,
    make_workload,
    token_rank_mask,
)

#: Header words stamped into every row of the NCCL baseline's payload (source rank, token index).
NCCL_HEADER_WORDS = 3

# ----------------------------------------------------------------------------------------------
# NCCL baseline
# ----------------------------------------------------------------------------------------------


class CupyNcclBackend:
    """All-to-all-v with ``cupy.cuda.nccl`` send/recv in one NCCL group call.

    ``local_ranks`` are the ranks this thread drives: all of them in-process (communicators from
    ``ncclCommInitAll``), only its own under mpirun (``ncclCommInitRank``, unique id shared by the
    group's allgather). The byte payloads are sent as ``NCCL_UINT8``.
    """

    name = "cupy.cuda.nccl"

    def __init__(self, local_ranks: Sequence[int], devices: Sequence[int], num_ranks: int, group: Any = None):
        import cupy
        self.nccl = load_nccl()
        self.local_ranks, self.devices, self.num_ranks = list(local_ranks), list(devices), num_ranks
        if len(self.local_ranks) == num_ranks:
            self.comms = self.nccl.NcclCommunicator.initAll(list(self.devices))
        else:
            uid = self.nccl.get_unique_id() if group.rank == 0 else None
            uid = group.allgather(uid)[0]
            with cupy.cuda.Device(self.devices[0]):
                self.comms = [self.nccl.NcclCommunicator(num_ranks, uid, group.rank)]
        self.streams = []
        for d in self.devices:
            with cupy.cuda.Device(d):
                self.streams.append(cupy.cuda.Stream(non_blocking=True))

    def all_to_all_v(self, sends, send_counts, recvs, recv_counts) -> None:
        """Per local rank: rows of ``sends[i]`` split by ``send_counts[i]`` go to ranks 0..R-1, rows of
        ``recvs[i]`` split by ``recv_counts[i]`` come from ranks 0..R-1 (host int counts, in rows)."""
        import cupy
        nccl = self.nccl
        nccl.groupStart()
        try:
            for i in range(len(self.local_ranks)):
                with cupy.cuda.Device(self.devices[i]):
                    comm, sptr = self.comms[i], self.streams[i].ptr
                    s_row = sends[i].strides[0] if sends[i].ndim > 1 else sends[i].itemsize
                    r_row = recvs[i].strides[0] if recvs[i].ndim > 1 else recvs[i].itemsize
                    s_off = r_off = 0
                    for peer in range(self.num_ranks):
                        sc, rc = int(send_counts[i][peer]), int(recv_counts[i][peer])
                        if sc:
                            comm.send(sends[i].data.ptr + s_off * s_row, sc * s_row, nccl.NCCL_UINT8, peer, sptr)
                        if rc:
                            comm.recv(recvs[i].data.ptr + r_off * r_row, rc * r_row, nccl.NCCL_UINT8, peer, sptr)
                        s_off, r_off = s_off + sc, r_off + rc
        finally:
            nccl.groupEnd()

    def close(self) -> None:
        for c in self.comms:
            c.destroy()
        self.comms = []


class TorchNcclBackend:
    """All-to-all-v with ``torch.distributed.all_to_all_single`` (NCCL) on CuPy arrays (DLPack views).

    One local rank (mpirun). Rank 0 picks a free TCP port, shared by the group's allgather;
    ``MASTER_ADDR=127.0.0.1``. Torch runs on a torch view of our CuPy stream, so events recorded on
    that stream time the collective.
    """

    name = "torch.distributed (NCCL)"

    def __init__(self, local_ranks: Sequence[int], devices: Sequence[int], num_ranks: int, group: Any):
        import cupy
        try:
            import torch
            import torch.distributed as dist
        except Exception as exc:
            raise NcclUnavailable(f"torch is not importable ({exc})") from exc
        if len(local_ranks) != 1:
            raise NcclUnavailable("torch.distributed needs one process per rank")
        if not dist.is_nccl_available():
            raise NcclUnavailable("torch has no NCCL backend")
        self.torch, self.dist = torch, dist
        self.local_ranks, self.devices, self.num_ranks = list(local_ranks), list(devices), num_ranks
        dev = self.devices[0]
        torch.cuda.set_device(dev)
        port = _free_port() if group.rank == 0 else None
        port = group.allgather(port)[0]
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        kw = dict(backend="nccl", rank=group.rank, world_size=num_ranks)
        try:
            dist.init_process_group(device_id=torch.device("cuda", dev), **kw)
        except TypeError:
            dist.init_process_group(**kw)
        with cupy.cuda.Device(dev):
            self.streams = [cupy.cuda.Stream(non_blocking=True)]
        self._tstream = torch.cuda.ExternalStream(self.streams[0].ptr, device=torch.device("cuda", dev))
        self._views: Dict[Tuple[int, Tuple[int, ...]], Any] = {}

    def _view(self, arr):
        key = (arr.data.ptr, arr.shape, arr.dtype.str)
        if key not in self._views:
            flat = arr.reshape(arr.shape[0], -1).view("uint8") if arr.ndim > 1 else arr
            self._views[key] = self.torch.from_dlpack(flat)
        return self._views[key]

    def all_to_all_v(self, sends, send_counts, recvs, recv_counts) -> None:
        import cupy
        with cupy.cuda.Device(self.devices[0]), self.streams[0], self.torch.cuda.stream(self._tstream):
            self.dist.all_to_all_single(self._view(recvs[0]), self._view(sends[0]),
                                        output_split_sizes=[int(c) for c in recv_counts[0]],
                                        input_split_sizes=[int(c) for c in send_counts[0]])

    def forget_buffers(self) -> None:
        """Drop the cached torch views (they keep their CuPy buffers alive)."""
        self._views.clear()

    def close(self) -> None:
        self._views.clear()
        with contextlib.suppress(Exception):
            self.dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_nccl_backend(kind: str, mode: str, local_ranks: Sequence[int], devices: Sequence[int],
                      num_ranks: int, group: Any = None):
    """The NCCL backend for ``--nccl kind`` (``auto``/``torch``/``cupy``), or raise :class:`NcclUnavailable`."""
    if kind == "none":
        raise NcclUnavailable("disabled by --nccl none")
    if mode == "local" and len(set(devices)) != len(devices):
        raise NcclUnavailable("NCCL needs a distinct GPU per rank (ranks share a GPU here)")
    errors = []
    order = {"auto": ("torch", "cupy") if mode == "mpi" else ("cupy",), "torch": ("torch",), "cupy": ("cupy",)}[kind]
    if kind == "torch" and mode == "local":
        errors.append("torch.distributed needs mpirun (one process per rank); using cupy.cuda.nccl")
        order = ("cupy",)
    for k in order:
        try:
            cls = TorchNcclBackend if k == "torch" else CupyNcclBackend
            return cls(local_ranks, devices, num_ranks, group)
        except NcclUnavailable as exc:
            errors.append(f"{k}: {exc}")
        except Exception as exc:  # e.g. an NCCL init error
            errors.append(f"{k}: {type(exc).__name__}: {exc}")
    raise NcclUnavailable("; ".join(errors))


def _exchange_counts(backend, send_counts_dev, recv_counts_dev) -> None:
    """All-to-all of one int64 per peer (the split sizes), through the same backend."""
    R = backend.num_ranks
    backend.all_to_all_v([a.reshape(R, 1) for a in send_counts_dev], [[1] * R] * len(send_counts_dev),
                         [a.reshape(R, 1) for a in recv_counts_dev], [[1] * R] * len(recv_counts_dev))


def gather_rows(x: Any, rows: Any, out: Any) -> Any:
    """``out[:] = x[rows]`` for C-contiguous 2-D CuPy arrays, with 16-byte vector copies when rows allow.

    This is the NCCL baseline's permute (what ``torch.index_select`` does for a PyTorch user).
    """
    import cupy
    row_bytes = x.shape[1] * x.itemsize if x.ndim == 2 else 0
    if (row_bytes % 16 or not x.flags.c_contiguous or not out.flags.c_contiguous
            or x.data.ptr % 16 or out.data.ptr % 16):
        return cupy.take(x, rows, axis=0, out=out)
    n = int(rows.shape[0])
    if n:
        sms = sm_count_of(cupy.cuda.Device().id)
        raw_kernel("bench_gather.cu", "gather_rows_int4")(
            (min(n, sms * 8),), (256,),
            (np.uint64(x.data.ptr), np.uint64(out.data.ptr), rows.astype(cupy.int64, copy=False),
             np.int64(n), np.int64(row_bytes // 16)))
    return out


def _nccl_payload(num_tokens: int, hidden: int, rank: int):
    """Deterministic BF16-sized rows whose first words are (source rank, token & 0xffff, token >> 16)."""
    import cupy
    x = (cupy.arange(num_tokens * hidden, dtype=cupy.uint32) * np.uint32(2654435761) + np.uint32(rank))
    x = (x >> 16).astype(cupy.uint16).reshape(num_tokens, hidden)
    t = cupy.arange(num_tokens, dtype=cupy.int64)
    x[:, 0] = rank
    x[:, 1] = (t & 0xFFFF).astype(cupy.uint16)
    x[:, 2] = (t >> 16).astype(cupy.uint16)
    return x


def nccl_measure(backend, args: argparse.Namespace, num_tokens: int, topk_by_rank: Dict[int, np.ndarray],
                 all_masks: Optional[Sequence[np.ndarray]], iters: int, warmup: int, check: bool
                 ) -> Dict[int, Dict[str, Any]]:
    """Time the NCCL all-to-all path for the local ranks at ``num_tokens`` tokens per rank.

    Args:
        topk_by_rank: local rank -> its ``topk_idx`` (host).
        all_masks: every rank's ``is_token_in_rank`` (host), for the check; ``None`` skips it.
    Returns:
        local rank -> {op name: op_stats, "check": (ok, msg) or absent}.
    """
    import cupy
    R, H, E = backend.num_ranks, args.hidden, args.num_experts
    L = len(backend.local_ranks)
    devs, streams = backend.devices, backend.streams
    st: Dict[str, List[Any]] = {k: [None] * L for k in ("mask", "x", "counts", "perm", "send", "recv",
                                                         "back", "sc_dev", "rc_dev", "flush")}
    # Per local rank, the rows it sends to and receives from each rank (filled in below).
    send_counts: List[List[int]] = [[] for _ in range(L)]
    recv_counts: List[List[int]] = [[] for _ in range(L)]
    for i, rank in enumerate(backend.local_ranks):
        with cupy.cuda.Device(devs[i]), streams[i]:
            st["mask"][i] = token_rank_mask(cupy.asarray(topk_by_rank[rank]), E, R)
            st["x"][i] = _nccl_payload(num_tokens, H, rank)
            st["flush"][i] = make_l2_flush(args.flush_l2)
            c, p = build_send_index(st["mask"][i])
            st["counts"][i], st["perm"][i] = c, p
            send_counts[i] = c.get().tolist()
            st["sc_dev"][i] = c.copy()
            st["rc_dev"][i] = cupy.zeros(R, dtype=cupy.int64)
    _exchange_counts(backend, st["sc_dev"], st["rc_dev"])
    for i in range(L):
        with cupy.cuda.Device(devs[i]), streams[i]:
            streams[i].synchronize()
            recv_counts[i] = st["rc_dev"][i].get().tolist()
            st["send"][i] = cupy.empty((st["perm"][i].shape[0], H), dtype=cupy.uint16)
            gather_rows(st["x"][i], st["perm"][i], st["send"][i])
            st["recv"][i] = cupy.empty((sum(recv_counts[i]), H), dtype=cupy.uint16)
            st["back"][i] = cupy.empty_like(st["send"][i])

    out: Dict[int, Dict[str, Any]] = {r: {} for r in backend.local_ranks}
    per_local_times: Dict[str, List[List[float]]] = {}

    def local_op(i, fn):  # a per-rank op: timed alone on its device and stream
        with cupy.cuda.Device(devs[i]), streams[i]:
            return time_ops_multi(fn, warmup, iters, [streams[i]], [devs[i]], [st["flush"][i]])[0]

    def index_build(i):
        def fn():
            c, p = build_send_index(st["mask"][i])
            return c.get()
        return fn

    per_local_times["nccl index build"] = [local_op(i, index_build(i)) for i in range(L)]
    per_local_times["nccl permute"] = [
        local_op(i, (lambda i=i: gather_rows(st["x"][i], st["perm"][i], st["send"][i]))) for i in range(L)]

    def collective(fn):
        return time_ops_multi(fn, warmup, iters, streams, devs, st["flush"])

    def exchange():
        _exchange_counts(backend, st["sc_dev"], st["rc_dev"])
        host = []
        for i in range(L):  # the host needs the split sizes
            with cupy.cuda.Device(devs[i]), streams[i]:
                host.append(st["rc_dev"][i].get())
        return host

    per_local_times["nccl count exchange"] = collective(exchange)
    per_local_times["nccl a2a dispatch"] = collective(
        lambda: backend.all_to_all_v(st["send"], send_counts, st["recv"], recv_counts))
    per_local_times["nccl a2a combine"] = collective(
        lambda: backend.all_to_all_v(st["recv"], recv_counts, st["back"], send_counts))
    for i, rank in enumerate(backend.local_ranks):
        with cupy.cuda.Device(devs[i]):
            streams[i].synchronize()
        total = sum(recv_counts[i])
        cross = total - recv_counts[i][rank]
        nb, cb = dispatch_bytes(total, H, "bf16"), dispatch_bytes(cross, H, "bf16")
        for name, times in per_local_times.items():
            moving = name.startswith("nccl a2a")
            out[rank][name] = op_stats(times[i], nb if moving else None, cb if moving else None)
        steps = ("nccl index build", "nccl count exchange", "nccl permute", "nccl a2a dispatch")
        mean_sum = sum(out[rank][s]["mean_us"] for s in steps)
        out[rank]["nccl dispatch (all steps)"] = {"times_us": [], "mean_us": mean_sum,
                                                  "min_us": sum(out[rank][s]["min_us"] for s in steps),
                                                  "bytes": nb, "cross_bytes": cb}
        if check and all_masks is not None:
            with cupy.cuda.Device(devs[i]):
                hdr = st["recv"][i][:, :NCCL_HEADER_WORDS].get().astype(np.int64)
                back_ok = bool(cupy.array_equal(st["back"][i], st["send"][i]))
            src_rank, src_tok = expected_recv_sources(all_masks, rank)
            got_tok = hdr[:, 1] | (hdr[:, 2] << 16)
            ok = (hdr.shape[0] == src_rank.shape[0] and np.array_equal(hdr[:, 0], src_rank)
                  and np.array_equal(got_tok, src_tok))
            out[rank]["check"] = (bool(ok and back_ok),
                                  f"rows {hdr.shape[0]} (want {src_rank.shape[0]}), sources "
                                  f"{'ok' if ok else 'WRONG'}, transfer back {'ok' if back_ok else 'WRONG'}")
    getattr(backend, "forget_buffers", lambda: None)()
    return out


def run_nccl_baseline(args: argparse.Namespace, mode: str, group: Any, local_ranks: Sequence[int],
                      devices: Sequence[int], num_ranks: int) -> Dict[str, Any]:
    """The NCCL baseline for the local ranks: main workload (+ tokens sweep). Returns per local rank results."""
    _, reference = _import_library()
    try:
        backend = make_nccl_backend(args.nccl, mode, local_ranks, devices, num_ranks, group)
    except NcclUnavailable as exc:
        return {"skipped": str(exc)}
    res: Dict[str, Any] = {"backend": backend.name, "skipped": None, "main": {}, "sweep": []}
    try:
        sizes = [args.num_tokens] + list(args.tokens_sweep or [])
        for n_idx, n in enumerate(sizes):
            topk = {r: make_workload(reference, args, r, n, with_data=False)["topk_idx"] for r in local_ranks}
            masks = None
            if n_idx == 0 and args.check:
                if len(local_ranks) == num_ranks:
                    masks = [token_rank_mask(topk[r], args.num_experts, num_ranks) for r in range(num_ranks)]
                else:
                    masks = [token_rank_mask(t, args.num_experts, num_ranks)
                             for t in group.allgather(topk[local_ranks[0]])]
            first = n_idx == 0
            m = nccl_measure(backend, args, n, topk, masks, args.iters if first else args.sweep_iters,
                             args.warmup if first else min(args.warmup, 10), first and args.check)
            if first:
                res["main"] = m
            else:
                res["sweep"].append({"num_tokens": n, "ranks": m})
    finally:
        backend.close()
    return res
