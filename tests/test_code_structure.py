"""The shape of the code (CPU): the Buffer composes its paths, the layers import one way.

docs/DESIGN.md draws the layers; these tests keep them: the Buffer is a facade that owns its
paths as objects (no base classes of ours), nothing below it imports it, the leaves import
nothing of ours, and the references stay NumPy.
"""

import ast
from pathlib import Path

import pytest

import deepep_cupy
from deepep_cupy.buffer import Buffer

PACKAGE = Path(deepep_cupy.__file__).resolve().parent


def ours_imported_by(module: str) -> set:
    """The modules of this package that ``deepep_cupy/<module>.py`` imports (at any depth of its code)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith("deepep_cupy"):
                found.add(node.module.split(".")[1] if "." in node.module else "__init__")
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("deepep_cupy."))
    return found


def modules():
    return sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def test_the_buffer_has_no_base_class_of_this_package():
    assert all(not base.__module__.startswith("deepep_cupy") for base in Buffer.__mro__[1:])


def test_the_buffer_owns_its_intranode_paths_as_objects():
    from deepep_cupy.combine_path import CombinePath
    from deepep_cupy.dispatch_path import DispatchPath

    assert not issubclass(Buffer, (DispatchPath, CombinePath))
    source = (PACKAGE / "buffer.py").read_text()
    assert "DispatchPath(" in source and "CombinePath(" in source


@pytest.mark.parametrize("module", [m for m in modules() if m != "buffer"])
def test_no_module_below_the_buffer_imports_it(module):
    assert "buffer" not in ours_imported_by(module)


@pytest.mark.parametrize("leaf", ["constants", "tensors", "errors", "driver_check"])
def test_the_leaves_import_nothing_of_ours(leaf):
    assert ours_imported_by(leaf) == set()


def test_the_gpu_check_imports_only_the_exception_it_raises():
    assert ours_imported_by("gpu_check") == {"errors"}


@pytest.mark.parametrize("reference", ["reference", "internode_reference", "low_latency_reference"])
def test_the_references_import_only_numpy_and_each_other(reference):
    assert ours_imported_by(reference) <= {"constants", "reference"}
    source = (PACKAGE / f"{reference}.py").read_text()
    assert "import cupy" not in source and "import torch" not in source


@pytest.mark.parametrize("plumbing", ["slots", "streams", "layout", "kernels", "ipc", "launch", "operation_context",
                                      "nccl_library"])
def test_the_gpu_plumbing_knows_no_operation(plumbing):
    assert not ours_imported_by(plumbing) & {"dispatch_path", "combine_path", "internode", "low_latency", "buffer"}


def test_every_optional_import_of_the_tests_follows_the_ci_rule():
    # pytest.importorskip skips under CI=true too; _harness.import_or_skip fails there instead, so
    # that CI, which installs every optional package, cannot pass while their tests skip.
    tests = Path(__file__).resolve().parent
    calling = sorted(str(p.relative_to(tests)) for p in tests.rglob("*.py")
                     if p.name != "test_code_structure.py" and "importorskip(" in p.read_text())
    assert calling == []
