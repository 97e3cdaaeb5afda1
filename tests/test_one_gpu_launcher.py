"""tests/workers/one_gpu_ranks.py, the launcher that lets mpiexec GPU tests share one GPU
(``DEEPEP_TEST_ONE_GPU_MPI=1``): what it does to a worker is checked here, without a GPU."""

from _harness import WORKERS, describe, import_or_skip, run_python

LAUNCHER = WORKERS / "one_gpu_ranks.py"


def test_the_launcher_runs_the_worker_as_main_with_its_arguments_and_folder(tmp_path):
    import_or_skip("cupy")
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nprint('RAN', __name__, sys.argv, sys.path[0])\n")
    run = run_python([LAUNCHER, worker, "scenario", "--flag"], timeout=120)
    assert run.returncode == 0, describe(run)
    assert f"RAN __main__ ['{worker}', 'scenario', '--flag'] {tmp_path}" in run.stdout, describe(run)


def test_the_launcher_gives_each_rank_a_bus_id_of_its_own(tmp_path):
    import_or_skip("cupy")
    worker = tmp_path / "worker.py"
    worker.write_text("import cupy\nprint('BUS', cupy.cuda.runtime.deviceGetPCIBusId.__qualname__)\n")
    run = run_python([LAUNCHER, worker], timeout=120, env={"OMPI_COMM_WORLD_RANK": "1"})
    assert run.returncode == 0 and "BUS _give_each_rank_a_bus_id.<locals>" in run.stdout, describe(run)


def test_the_launcher_without_a_worker_prints_its_usage():
    run = run_python([LAUNCHER], timeout=120)
    assert run.returncode != 0 and "one_gpu_ranks.py WORKER" in run.stderr, describe(run)
