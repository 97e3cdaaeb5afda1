"""Run a process-per-rank worker with every rank on the one GPU of a one-GPU machine.

Usage: ``mpiexec -n 2 python tests/workers/one_gpu_ranks.py WORKER [ARGS ...]`` (or ``-m MODULE
[ARGS ...]``, as ``python -m`` takes it: ``-m deepep_cupy.bench --ranks-per-node 2``)
(``DEEPEP_TEST_ONE_GPU_MPI=1`` makes the test harness start its mpiexec workers this way).

A Buffer refuses processes that share a GPU: their contexts take turns on it, so every wait for
a peer costs a time slice (milliseconds) and a real job would be slow, not wrong. For the tests
slow is fine: each rank here reports a PCI bus id of its own, so that what runs only between
processes (CUDA IPC handles, the count slots polled by the host, a fresh dispatch in one launch,
torch.distributed groups) runs on a machine with one GPU too. torch.distributed gets Gloo, as NCCL
refuses two ranks on one GPU, and ``torch.cuda.set_device`` picks GPU 0 whatever rank asks. Ranks
started by torchrun work too (``torchrun --nproc-per-node 2 one_gpu_ranks.py WORKER``). Nothing
about speed can be learned from such a run.
"""

import os
import runpy
import sys

import cupy


def launcher_rank() -> str:
    """This process's rank as its launcher set it: Open MPI, MPICH (PMI) or torchrun (``RANK``)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def _give_each_rank_a_bus_id() -> None:
    rank = launcher_rank()
    bus_id_of = cupy.cuda.runtime.deviceGetPCIBusId
    cupy.cuda.runtime.deviceGetPCIBusId = lambda device: f"{bus_id_of(device)}/rank{rank}"


def _make_process_groups_use_gloo() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        return
    init_process_group = dist.init_process_group

    def init_with_gloo(backend=None, *args, **kwargs):
        return init_process_group("gloo", *args, **kwargs)

    dist.init_process_group = init_with_gloo


def _make_set_device_pick_gpu_0() -> None:
    """``torch.cuda.set_device(local_rank)``, as DeepEP scripts call it, picks the one GPU there is."""
    try:
        import torch
    except ImportError:
        return
    set_device = torch.cuda.set_device

    def set_gpu_0(device):
        set_device(0)

    torch.cuda.set_device = set_gpu_0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    _give_each_rank_a_bus_id()
    _make_process_groups_use_gloo()
    _make_set_device_pick_gpu_0()
    if sys.argv[1] == "-m" and len(sys.argv) > 2:  # a module, as `python -m` runs it
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        worker = os.path.abspath(sys.argv[1])
        sys.argv = sys.argv[1:]
        sys.path.insert(0, os.path.dirname(worker))
        runpy.run_path(worker, run_name="__main__")
