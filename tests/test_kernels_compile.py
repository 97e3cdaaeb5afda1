"""Every kernel instance compiles with NVRTC for sm_90 (Hopper), on any machine, GPU or not.

NVRTC is a library, not a device feature: CuPy loads it from the ``nvidia-cuda-nvrtc`` wheel (the
``cuda12``/``cuda13`` extras) or the CUDA toolkit. These tests call ``cupy.cuda.nvrtc`` directly,
with the options the run-time build uses (``kernels.NVRTC_OPTIONS``), so a kernel that does not
compile fails CI even though CI has no GPU.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from _harness import skip_or_fail

from deepep_cupy.bench import own_kernels
from deepep_cupy.gpu import kernels

ARCH = "--gpu-architecture=sm_90"


def _nvrtc():
    """``cupy.cuda.nvrtc`` with the NVRTC library loaded; skips (fails on CI) when it cannot load."""
    try:
        import cupy  # noqa: F401  (loads the CUDA wheels' library paths)
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # ImportError, or the library itself missing
        skip_or_fail(f"NVRTC cannot be loaded, kernels NOT compiled: {type(exc).__name__}: {exc} "
                     "(install the cuda12 or cuda13 extra)")
    return nvrtc


def _compile(nvrtc, file_name: str, source: str, expressions, arch: str = ARCH):
    """Compile ``source``; return ``(lowered names, cubin size)``; fail with NVRTC's log."""
    prog = nvrtc.createProgram(source, file_name, [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(prog, expression)
        options = [*kernels.NVRTC_OPTIONS, arch]
        error = None
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            error = exc
        if error is not None:
            pytest.fail(f"NVRTC failed to compile {file_name} ({' '.join(options)}): {error}\n"
                        f"--- program log ---\n{nvrtc.getProgramLog(prog)}", pytrace=False)
        lowered = {}
        for expression in expressions:
            try:
                lowered[expression] = nvrtc.getLoweredName(prog, expression)
            except nvrtc.NVRTCError as exc:
                error = exc
            if error is not None:
                pytest.fail(f"{file_name}: no kernel instance {expression!r} after compiling "
                            f"(is it a __global__ template/function of that name?): {error}",
                            pytrace=False)
        cubin = nvrtc.getCUBIN(prog)
        return lowered, len(cubin)
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("file_name", sorted(kernels.SOURCES))
def test_source_compiles_for_sm90(file_name):
    nvrtc = _nvrtc()
    expressions = kernels.SOURCES[file_name]
    assert expressions, f"{file_name}: SOURCES lists no kernel instance"
    lowered, cubin_size = _compile(nvrtc, file_name, kernels.read_source(file_name), expressions)
    assert set(lowered) == set(expressions)
    assert all(lowered.values()), lowered
    assert cubin_size > 0, f"{file_name}: empty CUBIN"



def test_instances_compiled_in_threads_at_once_match_those_compiled_one_by_one():
    # kernels.warm_up compiles the instances a Buffer needs in threads at once (NVRTC runs without the GIL).
    nvrtc = _nvrtc()
    jobs = [("notify.cu", ["barrier_kernel"]), ("expand.cu", ["expand_kernel"]),
            ("layout.cu", ["dispatch_layout_kernel"])]

    def compile_job(job):
        file_name, expressions = job
        return _compile(nvrtc, file_name, kernels.read_source(file_name), expressions)

    one_by_one = [compile_job(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        at_once = list(pool.map(compile_job, jobs))
    assert at_once == one_by_one

#: Kernels outside the library (deepep_cupy/bench/kernels/), compiled by the benchmark or a probe
#: script with cupy.RawModule / RawKernel (extern "C", so each is named as written).
SCRIPT_KERNELS = {
    "bench_copy.cu": ["copy_int4"],
    "bench_gather.cu": ["gather_rows_int4"],
    "probe_sm_rates.cu": ["fan_out_registers", "fan_out_bulk", "sum_registers", "sum_bulk"],
}


@pytest.mark.parametrize("file_name", sorted(SCRIPT_KERNELS))
def test_benchmark_and_probe_kernels_compile_for_sm90(file_name):
    nvrtc = _nvrtc()
    lowered, cubin_size = _compile(nvrtc, file_name, own_kernels.read_source(file_name), SCRIPT_KERNELS[file_name])
    assert lowered == {name: name for name in SCRIPT_KERNELS[file_name]}
    assert cubin_size > 0, f"{file_name}: empty CUBIN"


def test_every_kernel_file_is_compiled_by_a_test():
    assert {path.name for path in kernels.kernel_dir().glob("*.cu")} == set(kernels.SOURCES)
    assert {path.name for path in own_kernels.KERNEL_DIR.glob("*.cu")} == set(SCRIPT_KERNELS)


def test_every_source_file_exists():
    folder = kernels.kernel_dir()
    missing = [name for name in kernels.SOURCES if not (folder / name).is_file()]
    assert not missing, f"listed in kernels.SOURCES but not in {folder}: {missing}"


@pytest.mark.parametrize("file_name", sorted(kernels.SOURCES))
def test_read_source_inlines_local_includes(file_name):
    text = kernels.read_source(file_name)
    left = re.findall(r'^\s*#\s*include\s+"[^"]*"', text, flags=re.MULTILINE)
    assert not left, f"{file_name}: includes left after read_source: {left}"


def test_the_bench_reads_its_own_folder_and_the_library_s_headers(tmp_path, monkeypatch):
    # A bench kernel may include a header of its folder or one of the library's (each once); the
    # library's kernel folder never holds the bench's sources.
    (tmp_path / "own.cuh").write_text('#include "common.cuh"\nstruct own_tag {};\n')
    (tmp_path / "probe.cu").write_text('#include "own.cuh"\n#include "common.cuh"\n__global__ void k() {}\n')
    monkeypatch.setattr(own_kernels, "KERNEL_DIR", tmp_path)
    text = own_kernels.read_source("probe.cu")
    assert "#include" not in text and text.count(kernels.read_source("common.cuh")) == 1
    assert text.index("struct own_tag") < text.index("void k")
    assert not set(SCRIPT_KERNELS) & {path.name for path in kernels.kernel_dir().iterdir()}


def test_read_source_inlines_each_header_once(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("#pragma once\nstruct common_tag {};\n")
    (tmp_path / "b.cuh").write_text('#include "common.cuh"\nstruct b_tag {};\n')
    (tmp_path / "a.cu").write_text('#include "b.cuh"\n  #  include "common.cuh"\n__global__ void k() {}\n')
    monkeypatch.setattr(kernels, "kernel_dir", lambda: tmp_path)
    text = kernels.read_source("a.cu")
    assert "#include" not in text
    assert text.count("struct common_tag") == 1
    assert text.index("struct common_tag") < text.index("struct b_tag") < text.index("__global__ void k")
