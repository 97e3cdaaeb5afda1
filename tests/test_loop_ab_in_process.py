"""scripts/loop_ab_in_process.py measures two trees in one process: each tree's calls run its own
library, whichever was imported last (in a subprocess: it swaps ``sys.modules``)."""

import shutil
import sys
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
        import deepep_cupy.intranode.capacity  # a lazy import inside the library finds the active tree
        assert deepep_cupy.intranode.capacity.__file__.startswith(root), (deepep_cupy.intranode.capacity.__file__, root)
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


def test_the_summary_gives_the_median_of_the_rounds_ratios_per_measure():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        from loop_ab_in_process import summary_lines
    finally:
        sys.path.remove(str(REPO_ROOT / "scripts"))
    # Three rounds; the host slowed down in the second, for both trees alike: new is 10 % slower
    # in the loop every round, and equal in host work.
    times = {("fresh", "cupy"): {"old": [(50.0, 40.0, 30.0), (100.0, 80.0, 60.0), (50.0, 40.0, 30.0)],
                                 "new": [(55.0, 40.0, 30.0), (110.0, 80.0, 60.0), (55.0, 40.0, 30.0)]}}
    lines = summary_lines(times)
    loop = next(line for line in lines if " loop " in line).split()
    work = next(line for line in lines if "host work" in line).split()
    assert loop[3:6] == ["50.0", "55.0", "1.100"], lines
    assert work[4:7] == ["40.0", "40.0", "1.000"], lines
    assert len(lines) == 1 + 3
