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
   outputs bit-exactly with :mod:`deepep_cupy.reference.intranode` run on the allgathered inputs.
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

Nothing here touches a GPU, CuPy, MPI or NCCL at import time: the package imports on a CPU machine.

Modules: :mod:`~deepep_cupy.bench.cli` (command line, launch), :mod:`~deepep_cupy.bench.workload`
(workload, routing, byte accounting), :mod:`~deepep_cupy.bench.timing`, :mod:`~deepep_cupy.bench.library`
(the library's check and timings), :mod:`~deepep_cupy.bench.nccl` (NCCL baseline),
:mod:`~deepep_cupy.bench.ceiling` (copy-kernel ceiling), :mod:`~deepep_cupy.bench.report` (statistics,
tables, JSON, report, plot). The config file is read and written by :mod:`deepep_cupy.config`.
"""

from ..config import load_config, save_config, write_json
from .ceiling import copy_ceiling
from .cli import (
    DEFAULT_TOKENS_SWEEP,
    DEFAULT_TUNE_RECV,
    DEFAULT_TUNE_SEND,
    DEFAULT_TUNE_SMS,
    _main_local,  # noqa: F401  (not public: the tests call it)
    build_parser,
    detect_launcher,
    main,
    parse_args,
)
from .library import compare_exact, compare_rank, nvl_buffer_bytes, reference_outputs
from .nccl import run_nccl_baseline
from .report import (
    aggregate,
    best_configs,
    format_settings,
    format_table,
    op_stats,
    render_report,
    results_to_json,
    summarize_op,
    tune_grid,
)
from .timing import time_op
from .workload import (
    FP8_FACTOR,
    build_send_index,
    cross_gpu_bytes,
    dispatch_bytes,
    expected_recv_sources,
    gbps,
    make_workload,
    recv_token_counts,
    token_rank_mask,
)

__all__ = [
    "DEFAULT_TOKENS_SWEEP", "DEFAULT_TUNE_RECV", "DEFAULT_TUNE_SEND", "DEFAULT_TUNE_SMS", "FP8_FACTOR",
    "aggregate", "best_configs", "build_parser", "build_send_index", "compare_exact", "compare_rank",
    "copy_ceiling", "cross_gpu_bytes", "detect_launcher", "dispatch_bytes", "expected_recv_sources",
    "format_settings", "format_table", "gbps", "load_config", "main", "make_workload", "nvl_buffer_bytes",
    "op_stats", "parse_args", "recv_token_counts", "reference_outputs", "render_report", "results_to_json",
    "run_nccl_baseline", "save_config", "summarize_op", "time_op", "token_rank_mask", "tune_grid", "write_json",
]
