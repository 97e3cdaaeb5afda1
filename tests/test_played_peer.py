"""scripts/host_path_alone.py's stand-ins for the kernels (the peer played on the GPU) compile.

They are generated from each kernel's parameter list (kernels.SIGNATURES), so they follow the
kernels as those change; NVRTC only, on any machine.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_kernels_compile import _compile, _nvrtc

from deepep_cupy.gpu import kernels

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("kernel", sorted(kernels.SIGNATURES))
def test_the_kernel_playing_the_peer_compiles_with_the_kernels_parameters(kernel, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the script imports its neighbours
    spec = importlib.util.spec_from_file_location("host_path_alone", SCRIPTS / "host_path_alone.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = module.played_source(kernel, 256, [16] * 128, 17.0, 12.0)
    assert all(f" {name}" in source for name, _ in kernels.SIGNATURES[kernel])
    lowered, cubin_size = _compile(_nvrtc(), "played.cu", source, ["played"])
    assert lowered == {"played": "played"} and cubin_size > 0
