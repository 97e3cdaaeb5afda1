"""The internode benchmark: ``mpirun -np R python -m deepep_cupy.bench --ranks-per-node L``.

Every rank makes an internode Buffer over nodes of ``L`` ranks (simulated on one machine when the
hosts hold more), dispatches its workload (BF16, :func:`deepep_cupy.bench.workload.make_workload`)
and reports, per op (fresh dispatch, cached dispatch, combine):

* the bytes that left the rank for other nodes (rows the internode path sent over its rail x row
  bytes), next to what a flat all-to-all that sends each token once per destination rank puts
  between nodes (:func:`deepep_cupy.reference.internode.traffic`); the measured row count must
  equal the reference's count of (token, other destination node) pairs, or the run FAILs;
* the time (CUDA events on the caller's stream around each synchronous call: the host waits
  inside a call, for the per-node counts and the transport, are part of it);
* the NCCL baseline: an all-to-all-v of the same routing, flat (every token to every rank that
  owns one of its experts, own rank included), through ``torch.distributed.all_to_all_single`` or
  ``cupy.cuda.nccl`` (:mod:`deepep_cupy.bench.nccl`), on the flat all-to-all's bytes.

Rows counted are payload rows (``hidden * 2`` bytes); the rail moves records of a row plus its
top-k ids and weights (fresh dispatch) or a row plus its weights (combine), padded to 16 bytes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Sequence

import numpy as np

from ..errors import NcclUnavailable
from .library import use_local_gpu
from .nccl import make_nccl_backend
from .timing import make_l2_flush, time_op
from .workload import build_send_index, make_workload, token_rank_mask

OPS = ("dispatch", "cached dispatch", "combine")


def traffic_rows(topk_idxs: Sequence[np.ndarray], num_experts: int, ranks_per_node: int) -> Dict[str, List[int]]:
    """Per rank: rows to other nodes, hierarchical (``hierarchical``) and flat (``flat``), and the
    rows of a flat all-to-all to every other rank (``flat_all_ranks``)."""
    from ..reference import internode as iref

    t = iref.traffic(topk_idxs, num_experts, len(topk_idxs), ranks_per_node)
    return {"hierarchical": t["per_rank_hierarchical"], "flat": t["per_rank_flat"],
            "flat_all_ranks": t["per_rank_flat_all_ranks"]}


def format_internode_report(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    """The table rank 0 prints: one line per rank, then the totals and the ratio."""
    row_bytes = args.hidden * 2
    lines = [f"internode: {len(rows)} ranks, {len(rows) // args.ranks_per_node} nodes x {args.ranks_per_node}, "
             f"{args.num_tokens} tokens x hidden {args.hidden} (BF16), top-{args.num_topk} of {args.num_experts} "
             f"experts, transport {rows[0]['transport']}",
             f"{'rank':>4} {'to other nodes MB':>18} {'flat a2a MB':>12} {'ratio':>6} "
             + " ".join(f"{op + ' us':>18}" for op in OPS) + f" {'NCCL a2a us':>12} {'NCCL MB':>8}  check"]
    for r in rows:
        hier, flat = r["internode_rows"] * row_bytes / 1e6, r["flat_rows"] * row_bytes / 1e6
        ratio = hier / flat if flat else float("nan")
        nccl = r.get("nccl_us")
        lines.append(f"{r['rank']:>4} {hier:>18.2f} {flat:>12.2f} {ratio:>6.3f} "
                     + " ".join(f"{r['times_us'][op]:>18.1f}" for op in OPS)
                     + f" {nccl if nccl is not None else float('nan'):>12.1f} {r['nccl_rows'] * row_bytes / 1e6:>8.2f}"
                     + f"  {'PASS' if r['ok'] else 'FAIL: ' + r['why']}")
    hier = sum(r["internode_rows"] for r in rows)
    flat = sum(r["flat_rows"] for r in rows)
    lines.append(f"total rows to other nodes: {hier} hierarchical, {flat} flat all-to-all "
                 f"(ratio {hier / flat if flat else float('nan'):.3f})")
    if rows[0].get("nccl_skipped"):
        lines.append(f"NCCL baseline skipped: {rows[0]['nccl_skipped']}")
    return "\n".join(lines)


def run_internode(args: argparse.Namespace) -> int:
    """The internode benchmark under mpirun (see the module docstring); returns the exit status."""
    import cupy
    from mpi4py import MPI

    import deepep_cupy as ep
    from deepep_cupy.groups.group import MPIGroup
    from deepep_cupy.reference import intranode as reference

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    L = args.ranks_per_node
    if size % L or size // L < 2:
        raise SystemExit(f"--ranks-per-node {L}: the {size} ranks must make at least 2 nodes of {L}")
    if args.num_experts % size:
        raise SystemExit(f"--num-experts {args.num_experts} must be a multiple of the rank count {size}")
    dev = use_local_gpu(world)
    group = MPIGroup(world)
    E, N = args.num_experts, size // L
    stream = cupy.cuda.Stream(non_blocking=True)
    result: Dict[str, Any] = {"rank": rank}
    with stream:
        hidden_bytes = args.hidden * 2
        nvl = ep.get_nvl_buffer_size_hint(hidden_bytes, max(L, 2), num_topk=args.num_topk,
                                          num_max_tokens_per_rank=args.num_tokens * N)
        rdma = ep.Config().get_rdma_buffer_size_hint(hidden_bytes, size, num_topk=args.num_topk,
                                                    num_max_tokens_per_rank=args.num_tokens)
        buf = ep.Buffer(world, nvl, rdma, ranks_per_node=L, internode_transport=args.transport,
                        timeout_s=args.timeout)
        try:
            w = make_workload(reference, args, rank, args.num_tokens, with_fp8=False)
            x, topk, weights = (cupy.asarray(w[k]) for k in ("x", "topk_idx", "topk_weights"))
            per_rank, per_node, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)

            def fresh():
                return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node,
                                    is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk,
                                    topk_weights=weights)

            recv_x, _, recv_weights, _, handle, _ = fresh()
            sent = buf.last_internode_rows
            rows = traffic_rows(group.allgather(w["topk_idx"]), E, L)
            result.update(transport=buf.internode_transport, internode_rows=sent,
                          flat_rows=rows["flat"][rank], nccl_rows=rows["flat_all_ranks"][rank],
                          ok=sent == rows["hierarchical"][rank],
                          why=f"{sent} rows to other nodes, the reference counts {rows['hierarchical'][rank]}")
            calls = {"dispatch": fresh, "cached dispatch": lambda: buf.dispatch(x, handle=handle),
                     "combine": lambda: buf.combine(recv_x, handle, topk_weights=recv_weights)}
            flush = make_l2_flush(args.flush_l2)
            result["times_us"] = {}
            for op in OPS:
                world.Barrier()
                times = time_op(calls[op], args.warmup, args.iters, stream, flush)
                result["times_us"][op] = float(np.mean(times)) * 1e6
        finally:
            buf.destroy()
        result.update(_nccl_baseline(args, group, rank, dev, size, x, w["topk_idx"], E))
    everyone = group.allgather(result)
    if rank == 0:
        print(format_internode_report(everyone, args), flush=True)
    return 0 if all(r["ok"] for r in everyone) else 1


def _nccl_baseline(args, group, rank: int, dev: int, size: int, x, topk: np.ndarray, E: int) -> Dict[str, Any]:
    """The flat all-to-all of the same routing through NCCL: its mean time in us (or why not)."""
    import cupy

    try:
        backend = make_nccl_backend(args.nccl, "mpi", [rank], [dev], size, group)
    except NcclUnavailable as exc:
        return {"nccl_us": None, "nccl_skipped": str(exc)}
    try:
        send_counts, perm = build_send_index(token_rank_mask(topk, E, size))
        send_counts = [int(c) for c in send_counts]
        recv_counts = [row[rank] for row in group.allgather(send_counts)]
        send = x[cupy.asarray(perm)]
        recv = cupy.empty((sum(recv_counts), x.shape[1]), x.dtype)
        times = time_op(lambda: backend.all_to_all_v([send], [send_counts], [recv], [recv_counts]), args.warmup,
                        args.iters, backend.streams[0], make_l2_flush(args.flush_l2))
        return {"nccl_us": float(np.mean(times)) * 1e6, "nccl_skipped": None}
    except Exception as exc:  # a baseline that cannot run is reported, not fatal
        print(f"[rank {rank}] NCCL baseline failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return {"nccl_us": None, "nccl_skipped": f"{type(exc).__name__}: {exc}"}
    finally:
        backend.close()
