"""Every Python code block of the README and of docs/ runs as written.

A block that uses ``MPI.COMM_WORLD`` runs under mpiexec with one process per GPU (2); any other
block runs in one process. On a machine without GPUs only the parsing is checked.
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
