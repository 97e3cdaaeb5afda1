"""Kernel argument packing: the Python signatures mirror the CUDA declarations (CPU only)."""

import re
import struct

import pytest

from deepep_cupy import kernels


def _declared_parameters(kernel):
    """[(name, kind)] parsed from the kernel's ``__global__`` declaration in kernels/*.cu."""
    file_name = next(f for f, exprs in kernels.SOURCES.items() if any(e.split("<")[0] == kernel for e in exprs))
    text = kernels.read_source(file_name)
    match = re.search(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?(?:void\s+)?"
                      + kernel + r"\s*\(([^)]*)\)", text)
    assert match, f"{kernel}: declaration not found"
    params = []
    for declaration in match.group(1).split(","):
        declaration = " ".join(declaration.split())
        name = re.findall(r"\w+", declaration)[-1]
        if "*" in declaration:
            kind = "ptr"
        elif "int64_t_" in declaration:
            kind = "i64"
        elif "float" in declaration:
            kind = "f32"
        else:
            kind = "i32"
        params.append((name, kind))
    return params


@pytest.mark.parametrize("kernel", sorted(kernels.SIGNATURES))
def test_signature_matches_the_cuda_declaration(kernel):
    assert list(kernels.SIGNATURES[kernel]) == _declared_parameters(kernel)


@pytest.mark.parametrize("kernel", sorted(kernels.SIGNATURES))
def test_every_signature_has_a_block_size_and_a_compiled_instance(kernel):
    assert kernels.block_threads(kernel) % 32 == 0
    assert any(e.split("<")[0] == kernel for exprs in kernels.SOURCES.values() for e in exprs)


def test_parameters_sit_at_their_c_alignment():
    packer = kernels.ArgumentPacker([("a", "i32"), ("b", "i64"), ("c", "i32"), ("d", "ptr"), ("e", "f32")])
    assert packer.offsets == (0, 8, 16, 24, 32)


def test_packed_buffer_holds_the_values():
    packer = kernels.ArgumentPacker([("n", "i32"), ("deadline", "i64"), ("ptr", "ptr"), ("scale", "f32")])
    packed = packer.pack({"n": -3, "deadline": 2 ** 40, "ptr": 0xDEADBEEF, "scale": 1.5})
    assert struct.unpack("@iqQf", packed) == (-3, 2 ** 40, 0xDEADBEEF, 1.5)


def test_none_is_a_null_pointer():
    packer = kernels.ArgumentPacker([("p", "ptr")])
    assert struct.unpack("@Q", packer.pack({"p": None})) == (0,)


def test_missing_and_unexpected_arguments_are_named():
    packer = kernels.ArgumentPacker([("alpha", "i32"), ("beta", "i32")])
    with pytest.raises(TypeError, match=r"missing \['beta'\], unexpected \['gamma'\]"):
        packer.pack({"alpha": 1, "gamma": 2})


def test_an_object_that_is_no_pointer_is_refused():
    packer = kernels.ArgumentPacker([("p", "ptr")])
    with pytest.raises(TypeError, match="device pointer"):
        packer.pack({"p": "not a pointer"})


def test_name_expressions_of_template_instances():
    assert kernels.name_expression("dispatch_kernel", (4,)) == "dispatch_kernel<4>"
    assert kernels.name_expression("combine_kernel", ("bf16_t", 2)) == "combine_kernel<bf16_t, 2>"
    assert kernels.name_expression("barrier_kernel") == "barrier_kernel"
    for args in [(r,) for r in kernels.RANK_COUNTS]:
        assert kernels.name_expression("dispatch_kernel", args) in kernels.SOURCES["dispatch.cu"]


def test_kernel_dir_can_be_overridden(tmp_path, monkeypatch):
    (tmp_path / "common.cuh").write_text("// stand-in\n")
    monkeypatch.setenv("DEEPEP_CUPY_KERNEL_DIR", str(tmp_path))
    assert kernels.kernel_dir() == tmp_path
