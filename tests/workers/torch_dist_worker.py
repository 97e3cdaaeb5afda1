"""torch.distributed worker: ranks started the PyTorch way run scenarios on a Buffer built on a ProcessGroup.

Usage::

    python tests/workers/torch_dist_worker.py [NAME ...]               # spawns one rank per GPU
    mpiexec -n 2 python tests/workers/torch_dist_worker.py [NAME ...]  # ranks from the launcher

Each rank selects its GPU with ``torch.cuda.set_device`` (as DeepEP scripts do), joins an NCCL
process group over a local TCP store (``MASTER_PORT``, chosen free when spawning), builds a
``Buffer`` on a ``dist.new_group`` of all ranks, and runs the torch scenarios of
``gpu_scenarios.py`` through ``gpu_worker.run_scenario``: every output compared with the NumPy
reference bit-exactly. One ``RESULT {json}`` line per rank and scenario.
"""

import os
import socket
import sys

from gpu_scenarios import SCENARIOS, TORCH_DIST_NAMES  # run as a script: its folder is on sys.path
from gpu_worker import run_and_report


def launcher_ranks():
    """``(rank, size)`` when mpiexec started this process, else None."""
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return None


def rank_main(rank: int, size: int, names) -> int:
    import cupy
    import torch
    import torch.distributed as dist

    import deepep_cupy as ep

    torch.cuda.set_device(rank % torch.cuda.device_count())
    cupy.cuda.Device(torch.cuda.current_device()).use()  # the scenarios build their inputs with CuPy
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=size)
    group = dist.new_group(list(range(size)))
    timeout_s = float(os.environ.get("DEEPEP_TEST_TIMEOUT_S", "30"))
    nvl_bytes = ep.get_nvl_buffer_size_hint(7168 * 4, size, ep.Config(48, 16, 256))

    def new_buffer():
        buf = ep.Buffer(group, nvl_bytes, timeout_s=timeout_s)
        assert buf.group is group and buf.device_id == torch.cuda.current_device(), (buf.group, buf.device_id)
        return buf

    def everyone_ok(ok):
        oks = [None] * size
        dist.all_gather_object(oks, ok, group=group)
        return all(oks)

    selected = [dict(s, framework="torch") for s in SCENARIOS if s["name"] in (names or TORCH_DIST_NAMES)]
    failures = run_and_report(new_buffer, selected, rank, size, everyone_ok)
    dist.destroy_process_group()
    return failures


def _spawned(rank: int, size: int, names) -> None:
    if rank_main(rank, size, names):
        sys.exit(1)


def main(names) -> int:
    launched = launcher_ranks()
    if launched is not None:
        return 1 if rank_main(*launched, names) else 0
    import torch

    size = torch.cuda.device_count()
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.multiprocessing.spawn(_spawned, args=(size, names), nprocs=size)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
