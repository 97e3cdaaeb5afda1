"""Helpers shared by the tests: how many GPUs there are, how to run a script under MPI, and how to
read the records the worker scripts print."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

#: The checkout's root (the folder holding ``deepep_cupy/`` and ``kernels/``).
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Worker scripts started by the MPI tests.
WORKERS = Path(__file__).resolve().parent / "workers"

#: Environment every MPI run gets (values already set by the caller win, see :func:`mpi_env`).
MPI_ENV_DEFAULTS: Dict[str, str] = {
    # Open MPI refuses to start as root without these (CI and the GPU machine run as root).
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # NVLink SHARP (multicast) is not available on the lent machines.
    "NCCL_NVLS_ENABLE": "0",
    # Workers print JSON lines that the tests read: do not let them sit in a buffer.
    "PYTHONUNBUFFERED": "1",
}


#: ``DEEPEP_TEST_ONE_GPU_MPI=1``: on a machine with fewer GPUs than an mpiexec run has ranks, put
#: every rank on GPU 0 (tests/workers/one_gpu_ranks.py) instead of skipping the run.
ONE_GPU_MPI = os.environ.get("DEEPEP_TEST_ONE_GPU_MPI", "0").strip() == "1"


@functools.lru_cache(maxsize=None)
def probe_gpus():
    """``deepep_cupy.gpu.check.probe()`` once per session: ``(count, reason)``, the reason saying why
    the probe failed (no CuPy, no driver, ...) or None."""
    try:
        from deepep_cupy.gpu.check import probe
    except Exception as exc:  # noqa: BLE001 - the package itself is broken: no GPU test can run
        from types import SimpleNamespace

        return SimpleNamespace(count=0, reason=f"deepep_cupy.gpu.check does not import ({type(exc).__name__}: {exc})")
    return probe()


def gpu_count() -> int:
    """The number of CUDA devices visible to this process; 0 when the probe failed (see :func:`probe_gpus`)."""
    return probe_gpus().count


def found_gpus() -> str:
    """``"found N"``, with the probe's reason when it failed: the end of every GPU skip reason."""
    found = probe_gpus()
    return f"found {found.count}" + (f": {found.reason}" if found.reason else "")


def required_gpus() -> int:
    """``DEEPEP_TEST_REQUIRE_GPUS`` (0 when unset): the GPUs this run promises (tests/conftest.py)."""
    value = os.environ.get("DEEPEP_TEST_REQUIRE_GPUS", "").strip() or "0"
    try:
        required = int(value)
    except ValueError:
        required = -1
    if required < 0:
        raise ValueError(f"DEEPEP_TEST_REQUIRE_GPUS={value!r}: expected a number of GPUs (0 or more)")
    return required


def skip_unless_gpus(need: int, what: str = "") -> None:
    """Skip the current test when fewer than ``need`` GPUs are usable, saying how many were found
    and why the probe failed; fail instead when ``DEEPEP_TEST_REQUIRE_GPUS=N`` is set and fewer than
    ``min(N, need)`` were found (tests/conftest.py states the rule)."""
    import pytest

    have = gpu_count()
    if have >= need:
        return
    message = f"{what or 'needs'} {need} GPUs, {found_gpus()}"
    required = required_gpus()
    if have < min(required, need):
        pytest.fail(f"{message} (DEEPEP_TEST_REQUIRE_GPUS={required}: too few usable GPUs is a failure)",
                    pytrace=False)
    pytest.skip(message)


def gpus_needed_under_mpiexec(num_ranks: int) -> int:
    """GPUs an mpiexec run of ``num_ranks`` GPU ranks needs: one per rank, or one in all with
    :data:`ONE_GPU_MPI`."""
    return 1 if ONE_GPU_MPI else num_ranks


def skip_unless_gpus_for_mpiexec(num_ranks: int) -> None:
    skip_unless_gpus(gpus_needed_under_mpiexec(num_ranks),
                     f"an mpiexec run of {num_ranks} ranks (one GPU per process; DEEPEP_TEST_ONE_GPU_MPI=1: "
                     f"one for all) needs")


def find_mpiexec() -> Optional[str]:
    """The MPI launcher to use, or None.

    Order: ``$MPIEXEC``; ``mpiexec``/``mpirun`` next to ``sys.executable`` (the mpich wheel puts
    them in the virtual environment's ``bin/``); ``mpiexec``/``mpirun`` on ``PATH``.
    """
    explicit = os.environ.get("MPIEXEC")
    if explicit:
        return explicit
    bin_dir = Path(sys.executable).parent  # not resolved: a venv's python is a symlink
    for name in ("mpiexec", "mpirun"):
        candidate = bin_dir / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    return None


