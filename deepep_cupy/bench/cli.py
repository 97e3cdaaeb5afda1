"""The command line of ``python -m deepep_cupy.bench`` and the launch: in one process for all
local GPUs, or one process per GPU under mpirun."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

from ..config import save_config, write_json
from ..constants import FP8_SCALE_BLOCK
from ..gpu.check import exit_unless_gpu
from .calls import DEFAULT_CALLS_TOKENS
from .ceiling import run_copy_ceiling
from .decode import DEFAULT_DECODE_TOKENS
from .library import bench_library_rank, use_local_gpu
from .nccl import run_nccl_baseline
from .report import aggregate, plot_calls, plot_sm_sweep, plot_sweep, render_report, results_to_json
from .timing import interpreter_us

DEFAULT_TOKENS_SWEEP = (512, 1024, 2048, 4096, 8192)
DEFAULT_TUNE_SMS = (8, 16, 24, 32, 48)
DEFAULT_SM_SWEEP = (4, 8, 16, 24, 32)
DEFAULT_TUNE_SEND = (4, 6, 8, 12, 16, 24, 32)
DEFAULT_TUNE_RECV = (128, 256, 512)

# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> List[int]:
    """Parse ``"8,16,24"`` (spaces allowed) into ``[8, 16, 24]``."""
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _name_list(text: str) -> List[str]:
    """Parse ``"cupy,torch"`` into ``["cupy", "torch"]`` (each one of those two)."""
    names = [v for v in text.replace(" ", "").split(",") if v]
    bad = [n for n in names if n not in ("cupy", "torch")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of cupy, torch; got {text!r}")
    return names


def _shown(value: Any) -> str:
    """A default as it is typed on the command line: lists comma-separated, as _int_list reads them."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's help ends in its real default, written once.

    Unlike argparse's ArgumentDefaultsHelpFormatter it adds nothing to a help text that already
    says its default in words (``(default: the recommended config)``), nor to an on/off flag, whose
    stored True or False (``--no-check``: True) reads as the opposite of what the flag does; options
    without a value (None) state what happens without them in their own text (tests/test_bench.py)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS
                or "default" in text):
            return text
        return f"{text} (default: {_shown(action.default)})"


#: The installed command (pyproject.toml's console script) that runs :func:`main`.
CONSOLE_SCRIPT = "deepep-cupy-bench"


