"""Benchmark of deepep_cupy's intranode dispatch / combine, with NCCL and copy-kernel baselines.

Run it in one process that drives every local GPU (one rank per GPU, one thread per rank)::

    python -m deepep_cupy.bench                       # all local GPUs, reference workload
    python -m deepep_cupy.bench --num-ranks 2 --json out.json --plot out.png

or under MPI, one process per GPU (the device is the node-local rank)::

    mpirun -np 2 python -m deepep_cupy.bench

What it does, in order:

1. **Correctness.** Every rank builds its workload (``--num-tokens`` tokens of ``--hidden`` BF16
   values, FP8 e4m3 copies with float32 scales, ``--num-topk`` of ``--num-experts`` experts per
   token), runs layout, dispatch (BF16, FP8, cached BF16) and combine once, and compares its own
   outputs bit-exactly with :mod:`deepep_cupy.reference` run on the allgathered inputs.
   PASS/FAIL is printed per op; any FAIL makes the exit status 1.
2. **Timing.** Each op runs ``--warmup`` times, then ``--iters`` times between CUDA events recorded
   on the caller's current stream (the library makes that stream wait for its own, sync mode).
   The L2 cache is flushed (256 MB memset) before each timed call unless ``--no-flush-l2``.
   All ranks barrier before each op. Reported: time mean = max over ranks of each rank's mean,
   time min = max over ranks of each rank's minimum; GB/s = rank's bytes / rank's mean time,
   shown as the minimum over ranks and the mean over ranks.
3. **Accounting** (DeepEP's): dispatch bytes = tokens received by the rank (its own included)
   x hidden x 2 for BF16, x hidden x 2 x (1 + 4/128) / 2 for FP8 (one byte per value plus one
   float32 scale per 128 values); combine moves the same bytes back as the BF16 dispatch.
   "xGPU" columns count only tokens received from other ranks.
4. **Baselines.** (a) NCCL all-to-all on the same routing (torch.distributed under mpirun when
   torch imports, else ``cupy.cuda.nccl``), timed in steps: index build (send counts and the
   permutation into rank order from ``is_token_in_rank``), count exchange, permute (gather the
   rows into send order), transfer (the all-to-all-v only) and the transfer back (combine
   direction, no reduction). (b) A 16-byte-vector copy kernel over NVLink peer access from GPU 0
   to GPU 1 (and both directions at once) at ``--num-sms`` SMs and at all SMs, and a copy-engine
   ``cudaMemcpyPeerAsync``: the hardware ceiling.
5. Optional: ``--tokens-sweep``/``--plot`` (GB/s vs tokens per rank), ``--tune`` (grid over SMs
   and chunk sizes), ``--json`` (every figure and the settings), ``--save-config``.

Config file written by ``--save-config`` (read by the library through ``DEEPEP_CUPY_CONFIG``)::

    {
      "num_ranks": 2,                      # the rank count the configs were tuned for
      "device": "NVIDIA H200",             # informational
      "dispatch": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                   "num_max_nvl_chunked_recv_tokens": 256},
      "combine":  {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 4,
                   "num_max_nvl_chunked_recv_tokens": 256},
      "measured": {...}                    # informational: workload and the best times / GB/s
    }

Only ``num_ranks``, ``dispatch`` and ``combine`` are required; the three keys of each config are the
arguments of :class:`deepep_cupy.Config`. Any other key is informational.

Nothing here touches a GPU, CuPy, MPI or NCCL at import time: the module imports on a CPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .comm import _sm_count

# ----------------------------------------------------------------------------------------------
# Constants
# ----------------------------------------------------------------------------------------------

#: FP8 bytes per value relative to BF16: one byte per value plus a float32 scale per 128 values.
FP8_FACTOR = (1.0 + 4.0 / 128.0) / 2.0

DEFAULT_TOKENS_SWEEP = (512, 1024, 2048, 4096, 8192)
DEFAULT_TUNE_SMS = (8, 16, 24, 32, 48)
DEFAULT_TUNE_SEND = (4, 6, 8, 12, 16, 24, 32)
DEFAULT_TUNE_RECV = (128, 256, 512)

#: Bytes zeroed before every timed call so that no call finds its inputs in L2.
L2_FLUSH_BYTES = 256 * 1024 * 1024

#: Header words stamped into every row of the NCCL baseline's payload (source rank, token index).
NCCL_HEADER_WORDS = 3

CONFIG_KEYS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens")

# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> List[int]:
    """Parse ``"8,16,24"`` (spaces allowed) into ``[8, 16, 24]``."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m deepep_cupy.bench``."""
    p = argparse.ArgumentParser(
        prog="python -m deepep_cupy.bench",
        description="Benchmark deepep_cupy dispatch/combine against NCCL all-to-all and a copy kernel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("launch")
    g.add_argument("--num-ranks", type=int, default=None,
                   help="in-process mode: ranks to run (default: number of visible GPUs); "
                        "under mpirun it must equal the MPI world size")
    g.add_argument("--launcher", choices=("auto", "local", "mpi"), default="auto",
                   help="auto: mpi when started by mpirun/mpiexec, else one process for all GPUs")
    g = p.add_argument_group("workload")
    g.add_argument("--num-tokens", type=int, default=4096, help="tokens per rank")
    g.add_argument("--hidden", type=int, default=7168)
    g.add_argument("--num-topk", type=int, default=8)
    g.add_argument("--num-experts", type=int, default=256)
    g.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    g.add_argument("--skew", type=float, default=1.0, help="skew of --routing skewed")
    g.add_argument("--dtype", choices=("bf16", "fp8", "both"), default="both",
                   help="dispatch data types to time (combine is always BF16)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("library config")
    g.add_argument("--num-sms", type=int, default=24)
    g.add_argument("--send-chunk", type=int, default=None,
                   help="num_max_nvl_chunked_send_tokens (default: the recommended config)")
    g.add_argument("--recv-chunk", type=int, default=None,
                   help="num_max_nvl_chunked_recv_tokens (default: the recommended config)")
    g.add_argument("--timeout", type=float, default=100.0, help="Buffer timeout_s")
    g.add_argument("--no-allocate-ahead", dest="allocate_ahead", action="store_false",
                   help="Buffer(allocate_ahead=False): the host waits for the receive counts before "
                        "it launches a fresh dispatch")
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--iters", type=int, default=100)
    g.add_argument("--no-flush-l2", dest="flush_l2", action="store_false",
                   help="do not zero 256 MB before each timed call")
    g.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    g = p.add_argument_group("baselines")
    g.add_argument("--nccl", choices=("auto", "torch", "cupy", "none"), default="auto",
                   help="NCCL baseline backend: auto = torch.distributed under mpirun if torch imports, "
                        "else cupy.cuda.nccl; none = skip")
    g.add_argument("--no-copy", dest="copy", action="store_false", help="skip the copy-kernel ceiling")
    g.add_argument("--copy-mib", type=int, default=1024, help="bytes copied by the copy kernel, MiB")
    g.add_argument("--copy-iters", type=int, default=10)
    g = p.add_argument_group("sweeps and output")
    g.add_argument("--tokens-sweep", type=_int_list, default=None,
                   help="tokens per rank for the GB/s-vs-tokens sweep "
                        f"(default with --plot: {','.join(map(str, DEFAULT_TOKENS_SWEEP))})")
    g.add_argument("--sweep-iters", type=int, default=30, help="timed iterations per sweep point")
    g.add_argument("--tune", action="store_true", help="grid search over SMs and chunk sizes")
    g.add_argument("--tune-sms", type=_int_list, default=list(DEFAULT_TUNE_SMS))
    g.add_argument("--tune-send", type=_int_list, default=list(DEFAULT_TUNE_SEND))
    g.add_argument("--tune-recv", type=_int_list, default=list(DEFAULT_TUNE_RECV))
    g.add_argument("--tune-warmup", type=int, default=5)
    g.add_argument("--tune-iters", type=int, default=20)
    g.add_argument("--save-config", metavar="PATH", default=None,
                   help="write the best --tune configs as JSON (see the module docstring)")
    g.add_argument("--json", metavar="PATH", default=None, help="write every figure and the settings")
    g.add_argument("--plot", metavar="PATH", default=None, help="PNG of GB/s vs tokens per rank")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line (``argv`` without the program name)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("num_tokens", "hidden", "num_topk", "num_experts", "num_sms", "iters", "copy_mib",
                 "copy_iters", "sweep_iters", "tune_iters"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("warmup", "tune_warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.num_ranks is not None and args.num_ranks < 1:
        parser.error("--num-ranks must be positive")
    if args.hidden % 128:
        parser.error("--hidden must be a multiple of 128 (FP8 scales cover 128 values)")
    if args.num_topk > args.num_experts:
        parser.error("--num-topk must not exceed --num-experts")
    if args.save_config and not args.tune:
        parser.error("--save-config needs --tune")
    if args.plot and args.tokens_sweep is None:
        args.tokens_sweep = list(DEFAULT_TOKENS_SWEEP)
    return args


def detect_launcher(args: argparse.Namespace, environ: Optional[Dict[str, str]] = None) -> str:
    """``"mpi"`` when started by mpirun/mpiexec with more than one process, else ``"local"``."""
    if args.launcher != "auto":
        return args.launcher
    env = os.environ if environ is None else environ
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        try:
            if int(env.get(var, "0")) > 1:
                return "mpi"
        except ValueError:
            pass
    mpi = sys.modules.get("mpi4py.MPI")  # only if someone already initialised MPI
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        return "mpi"
    return "local"


# ----------------------------------------------------------------------------------------------
# Accounting
# ----------------------------------------------------------------------------------------------


def dispatch_bytes(num_recv_tokens: int, hidden: int, dtype: str) -> float:
    """DeepEP's byte count for ``num_recv_tokens`` received rows of ``hidden`` values.

    Args:
        num_recv_tokens: tokens received by the rank.
        hidden: values per token.
        dtype: ``"bf16"`` (2 bytes a value) or ``"fp8"`` (1 byte a value + a float32 per 128).
    Returns:
        Bytes, as a float.
    """
    if dtype == "bf16":
        factor = 1.0
    elif dtype == "fp8":
        factor = FP8_FACTOR
    else:
        raise ValueError(f"dtype: expected 'bf16' or 'fp8', got {dtype!r}")
    return float(num_recv_tokens) * hidden * 2 * factor


def gbps(nbytes: float, seconds: float) -> float:
    """Bytes per second in GB/s (1e9); NaN when ``seconds`` is not positive."""
    if not seconds > 0:
        return float("nan")
    return nbytes / seconds / 1e9


def recv_token_counts(rank_prefix_matrix: Any, rank: int) -> Tuple[int, int]:
    """Tokens ``rank`` receives in total and from other ranks only.

    Args:
        rank_prefix_matrix: ``[R, R]`` int, ``[i, j]`` = tokens ranks ``0..i`` send to rank ``j``.
        rank: the receiving rank.
    Returns:
        ``(total, from_other_ranks)``.
    """
    col = np.asarray(rank_prefix_matrix)[:, rank].astype(np.int64)
    total = int(col[-1])
    own = int(col[rank] - (col[rank - 1] if rank > 0 else 0))
    return total, total - own


def cross_gpu_bytes(rank_prefix_matrix: Any, rank: int, hidden: int, dtype: str) -> float:
    """:func:`dispatch_bytes` of the tokens ``rank`` receives from other ranks only."""
    return dispatch_bytes(recv_token_counts(rank_prefix_matrix, rank)[1], hidden, dtype)


# ----------------------------------------------------------------------------------------------
# Routing helpers (NumPy or CuPy: the array's own module is used)
# ----------------------------------------------------------------------------------------------


def _xp(array: Any):
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def token_rank_mask(topk_idx: Any, num_experts: int, num_ranks: int) -> Any:
    """``is_token_in_rank [N, R] bool``: token ``t`` has at least one expert on rank ``r``.

    Args:
        topk_idx: ``[N, K]`` int, expert ids, ``-1`` = none.
    """
    xp = _xp(topk_idx)
    per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    dest = xp.where(valid, topk_idx // per_rank, num_ranks)  # num_ranks = "nowhere"
    mask = xp.zeros((topk_idx.shape[0], num_ranks + 1), dtype=bool)
    rows = xp.broadcast_to(xp.arange(topk_idx.shape[0])[:, None], topk_idx.shape)
    mask[rows.ravel(), dest.ravel().astype(xp.int64)] = True
    return mask[:, :num_ranks]


def build_send_index(is_token_in_rank: Any) -> Tuple[Any, Any]:
    """The NCCL baseline's index build: send counts and the permutation into rank order.

    Args:
        is_token_in_rank: ``[N, R]`` bool (NumPy or CuPy).
    Returns:
        ``(send_counts, perm)``: ``send_counts [R] int64`` = tokens for each destination;
        ``perm [sum(send_counts)] int64`` = source token of each send row, grouped by destination
        rank (0 first), token index ascending inside a destination; the rows for rank ``r`` are
        ``perm[cumsum[r-1]:cumsum[r]]``.
    """
    xp = _xp(is_token_in_rank)
    num_tokens = is_token_in_rank.shape[0]
    by_rank = is_token_in_rank.T  # [R, N]: flat order is (rank, token)
    send_counts = by_rank.sum(axis=1).astype(xp.int64)
    flat = xp.flatnonzero(by_rank)
    perm = (flat % max(num_tokens, 1)).astype(xp.int64)
    return send_counts, perm


def expected_recv_sources(masks: Sequence[np.ndarray], rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """Source rank and source token index of each row ``rank`` receives, in receive order.

    Args:
        masks: per source rank, its ``is_token_in_rank [N_s, R]``.
    """
    src_rank, src_tok = [], []
    for s, mask in enumerate(masks):
        toks = np.flatnonzero(np.asarray(mask)[:, rank])
        src_rank.append(np.full(toks.shape, s, dtype=np.int64))
        src_tok.append(toks.astype(np.int64))
    return np.concatenate(src_rank), np.concatenate(src_tok)


# ----------------------------------------------------------------------------------------------
# Statistics and tables
# ----------------------------------------------------------------------------------------------


def op_stats(times: Sequence[float], nbytes: Optional[float] = None,
             cross_bytes: Optional[float] = None) -> Dict[str, Any]:
    """One rank's figures for one op: ``times`` in seconds, bytes it received (or ``None``)."""
    times = [float(t) for t in times]
    return {"times_us": [t * 1e6 for t in times],
            "mean_us": float(np.mean(times)) * 1e6 if times else float("nan"),
            "min_us": float(np.min(times)) * 1e6 if times else float("nan"),
            "bytes": None if nbytes is None else float(nbytes),
            "cross_bytes": None if cross_bytes is None else float(cross_bytes)}


def summarize_op(name: str, per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Combine the ranks' :func:`op_stats` of one op into a table row.

    Time mean/min: the max over ranks of each rank's mean/min (a collective is as slow as its
    slowest rank). GB/s: each rank's bytes over its mean time; ``gbps`` is the minimum over ranks,
    ``gbps_avg`` the mean; ``xgpu_*`` the same for the bytes received from other ranks.
    """
    row: Dict[str, Any] = {"op": name,
                           "time_mean_us": max(r["mean_us"] for r in per_rank),
                           "time_min_us": max(r["min_us"] for r in per_rank)}
    for key, out in (("bytes", "gbps"), ("cross_bytes", "xgpu_gbps")):
        if all(r.get(key) is not None for r in per_rank):
            rates = [gbps(r[key], r["mean_us"] * 1e-6) for r in per_rank]
            row[out], row[out + "_avg"] = min(rates), float(np.mean(rates))
        else:
            row[out] = row[out + "_avg"] = None
    row["per_rank"] = [dict(r) for r in per_rank]
    return row


OP_COLUMNS = (("op", "op", "{}"), ("time_mean_us", "mean us", "{:.1f}"), ("time_min_us", "min us", "{:.1f}"),
              ("gbps", "GB/s", "{:.1f}"), ("gbps_avg", "GB/s avg", "{:.1f}"),
              ("xgpu_gbps", "xGPU GB/s", "{:.1f}"), ("xgpu_gbps_avg", "xGPU avg", "{:.1f}"))


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(rows: Sequence[Dict[str, Any]], columns: Sequence[Tuple[str, str, str]] = OP_COLUMNS,
                 title: Optional[str] = None) -> str:
    """Rows (dicts) as an aligned text table; ``columns`` = (key, header, format) triples."""
    cells = [[h for _, h, _ in columns]]
    cells += [[_cell(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    if title:
        lines.append(title)
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_settings(s: Dict[str, Any]) -> str:
    """The one-line workload/config summary printed above the tables."""
    d, c = s.get("dispatch_config") or {}, s.get("combine_config") or {}
    return (f"ranks={s.get('num_ranks')} ({s.get('mode')}) tokens/rank={s.get('num_tokens')} "
            f"hidden={s.get('hidden')} topk={s.get('num_topk')} experts={s.get('num_experts')} "
            f"routing={s.get('routing')}{'' if s.get('routing') == 'uniform' else '(skew=%s)' % s.get('skew')} "
            f"num_sms={d.get('num_sms')} dispatch chunks={d.get('num_max_nvl_chunked_send_tokens')}/"
            f"{d.get('num_max_nvl_chunked_recv_tokens')} combine chunks={c.get('num_max_nvl_chunked_send_tokens')}/"
            f"{c.get('num_max_nvl_chunked_recv_tokens')} "
            f"allocate_ahead={s.get('allocate_ahead', True)} device={s.get('device_name')}")


# ----------------------------------------------------------------------------------------------
# JSON, configs
# ----------------------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    """Convert NumPy scalars/arrays, tuples and non-finite floats into plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def results_to_json(settings: Dict[str, Any], checks: Optional[Dict[str, Any]] = None,
                    ops: Sequence[Dict[str, Any]] = (), nccl: Optional[Dict[str, Any]] = None,
                    copy: Optional[Dict[str, Any]] = None, sweep: Optional[Dict[str, Any]] = None,
                    tune: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every figure and the settings as one JSON-ready dict (NaN becomes ``null``)."""
    return _jsonable({"format": "deepep_cupy.bench/1", "settings": settings, "checks": checks or {},
                      "ops": list(ops), "nccl": nccl, "copy": copy, "sweep": sweep, "tune": tune})


def write_json(path: str, doc: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def config_to_dict(config: Any) -> Dict[str, int]:
    """A ``deepep_cupy.Config`` (or a dict with its keys) as ``{num_sms, ..send_tokens, ..recv_tokens}``."""
    if isinstance(config, dict):
        return {k: int(config[k]) for k in CONFIG_KEYS}
    return {k: int(getattr(config, k)) for k in CONFIG_KEYS}


def config_document(num_ranks: int, dispatch: Any, combine: Any, device: Optional[str] = None,
                    measured: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``--save-config`` document (format in the module docstring)."""
    doc = {"num_ranks": int(num_ranks), "device": device,
           "dispatch": config_to_dict(dispatch), "combine": config_to_dict(combine)}
    if measured:
        doc["measured"] = _jsonable(measured)
    return doc


def save_config(path: str, num_ranks: int, dispatch: Any, combine: Any, device: Optional[str] = None,
                measured: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write :func:`config_document` to ``path``; returns the document."""
    doc = config_document(num_ranks, dispatch, combine, device, measured)
    write_json(path, doc)
    return doc


def load_config(path: str) -> Dict[str, Any]:
    """Read and validate a ``--save-config`` file: ``{"num_ranks", "dispatch", "combine", ...}``."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc.get("num_ranks"), int):
        raise ValueError(f"{path}: 'num_ranks' must be an integer")
    for op in ("dispatch", "combine"):
        missing = [k for k in CONFIG_KEYS if not isinstance((doc.get(op) or {}).get(k), int)]
        if missing:
            raise ValueError(f"{path}: '{op}' lacks integer {missing}")
    return doc


def tune_grid(sms: Sequence[int], send: Sequence[int], recv: Sequence[int]) -> List[Tuple[int, int, int]]:
    """The ``(num_sms, send_chunk, recv_chunk)`` triples of ``--tune``: even SM counts, send < recv."""
    return [(s, a, b) for s in sms if s % 2 == 0 for a in send for b in recv if a < b]


def best_configs(entries: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per op (``"dispatch"``/``"combine"``), the tuning entry with the lowest ``time_us``."""
    best: Dict[str, Dict[str, Any]] = {}
    for e in entries:
        t = e.get("time_us")
        if t is None or not math.isfinite(t):
            continue
        if e["op"] not in best or t < best[e["op"]]["time_us"]:
            best[e["op"]] = e
    return best


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


def _ref_key(d: Dict[str, Any], *names: str) -> Any:
    for n in names:
        if n in d:
            return d[n]
    raise KeyError(f"reference result lacks {names[0]!r} (has {sorted(d)})")


# ----------------------------------------------------------------------------------------------
# GPU-side helpers (all imports of cupy / the library happen inside functions)
# ----------------------------------------------------------------------------------------------


def _import_library():
    try:
        import deepep_cupy as ep
        from deepep_cupy import reference
    except Exception as exc:  # pragma: no cover - depends on the rest of the package
        raise SystemExit(f"deepep_cupy.bench: cannot import the library ({type(exc).__name__}: {exc})")
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


def tune_configs(ep: Any, num_ranks: int, args: argparse.Namespace) -> List[Any]:
    if not args.tune:
        return []
    return [ep.Config(*t) for t in tune_grid(args.tune_sms, args.tune_send, args.tune_recv)]


def nvl_buffer_bytes(ep: Any, args: argparse.Namespace, num_ranks: int, configs: Sequence[Any]) -> int:
    """The largest ``get_nvl_buffer_size_hint`` over every config this run uses (BF16 rows are the widest)."""
    return max(int(ep.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks, c, num_topk=args.num_topk))
               for c in configs)


def make_workload(reference: Any, args: argparse.Namespace, rank: int, num_tokens: int,
                  with_data: bool = True, with_fp8: bool = True) -> Dict[str, np.ndarray]:
    """One rank's host workload; each part has its own random stream so routing never depends on data."""
    skew = args.skew if args.routing == "skewed" else 0.0
    out = {"topk_idx": reference.random_routing(np.random.default_rng([args.seed, rank, num_tokens, 0]),
                                                num_tokens, args.num_experts, args.num_topk, skew=skew)}
    rng = np.random.default_rng([args.seed, rank, num_tokens, 1])
    out["topk_weights"] = rng.uniform(0.1, 1.0, (num_tokens, args.num_topk)).astype(np.float32)
    if with_data:
        rng = np.random.default_rng([args.seed, rank, num_tokens, 2])
        out["x"] = reference.float32_to_bfloat16_bits(
            rng.standard_normal((num_tokens, args.hidden), dtype=np.float32))
    if with_data and with_fp8:
        x_fp8, scales = reference.fp8_e4m3_scaled_random(
            np.random.default_rng([args.seed, rank, num_tokens, 3]), num_tokens, args.hidden)
        out["x_fp8"], out["x_scales"] = np.asarray(x_fp8), np.asarray(scales, dtype=np.float32)
    return out


def make_l2_flush(enabled: bool) -> Optional[Callable[[], None]]:
    """A callable that zeroes 256 MB on the current stream of the current device (or ``None``)."""
    if not enabled:
        return None
    import cupy
    scratch = cupy.empty(L2_FLUSH_BYTES, dtype=cupy.uint8)
    return lambda: scratch.data.memset_async(0, L2_FLUSH_BYTES)


def time_ops_multi(fn: Callable[[], Any], warmup: int, iters: int, streams: Sequence[Any],
                   devices: Sequence[int], flushes: Optional[Sequence[Optional[Callable]]] = None
                   ) -> List[List[float]]:
    """Time ``fn`` between events recorded on several devices' streams (one thread drives them all).

    Returns:
        Per stream, ``iters`` elapsed times in seconds.
    """
    import cupy
    for _ in range(warmup):
        fn()
    events = []
    for dev in devices:
        with cupy.cuda.Device(dev):
            events.append([(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)])
    for i in range(iters):
        for k, (dev, stream) in enumerate(zip(devices, streams)):
            with cupy.cuda.Device(dev):
                if flushes and flushes[k]:
                    with stream:
                        flushes[k]()
                events[k][i][0].record(stream)
        fn()
        for k, (dev, stream) in enumerate(zip(devices, streams)):
            with cupy.cuda.Device(dev):
                events[k][i][1].record(stream)
    out = []
    for k, dev in enumerate(devices):
        with cupy.cuda.Device(dev):
            events[k][-1][1].synchronize()
            out.append([cupy.cuda.get_elapsed_time(s, e) * 1e-3 for s, e in events[k]])
    return out


def time_op(fn: Callable[[], Any], warmup: int, iters: int, stream: Any,
            flush: Optional[Callable[[], None]] = None) -> List[float]:
    """Call ``fn`` ``warmup`` times, then ``iters`` times between CUDA events on ``stream``.

    ``stream`` must be the stream ``fn``'s work is ordered on (the caller's current stream for the
    library in sync mode) and belong to the current device. ``flush`` runs before each start event.

    Returns:
        ``iters`` elapsed times in seconds.
    """
    import cupy
    return time_ops_multi(fn, warmup, iters, [stream], [cupy.cuda.Device().id], [flush])[0]


class _Progress:
    """A progress counter on stderr (tqdm when importable); silent when ``enabled`` is false."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.n, self._bar = total, desc, enabled, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
            except Exception:
                self._bar = None

    def update(self, note: str = "") -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        else:
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} {note:<40}")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


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
                                       topk_weights=[_ref_key(r, "recv_topk_weights") for r in bf16])
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
        compare_exact("recv_topk_idx", d["recv_topk_idx"], _ref_key(r, "recv_topk_idx")),
        compare_exact("recv_topk_weights", d["recv_topk_weights"], _ref_key(r, "recv_topk_weights")),
        compare_exact("recv_src_idx", d["recv_src_idx"], r["recv_src_idx"]),
        compare_exact("rank_prefix_matrix", d["rank_prefix_matrix"], r["rank_prefix_matrix"]),
        compare_exact("num_recv_tokens_per_expert_list", d["num_recv_tokens_per_expert_list"],
                      list(_ref_key(r, "num_recv_tokens_per_expert_list", "num_recv_tokens_per_expert")))]
    if gpu.get("fp8") is not None:
        f, rf = gpu["fp8"], ref["fp8"][rank]
        checks["dispatch FP8"] = [
            compare_exact("recv_x (fp8 bytes)", f["recv_x"], rf["recv_x"]),
            compare_exact("recv_x_scales", f["recv_x_scales"], _ref_key(rf, "recv_x_scales", "recv_scales")),
            compare_exact("recv_topk_idx", f["recv_topk_idx"], _ref_key(rf, "recv_topk_idx")),
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
    tcfgs = tune_configs(ep, num_ranks, args)
    nvl_bytes = nvl_buffer_bytes(ep, args, num_ranks, [dcfg, ccfg] + tcfgs)
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
            num_channels = dcfg.num_sms // 2
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
        ops = [("layout", lambda: buf.get_dispatch_layout(topk_idx, E), None)]
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
            nb = None if dt is None else dispatch_bytes(total, H, dt)
            cb = None if dt is None else dispatch_bytes(cross, H, dt)
            result["ops"][name] = op_stats(times, nb, cb)
            if name.startswith("dispatch"):  # how the last timed fresh dispatch sized its outputs
                result.setdefault("dispatch_allocation", {})[name] = buf.last_dispatch_allocation
        del out_bf16, out_fp8, cached_x, combined_x

        # --- tokens sweep --------------------------------------------------------------------
        if args.tokens_sweep:
            result["sweep"] = _library_sweep(buf, group, args, reference, dcfg, ccfg, stream, flush)

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


# ----------------------------------------------------------------------------------------------
# NCCL baseline
# ----------------------------------------------------------------------------------------------


class NcclUnavailable(RuntimeError):
    """Raised with the reason the NCCL baseline cannot run."""


def _load_cupy_nccl():
    """``cupy.cuda.nccl`` with its library loaded; falls back to the libnccl of a pip NVIDIA/torch install."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    if getattr(nccl, "available", False) and hasattr(nccl, "NcclCommunicator"):
        return nccl
    import ctypes
    import glob
    import importlib
    candidates = [os.environ.get("DEEPEP_CUPY_NCCL_LIB", "")]
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*")))
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "lib", "libnccl.so*")))
        candidates += sorted(glob.glob(os.path.join(entry, "torch", "lib", "libnccl.so*")))
    errors = []
    for path in filter(None, candidates):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib = importlib.import_module("cupy_backends.cuda.libs.nccl")
            return lib
        except (OSError, ImportError) as exc:
            errors.append(f"{path}: {exc}")
    raise NcclUnavailable("cupy.cuda.nccl cannot load libnccl (set DEEPEP_CUPY_NCCL_LIB=/path/libnccl.so.2"
                          + (f"; tried {errors[:3]}" if errors else "") + ")")


class CupyNcclBackend:
    """All-to-all-v with ``cupy.cuda.nccl`` send/recv in one NCCL group call.

    ``local_ranks`` are the ranks this thread drives: all of them in-process (communicators from
    ``ncclCommInitAll``), only its own under mpirun (``ncclCommInitRank``, unique id shared by the
    group's allgather). The byte payloads are sent as ``NCCL_UINT8``.
    """

    name = "cupy.cuda.nccl"

    def __init__(self, local_ranks: Sequence[int], devices: Sequence[int], num_ranks: int, group: Any = None):
        import cupy
        self.nccl = _load_cupy_nccl()
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
            for i, rank in enumerate(self.local_ranks):
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
            raise NcclUnavailable(f"torch is not importable ({exc})")
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


GATHER_KERNEL_SRC = r"""
extern "C" __global__ void gather_rows_int4(unsigned long long src_addr, unsigned long long dst_addr,
                                            const long long* __restrict__ rows, long long num_rows,
                                            long long row_vecs) {
    // dst row r = src row rows[r]; one block per row at a time, 16-byte vectors.
    const int4* __restrict__ src = reinterpret_cast<const int4*>(src_addr);
    int4* __restrict__ dst = reinterpret_cast<int4*>(dst_addr);
    for (long long r = blockIdx.x; r < num_rows; r += gridDim.x) {
        const int4* s = src + rows[r] * row_vecs;
        int4* d = dst + r * row_vecs;
        for (long long i = threadIdx.x; i < row_vecs; i += blockDim.x) d[i] = s[i];
    }
}
"""

_RAW_KERNELS: Dict[str, Any] = {}


def _raw_kernel(source: str, name: str):
    import cupy
    if name not in _RAW_KERNELS:
        _RAW_KERNELS[name] = cupy.RawKernel(source, name)
    return _RAW_KERNELS[name]


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
        sms = _sm_count(cupy.cuda.Device().id)
        _raw_kernel(GATHER_KERNEL_SRC, "gather_rows_int4")(
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
    send_counts, recv_counts = [None] * L, [None] * L
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


# ----------------------------------------------------------------------------------------------
# Copy-kernel ceiling
# ----------------------------------------------------------------------------------------------

COPY_KERNEL_SRC = r"""
extern "C" __global__ void __launch_bounds__(1024)
copy_int4(unsigned long long src_addr, unsigned long long dst_addr, unsigned long long n_vec) {
    // Grid-stride copy of n_vec 16-byte vectors; four loads in flight per thread before the stores.
    const int4* __restrict__ src = reinterpret_cast<const int4*>(src_addr);
    int4* __restrict__ dst = reinterpret_cast<int4*>(dst_addr);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n_vec; i += 4 * stride) {
        int4 v0 = src[i], v1 = src[i + stride], v2 = src[i + 2 * stride], v3 = src[i + 3 * stride];
        dst[i] = v0; dst[i + stride] = v1; dst[i + 2 * stride] = v2; dst[i + 3 * stride] = v3;
    }
    for (; i < n_vec; i += stride) dst[i] = src[i];
}
"""


def _enable_peer(dev: int, peer: int) -> None:
    import cupy
    rt = cupy.cuda.runtime
    if not rt.deviceCanAccessPeer(dev, peer):
        raise RuntimeError(f"GPU {dev} cannot access GPU {peer} (no P2P)")
    with cupy.cuda.Device(dev):
        try:
            rt.deviceEnablePeerAccess(peer)
        except rt.CUDARuntimeError as exc:  # already enabled (e.g. by the library) is fine
            if "AlreadyEnabled" not in str(exc) and getattr(exc, "status", None) != 704:
                raise


def copy_ceiling(devices: Tuple[int, int], nbytes: int, sms_list: Sequence[int], iters: int,
                 warmup: int = 2) -> List[Dict[str, Any]]:
    """NVLink copy ceiling between two GPUs of this process.

    For each SM count: the kernel on GPU a writes a's buffer into b's memory (push, one direction),
    the kernel on b reads a's buffer (pull), and both GPUs push at once; plus
    ``cudaMemcpyPeerAsync`` (copy engine). Returns table rows (``op``, ``time_mean_us``, ``gbps``...).
    """
    import cupy
    a, b = devices
    _enable_peer(a, b)
    _enable_peer(b, a)
    n_vec = nbytes // 16
    nbytes = n_vec * 16
    bufs, kernels, streams, nsm = {}, {}, {}, {}
    for d in (a, b):
        with cupy.cuda.Device(d):
            bufs[d] = (cupy.ones(nbytes, dtype=cupy.uint8), cupy.zeros(nbytes, dtype=cupy.uint8))
            kernels[d] = _raw_kernel(COPY_KERNEL_SRC, "copy_int4")
            streams[d] = cupy.cuda.Stream(non_blocking=True)
            nsm[d] = _sm_count(d)
            cupy.cuda.Device(d).synchronize()  # the fills ran on the default stream

    def launcher(run_on, src, dst, blocks):
        def go():
            with cupy.cuda.Device(run_on):
                kernels[run_on]((blocks,), (1024,), (np.uint64(src.data.ptr), np.uint64(dst.data.ptr),
                                                     np.uint64(n_vec)), stream=streams[run_on])
        return go

    rows = []
    for sms in sms_list:
        label = f"{sms} SMs" if sms < max(nsm.values()) else f"all {sms} SMs"
        cases = [
            (f"push GPU{a}->GPU{b}, {label}", [a], [launcher(a, bufs[a][0], bufs[b][1], sms)]),
            (f"pull GPU{a}->GPU{b}, {label}", [b], [launcher(b, bufs[a][0], bufs[b][1], sms)]),
            (f"push both directions, {label}", [a, b],
             [launcher(a, bufs[a][0], bufs[b][1], sms), launcher(b, bufs[b][0], bufs[a][1], sms)]),
        ]
        for name, on, fns in cases:
            times = time_ops_multi(lambda: [f() for f in fns], warmup, iters, [streams[d] for d in on], on)
            means = [float(np.mean(t)) for t in times]
            rows.append({"op": name, "time_mean_us": max(means) * 1e6,
                         "time_min_us": max(float(np.min(t)) for t in times) * 1e6,
                         "gbps": min(gbps(nbytes, m) for m in means),  # per direction
                         "gbps_total": gbps(nbytes * len(on), max(means))})

    def ce():
        with cupy.cuda.Device(a):
            cupy.cuda.runtime.memcpyPeerAsync(bufs[b][1].data.ptr, b, bufs[a][0].data.ptr, a, nbytes,
                                              streams[a].ptr)
    times = time_ops_multi(ce, warmup, iters, [streams[a]], [a])[0]
    rows.append({"op": f"copy engine GPU{a}->GPU{b}", "time_mean_us": float(np.mean(times)) * 1e6,
                 "time_min_us": float(np.min(times)) * 1e6, "gbps": gbps(nbytes, float(np.mean(times))),
                 "gbps_total": gbps(nbytes, float(np.mean(times)))})
    bufs.clear()  # free the 2 x nbytes per GPU now
    return rows


COPY_COLUMNS = (("op", "copy ceiling", "{}"), ("time_mean_us", "mean us", "{:.1f}"),
                ("time_min_us", "min us", "{:.1f}"), ("gbps", "GB/s per direction", "{:.1f}"),
                ("gbps_total", "GB/s total", "{:.1f}"))


def run_copy_ceiling(args: argparse.Namespace, devices: Sequence[int]) -> Dict[str, Any]:
    """Copy ceiling between the first two distinct GPUs, or ``{"skipped": reason}``."""
    if not args.copy:
        return {"skipped": "disabled by --no-copy"}
    distinct = list(dict.fromkeys(devices))
    if len(distinct) < 2:
        return {"skipped": "needs two visible GPUs"}
    try:
        a, b = distinct[0], distinct[1]
        sm_all = _sm_count(a)
        sms = sorted({min(args.num_sms, sm_all), sm_all})
        rows = copy_ceiling((a, b), args.copy_mib * 1024 * 1024, sms, args.copy_iters)
        return {"skipped": None, "bytes": args.copy_mib * 1024 * 1024, "rows": rows}
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}


# ----------------------------------------------------------------------------------------------
# Aggregation across ranks, report, plot
# ----------------------------------------------------------------------------------------------


def aggregate(rank_results: Sequence[Dict[str, Any]], nccl_ranks: Optional[Sequence[Dict[str, Any]]],
              nccl_info: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """Turn the ranks' raw results into checks, op rows, NCCL rows, sweep series and tuning results."""
    out: Dict[str, Any] = {}
    checks: Dict[str, Any] = {}
    if args.check and rank_results and "checks" in rank_results[0]:
        for op in rank_results[0]["checks"]:
            msgs = [(r["rank"], ok, m) for r in rank_results for ok, m in r["checks"][op]]
            checks[op] = {"ok": all(ok for _, ok, _ in msgs),
                          "failures": [f"rank {rk}: {m}" for rk, ok, m in msgs if not ok]}
    if nccl_ranks and args.check and all("check" in r for r in nccl_ranks):
        checks["nccl all-to-all (baseline)"] = {
            "ok": all(r["check"][0] for r in nccl_ranks),
            "failures": [f"rank {k}: {r['check'][1]}" for k, r in enumerate(nccl_ranks) if not r["check"][0]]}
    out["checks"] = checks
    op_names = list(rank_results[0]["ops"])
    out["ops"] = [summarize_op(n, [r["ops"][n] for r in rank_results]) for n in op_names]
    nccl = {"backend": nccl_info.get("backend"), "skipped": nccl_info.get("skipped"), "ops": []}
    if nccl_ranks:
        nccl["ops"] = [summarize_op(n, [r[n] for r in nccl_ranks]) for n in nccl_ranks[0] if n != "check"]
    out["nccl"] = nccl
    sweep = None
    if args.tokens_sweep and "sweep" in rank_results[0]:
        sweep = {"tokens": [], "series": {"deepep_cupy dispatch BF16": [], "deepep_cupy combine BF16": [],
                                          "NCCL a2a transfer": [], "NCCL dispatch (all steps)": []}, "rows": []}
        nccl_sweep = {p["num_tokens"]: p["ranks"] for p in nccl_info.get("sweep", [])}
        for k, point in enumerate(rank_results[0]["sweep"]["points"]):
            n = point["num_tokens"]
            sweep["tokens"].append(n)
            for op, series in (("dispatch BF16", "deepep_cupy dispatch BF16"),
                               ("combine BF16", "deepep_cupy combine BF16")):
                row = summarize_op(f"{op} @ {n}", [r["sweep"]["points"][k][op] for r in rank_results])
                sweep["series"][series].append(row["gbps"])
                sweep["rows"].append(row)
            ranks = nccl_sweep.get(n)
            for op, series in (("nccl a2a dispatch", "NCCL a2a transfer"),
                               ("nccl dispatch (all steps)", "NCCL dispatch (all steps)")):
                if ranks:
                    row = summarize_op(f"{op} @ {n}", [ranks[r][op] for r in sorted(ranks)])
                    sweep["series"][series].append(row["gbps"])
                    sweep["rows"].append(row)
                else:
                    sweep["series"][series].append(None)
    out["sweep"] = sweep
    tune = None
    if args.tune and "tune" in rank_results[0]:
        entries = []
        for k, e in enumerate(rank_results[0]["tune"]):
            per = [r["tune"][k] for r in rank_results]
            entry = {key: e[key] for key in ("op",) + CONFIG_KEYS}
            if any("error" in p for p in per):
                entry["error"] = next(p["error"] for p in per if "error" in p)
                entry["time_us"] = None
            else:
                row = summarize_op(e["op"], per)
                entry.update(time_us=row["time_mean_us"], gbps=row["gbps"], xgpu_gbps=row["xgpu_gbps"])
            entries.append(entry)
        tune = {"entries": entries, "best": best_configs(entries)}
    out["tune"] = tune
    return out


TUNE_COLUMNS = (("op", "op", "{}"), ("num_sms", "SMs", "{}"), ("num_max_nvl_chunked_send_tokens", "send", "{}"),
                ("num_max_nvl_chunked_recv_tokens", "recv", "{}"), ("time_us", "mean us", "{:.1f}"),
                ("gbps", "GB/s", "{:.1f}"), ("xgpu_gbps", "xGPU GB/s", "{:.1f}"))


def render_report(doc: Dict[str, Any]) -> str:
    """The text report of a :func:`results_to_json` document."""
    s = doc["settings"]
    parts = [format_settings(s)]
    if doc.get("checks"):
        lines = ["correctness (bit-exact against deepep_cupy.reference):"]
        for op, c in doc["checks"].items():
            lines.append(f"  {op:<28} {'PASS' if c['ok'] else 'FAIL'}")
            lines += [f"      {m}" for m in c["failures"][:8]]
        parts.append("\n".join(lines))
    else:
        parts.append("correctness: not checked (--no-check)")
    parts.append(format_table(doc["ops"], title="deepep_cupy (time: max over ranks; GB/s: min over ranks, avg)"))
    nccl = doc.get("nccl") or {}
    if nccl.get("skipped"):
        parts.append(f"NCCL baseline skipped: {nccl['skipped']}")
    elif nccl.get("ops"):
        parts.append(format_table(nccl["ops"], title=f"NCCL baseline ({nccl.get('backend')}), same routing"))
    copy = doc.get("copy") or {}
    if copy.get("skipped"):
        parts.append(f"copy ceiling skipped: {copy['skipped']}")
    elif copy.get("rows"):
        parts.append(format_table(copy["rows"], COPY_COLUMNS,
                                  title=f"copy-kernel ceiling ({copy['bytes'] / 2**20:.0f} MiB, 16-byte vectors)"))
    sweep = doc.get("sweep")
    if sweep:
        parts.append(format_table(sweep["rows"], title="tokens sweep"))
    tune = doc.get("tune")
    if tune:
        for op in ("dispatch", "combine"):
            ok = sorted((e for e in tune["entries"] if e["op"] == op and e.get("time_us") is not None),
                        key=lambda e: e["time_us"])
            bad = sum(1 for e in tune["entries"] if e["op"] == op and e.get("time_us") is None)
            parts.append(format_table(ok[:5], TUNE_COLUMNS, title=f"tune {op}: best {min(5, len(ok))} of {len(ok)}"
                                      + (f" ({bad} configs rejected)" if bad else "")))
            best = tune.get("best", {}).get(op)
            if best:
                parts[-1] += (f"\nbest {op} config: Config(num_sms={best['num_sms']}, "
                              f"num_max_nvl_chunked_send_tokens={best['num_max_nvl_chunked_send_tokens']}, "
                              f"num_max_nvl_chunked_recv_tokens={best['num_max_nvl_chunked_recv_tokens']})")
    return "\n\n".join(parts)


def plot_sweep(path: str, sweep: Dict[str, Any], settings: Dict[str, Any]) -> Optional[str]:
    """PNG of GB/s vs tokens per rank. Returns ``None`` on success, else why it was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib is not importable ({exc})"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in sweep["series"].items():
        pts = [(t, v) for t, v in zip(sweep["tokens"], values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sweep["tokens"])
    ax.set_xticklabels([str(t) for t in sweep["tokens"]])
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("GB/s per rank (DeepEP accounting, min over ranks)")
    ax.set_title(f"{settings.get('num_ranks')} x {settings.get('device_name')}, hidden {settings.get('hidden')}, "
                 f"top-{settings.get('num_topk')} of {settings.get('num_experts')}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace, mode: str, num_ranks: int, devices: Sequence[int],
              first: Dict[str, Any]) -> Dict[str, Any]:
    import cupy
    s = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "save_config")}
    s.update(mode="in-process" if mode == "local" else "mpirun", num_ranks=num_ranks, devices=list(devices),
             device_name=first["device_name"], dispatch_config=first["dispatch_config"],
             combine_config=first["combine_config"], nvl_bytes=first["nvl_bytes"],
             recv_tokens_rank0=first.get("recv_tokens"), dispatch_allocation_rank0=first.get("dispatch_allocation"),
             cupy_version=cupy.__version__,
             python=sys.version.split()[0], nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
             time=time.strftime("%Y-%m-%d %H:%M:%S"))
    with contextlib.suppress(Exception):
        import deepep_cupy
        s["library_version"] = getattr(deepep_cupy, "__version__", None)
    return s


def _finish(args: argparse.Namespace, mode: str, num_ranks: int, devices: Sequence[int],
            rank_results: List[Dict[str, Any]], nccl_ranks: Optional[List[Dict[str, Any]]],
            nccl_info: Dict[str, Any], copy: Dict[str, Any]) -> int:
    """Rank 0: aggregate, print, write JSON / plot / config. Returns the exit status."""
    agg = aggregate(rank_results, nccl_ranks, nccl_info, args)
    settings = _settings(args, mode, num_ranks, devices, rank_results[0])
    doc = results_to_json(settings, agg["checks"], agg["ops"], agg["nccl"], copy, agg["sweep"], agg["tune"])
    print(render_report(doc), flush=True)
    if args.json:
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    if args.plot:
        if agg["sweep"]:
            why = plot_sweep(args.plot, doc["sweep"], settings)
            print(f"plot skipped: {why}" if why else f"wrote {args.plot}")
        else:
            print("plot skipped: no sweep results")
    if args.save_config:
        best = (agg["tune"] or {}).get("best", {})
        if "dispatch" in best and "combine" in best:
            measured = {"num_tokens": args.num_tokens, "hidden": args.hidden, "num_topk": args.num_topk,
                        "num_experts": args.num_experts, "routing": args.routing,
                        "dispatch_us": best["dispatch"]["time_us"], "dispatch_gbps": best["dispatch"]["gbps"],
                        "combine_us": best["combine"]["time_us"], "combine_gbps": best["combine"]["gbps"]}
            save_config(args.save_config, num_ranks, best["dispatch"], best["combine"],
                        settings["device_name"], measured)
            print(f"wrote {args.save_config}")
        else:
            print("config not saved: no valid tuning result for dispatch and combine")
    failed = [op for op, c in agg["checks"].items() if not c["ok"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}", flush=True)
        return 1
    return 0


def _main_local(args: argparse.Namespace) -> int:
    import cupy
    from deepep_cupy import comm as _comm
    run_local_group = getattr(_comm, "run_local_group", None)
    if run_local_group is None:
        raise SystemExit("deepep_cupy.bench: this deepep_cupy has no in-process mode "
                         "(deepep_cupy.comm.run_local_group is missing); run one process per GPU instead:\n"
                         "  mpirun -np 2 python -m deepep_cupy.bench")
    count = cupy.cuda.runtime.getDeviceCount()
    num_ranks = args.num_ranks or count
    if num_ranks < 2:
        raise SystemExit(f"deepep_cupy.bench: needs at least 2 ranks (found {count} GPU(s); use --num-ranks)")
    devices = [r % count for r in range(num_ranks)]
    if num_ranks > count:
        print(f"note: {num_ranks} ranks on {count} GPU(s): ranks share GPUs; figures are not NVLink figures",
              file=sys.stderr)
    rank_results = run_local_group(lambda group: bench_library_rank(group, args), num_ranks, devices=devices)
    nccl_info = run_nccl_baseline(args, "local", None, list(range(num_ranks)), devices, num_ranks)
    nccl_ranks = [nccl_info["main"][r] for r in range(num_ranks)] if nccl_info.get("main") else None
    copy = run_copy_ceiling(args, devices)
    return _finish(args, "local", num_ranks, devices, rank_results, nccl_ranks, nccl_info, copy)


def _main_mpi(args: argparse.Namespace) -> int:
    from mpi4py import MPI
    import cupy
    from deepep_cupy.comm import MPIGroup
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    try:
        if args.num_ranks is not None and args.num_ranks != size:
            raise SystemExit(f"deepep_cupy.bench: --num-ranks {args.num_ranks} != MPI world size {size}")
        local_rank = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        count = cupy.cuda.runtime.getDeviceCount()
        dev = local_rank % count
        cupy.cuda.Device(dev).use()
        group = MPIGroup(world)
        mine = bench_library_rank(group, args)
        rank_results = group.allgather(mine)
        devices = [r["device"] for r in rank_results]
        nccl_info = run_nccl_baseline(args, "mpi", group, [rank], [dev], size)
        main_parts = group.allgather((nccl_info.get("main") or {}).get(rank))
        sweep_parts = group.allgather(nccl_info.get("sweep") or [])
        nccl_ranks = main_parts if all(p is not None for p in main_parts) else None
        if nccl_ranks is not None and sweep_parts[0]:
            nccl_info["sweep"] = [{"num_tokens": pt["num_tokens"],
                                   "ranks": {r: sweep_parts[r][k]["ranks"][r] for r in range(size)}}
                                  for k, pt in enumerate(sweep_parts[0])]
        group.barrier()
        copy = {"skipped": "rank 0 only"}
        if rank == 0:  # the others wait at the barrier, their GPUs idle
            if count >= 2:
                copy = run_copy_ceiling(args, list(range(count)))
            else:
                copy = {"skipped": "rank 0 sees one GPU (CUDA_VISIBLE_DEVICES); run in-process for the copy ceiling"}
        group.barrier()
        code = _finish(args, "mpi", size, devices, rank_results, nccl_ranks, nccl_info, copy) if rank == 0 else 0
        return world.bcast(code, root=0)
    except SystemExit as exc:
        if size == 1 or exc.code in (0, None):
            raise
        print(f"[rank {rank}] {exc}", file=sys.stderr, flush=True)
        world.Abort(2)  # the other ranks may be waiting in a collective
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        world.Abort(1)
    return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m deepep_cupy.bench``; returns the exit status (1 when a check fails)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before anything can initialise NCCL
    args = parse_args(argv)
    mode = detect_launcher(args)
    if mode == "mpi":
        return _main_mpi(args)
    return _main_local(args)


if __name__ == "__main__":
    sys.exit(main())