def mpi_env(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``os.environ`` plus ``env``, with :data:`MPI_ENV_DEFAULTS` and the repo on ``PYTHONPATH``."""
    merged = dict(os.environ)
    if env:
        merged.update(env)
    for key, value in MPI_ENV_DEFAULTS.items():
        merged.setdefault(key, value)
    path = merged.get("PYTHONPATH", "")
    parts = [p for p in path.split(os.pathsep) if p]
    if str(REPO_ROOT) not in parts:
        parts.insert(0, str(REPO_ROOT))
    merged["PYTHONPATH"] = os.pathsep.join(parts)
    return merged


def local_gpu_args() -> List[str]:
    """``["--gpus", G]`` for an in-process worker or soak when ``DEEPEP_TEST_LOCAL_GPUS`` asks for
    GPUs ``0..G-1`` (at most the visible ones); else none (every visible GPU)."""
    wanted = int(os.environ.get("DEEPEP_TEST_LOCAL_GPUS") or 0)
    return ["--gpus", str(min(wanted, gpu_count()))] if wanted else []


def run_mpi(n: int, args: Sequence[str], timeout: float,
            env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python args...`` and return its CompletedProcess (text, output captured).

    The launcher runs in its own process group; when ``timeout`` seconds pass, the whole group is
    killed and an AssertionError carrying the output so far is raised (a hang never stays a hang).
    With :data:`ONE_GPU_MPI` on a machine with GPUs, but fewer than ``n``, the ranks share GPU 0.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise AssertionError("no mpiexec/mpirun found (set MPIEXEC, or install the 'test' extra: mpich)")
    return run_command([mpiexec, "-n", str(n), sys.executable,
                        *[str(a) for a in [*shared_gpu_launcher(n), *args]]], timeout, env)


def shared_gpu_launcher(n: int) -> List[Path]:
    """What to put before the worker of a job of ``n`` processes (mpiexec, torchrun): with
    :data:`ONE_GPU_MPI` on a machine with GPUs, but fewer than ``n``, the launcher that makes them
    share GPU 0 (tests/workers/one_gpu_ranks.py); else nothing."""
    return [WORKERS / "one_gpu_ranks.py"] if ONE_GPU_MPI and 0 < gpu_count() < n else []


def run_python(args: Sequence[str], timeout: float,
               env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """``python args...`` (a worker that starts its own ranks), as :func:`run_command` runs it."""
    return run_command([sys.executable, *[str(a) for a in args]], timeout, env)


def run_command(cmd: Sequence[str], timeout: float,
                env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root with :func:`mpi_env` in its own process group; on a timeout
    kill the group and raise an AssertionError carrying the output so far."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(env), cwd=str(REPO_ROOT), start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        _keep_log(cmd, f"timed out after {timeout:g} s", stdout, stderr)
        raise AssertionError(
            f"timed out after {timeout:g} s: {' '.join(cmd)}\n"
            f"--- stdout ---\n{stdout or ''}\n--- stderr ---\n{stderr or ''}") from None
    except BaseException:
        _stop(proc)
        raise
    _keep_log(cmd, f"exit {proc.returncode}", stdout, stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


#: ``DEEPEP_TEST_LOG_DIR``: every command run_command runs leaves its output there, numbered, as
#: soon as it ends, so that a GPU session cut short still has the workers' own reports.
LOG_DIR = os.environ.get("DEEPEP_TEST_LOG_DIR", "")
_logs_kept = [0]


def _keep_log(cmd: Sequence[str], how: str, stdout: Optional[str], stderr: Optional[str]) -> None:
    if not LOG_DIR:
        return
    os.makedirs(LOG_DIR, exist_ok=True)
    _logs_kept[0] += 1
    script = next((Path(c).stem for c in reversed(cmd) if c.endswith(".py")), Path(cmd[0]).name)
    path = Path(LOG_DIR) / f"{os.getpid()}-{_logs_kept[0]:03d}-{script}.log"
    path.write_text(f"$ {' '.join(cmd)}\n{how}\n--- stdout ---\n{stdout or ''}\n--- stderr ---\n{stderr or ''}")


def _stop(proc: subprocess.Popen, grace: float = 5.0):
    """End a launcher and everything it started; return the output it had written.

    The launcher is asked first (SIGTERM), so that it can stop and reap its own children; then
    the whole process group is killed, which takes care of anything left over.
    """
    try:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        stdout, stderr = None, None
    _kill_group(proc.pid)
    try:
        more_out, more_err = proc.communicate(timeout=grace)
    except (subprocess.TimeoutExpired, ValueError):  # pragma: no cover - ignores SIGKILL / closed
        more_out, more_err = "", ""
    return (stdout or more_out or ""), (stderr or more_err or "")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module of that name (its main does not run)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_constant(path: Path, name: str):
    """The value of ``NAME = <plain data>`` at the top level of a worker script, read without importing
    it (a worker imports what only its own folder, or an MPI launch, provides)."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{Path(path).name} defines no {name}")


