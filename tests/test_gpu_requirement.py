"""What the GPU tests do when there are too few GPUs (tests/conftest.py states the rule): they skip,
saying how many GPUs were found and why the probe failed; with ``DEEPEP_TEST_REQUIRE_GPUS=N`` they
fail instead. Checked with a stubbed probe, in a pytest run of its own, and on this machine's own
probe where it finds no GPU."""

import subprocess
import sys
import textwrap

import _harness
import pytest
from _harness import REPO_ROOT, mpi_env, skip_unless_gpus

from deepep_cupy.gpu.check import GpuProbe

TESTS = REPO_ROOT / "tests"
STUB_REASON = "stubbed probe: the NVIDIA driver is missing"


@pytest.fixture
def probe(monkeypatch):
    """Set what the GPU probe finds: ``probe(count, reason=None)``."""
    def stub(count, reason=None):
        monkeypatch.setattr(_harness, "probe_gpus", lambda: GpuProbe(count, reason))
    monkeypatch.delenv("DEEPEP_TEST_REQUIRE_GPUS", raising=False)
    return stub


def test_a_failing_probe_says_why_in_the_skip_reason(probe):
    probe(0, STUB_REASON)
    with pytest.raises(pytest.skip.Exception, match=f"needs 2 GPUs, found 0: {STUB_REASON}$"):
        skip_unless_gpus(2)


def test_a_probe_that_worked_but_found_too_few_says_how_many(probe):
    probe(1)
    with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs, found 1$"):
        skip_unless_gpus(2)


# (DEEPEP_TEST_REQUIRE_GPUS, GPUs the test needs, GPUs found, what happens)
REQUIRE_RULE = [
    ("", 2, 0, "skip"), ("0", 2, 1, "skip"),
    ("1", 1, 0, "fail"), ("1", 2, 0, "fail"), ("1", 2, 1, "skip"),
    ("2", 2, 1, "fail"), ("2", 4, 1, "fail"), ("2", 4, 2, "skip"), ("2", 1, 1, "run"), ("8", 2, 2, "run"),
]


@pytest.mark.parametrize("required, need, have, outcome", REQUIRE_RULE)
def test_require_gpus_fails_a_test_that_finds_fewer_than_promised_and_needed(probe, monkeypatch, required, need,
                                                                             have, outcome):
    probe(have)
    monkeypatch.setenv("DEEPEP_TEST_REQUIRE_GPUS", required)
    expected = {"skip": pytest.skip.Exception, "fail": pytest.fail.Exception}.get(outcome)
    if expected is None:
        skip_unless_gpus(need)
        return
    with pytest.raises(expected) as raised:
        skip_unless_gpus(need)
    assert f"needs {need} GPUs, found {have}" in str(raised.value)
    assert ("DEEPEP_TEST_REQUIRE_GPUS" in str(raised.value)) == (outcome == "fail")


def test_require_gpus_refuses_a_value_that_is_not_a_count(probe, monkeypatch):
    probe(0, STUB_REASON)
    monkeypatch.setenv("DEEPEP_TEST_REQUIRE_GPUS", "two")
    with pytest.raises(ValueError, match="DEEPEP_TEST_REQUIRE_GPUS='two'"):
        skip_unless_gpus(1)


def _pytest_run(folder, env):
    """pytest on ``folder`` with the markers and set-up of tests/conftest.py, as a process of its own."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "-p", "stub_gpu_probe", str(folder)], capture_output=True, text=True, timeout=120,
                          cwd=str(folder), env=mpi_env({"PYTHONPATH": f"{folder}:{TESTS}", **env}))


@pytest.fixture
def gpu_test_with_a_stubbed_probe(tmp_path):
    """A folder holding one test marked ``gpu(1)`` and a plugin that stubs the probe (found 0, with
    :data:`STUB_REASON`) and brings in tests/conftest.py's hooks."""
    (tmp_path / "stub_gpu_probe.py").write_text(textwrap.dedent(f"""\
        import _harness
        from deepep_cupy.gpu.check import GpuProbe

        _harness.probe_gpus = lambda: GpuProbe(0, {STUB_REASON!r})

        from conftest import pytest_configure, pytest_runtest_setup  # noqa: E402,F401 - tests/conftest.py
        """))
    (tmp_path / "test_needs_one_gpu.py").write_text(textwrap.dedent("""\
        import pytest

        @pytest.mark.gpu(1)
        def test_on_a_gpu():
            pass
        """))
    return tmp_path


def test_a_gpu_test_skips_without_require_gpus(gpu_test_with_a_stubbed_probe):
    run = _pytest_run(gpu_test_with_a_stubbed_probe, {"DEEPEP_TEST_REQUIRE_GPUS": "0"})
    assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout + run.stderr
    assert f"needs 1 GPUs, found 0: {STUB_REASON}" in run.stdout, run.stdout


def test_require_gpus_makes_a_failing_probe_fail_the_run_saying_why(gpu_test_with_a_stubbed_probe):
    run = _pytest_run(gpu_test_with_a_stubbed_probe, {"DEEPEP_TEST_REQUIRE_GPUS": "1"})
    assert run.returncode == 1 and "1 error" in run.stdout, run.stdout + run.stderr
    assert f"needs 1 GPUs, found 0: {STUB_REASON} (DEEPEP_TEST_REQUIRE_GPUS=1" in run.stdout, run.stdout


def test_require_gpus_fails_a_gpu_test_file_on_a_machine_without_a_usable_gpu():
    """This machine's own probe, where it finds no GPU (CPU CI): a real GPU test file fails, and says why."""
    found = _harness.probe_gpus()
    if found.count > 0:
        pytest.skip(f"this machine has {found.count} usable GPUs")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(TESTS / "test_gpu_failures.py"), "-k", "missing_peer"],
                         capture_output=True, text=True, timeout=120, cwd=str(REPO_ROOT),
                         env=mpi_env({"DEEPEP_TEST_REQUIRE_GPUS": "1", "DEEPEP_TEST_ONE_GPU_MPI": "0"}))
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"needs 2 GPUs, {_harness.found_gpus()} (DEEPEP_TEST_REQUIRE_GPUS=1" in run.stdout, run.stdout
