"""How long the first Buffer() takes with an empty kernel cache, and with a warm one.

    python scripts/first_use_time.py [--ranks 2] [--gpus N] [--serial]
    python scripts/first_use_time.py --nvrtc [--ranks 2] [--hot-path] [--arch 90] [--threads N]

GPU mode: runs itself twice, each time in a fresh process with CUPY_CACHE_DIR pointed at one new
temporary folder: first with it empty (every kernel instance is compiled), then warm (read back
from it). Each run starts ``--ranks`` in-process ranks (``run_local_group``, rank r on GPU
r % gpus: with one GPU the ranks share it and compile every instance up front) and prints the
seconds of ``import deepep_cupy``, of the slowest rank's ``Buffer()`` and of its
``kernels.warm_up``. ``--serial`` compiles one instance at a time, as warm_up did before it
compiled in threads.

NVRTC mode (no GPU needed): compiles the instances such a Buffer compiles
(``kernels.warm_up_instances(ranks, every_instance=True)``; ``--hot-path``: those of one rank per
GPU) with NVRTC alone for ``sm_<arch>``, with the options CuPy adds to ``kernels.NVRTC_OPTIONS``,
first one at a time, then in ``kernels.compile_threads()`` threads at once, and prints the
seconds (wall and CPU) of each instance and of both ways. On a busy machine the CPU seconds are
the steadier figures: their sum is a serial compile's time, the longest one the least a compile
in threads can take.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's deepep_cupy first

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--ranks", type=int, default=2)
parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: every visible one)")
parser.add_argument("--serial", action="store_true", help="compile one kernel instance at a time")
parser.add_argument("--nvrtc", action="store_true", help="time NVRTC alone (CPU)")
parser.add_argument("--hot-path", action="store_true", help="--nvrtc: the instances of one rank per GPU")
parser.add_argument("--arch", default="90", help="--nvrtc: the sm_ architecture")
parser.add_argument("--threads", type=int, default=0, help="--nvrtc: threads (default: kernels.compile_threads())")
parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
args = parser.parse_args()


def one_run() -> dict:
    """One process's first Buffer() on every rank (CUPY_CACHE_DIR set by the parent)."""
    start = time.perf_counter()
    import cupy

    import deepep_cupy as ep
    from deepep_cupy.gpu import kernels
    imported = time.perf_counter() - start

    if args.serial:
        kernels.compile_threads = lambda: 1
    warm_up_s = {}
    warm_up = kernels.warm_up

    def timed_warm_up(*a, **kw):
        begin = time.perf_counter()
        warm_up(*a, **kw)
        warm_up_s[threading.get_ident()] = time.perf_counter() - begin

    kernels.warm_up = timed_warm_up  # Buffer() calls it through the module
    gpus = args.gpus or cupy.cuda.runtime.getDeviceCount()
    devices = [r % gpus for r in range(args.ranks)]
    num_nvl_bytes = ep.get_nvl_buffer_size_hint(7168 * 2, args.ranks)

    def rank(group):
        begin = time.perf_counter()
        buffer = ep.Buffer(group, num_nvl_bytes)
        seconds = time.perf_counter() - begin
        buffer.destroy()
        return seconds

    buffer_s = ep.run_local_group(rank, devices=devices)
    shared = max(devices.count(d) for d in devices) > 1
    return dict(import_s=imported, buffer_s=max(buffer_s), warm_up_s=max(warm_up_s.values()), devices=devices,
                instances=len(kernels.warm_up_instances(args.ranks, every_instance=shared)),
                threads=kernels.compile_threads())


def gpu_mode() -> None:
    from deepep_cupy.gpu.check import exit_unless_gpu

    # Without a GPU: one sentence and exit status 2, as every command (--nvrtc needs none).
    exit_unless_gpu("scripts/first_use_time.py without --nvrtc")
    with tempfile.TemporaryDirectory(prefix="deepep_cupy-first-use-") as cache:
        for label in ("empty cache", "warm cache"):
            command = [sys.executable, os.path.abspath(__file__), "--child", "--ranks", str(args.ranks),
                       "--gpus", str(args.gpus)] + (["--serial"] if args.serial else [])
            run = subprocess.run(command, env=dict(os.environ, CUPY_CACHE_DIR=cache), capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"{label}: the run failed (exit {run.returncode})\n{run.stdout}{run.stderr}")
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{label}: first Buffer() {r['buffer_s']:.2f} s (slowest of {args.ranks} ranks on GPUs "
                  f"{r['devices']}; its warm_up {r['warm_up_s']:.2f} s: {r['instances']} instances, "
                  f"{r['threads']} compile threads), import {r['import_s']:.2f} s; "
                  f"{len(os.listdir(cache))} files in the cache", flush=True)


def nvrtc_mode() -> None:
    import cupy  # noqa: F401  (loads the CUDA wheels' library paths)
    from cupy.cuda import nvrtc

    from deepep_cupy.gpu import kernels

    # What cupy.RawModule adds to our options (cupy/cuda/compiler.py); -arch=sm_ gives a cubin.
    options = [*kernels.NVRTC_OPTIONS, "-ftz=true", f"-arch=sm_{args.arch}", "--device-as-default-execution-space"]

    def compile_one(expression: str):
        """(wall seconds, this thread's CPU seconds) of one instance's compile."""
        file_name = kernels.source_of(expression)
        begin, begin_cpu = time.perf_counter(), time.thread_time()
        program = nvrtc.createProgram(kernels.read_source(file_name), file_name, [], [])
        try:
            nvrtc.addNameExpression(program, expression)
            nvrtc.compileProgram(program, options)
            nvrtc.getLoweredName(program, expression)
            nvrtc.getCUBIN(program)
        finally:
            nvrtc.destroyProgram(program)
        return time.perf_counter() - begin, time.thread_time() - begin_cpu

    instances = kernels.warm_up_instances(args.ranks, every_instance=not args.hot_path)
    threads = args.threads or kernels.compile_threads()
    print(f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, sm_{args.arch}, {len(instances)} instances "
          f"({'one rank per GPU' if args.hot_path else 'ranks sharing a GPU'}, {args.ranks} ranks), "
          f"{os.cpu_count()} CPUs", flush=True)
    compile_one("dispatch_layout_kernel")  # NVRTC's own start, paid once either way
    begin = time.perf_counter()
    cpu = {}
    for expression in instances:
        wall, cpu[expression] = compile_one(expression)
        print(f"  {expression:36s} {wall:.2f} s (CPU {cpu[expression]:.2f} s)", flush=True)
    one_by_one = time.perf_counter() - begin
    begin = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(compile_one, instances))
    at_once = time.perf_counter() - begin
    print(f"one at a time: {one_by_one:.2f} s (CPU {sum(cpu.values()):.2f} s); in {threads} threads at once: "
          f"{at_once:.2f} s; the longest instance alone: CPU {max(cpu.values()):.2f} s")

if args.child:
    print(json.dumps(one_run()))
elif args.nvrtc:
    nvrtc_mode()
else:
    gpu_mode()
