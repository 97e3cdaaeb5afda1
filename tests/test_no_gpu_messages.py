"""Without a usable GPU (no CuPy, no driver, no device), every command a user runs ends in one
sentence on stderr saying what is missing, and exit status 2, not a traceback
(``deepep_cupy.gpu_check``). The commands run for real where this machine has no GPU (CPU CI)."""

import sys

import pytest
from _harness import REPO_ROOT, WORKERS, describe, import_or_skip, probe_gpus, run_python

from deepep_cupy import gpu_check
from deepep_cupy.gpu_check import NO_GPU_EXIT_STATUS, GpuProbe

#: ``(what, arguments of python)``: the commands of ``make bench``, ``make soak`` (its three soaks)
#: and the examples.
COMMANDS = [
    ("bench", ["-m", "deepep_cupy.bench"]),
    ("soak", [WORKERS / "random_soak.py", "--cases", "1"]),
    ("sequence soak", [WORKERS / "sequence_soak.py", "--sequences", "1", "--steps", "2"]),
    ("internode soak", [WORKERS / "internode_soak.py", "--cases", "1"]),
    ("in-process example", [REPO_ROOT / "examples" / "in_process_dispatch_combine.py"]),
    ("DeepEP example", [REPO_ROOT / "examples" / "deepep_intranode.py"]),
] + [(f"scripts/{name}", [REPO_ROOT / "scripts" / name, *args]) for name, args in (
    # The measuring tools that need a GPU (scripts/README.md), with the arguments they require.
    ("combine_in_place.py", []), ("combine_senders.py", []), ("fresh_host_timeline.py", []),
    ("host_breakdown.py", []), ("host_costs.py", []), ("host_path_alone.py", []), ("host_profile.py", []),
    ("in_place_split.py", []), ("kernel_timeline.py", []), ("quick_perf.py", []), ("sm_rates_probe.py", []),
    ("loop_ab_in_process.py", ["--old", str(REPO_ROOT)]))]


@pytest.mark.parametrize("what, args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_command_without_a_gpu_ends_in_one_sentence_and_exit_status_2(what, args):
    found = probe_gpus()
    if found.count > 0:
        pytest.skip(f"this machine has {found.count} usable GPUs")
    if what == "DeepEP example":
        import_or_skip("torch", "the DeepEP example imports torch")
    run = run_python(args, timeout=120)
    assert run.returncode == NO_GPU_EXIT_STATUS, describe(run)
    message = run.stderr.strip()
    assert "Traceback" not in run.stderr and "\n" not in message, describe(run)
    assert "needs a CUDA GPU, but " in message and message.endswith(".") and message.count(". ") == 0, message
    assert gpu_check.missing_gpu_reason(found) in message, message


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


def test_exit_unless_gpu_prints_one_sentence_and_exits_with_2(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "probe", lambda: GpuProbe(0, "the NVIDIA driver is missing"))
    with pytest.raises(SystemExit) as exited:
        gpu_check.exit_unless_gpu("tool")
    assert exited.value.code == NO_GPU_EXIT_STATUS
    assert capsys.readouterr().err == "tool needs a CUDA GPU, but the NVIDIA driver is missing.\n"
