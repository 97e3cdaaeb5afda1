"""The shape of the code (CPU): the Buffer is a facade over one engine, the layers import one way.

docs/DESIGN.md draws the layers; these tests keep them: the package's folders are the layers'
parts, no import runs back up the layers or goes round in a circle, the operation paths never
import each other, the Buffer has no base class of ours and nothing below it imports it, the
leaves import nothing of ours, the references stay NumPy, and no module is over 600 lines.
"""

import ast
import re
from pathlib import Path

import pytest

import deepep_cupy
from deepep_cupy.buffer import Buffer

PACKAGE = Path(deepep_cupy.__file__).resolve().parent

#: The layers, lowest first: a module imports only from its own layer and the layers below.
LAYERS = (
    ("leaves", ("constants", "tensors", "errors", "events", "driver_check")),
    ("plumbing", ("gpu", "groups", "transports", "reference")),
    ("settings", ("config", "compat", "engine", "checks")),
    ("paths", ("intranode", "internode", "low_latency")),
    ("facade", ("buffer", "engines")),
    ("entry points", ("__init__", "bench")),
)
#: The folders of the operation paths, which never import each other.
PATHS = ("intranode", "internode", "low_latency")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def modules():
    return sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def source_of(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imported(module: str, node: ast.ImportFrom) -> list:
    """The package's modules (dotted, below deepep_cupy) that one ``from ... import`` names."""
    if node.level == 0:
        if not (node.module or "").startswith("deepep_cupy"):
            return []
        base = node.module.split(".")[1:]
    else:
        here = module.split(".") if module != "__init__" else []
        package = here if source_of(module).name == "__init__.py" else here[:-1]
        base = package[:len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    found = []
    for alias in node.names:
        candidate = base + [alias.name]
        if source_of(".".join(candidate)).exists():
            found.append(".".join(candidate))
        elif base:
            found.append(".".join(base))
    return found


def ours_imported_by(module: str, *, module_level_only: bool = False) -> set:
    """The modules of this package that ``module`` imports (at any depth of its code, or at its top only)."""
    tree = ast.parse(source_of(module).read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            found.update(_imported(module, node))
    return found


def layer_of(module: str) -> int:
    top = module.split(".")[0]
    return next(i for i, (_, tops) in enumerate(LAYERS) if top in tops)


def test_every_module_has_a_layer():
    assert [m for m in modules() if m.split(".")[0] not in {t for _, tops in LAYERS for t in tops}] == []


@pytest.mark.parametrize("module", modules())
def test_no_import_runs_back_up_the_layers(module):
    upward = {m for m in ours_imported_by(module) if layer_of(m) > layer_of(module)}
    assert upward == set()


@pytest.mark.parametrize("path", PATHS)
def test_the_operation_paths_never_import_each_other(path):
    imported = set()
    for module in modules():
        if module.split(".")[0] == path:
            imported |= {m.split(".")[0] for m in ours_imported_by(module)}
    assert imported & (set(PATHS) - {path}) == set()


def test_no_import_circle_between_modules():
    graph = {m: {d for d in ours_imported_by(m, module_level_only=True) if d != m} for m in modules()}
    done, active = set(), []

    def visit(module):
        if module in active:
            raise AssertionError("import circle: " + " -> ".join(active[active.index(module):] + [module]))
        if module in done:
            return
        active.append(module)
        for dependency in sorted(graph.get(module, ())):
            visit(dependency)
        active.pop()
        done.add(module)

    for module in graph:
        visit(module)


@pytest.mark.parametrize("module", modules())
def test_no_module_is_over_600_lines(module):
    assert len(source_of(module).read_text().splitlines()) <= 600


def test_the_package_folders_show_the_architecture():
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert folders == ["bench", "gpu", "groups", "internode", "intranode", "low_latency", "reference", "transports"]


def test_the_buffer_has_no_base_class_of_this_package():
    assert all(not base.__module__.startswith("deepep_cupy") for base in Buffer.__mro__[1:])


@pytest.mark.parametrize("module", [m for m in modules() if m not in ("buffer", "__init__")])
def test_no_module_below_the_buffer_imports_it(module):
    assert "buffer" not in ours_imported_by(module)


@pytest.mark.parametrize("leaf", ["constants", "tensors", "errors", "events", "driver_check"])
def test_the_leaves_import_nothing_of_ours(leaf):
    assert ours_imported_by(leaf) == set()


def test_the_gpu_check_imports_only_the_exception_it_raises():
    assert ours_imported_by("gpu.check") == {"errors"}


@pytest.mark.parametrize("reference", ["reference.intranode", "reference.internode", "reference.low_latency"])
def test_the_references_import_only_numpy_and_each_other(reference):
    assert ours_imported_by(reference) <= {"constants", "reference.intranode"}
    source = source_of(reference).read_text()
    assert "import cupy" not in source and "import torch" not in source


@pytest.mark.parametrize("module", [m for m in modules() if m.split(".")[0] in ("gpu", "groups", "transports")])
def test_the_plumbing_groups_and_transports_know_no_operation(module):
    assert {m.split(".")[0] for m in ours_imported_by(module)} & {*PATHS, "buffer", "config"} == set()


def test_every_optional_import_of_the_tests_follows_the_ci_rule():
    # pytest.importorskip skips under CI=true too; _harness.import_or_skip fails there instead, so
    # that CI, which installs every optional package, cannot pass while their tests skip.
    tests = Path(__file__).resolve().parent
    calling = sorted(str(p.relative_to(tests)) for p in tests.rglob("*.py")
                     if p.name != "test_code_structure.py" and "importorskip(" in p.read_text())
    assert calling == []


def _package_sources():
    return {module: source_of(module).read_text() for module in modules()}


def _calls_named(module: str, name: str) -> bool:
    tree = ast.parse(source_of(module).read_text())
    return any(isinstance(node, ast.Call) and (getattr(node.func, "id", None) == name
                                               or getattr(node.func, "attr", None) == name)
               for node in ast.walk(tree))


def test_no_buffer_is_made_below_the_entry_points_but_by_buffer_py():
    # The internode path gets an intranode engine for its node, never a Buffer of its own.
    makers = sorted(m for m in modules() if layer_of(m) < layer_of("__init__") and m != "buffer"
                    and _calls_named(m, "Buffer"))
    assert makers == []


def _private_names_defined() -> dict:
    """Per private name defined in the package (a function, class, or attribute set on ``self``),
    the folders (top-level names) of the modules that define it."""
    defined: dict = {}
    for module in modules():
        for node in ast.walk(ast.parse(source_of(module).read_text())):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names = [node.attr]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    defined.setdefault(name, set()).add(module.split(".")[0])
    return defined


@pytest.mark.parametrize("module", [m for m in modules() if layer_of(m) < layer_of("buffer")])
def test_nothing_below_the_facade_reads_another_layers_private_names(module):
    defined, folder = _private_names_defined(), module.split(".")[0]
    read = set()
    for node in ast.walk(ast.parse(source_of(module).read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            read.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            read.update(alias.name for alias in node.names)
    foreign = {name for name in read if name in defined and folder not in defined[name]}
    assert foreign == set()


def test_one_call_span_orders_every_call():
    # StreamOrder.begin (which orders a call after the caller's stream) and abandon are called by
    # the call span alone; every path opens its calls with CallSpan.begin.
    callers = sorted(m for m, source in _package_sources().items()
                     if re.search(r"order\.(begin|abandon)\(", source) and m != "gpu.call_span")
    assert callers == []
    for path in ("intranode.dispatch", "intranode.combine", "intranode.layout_call", "internode.path",
                 "low_latency.path"):
        assert "span.begin(" in source_of(path).read_text(), path


def test_one_module_holds_the_shared_argument_checks():
    shared = {node.name for node in ast.parse(source_of("checks").read_text()).body
              if isinstance(node, ast.FunctionDef)}
    defined_twice = sorted((m, node.name) for m in modules() if m != "checks"
                           for node in ast.walk(ast.parse(source_of(m).read_text()))
                           if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in shared)
    assert defined_twice == []
    assert [m for m in modules() if m.split(".")[-1] == "checks"] == ["checks"]


def test_one_handle_check_says_what_a_handle_must_be():
    raising = sorted(m for m, source in _package_sources().items()
                     if "handle: expected the handle returned by" in source)
    assert raising == ["checks"]
