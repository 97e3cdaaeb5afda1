"""scripts/loop_ab_in_process.py measures two trees in one process: each tree's calls run its own
library, whichever was imported last (in a subprocess: it swaps ``sys.modules``)."""

import shutil
import textwrap

from _harness import REPO_ROOT, describe, run_python

CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, {scripts!r})
    import loop_ab_in_process as ab

    old, new = ab.import_tree(Path({old!r})), ab.import_tree(Path({new!r}))
    assert old["deepep_cupy"] is not new["deepep_cupy"]
    for modules, root in ((old, {old!r}), (new, {new!r}), (old, {old!r})):
        ab.activate(modules)
        import deepep_cupy.capacity  # a lazy import inside the library finds the active tree
        assert deepep_cupy.capacity.__file__.startswith(root), (deepep_cupy.capacity.__file__, root)
        assert sys.modules["host_path_alone"].__file__.startswith(root)
        assert sys.modules["host_path_alone"].ep is modules["deepep_cupy"]
    print("OK")
""")


def copy_tree(destination):
    """The package, its CUDA sources and the scripts, as another checkout would hold them."""
    for folder in ("deepep_cupy", "kernels", "scripts"):
        shutil.copytree(REPO_ROOT / folder, destination / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "_kernels"))
    return destination


def test_each_tree_runs_its_own_library_in_one_process(tmp_path):
    old = copy_tree(tmp_path / "old")
    script = tmp_path / "check.py"
    script.write_text(CHECK.format(scripts=str(REPO_ROOT / "scripts"), old=str(old), new=str(REPO_ROOT)))
    result = run_python([script], timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), describe(result)
