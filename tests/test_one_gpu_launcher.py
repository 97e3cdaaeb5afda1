"""tests/workers/one_gpu_ranks.py, the launcher that lets mpiexec GPU tests share one GPU
(``DEEPEP_TEST_ONE_GPU_MPI=1``): what it does to a worker is checked here, without a GPU."""

import importlib

import pytest
from _harness import WORKERS, describe, import_or_skip, run_python

LAUNCHER = WORKERS / "one_gpu_ranks.py"


def test_the_launcher_runs_the_worker_as_main_with_its_arguments_and_folder(tmp_path):
    import_or_skip("cupy")
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nprint('RAN', __name__, sys.argv, sys.path[0])\n")
    run = run_python([LAUNCHER, worker, "scenario", "--flag"], timeout=120)
    assert run.returncode == 0, describe(run)
    assert f"RAN __main__ ['{worker}', 'scenario', '--flag'] {tmp_path}" in run.stdout, describe(run)


def test_the_launcher_runs_a_module_as_python_dash_m_does(tmp_path):
    import_or_skip("cupy")
    (tmp_path / "probe_module.py").write_text("import sys\nprint('RAN', __name__, sys.argv[1:])\n")
    run = run_python([LAUNCHER, "-m", "probe_module", "--ranks-per-node", "2"], timeout=120,
                     env={"PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, describe(run)
    assert "RAN __main__ ['--ranks-per-node', '2']" in run.stdout, describe(run)


def test_the_launcher_gives_each_rank_a_bus_id_of_its_own(tmp_path):
    import_or_skip("cupy")
    worker = tmp_path / "worker.py"
    worker.write_text("import cupy\nprint('BUS', cupy.cuda.runtime.deviceGetPCIBusId.__qualname__)\n")
    run = run_python([LAUNCHER, worker], timeout=120, env={"OMPI_COMM_WORLD_RANK": "1"})
    assert run.returncode == 0 and "BUS _give_each_rank_a_bus_id.<locals>" in run.stdout, describe(run)


def test_the_launcher_without_a_worker_prints_its_usage():
    run = run_python([LAUNCHER], timeout=120)
    assert run.returncode == 1 and "one_gpu_ranks.py WORKER" in run.stderr, describe(run)


@pytest.fixture
def launcher(monkeypatch):
    import_or_skip("cupy")
    monkeypatch.syspath_prepend(str(WORKERS))
    return importlib.import_module("one_gpu_ranks")


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"])
def test_the_launcher_reads_the_rank_of_mpiexec_or_torchrun(launcher, monkeypatch, variable):
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "3")
    assert launcher.launcher_rank() == "3"


def test_the_launcher_makes_set_device_pick_gpu_0(launcher, monkeypatch):
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    picked = []
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)  # restored after the test
    launcher._make_set_device_pick_gpu_0()
    torch.cuda.set_device(1)
    assert picked == [0]


@pytest.mark.parametrize("one_gpu_mode, gpus, launcher_used", [
    (True, 1, True), (True, 2, False), (True, 0, False), (False, 1, False)])
def test_jobs_share_gpu_0_only_in_one_gpu_mode_with_too_few_gpus(monkeypatch, one_gpu_mode, gpus, launcher_used):
    import _harness

    from deepep_cupy.gpu.check import GpuProbe

    monkeypatch.setattr(_harness, "ONE_GPU_MPI", one_gpu_mode)
    monkeypatch.setattr(_harness, "probe_gpus", lambda: GpuProbe(gpus))
    assert _harness.shared_gpu_launcher(2) == ([LAUNCHER] if launcher_used else [])