def program_name() -> str:
    """How the user started the benchmark: the console script, or ``python -m deepep_cupy.bench``."""
    return CONSOLE_SCRIPT if os.path.basename(sys.argv[0]) == CONSOLE_SCRIPT else "python -m deepep_cupy.bench"


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m deepep_cupy.bench`` (``deepep-cupy-bench`` when installed)."""
    p = argparse.ArgumentParser(
        prog=program_name(),
        description="Benchmark deepep_cupy dispatch/combine against NCCL all-to-all and a copy kernel.",
        formatter_class=_DefaultsHelpFormatter)
    g = p.add_argument_group("launch")
    g.add_argument("--num-ranks", type=int, default=None,
                   help="in-process mode: ranks to run (default: number of visible GPUs); "
                        "under mpirun it must equal the MPI world size")
    g.add_argument("--launcher", choices=("auto", "local", "mpi"), default="auto",
                   help="auto: mpi when started by mpirun/mpiexec, else one process for all GPUs")
    g = p.add_argument_group("workload")
    g.add_argument("--num-tokens", type=int, default=4096, help="tokens per rank")
    g.add_argument("--hidden", type=int, default=7168, help="values per token (a multiple of 128)")
    g.add_argument("--num-topk", type=int, default=8, help="experts per token")
    g.add_argument("--num-experts", type=int, default=256, help="experts in all, split evenly over the ranks")
    g.add_argument("--routing", choices=("uniform", "skewed"), default="uniform",
                   help="how tokens pick their experts: uniformly, or skewed towards low expert ids")
    g.add_argument("--skew", type=float, default=1.0, help="skew of --routing skewed")
    g.add_argument("--dtype", choices=("bf16", "fp8", "both"), default="both",
                   help="dispatch data types to time (combine is always BF16)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random routing")
    g = p.add_argument_group("library config")
    g.add_argument("--num-sms", type=int, default=24, help="SMs of the dispatch and combine configs (Config.num_sms)")
    g.add_argument("--send-chunk", type=int, default=None,
                   help="num_max_nvl_chunked_send_tokens (default: the recommended config)")
    g.add_argument("--recv-chunk", type=int, default=None,
                   help="num_max_nvl_chunked_recv_tokens (default: the recommended config)")
    g.add_argument("--timeout", type=float, default=100.0, help="Buffer timeout_s")
    g.add_argument("--no-allocate-ahead", dest="allocate_ahead", action="store_false",
                   help="Buffer(allocate_ahead=False): the host waits for the receive counts before "
                        "it launches a fresh dispatch")
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=int, default=20, help="untimed calls before the timed ones")
    g.add_argument("--iters", type=int, default=100, help="timed calls per op")
    g.add_argument("--no-flush-l2", dest="flush_l2", action="store_false",
                   help="do not zero 256 MB before each timed call")
    g.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    g = p.add_argument_group("baselines")
    g.add_argument("--nccl", choices=("auto", "torch", "cupy", "none"), default="auto",
                   help="NCCL baseline backend: auto = torch.distributed under mpirun if torch imports, "
                        "else cupy.cuda.nccl; none = skip")
    g.add_argument("--no-copy", dest="copy", action="store_false", help="skip the copy-kernel ceiling")
    g.add_argument("--copy-mib", type=int, default=1024, help="bytes copied by the copy kernel, MiB")
    g.add_argument("--copy-iters", type=int, default=10, help="timed copies of the copy-kernel ceiling")
    g = p.add_argument_group("sweeps and output")
    g.add_argument("--tokens-sweep", type=_int_list, default=None, metavar="LIST",
                   help="tokens per rank for the GB/s-vs-tokens sweep "
                        f"(default: no sweep; with --plot: {_shown(DEFAULT_TOKENS_SWEEP)})")
    g.add_argument("--sweep-iters", type=int, default=30, help="timed iterations per sweep point")
    g.add_argument("--sm-sweep", type=_int_list, default=None, metavar="LIST",
                   help="SM counts at which to time cached dispatch (BF16, FP8) and combine with the "
                        "recommended chunk sizes (default: no sweep; with --sm-plot: "
                        f"{_shown(DEFAULT_SM_SWEEP)})")
    g.add_argument("--sm-plot", metavar="PATH", default=None,
                   help="PNG of time vs SMs, the --sm-sweep (default: not drawn)")
    g.add_argument("--tune", action="store_true", help="grid search over SMs and chunk sizes")
    g.add_argument("--tune-sms", type=_int_list, default=list(DEFAULT_TUNE_SMS), metavar="LIST",
                   help="SM counts of the --tune grid")
    g.add_argument("--tune-send", type=_int_list, default=list(DEFAULT_TUNE_SEND), metavar="LIST",
                   help="send chunk sizes (tokens) of the --tune grid")
    g.add_argument("--tune-recv", type=_int_list, default=list(DEFAULT_TUNE_RECV), metavar="LIST",
                   help="receive chunk sizes (tokens) of the --tune grid")
    g.add_argument("--tune-warmup", type=int, default=5, help="untimed calls per --tune point")
    g.add_argument("--tune-iters", type=int, default=20, help="timed calls per --tune point")
    g.add_argument("--save-config", metavar="PATH", default=None,
                   help="write the best --tune configs as JSON, see the module docstring (default: not written)")
    g = p.add_argument_group("what a training loop sees (loop and host time per call)")
    g.add_argument("--no-calls", dest="calls", action="store_false",
                   help="skip the loop/host-time table per op, array library and token count")
    g.add_argument("--calls-tokens", type=_int_list, default=list(DEFAULT_CALLS_TOKENS), metavar="LIST",
                   help="tokens per rank of the loop/host-time table")
    g.add_argument("--calls-libs", type=_name_list, default=["cupy", "torch"], metavar="LIST",
                   help="array libraries of the loop/host-time table (torch is skipped when it does not import)")
    g.add_argument("--calls-iters", type=int, default=40, help="calls per loop")
    g.add_argument("--calls-warmup", type=int, default=10, help="untimed calls before each loop")
    g.add_argument("--calls-rounds", type=int, default=3,
                   help="rounds of loops, the libraries alternating; figures are medians over them")
    g.add_argument("--calls-plot", metavar="PATH", default=None,
                   help="PNG of loop time vs tokens per rank, per op and array library (default: not drawn)")
    g = p.add_argument_group("internode (under mpirun; deepep_cupy/bench/internode.py)")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="L",
                   help="benchmark an internode Buffer over nodes of L ranks (simulated when a host holds "
                        "more): bytes to other nodes next to a flat all-to-all's, times, NCCL baseline "
                        "(default: the intranode benchmark)")
    g.add_argument("--transport", choices=("nccl", "mpi", "local"), default=None,
                   help="the internode Buffer's rail transport (default: chosen by the library)")
    g = p.add_argument_group("decode (DeepEP's low-latency calls)")
    g.add_argument("--decode", action="store_true",
                   help="only the decode table: low-latency dispatch (FP8) and combine, graph-replayed")
    g.add_argument("--decode-tokens", type=_int_list, default=None, metavar="LIST",
                   help=f"tokens per rank of the decode table (default: {_shown(DEFAULT_DECODE_TOKENS)})")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", default=None,
                   help="write every figure and the settings as JSON (default: not written)")
    g.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG of GB/s vs tokens per rank, the --tokens-sweep (default: not drawn)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate the command line (``argv`` without the program name)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("num_tokens", "hidden", "num_topk", "num_experts", "num_sms", "iters", "copy_mib",
                 "copy_iters", "sweep_iters", "tune_iters", "calls_iters", "calls_rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("warmup", "tune_warmup", "calls_warmup"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.num_ranks is not None and args.num_ranks < 1:
        parser.error("--num-ranks must be positive")
    if args.hidden % FP8_SCALE_BLOCK:
        parser.error("--hidden must be a multiple of 128 (FP8 scales cover 128 values)")
    if args.num_topk > args.num_experts:
        parser.error("--num-topk must not exceed --num-experts")
    if args.save_config and not args.tune:
        parser.error("--save-config needs --tune")
    if args.plot and args.tokens_sweep is None:
        args.tokens_sweep = list(DEFAULT_TOKENS_SWEEP)
    if args.sm_plot and args.sm_sweep is None:
        args.sm_sweep = list(DEFAULT_SM_SWEEP)
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error("--ranks-per-node must be positive")
    if any(n < 2 or n % 2 for n in args.sm_sweep or ()):
        parser.error("--sm-sweep: SM counts must be even and at least 2")
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
# Launch
# ----------------------------------------------------------------------------------------------


def _settings(args: argparse.Namespace, mode: str, num_ranks: int, devices: Sequence[int],
              first: Dict[str, Any]) -> Dict[str, Any]:
    import cupy
    s = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "calls_plot", "sm_plot", "save_config")}
    s.update(mode="in-process" if mode == "local" else "mpirun", num_ranks=num_ranks, devices=list(devices),
             device_name=first["device_name"], dispatch_config=first["dispatch_config"],
             combine_config=first["combine_config"], nvl_bytes=first["nvl_bytes"],
             recv_tokens_rank0=first.get("recv_tokens"), dispatch_allocation_rank0=first.get("dispatch_allocation"),
             cupy_version=cupy.__version__,
             python=sys.version.split()[0], interpreter_us=round(interpreter_us(), 2),
             nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
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
    doc = results_to_json(settings, agg["checks"], agg["ops"], agg["nccl"], copy, agg["sweep"], agg["tune"],
                          agg["calls"], agg["sm_sweep"])
    print(render_report(doc), flush=True)
    if args.json:
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    for path, what, plot, absent in ((args.plot, "sweep", plot_sweep, "no sweep results"),
                                     (args.calls_plot, "calls", plot_calls, "--no-calls"),
                                     (args.sm_plot, "sm_sweep", plot_sm_sweep, "no SM sweep results")):
        if path:
            why = plot(path, doc[what], settings) if agg[what] else absent
            print(f"{what} plot skipped: {why}" if why else f"wrote {path}")
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

    from deepep_cupy import run_local_group
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
    import cupy
    from mpi4py import MPI

    from deepep_cupy.groups.group import MPIGroup
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    try:
        if args.num_ranks is not None and args.num_ranks != size:
            raise SystemExit(f"deepep_cupy.bench: --num-ranks {args.num_ranks} != MPI world size {size}")
        dev = use_local_gpu(world)
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
            count = cupy.cuda.runtime.getDeviceCount()
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


def _main_internode(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    from .internode import run_internode
    world = MPI.COMM_WORLD
    try:
        return world.bcast(run_internode(args), root=0)
    except SystemExit as exc:
        if world.Get_size() == 1 or exc.code in (0, None):
            raise
        print(f"[rank {world.Get_rank()}] {exc}", file=sys.stderr, flush=True)
        world.Abort(2)
    except BaseException:
        sys.stderr.write(f"[rank {world.Get_rank()}] " + traceback.format_exc())
        sys.stderr.flush()
        world.Abort(1)
    return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m deepep_cupy.bench``; returns the exit status (1 when a check fails)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # before anything can initialise NCCL
    args = parse_args(argv)
    mode = detect_launcher(args)
    if args.ranks_per_node is not None and mode != "mpi":
        raise SystemExit("deepep_cupy.bench: --ranks-per-node runs under mpirun (one process per rank)")
    exit_unless_gpu(program_name())
    if args.decode:
        from .decode import run_decode

        return run_decode(args)
    if args.ranks_per_node is not None:
        return _main_internode(args)
    if mode == "mpi":
        return _main_mpi(args)
    return _main_local(args)
