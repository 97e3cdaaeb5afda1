"""Every Python code block of the README and of docs/ runs as written, and the docs stay whole.

A block that uses ``MPI.COMM_WORLD`` runs under mpiexec with one process per GPU (2); any other
block runs in one process. On a machine without GPUs only the parsing is checked. The README stays
a first screen that links every docs/ page and names every make target, relative links resolve,
and every environment variable the code reads is in docs/ENVIRONMENT.md.
"""

import ast
import re
import subprocess
import sys

import pytest
from _harness import REPO_ROOT, describe, mpi_env, run_mpi

DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks():
    for path in DOCUMENTS:
        for number, match in enumerate(_BLOCK.finditer(path.read_text()), 1):
            yield pytest.param(match.group(1), id=f"{path.relative_to(REPO_ROOT)}#{number}")


BLOCKS = list(_blocks())


def test_the_readme_has_a_python_example():
    assert any("README.md" in block.id for block in BLOCKS)


@pytest.mark.parametrize("code", BLOCKS)
def test_the_block_parses(code):
    ast.parse(code)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("code", BLOCKS)
def test_the_block_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    if "MPI.COMM_WORLD" in code:
        run = run_mpi(2, [str(script)], timeout=300)
    else:
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env=mpi_env(None), cwd=str(REPO_ROOT))
    assert run.returncode == 0, describe(run)


# --- the README stays a first screen, and what moved out of it stays reachable -----------------

README_MAX_LINES = 150
_LINK = re.compile(r"\]\(([^)#\s]+)")
_ENV_READ = re.compile(r"""(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*["']([A-Z][A-Z0-9_]+)["']""")


def _readme():
    return (REPO_ROOT / "README.md").read_text()


def test_the_readme_is_under_150_lines():
    assert len(_readme().splitlines()) < README_MAX_LINES


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO_ROOT / target).resolve() for target in _LINK.findall(_readme())}
    unlinked = [p.name for p in sorted((REPO_ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for path in [*DOCUMENTS, REPO_ROOT / "scripts" / "README.md"]:
        for target in _LINK.findall(path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(REPO_ROOT)} -> {target}")
    assert not broken, broken


def test_every_make_target_is_in_the_readme():
    phony = re.search(r"^\.PHONY:(.*)$", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE).group(1).split()
    missing = [target for target in phony if f"`make {target}`" not in _readme()]
    assert phony and not missing, f"make targets missing from the README's command table: {missing}"


def test_every_environment_variable_read_is_in_the_environment_table():
    table = (REPO_ROOT / "docs" / "ENVIRONMENT.md").read_text()
    read = set()
    for folder in ("deepep_cupy", "tests", "scripts", "examples"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            read.update(_ENV_READ.findall(path.read_text()))
    makefile = (REPO_ROOT / "Makefile").read_text()
    read.update(re.findall(r"^([A-Z][A-Z0-9_]+)\s*\?=", makefile, re.MULTILINE))
    missing = sorted(name for name in read if f"`{name}`" not in table)
    assert read and not missing, f"read by the code but not in docs/ENVIRONMENT.md: {missing}"
