"""What two in-process ranks on GPU 0 allocate from, while both run and after one has ended.

Usage: ``python tests/workers/pool_worker.py``. Prints one ``RESULT {json}`` line: the device's
current pool before, during (per rank) and after ``run_local_group``, the reuse switch of the pool
the ranks saw, and what rank 1 saw once rank 0's thread had ended.
"""

import threading

from local_gpu_worker import emit  # run as a script: its folder is on sys.path


def pool_state(cupy):
    runtime = cupy.cuda.runtime
    pool = runtime.deviceGetMemPool(0)
    reuse = runtime.memPoolGetAttribute(pool, runtime.cudaMemPoolReuseAllowInternalDependencies)
    return {"pool": int(pool), "internal_reuse": int(reuse)}


def rank_main(group):
    import cupy

    seen = {"while_both_run": pool_state(cupy)}
    group.barrier()
    if group.rank == 1:
        rank0 = next(t for t in threading.enumerate() if t.name == "deepep-rank-0")
        rank0.join(60)  # its thread ends after it has left its pool
        seen["after_rank0_ended"] = pool_state(cupy)
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        seen["allocates_after"] = bool(float(x.sum()) == float((1 << 20) * ((1 << 20) - 1) / 2))
    return seen


def main():
    import cupy

    import deepep_cupy as ep

    before = pool_state(cupy)
    ranks = ep.run_local_group(rank_main, devices=[0, 0], timeout_s=60)
    emit("RESULT", {"before": before, "ranks": ranks, "after": pool_state(cupy)})


if __name__ == "__main__":
    main()
