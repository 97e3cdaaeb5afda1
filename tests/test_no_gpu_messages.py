"""Without a usable GPU (no CuPy, no driver, no device), every entry point a user runs ends in one
sentence saying what is missing and a non-zero exit, not a traceback: the commands (``make bench``,
the soaks, the examples, the scripts, the benchmark) print it on stderr and exit with status 2
(``deepep_cupy.gpu.check``; make asks the driver before it installs anything,
``deepep_cupy/driver_check.py``), and the library calls (``Buffer()``, ``run_local_group``) raise
:class:`~deepep_cupy.GpuUnavailableError` with it. They run for real where this machine has no GPU
(CPU CI)."""

import ctypes
import sys
import time

import pytest
from _harness import (
    REPO_ROOT,
    WORKERS,
    describe,
    find_mpiexec,
    import_or_skip,
    probe_gpus,
    run_command,
    run_python,
    skip_or_fail,
)

from deepep_cupy import driver_check
from deepep_cupy.gpu import check as gpu_check
from deepep_cupy.gpu.check import NO_GPU_EXIT_STATUS, GpuProbe

#: ``(what, arguments of python)``: the commands of ``make bench``, ``make soak`` (its three soaks),
#: the examples and the scripts.
COMMANDS = [
    ("bench", ["-m", "deepep_cupy.bench"]),
    ("bench --decode", ["-m", "deepep_cupy.bench", "--decode"]),
    ("soak", [WORKERS / "random_soak.py", "--cases", "1"]),
    ("sequence soak", [WORKERS / "sequence_soak.py", "--sequences", "1", "--steps", "2"]),
    ("internode soak", [WORKERS / "internode_soak.py", "--cases", "1"]),
    ("in-process example", [REPO_ROOT / "examples" / "in_process_dispatch_combine.py"]),
    ("DeepEP example", [REPO_ROOT / "examples" / "deepep_intranode.py"]),
    ("internode example", [REPO_ROOT / "examples" / "internode_mpirun.py"]),
] + [(f"scripts/{name}", [REPO_ROOT / "scripts" / name, *args]) for name, args in (
    # The measuring tools that need a GPU (scripts/README.md), with the arguments they require.
    ("combine_in_place.py", []), ("combine_senders.py", []), ("fresh_host_timeline.py", []),
    ("host_breakdown.py", []), ("host_costs.py", []), ("host_path_alone.py", []), ("host_profile.py", []),
    ("in_place_split.py", []), ("kernel_timeline.py", []), ("quick_perf.py", []), ("sm_rates_probe.py", []),
    ("loop_ab_in_process.py", ["--old", str(REPO_ROOT)]), ("first_use_time.py", []))]

#: ``(what, the code a user runs)``: the library calls that need a GPU, each in a fresh interpreter.
LIBRARY_CALLS = [
    ("Buffer() on an mpi4py communicator",
     "from mpi4py import MPI; import deepep_cupy as ep; ep.Buffer(MPI.COMM_WORLD, num_nvl_bytes=1 << 20)"),
    ("run_local_group", "import deepep_cupy as ep; ep.run_local_group(lambda group: None, 2)"),
]

#: The make targets that need a GPU: each asks the driver before it makes .venv or installs.
GPU_MAKE_TARGETS = ["bench", "soak", "soak-cases", "soak-sequences", "soak-internode"]


def _skip_with_a_gpu():
    found = probe_gpus()
    if found.count > 0:
        pytest.skip(f"this machine has {found.count} usable GPUs")
    return found


def _one_sentence(text: str) -> str:
    """``text`` stripped, checked to be one line and one sentence: "... needs a CUDA GPU, but ...."."""
    message = text.strip()
    assert "\n" not in message and "Traceback" not in message, text
    assert "needs a CUDA GPU, but " in message and message.endswith(".") and message.count(". ") == 0, message
    return message


