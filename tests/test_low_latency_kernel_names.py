"""The decode kernels are named as DeepEP's benchmark looks for them (CPU; NVRTC only).

DeepEP's ``bench_kineto`` (tests/utils.py of DeepEP) needs exactly one profiler-table line that
contains ``dispatch`` (resp. ``combine``) and trace events whose names contain ``::dispatch``
(resp. ``::combine``): its own kernels are ``deep_ep::internode_ll::dispatch<...>``. The profiler
shows a kernel by its demangled name, ``void deepep_cupy::low_latency::dispatch(void*, ...)``.
"""

from __future__ import annotations

from test_kernels_compile import _compile, _nvrtc

from deepep_cupy.gpu import kernels
from deepep_cupy.low_latency import path as low_latency


def test_the_decode_kernels_sit_in_a_namespace_named_as_deepep_s_benchmark_looks_for_them():
    names = kernels.SOURCES["low_latency.cu"]
    assert set(names) == {low_latency.DISPATCH_KERNEL, low_latency.COMBINE_KERNEL, low_latency.BARRIER_KERNEL}
    for word in ("dispatch", "combine"):
        assert sum(word in name for name in names) == 1
        assert sum(name.endswith(f"::{word}") for name in names) == 1


def test_the_compiled_decode_kernels_carry_their_namespace_in_the_symbol():
    lowered, _ = _compile(_nvrtc(), "low_latency.cu", kernels.read_source("low_latency.cu"),
                          kernels.SOURCES["low_latency.cu"])
    # Itanium mangling of deepep_cupy::low_latency::<name>(...): _ZN11deepep_cupy11low_latency<len><name>E...
    assert lowered[low_latency.DISPATCH_KERNEL].startswith("_ZN11deepep_cupy11low_latency8dispatchE")
    assert lowered[low_latency.COMBINE_KERNEL].startswith("_ZN11deepep_cupy11low_latency7combineE")
