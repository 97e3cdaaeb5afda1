"""One NCCL loader (CPU): the rail transport's automatic choice and the benchmark's NCCL baseline
find the same libnccl, or both say why not, naming what they tried."""
import sys
import types

import pytest

from deepep_cupy.bench import nccl as bench_nccl
from deepep_cupy.errors import NcclUnavailable
from deepep_cupy.transports import factory, nccl_library


@pytest.fixture
def cupy_without_nccl(monkeypatch, tmp_path):
    """CuPy's bindings unable to load libnccl, and nothing on sys.path but ``tmp_path``."""
    import cupy.cuda

    missing = types.ModuleType("cupy.cuda.nccl")
    missing.available = False
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", missing)
    monkeypatch.setattr(cupy.cuda, "nccl", missing, raising=False)
    monkeypatch.setattr(nccl_library, "_loaded", None)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delenv(nccl_library.NCCL_LIB_ENV, raising=False)
    return tmp_path


def test_the_named_library_is_tried_first_then_the_wheels(cupy_without_nccl, monkeypatch):
    wheel = cupy_without_nccl / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    wheel.parent.mkdir(parents=True)
    wheel.write_text("")
    monkeypatch.setenv(nccl_library.NCCL_LIB_ENV, "/opt/mine/libnccl.so.2")
    assert nccl_library._candidate_paths() == ["/opt/mine/libnccl.so.2", str(wheel)]


def test_a_library_that_does_not_load_is_named_in_the_error(cupy_without_nccl, monkeypatch):
    not_a_library = cupy_without_nccl / "libnccl.so.2"
    not_a_library.write_text("not ELF")
    monkeypatch.setenv(nccl_library.NCCL_LIB_ENV, str(not_a_library))
    with pytest.raises(NcclUnavailable, match=f"DEEPEP_CUPY_NCCL_LIB.*tried.*{not_a_library}"):
        nccl_library.load_nccl()
    assert nccl_library.nccl_or_none() is None
    assert factory.nccl_module() is None


def test_the_transport_and_the_benchmark_share_the_loader(monkeypatch):
    bindings = object()
    monkeypatch.setattr(nccl_library, "_loaded", bindings)
    assert factory.nccl_module() is bindings
    assert bench_nccl.load_nccl is nccl_library.load_nccl
    assert bench_nccl.load_nccl() is bindings
