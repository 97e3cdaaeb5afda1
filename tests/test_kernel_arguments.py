"""Kernel argument packing: the Python signatures mirror the CUDA declarations (CPU only)."""

import ctypes
import re
import struct
from types import SimpleNamespace

import pytest

from deepep_cupy.gpu import kernels, launch
from deepep_cupy.gpu.launch import KernelCall, ParameterBlock, parameter_struct


def _declared_parameters(kernel):
    """[(name, kind)] parsed from the kernel's ``__global__`` declaration in kernels/*.cu (a
    namespaced kernel, ``ns::name``, by its own name)."""
    file_name = next(f for f, exprs in kernels.SOURCES.items() if any(e.split("<")[0] == kernel for e in exprs))
    text = kernels.read_source(file_name)
    match = re.search(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s*)?(?:void\s+)?"
                      + kernel.split("::")[-1] + r"\s*\(([^)]*)\)", text)
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


def test_parameters_sit_at_their_c_alignment(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k", (("a", "i32"), ("b", "i64"), ("c", "i32"), ("d", "ptr"), ("e", "f32")))
    fields = parameter_struct("k")
    assert [getattr(fields, name).offset for name in "abcde"] == [0, 8, 16, 24, 32]


@pytest.mark.parametrize("kernel", sorted(kernels.SIGNATURES))
def test_the_parameter_block_is_laid_out_like_a_c_struct(kernel):
    codes = {"ptr": "Q", "i32": "i", "i64": "q", "f32": "f"}
    layout = "@" + "".join(codes[kind] for _, kind in kernels.SIGNATURES[kernel])
    assert ctypes.sizeof(parameter_struct(kernel)) == struct.calcsize(layout)


def test_the_block_holds_fixed_and_assigned_values(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k2", (("n", "i32"), ("deadline", "i64"), ("p", "ptr"), ("scale", "f32")))
    block = ParameterBlock("k2", n=-3, deadline=2 ** 40)
    block.assign({"p": 0xDEADBEEF, "scale": 1.5})
    assert struct.unpack("@iqQf", block.as_bytes()[:struct.calcsize("@iqQf")]) == (-3, 2 ** 40, 0xDEADBEEF, 1.5)


def test_the_pointer_table_points_at_each_field(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k3", (("a", "i32"), ("b", "ptr")))
    block = ParameterBlock("k3", a=7, b=9)
    table = (ctypes.c_void_p * 2).from_address(block.table_address)
    assert ctypes.c_int32.from_address(table[0]).value == 7 and ctypes.c_uint64.from_address(table[1]).value == 9


def test_none_is_a_null_pointer(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k4", (("p", "ptr"),))
    assert struct.unpack("@Q", ParameterBlock("k4", p=None).as_bytes()) == (0,)


def test_unset_parameters_are_named(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k5", (("alpha", "i32"), ("beta", "i32"), ("gamma", "ptr")))
    assert ParameterBlock("k5", alpha=1).missing({"gamma": 2}) == ["beta"]


def test_an_unknown_fixed_argument_is_refused(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k6", (("alpha", "i32"),))
    with pytest.raises(TypeError, match=r"k6 has no parameters \['delta'\]"):
        ParameterBlock("k6", delta=2)


def test_per_call_values_are_packed_into_their_fields_around_fixed_ones(monkeypatch):
    kinds = (("p", "ptr"), ("n", "i32"), ("q", "ptr"), ("fixed", "i32"), ("w", "f32"), ("d", "i64"))
    monkeypatch.setitem(kernels.SIGNATURES, "k7", kinds)
    block = ParameterBlock("k7", fixed=-5)
    per_call = ("p", "n", "q", "w", "d")
    view = memoryview(block.values).cast("B")
    for packer, offset, first, end in block.packers(per_call):
        packer.pack_into(view, offset, *(0xABCDEF0123, 7, 0, 2.5, -2 ** 40)[first:end])
    assert struct.unpack("@QiQifq", block.as_bytes()) == (0xABCDEF0123, 7, 0, -5, 2.5, -2 ** 40)
    # p, n, q are one run (with the padding after n), w and d another.
    assert [(offset, first, end) for _, offset, first, end in block.packers(per_call)] == [(0, 0, 3), (28, 3, 5)]


def test_per_call_parameters_must_follow_the_declaration_order(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k8", (("a", "ptr"), ("b", "i32")))
    with pytest.raises(TypeError, match="declaration order"):
        ParameterBlock("k8").packers(("b", "a"))


def test_a_call_site_whose_per_call_parameters_leave_one_unset_is_refused_when_bound(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k9", (("a", "ptr"), ("b", "i32"), ("c", "i32")))
    monkeypatch.setattr(kernels, "get_kernel", lambda name: SimpleNamespace(kernel=SimpleNamespace(ptr=0)))
    with pytest.raises(TypeError, match=r"leave \['c'\] unset"):
        KernelCall("k9", grid=1, per_call=("a", "b"))
    with pytest.raises(TypeError, match=r"repeat fixed ones \['b'\]"):
        KernelCall("k9", grid=1, per_call=("a", "b"), b=1, c=2)


def test_a_call_site_with_every_parameter_fixed_runs_without_values_and_must_fix_them_all(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k11", (("a", "ptr"), ("b", "i32")))
    monkeypatch.setattr(kernels, "get_kernel", lambda name: SimpleNamespace(kernel=SimpleNamespace(ptr=0)))
    monkeypatch.setattr(kernels, "block_threads", lambda kernel: 32)
    launched = []
    monkeypatch.setattr(launch, "launch", lambda call, stream: launched.append((stream, call.params.as_bytes())))
    KernelCall("k11", grid=1, a=0x55, b=7).run(0x9)
    assert launched == [(0x9, struct.pack("@Qi4x", 0x55, 7))]
    with pytest.raises(TypeError, match=r"leave \['b'\] unset"):
        KernelCall("k11", grid=1, a=0x55)


def test_run_launches_with_the_per_call_values_written(monkeypatch):
    monkeypatch.setitem(kernels.SIGNATURES, "k10", (("a", "ptr"), ("b", "i32"), ("c", "i32")))
    monkeypatch.setattr(kernels, "get_kernel", lambda name: SimpleNamespace(kernel=SimpleNamespace(ptr=0)))
    monkeypatch.setattr(kernels, "block_threads", lambda kernel: 32)
    launched = []
    monkeypatch.setattr(launch, "launch", lambda call, stream: launched.append((stream, call.params.as_bytes())))
    call = KernelCall("k10", grid=1, per_call=("a", "c"), b=3)
    call.run(0x77, 0x1234, 9)
    assert launched == [(0x77, struct.pack("@Qii", 0x1234, 3, 9))]


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
