"""What pyproject.toml promises holds: each Python version it admits is tested by CI and named in
the classifiers, the version is written once, mypy checks the whole package, and an installed wheel
carries the licence, the kernels (the library's and the benchmark's own), the ``py.typed`` marker
and a working ``deepep-cupy-bench`` command."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from email.parser import Parser

import pytest
from _harness import REPO_ROOT, describe, import_or_skip, probe_gpus

import deepep_cupy
from deepep_cupy.gpu.check import NO_GPU_EXIT_STATUS

#: What the wheel is built from (pyproject.toml's packages, readme and licence).
PACKAGED = ["pyproject.toml", "README.md", "LICENSE", "deepep_cupy", "kernels"]

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _admitted_minor_versions() -> list:
    """The 3.x versions requires-python admits: it must read ">=3.A,<3.B" (a bound at each end)."""
    bounds = re.fullmatch(r">=3\.(\d+),\s*<3\.(\d+)", PROJECT["requires-python"])
    assert bounds, f"requires-python {PROJECT['requires-python']!r}: expected '>=3.A,<3.B'"
    return [f"3.{minor}" for minor in range(int(bounds.group(1)), int(bounds.group(2)))]


def test_ci_runs_the_suite_on_every_python_version_that_requires_python_admits():
    listed = re.search(r"^PYTHON_VERSIONS=\(([^)]*)\)$", (REPO_ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    assert listed and listed.group(1).split() == _admitted_minor_versions()


def test_the_classifiers_name_exactly_the_admitted_python_versions():
    named = [c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"]
             if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert named == _admitted_minor_versions()


def test_this_interpreter_is_one_that_requires_python_admits():
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in _admitted_minor_versions()


def test_the_version_is_written_once_in_the_package():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    setuptools_dynamic = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert setuptools_dynamic["version"] == {"attr": "deepep_cupy.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", deepep_cupy.__version__)


def test_mypy_is_pinned_in_the_test_extra_and_make_lint_runs_it():
    assert [r for r in PROJECT["optional-dependencies"]["test"] if r.startswith("mypy")] == ["mypy==1.13.0"]
    lint = re.search(r"^lint:.*\n((?:\t.*\n)+)", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE)
    assert lint and lint.group(1).split("\n")[:2] == ["\t$(PY) -m ruff check .", "\t$(PY) -m mypy"]


def test_mypy_checks_the_whole_package_and_ignores_no_errors_wholesale():
    mypy = PYPROJECT["tool"]["mypy"]
    assert mypy["packages"] == ["deepep_cupy"] and "ignore_errors" not in mypy
    # Overrides may only say that a third-party module has no types (or is not installed).
    for override in mypy.get("overrides", []):
        assert set(override) == {"module", "ignore_missing_imports"}, override
        assert not any(m.split(".")[0] == "deepep_cupy" for m in override["module"]), override


#: ``# type: ignore[code] # why`` (or ``- why``): an ignore that names what it silences and says why.
EXPLAINED_IGNORE = re.compile(r"type: ignore\[[a-z-]+(, *[a-z-]+)*\] *(#|-) *\w")


def test_every_type_ignore_names_its_error_code_and_why():
    unexplained = [f"{path.relative_to(REPO_ROOT)}:{n}" for path in sorted((REPO_ROOT / "deepep_cupy").rglob("*.py"))
                   for n, line in enumerate(path.read_text().splitlines(), 1)
                   if "type: ignore" in line and not EXPLAINED_IGNORE.search(line)]
    assert unexplained == []


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package built as a wheel and installed (without its dependencies, which this interpreter
    has) into a folder of its own; returns that folder."""
    import_or_skip("setuptools", "building the wheel (the test extra brings it)")
    # Built from a copy of what the wheel is made of: setuptools writes build/ and *.egg-info into
    # the tree it builds, which must not be the checkout.
    source = tmp_path_factory.mktemp("source")
    for name in PACKAGED:
        copy = shutil.copytree if (REPO_ROOT / name).is_dir() else shutil.copy2
        copy(REPO_ROOT / name, source / name)
    target = tmp_path_factory.mktemp("installed")
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
                            "--target", str(target), str(source)], capture_output=True, text=True, timeout=300,
                           cwd=str(source))
    assert build.returncode == 0, describe(build)
    return target


def _metadata(installed):
    (info,) = installed.glob("deepep_cupy-*.dist-info")
    return info, Parser().parsestr((info / "METADATA").read_text())


def test_the_wheel_states_the_licence_version_and_pythons(installed):
    info, metadata = _metadata(installed)
    assert metadata["Version"] == deepep_cupy.__version__
    assert metadata["License-Expression"] == "MIT" and metadata["License-File"] == "LICENSE"
    assert (info / "licenses" / "LICENSE").read_text() == (REPO_ROOT / "LICENSE").read_text()
    assert metadata["Requires-Python"].replace(" ", "") in (">=3.11,<3.14", "<3.14,>=3.11")


def test_the_wheel_marks_the_package_as_typed(installed):
    assert (REPO_ROOT / "deepep_cupy" / "py.typed").is_file()
    assert (installed / "deepep_cupy" / "py.typed").is_file()


def _kernel_sources(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".cu", ".cuh"))


def test_the_wheel_carries_every_kernel_source(installed):
    assert _kernel_sources(installed / "deepep_cupy" / "_kernels") == _kernel_sources(REPO_ROOT / "kernels")


def test_the_wheel_carries_the_benchmark_s_own_kernels_where_the_bench_reads_them(installed):
    bench_kernels = REPO_ROOT / "deepep_cupy" / "bench" / "kernels"
    assert _kernel_sources(installed / "deepep_cupy" / "bench" / "kernels") == _kernel_sources(bench_kernels) != []
    run = _run_installed(installed, sys.executable, "-c", "from deepep_cupy.bench import own_kernels; "
                         "print(own_kernels.KERNEL_DIR); print(own_kernels.read_source('bench_copy.cu'))")
    assert run.returncode == 0 and run.stdout.startswith(str(installed)), describe(run)
    assert "copy_int4" in run.stdout, describe(run)


def _run_installed(installed, *command):
    """``command`` with the installed package alone on PYTHONPATH (not the checkout's, which make puts there)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(installed))


def _bench_command(installed, *args):
    """The installed ``deepep-cupy-bench`` run with ``args``."""
    script = installed / "bin" / "deepep-cupy-bench"
    assert script.is_file(), sorted(p.name for p in (installed / "bin").iterdir())
    return _run_installed(installed, sys.executable, script, *args)


def test_the_installed_package_is_the_one_its_command_imports(installed):
    run = _run_installed(installed, sys.executable, "-c", "import deepep_cupy; print(deepep_cupy.__file__)")
    assert run.returncode == 0 and run.stdout.startswith(str(installed)), describe(run)


def test_the_console_script_lists_the_benchmark_options(installed):
    run = _bench_command(installed, "--help")
    assert run.returncode == 0 and run.stdout.startswith("usage: deepep-cupy-bench "), describe(run)
    assert "--num-tokens" in run.stdout, describe(run)


def test_the_console_script_without_a_gpu_says_so_in_one_sentence(installed):
    if probe_gpus().count:
        pytest.skip("a GPU is visible: the benchmark would run")
    run = _bench_command(installed)
    assert run.returncode == NO_GPU_EXIT_STATUS, describe(run)
    assert run.stderr.strip().count("\n") == 0, describe(run)
    assert run.stderr.startswith("deepep-cupy-bench needs a CUDA GPU, but "), describe(run)
