"""What the measurement scripts run under mpirun share: the reference workload of a rank as CuPy
arrays, with its layout, and the loop time of a call (imported as ``_mpi_timing``: a script's
folder is on its path)."""
import cupy
import numpy as np

from deepep_cupy import reference as ref

HIDDEN, NUM_EXPERTS, NUM_TOPK = 7168, 256, 8


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
