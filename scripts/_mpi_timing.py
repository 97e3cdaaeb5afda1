"""What the measurement scripts run under mpirun share: the arguments of an SM-count sweep, a rank's
GPU and Buffer, the reference workload of a rank as CuPy arrays, with its layout, and the loop time
of a call (imported as ``_mpi_timing``: a script's folder is on its path)."""
import argparse
import os
import sys
from typing import List, Tuple

import cupy
import numpy as np

import deepep_cupy as ep
from deepep_cupy.gpu.check import exit_unless_gpu
from deepep_cupy.reference import intranode as ref

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8


def sweep_arguments(description: str, sms: str, **extra: dict) -> Tuple[argparse.Namespace, List[int]]:
    """The command line of a sweep over SM counts: ``--sms`` (default ``sms``), ``--rounds``,
    ``--tokens`` and ``extra`` (option name -> ``add_argument`` keywords); returns ``(args, SM counts)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sms", default=sms)
    for name, options in extra.items():
        parser.add_argument(name, **options)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    return args, [int(v) for v in args.sms.split(",")]


def rank_buffer(comm, num_sms: int, num_tokens: int, recv_x_in_buffer: bool = False, timeout_s: float = 30):
    """This rank's GPU (one per rank) made current, and a Buffer sized for ``num_tokens`` tokens of the
    reference workload per rank at up to ``num_sms`` SMs. Without a usable GPU: one sentence, exit 2."""
    exit_unless_gpu(f"scripts/{os.path.basename(sys.argv[0])}")
    cupy.cuda.Device(comm.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    hint = ep.get_nvl_buffer_size_hint(HIDDEN * 2, comm.Get_size(), ep.Config(num_sms, 4, 256), num_topk=NUM_TOPK,
                                       num_max_tokens_per_rank=num_tokens, recv_x_in_buffer=recv_x_in_buffer)
    return ep.Buffer(comm, hint, timeout_s=timeout_s)


def reference_workload(buf, rank: int, num_tokens: int, fp8: bool = False) -> dict:
    """``rank``'s tokens (seeded by the rank): ``x`` BF16 rows, ``x8`` ``(FP8 rows, scales)`` when
    ``fp8``, and the fresh-dispatch arguments in ``layout`` (top-k of uniform routing, weights,
    and ``buf``'s layout of them)."""
    rng = np.random.default_rng(rank)
    topk = cupy.asarray(ref.random_routing(rng, num_tokens, NUM_EXPERTS, NUM_TOPK))
    x = cupy.asarray(ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, HIDDEN), dtype=np.float32)))
    x8 = (cupy.asarray(rng.integers(0, 120, (num_tokens, HIDDEN), dtype=np.uint8)),
          cupy.asarray(rng.random((num_tokens, HIDDEN // 128), dtype=np.float32))) if fp8 else None
    weights = cupy.asarray(rng.random((num_tokens, NUM_TOPK), dtype=np.float32))
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=topk, topk_weights=weights)
    return dict(x=x, x8=x8, layout=layout)


def loop_us(comm, fn, iters: int = 20, warmup: int = 3) -> float:
    """GPU time per call of ``fn`` over ``iters`` calls issued back to back (no L2 flush), after a
    barrier of ``comm``."""
    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    comm.Barrier()
    start = stream.record()
    for _ in range(iters):
        fn()
    end = stream.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters
