"""PyTorch code that uses DeepEP today, on real GPUs: ranks started with torch.multiprocessing.spawn
or mpiexec, a Buffer on a torch.distributed ProcessGroup.

* tests/workers/torch_dist_worker.py runs the torch scenarios (layout, BF16 and FP8 dispatch with
  column-major scales, with and without top-k, async with ``Buffer.capture()``, ``num_worst_tokens``,
  cached dispatch, combine with biases) and compares every output with the NumPy reference.
* examples/deepep_intranode.py is a DeepEP intranode script whose only change is its import line;
  it checks its own results the way DeepEP's test does.

Spawned ranks take one GPU each (2 GPUs). Ranks started by mpiexec or torchrun share one GPU under
``DEEPEP_TEST_ONE_GPU_MPI=1`` (tests/workers/one_gpu_ranks.py: a Gloo group, every rank on GPU 0).
"""

import socket

import pytest
from _harness import (
    REPO_ROOT,
    WORKERS,
    describe,
    gpus_needed_under_mpiexec,
    import_or_skip,
    records_by,
    run_mpi,
    run_python,
    shared_gpu_launcher,
    skip_unless_gpus,
    skip_unless_gpus_for_mpiexec,
)
from workers.gpu_scenarios import TORCH_DIST_NAMES

WORKER = WORKERS / "torch_dist_worker.py"
EXAMPLE = REPO_ROOT / "examples" / "deepep_intranode.py"
TIMEOUT_S = 600


def _free_port_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1])}


def _needs_torch():
    import_or_skip("torch", "the torch.distributed tests (the torch extra)")


@pytest.fixture(scope="module")
def spawned():
    _needs_torch()
    skip_unless_gpus(2, "spawning one process per GPU needs")
    return run_python([WORKER], TIMEOUT_S, env=_free_port_env())


@pytest.fixture(scope="module")
def under_mpiexec():
    _needs_torch()
    skip_unless_gpus_for_mpiexec(2)
    return run_mpi(2, [WORKER], TIMEOUT_S, env=_free_port_env())


def _assert_scenario_passed(run, scenario):
    entries = records_by(run.stdout, "scenario").get(scenario, [])
    ranks = sorted(e["rank"] for e in entries)
    assert ranks == [0, 1], f"{scenario}: results of ranks {ranks}, expected [0, 1]\n{describe(run)}"
    for entry in entries:
        assert entry["ok"], f"rank {entry['rank']}: {entry['error']}"


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", TORCH_DIST_NAMES)
def test_a_spawned_process_group_matches_the_reference(spawned, scenario):
    _assert_scenario_passed(spawned, scenario)


@pytest.mark.gpu
def test_the_spawned_run_exits_cleanly(spawned):
    assert spawned.returncode == 0, describe(spawned)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("scenario", TORCH_DIST_NAMES)
def test_a_process_group_under_mpiexec_matches_the_reference(under_mpiexec, scenario):
    _assert_scenario_passed(under_mpiexec, scenario)


@pytest.mark.gpu
@pytest.mark.mpi
def test_the_mpiexec_run_exits_cleanly(under_mpiexec):
    assert under_mpiexec.returncode == 0, describe(under_mpiexec)


@pytest.mark.gpu
def test_a_deepep_script_runs_spawned_with_only_its_import_changed():
    _needs_torch()
    skip_unless_gpus(2, "spawning one process per GPU needs")
    run = run_python([EXAMPLE, "--num-processes", 2], TIMEOUT_S, env=_free_port_env())
    assert run.returncode == 0 and "deepep_intranode: all: passed" in run.stdout, describe(run)


@pytest.mark.gpu
@pytest.mark.mpi
def test_a_deepep_script_runs_under_mpiexec_with_only_its_import_changed():
    _needs_torch()
    skip_unless_gpus_for_mpiexec(2)
    run = run_mpi(2, [EXAMPLE], TIMEOUT_S, env=_free_port_env())
    assert run.returncode == 0 and "deepep_intranode: all: passed" in run.stdout, describe(run)


@pytest.mark.gpu(1)
def test_a_deepep_script_runs_under_torchrun_with_only_its_import_changed():
    _needs_torch()
    skip_unless_gpus(gpus_needed_under_mpiexec(2), "a torchrun job of 2 processes (one GPU per process; "
                     "DEEPEP_TEST_ONE_GPU_MPI=1: one for all) needs")
    env = _free_port_env()
    run = run_python(["-m", "torch.distributed.run", "--nproc-per-node", 2, "--master-port", env["MASTER_PORT"],
                      *shared_gpu_launcher(2), EXAMPLE, "--num-tokens", 1024], TIMEOUT_S, env=env)
    assert run.returncode == 0 and "deepep_intranode: all: passed" in run.stdout, describe(run)
