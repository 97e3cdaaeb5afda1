"""scripts/loop_ab_summary.py, the summary of an old-against-new loop-model run, pairs like runs."""

import subprocess
import sys

from _harness import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "loop_ab_summary.py"


def log(tree, rnd, calibration, fresh_cupy, fresh_torch):
    prefix = f"{tree} r{rnd} 128: "
    return [prefix + f"modelled loop ... per call, median us, 128 tokens, 1 rounds (python 3.12.3, "
                     f"sum(range(200)) {calibration} us):",
            prefix + f"  fresh          cupy {fresh_cupy} [1.0, 2.0]   torch {fresh_torch} [3.0, 4.0]"]


def summarize(lines):
    return subprocess.run([sys.executable, str(SCRIPT)], input="\n".join(lines), capture_output=True, text=True,
                          timeout=60)


def test_only_rounds_whose_host_speed_agrees_count_as_like_for_like():
    # Round 1: both runs on an equally fast host, new 10 % slower. Round 2: the new run's host was
    # twice as slow, and so was its time: not like for like.
    lines = log(".dev_old", 1, 1.0, 50.0, 60.0) + log(".", 1, 1.02, 55.0, 66.0) \
        + log(".", 2, 2.0, 100.0, 120.0) + log(".dev_old", 2, 1.0, 50.0, 60.0)
    result = summarize(lines)
    assert result.returncode == 0, result.stderr
    cupy = next(line for line in result.stdout.splitlines() if " cupy " in line)
    assert "like-for-like rounds 1/2 ratio 1.100" in cupy, cupy
    assert "old   50.0 new   77.5" in cupy, cupy


def test_a_log_without_two_trees_is_an_error():
    result = summarize(log(".", 1, 1.0, 50.0, 60.0))
    assert result.returncode == 1
    assert "no paired runs" in result.stderr