def describe(result: subprocess.CompletedProcess) -> str:
    """A failure message showing a finished run's command, exit code and output."""
    return (f"command: {' '.join(result.args)}\nexit code: {result.returncode}\n"
            f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}")


def on_ci() -> bool:
    """True under CI (``CI=true``), where a missing tool is a failure, not a reason to skip."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_or_fail(reason: str, allow_module_level: bool = False) -> None:
    """Skip the current test (or module) with a loud ``reason``; under CI, fail with it instead."""
    import pytest

    if on_ci():
        pytest.fail(f"{reason} (CI=true: this must work on CI)", pytrace=False)
    pytest.skip(f"!!! {reason}", allow_module_level=allow_module_level)


def import_or_skip(name: str, needed_for: str = "", allow_module_level: bool = False):
    """``import name``, or skip the current test saying so (under CI, fail: :func:`skip_or_fail`).

    Every optional dependency (torch, matplotlib, ...) is asked for this way, so that CI, which
    installs them, cannot pass while their tests skip."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        skip_or_fail(f"{name} does not import ({type(exc).__name__}: {exc})"
                     + (f"; needed for {needed_for}" if needed_for else ""), allow_module_level)


def gloo_records(rank_main, num_ranks: int, out_dir: Path, *args) -> List[dict]:
    """Every rank's ``rank_main(rank, num_ranks, *args)`` (a JSON-able record), each rank a process
    started the PyTorch way: ``torch.multiprocessing.spawn`` + ``init_process_group`` over a TCP
    store, Gloo. ``rank_main`` must be a module-level function (the processes import it)."""
    import torch

    torch.multiprocessing.spawn(_gloo_rank, args=(rank_main, num_ranks, _free_port(), str(out_dir), args),
                                nprocs=num_ranks, join=True)
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(num_ranks)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, rank_main, num_ranks: int, port: int, out_dir: str, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    try:
        record = rank_main(rank, num_ranks, *args)
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(record, f)


def worker_records(output: str, tag: str = "RESULT") -> List[dict]:
    """The ``TAG {json}`` records a worker printed, in order.

    Read by position rather than by line, so that records of ranks whose output interleaves on one
    line are still found whole.
    """
    decoder, records, pos = json.JSONDecoder(), [], 0
    marker = tag + " "
    while (pos := output.find(marker, pos)) >= 0:
        record, pos = decoder.raw_decode(output, pos + len(marker))
        records.append(record)
    return records


def records_by(output: str, key: str, tag: str = "RESULT") -> Dict[str, List[dict]]:
    """:func:`worker_records` grouped by ``record[key]`` (e.g. the scenario), each in print order."""
    grouped: Dict[str, List[dict]] = {}
    for record in worker_records(output, tag):
        grouped.setdefault(record[key], []).append(record)
    return grouped


def mpi_job_records(worker: str, jobs: Mapping[int, Sequence[int]], timeout: float, log_name: str,
                    env: Optional[Mapping[str, str]] = None):
    """Run ``mpiexec -n R worker L...`` for each ``R: (L, ...)`` of ``jobs`` that the GPUs allow;
    ``({(R, case): [records]}, {R: output})``. A job that timed out still gives the records it
    printed; with ``DEEPEP_TEST_LOG_DIR`` each job's output is kept as ``{log_name}_{R}_ranks.log``."""
    results, outputs = {}, {}
    log_dir = os.environ.get("DEEPEP_TEST_LOG_DIR")
    for num_ranks, ranks_per_node in jobs.items():
        if gpu_count() < gpus_needed_under_mpiexec(num_ranks):
            continue
        try:
            run = run_mpi(num_ranks, [str(WORKERS / worker), *map(str, ranks_per_node)], timeout=timeout,
                          env={"DEEPEP_TEST_TIMEOUT_S": os.environ.get("DEEPEP_TEST_TIMEOUT_S", "60"), **(env or {})})
            output, stdout = describe(run), run.stdout
        except AssertionError as exc:  # a job that timed out: its records so far still count
            output = stdout = str(exc)
        outputs[num_ranks] = output
        if log_dir:
            with open(os.path.join(log_dir, f"{log_name}_{num_ranks}_ranks.log"), "w") as log:
                log.write(output)
        try:
            records = records_by(stdout, "case")
        except ValueError:  # a record cut short by the timeout
            records = {}
        results.update({(num_ranks, case): entries for case, entries in records.items()})
    return results, outputs