@pytest.mark.parametrize("what, args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_command_without_a_gpu_ends_in_one_sentence_and_exit_status_2(what, args):
    found = _skip_with_a_gpu()
    if what == "DeepEP example":
        import_or_skip("torch", "the DeepEP example imports torch")
    run = run_python(args, timeout=120)
    assert run.returncode == NO_GPU_EXIT_STATUS, describe(run)
    assert gpu_check.missing_gpu_reason(found) in _one_sentence(run.stderr), describe(run)


def test_the_internode_example_under_mpiexec_says_it_once_for_all_ranks():
    found = _skip_with_a_gpu()
    mpiexec = find_mpiexec()
    if mpiexec is None:
        skip_or_fail("no mpiexec found (the test extra's mpich brings one)")
    run = run_command([mpiexec, "-n", "2", sys.executable, REPO_ROOT / "examples" / "internode_mpirun.py"], 120)
    assert run.returncode != 0, describe(run)
    assert gpu_check.missing_gpu_reason(found) in _one_sentence(run.stderr), describe(run)


@pytest.mark.parametrize("what, code", LIBRARY_CALLS, ids=[c[0] for c in LIBRARY_CALLS])
def test_a_library_call_without_a_gpu_raises_one_sentence_instead_of_a_cuda_error(what, code):
    found = _skip_with_a_gpu()
    run = run_python(["-c", code], timeout=120)
    assert run.returncode != 0, describe(run)
    last = run.stderr.strip().splitlines()[-1]
    error, _, message = last.partition(": ")
    assert error == "deepep_cupy.errors.GpuUnavailableError", describe(run)
    assert gpu_check.missing_gpu_reason(found) in _one_sentence(message), describe(run)
    # Raised before any CUDA call, not around CuPy's error: no second traceback.
    assert "CUDARuntimeError" not in run.stderr.replace(message, ""), describe(run)


def test_run_local_group_says_that_pure_python_ranks_cannot_hold_a_buffer():
    _skip_with_a_gpu()
    import deepep_cupy as ep

    with pytest.raises(ep.GpuUnavailableError, match="use_devices=False runs pure-Python ranks, whose groups "
                                                     "have collectives but no GPU for a Buffer"):
        ep.run_local_group(lambda group: None, 2)


def _skip_with_a_driver():
    reason = driver_check.missing_driver_reason()
    if reason is None:
        pytest.skip("this machine has an NVIDIA driver that sees a GPU")
    return reason


@pytest.mark.parametrize("target", GPU_MAKE_TARGETS)
def test_a_make_target_that_needs_a_gpu_says_so_before_it_installs_anything(target, tmp_path):
    reason = _skip_with_a_driver()
    venv = tmp_path / "venv"
    began = time.monotonic()
    # USE_VENV=1 and a venv that does not exist: without the driver check, make would build it.
    run = run_command(["make", "--no-print-directory", target, f"VENV={venv}", "USE_VENV=1"], timeout=60)
    seconds = time.monotonic() - began
    assert run.returncode != 0 and not venv.exists(), describe(run)
    first_line = run.stderr.strip().splitlines()[0]
    assert _one_sentence(first_line) == f"make {target} needs a CUDA GPU, but {reason}.", describe(run)
    assert seconds < 5, f"make {target} took {seconds:.1f} s to say it"


def test_make_bench_help_lists_the_options_without_asking_the_driver():
    _skip_with_a_driver()
    run = run_command(["make", "-n", "bench", "BENCH_ARGS=--help"], timeout=60)
    assert run.returncode == 0 and "driver_check.py" not in run.stdout, describe(run)


def test_the_gpu_machine_session_script_says_so_before_its_first_stage():
    reason = _skip_with_a_driver()
    run = run_command(["bash", REPO_ROOT / "scripts" / "device_check.sh"], timeout=60)
    assert run.returncode == NO_GPU_EXIT_STATUS and run.stdout == "", describe(run)
    assert _one_sentence(run.stderr) == f"scripts/device_check.sh needs a CUDA GPU, but {reason}.", describe(run)


class _FakeLibcuda:
    """libcuda's two calls the driver check makes, answering ``init`` and ``count``."""

    def __init__(self, init: int = 0, count: int = 1, count_status: int = 0):
        self.init, self.count, self.count_status = init, count, count_status

    def cuInit(self, flags):  # noqa: N802 - the driver API's name
        return self.init

    def cuDeviceGetCount(self, pointer):  # noqa: N802 - the driver API's name
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.count_status


def _no_library(name):
    raise OSError(f"{name}: cannot open shared object file")


@pytest.mark.parametrize("load, clause", [
    (_no_library, "no NVIDIA driver is installed (libcuda.so.1 does not load)"),
    (lambda name: _FakeLibcuda(init=driver_check.CUDA_ERROR_NO_DEVICE),
     "the NVIDIA driver sees no GPU; check CUDA_VISIBLE_DEVICES"),
    (lambda name: _FakeLibcuda(init=999), "the NVIDIA driver does not start (cuInit returned CUDA error 999)"),
    (lambda name: _FakeLibcuda(count_status=3),
     "the NVIDIA driver cannot count the GPUs (cuDeviceGetCount returned CUDA error 3)"),
    (lambda name: _FakeLibcuda(count=0), "the NVIDIA driver sees no GPU; check CUDA_VISIBLE_DEVICES"),
], ids=["no libcuda", "no device", "driver fails", "count fails", "zero devices"])
def test_the_driver_check_names_what_is_missing(load, clause):
    assert driver_check.missing_driver_reason(load) == clause


def test_the_driver_check_passes_a_driver_that_sees_a_gpu():
    assert driver_check.missing_driver_reason(lambda name: _FakeLibcuda(count=2)) is None


def test_the_reason_names_a_missing_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    found = gpu_check.probe()
    assert found.count == 0 and found.reason.startswith("CuPy does not import (ModuleNotFoundError: "), found
    assert found.reason.endswith("install the cuda12 or cuda13 extra"), found


@pytest.mark.parametrize("error, clause", [
    ("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
     "the NVIDIA driver is missing or older than CuPy's CUDA runtime"),
    ("cudaErrorNoDevice: no CUDA-capable device is detected", "the driver sees no CUDA GPU"),
    ("cudaErrorUnknown: unknown error", "the CUDA runtime cannot count the GPUs"),
])
def test_the_reason_names_what_the_cuda_runtime_said(monkeypatch, error, clause):
    cupy = import_or_skip("cupy")

    def fail():
        raise RuntimeError(error)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", fail)
    found = gpu_check.probe()
    assert found.count == 0 and found.reason.startswith(clause) and error in found.reason, found


def test_a_probe_that_found_no_device_says_so():
    assert gpu_check.missing_gpu_reason(GpuProbe(0)) == "no CUDA GPU is visible; check CUDA_VISIBLE_DEVICES"
    assert gpu_check.missing_gpu_reason(GpuProbe(1)) is None


def test_require_gpu_raises_the_same_sentence(monkeypatch):
    monkeypatch.setattr(gpu_check, "probe", lambda: GpuProbe(0, "the NVIDIA driver is missing"))
    with pytest.raises(gpu_check.GpuUnavailableError) as raised:
        gpu_check.require_gpu("call")
    assert str(raised.value) == "call needs a CUDA GPU, but the NVIDIA driver is missing."


def test_exit_unless_gpu_without_say_exits_silently(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "probe", lambda: GpuProbe(0, "the NVIDIA driver is missing"))
    with pytest.raises(SystemExit) as exited:
        gpu_check.exit_unless_gpu("tool", say=False)
    assert exited.value.code == NO_GPU_EXIT_STATUS and capsys.readouterr().err == ""


def test_exit_unless_gpu_prints_one_sentence_and_exits_with_2(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "probe", lambda: GpuProbe(0, "the NVIDIA driver is missing"))
    with pytest.raises(SystemExit) as exited:
        gpu_check.exit_unless_gpu("tool")
    assert exited.value.code == NO_GPU_EXIT_STATUS
    assert capsys.readouterr().err == "tool needs a CUDA GPU, but the NVIDIA driver is missing.\n"
