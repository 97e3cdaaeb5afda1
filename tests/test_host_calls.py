"""The host path's Python calls per op (scripts/host_calls.py, fake hardware on the CPU) stay within
their budget: host time on the GPU machine moves with the host's speed from run to run, a call
count does not, so growth is caught here. A change that needs more calls raises the budget here
and says why in docs/PERFORMANCE.md."""

import re

from _harness import REPO_ROOT, describe, run_python

SCRIPT = REPO_ROOT / "scripts" / "host_calls.py"
#: Library calls per call (f89c4ff, before issues 36 and 37: 56, 30, 21). The Buffer's delegation to
#: its engine (issue 50) costs one call, paid back by the engine's skipping its config check for a
#: Config it has checked (docs/PERFORMANCE.md).
BUDGET = {"fresh": 53, "cached": 26, "combine": 21}


def test_each_steady_op_makes_no_more_library_calls_than_its_budget():
    result = run_python([SCRIPT], timeout=120)
    assert result.returncode == 0, describe(result)
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+)\s+([\d.]+) library calls", result.stdout,
                                                                  re.M)}
    assert set(counts) == set(BUDGET), result.stdout
    over = {op: count for op, count in counts.items() if count > BUDGET[op]}
    assert not over, f"library calls per call above the budget {BUDGET}: {over}"
    assert all(count > 10 for count in counts.values()), counts
