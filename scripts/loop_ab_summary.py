"""Old tree against new in the loop model: the summary of ``STAGES=loop-ab scripts/device_check.sh``.

    python3 scripts/loop_ab_summary.py < loop_ab.log

Reads the lines of ``host_path_alone.py --exchange-us ...`` runs, each prefixed ``TREE rROUND
TOKENS: `` by the stage, and prints per token count, op and library the median loop time of each
tree and the ratio new / old. The host's speed is not steady on the one-GPU machine: the
interpreter benchmark each run prints (``sum(range(200))``) took 1.1 to 2.5 us from one process to
the next (2026-12-01), and the loop times follow it. So the ratio is also given over the rounds
whose two runs agree on that figure within ``--tolerance`` (the like-for-like pairs), and with each
time divided by its run's figure. A tree is named by its directory; ``.`` is the new one.
"""

import argparse
import collections
import re
import statistics
import sys
from typing import Dict, Iterable, List, Tuple

HEADER = re.compile(r"^(\S+) r(\d+) (\d+): .*sum\(range\(200\)\) ([\d.]+) us")
FIGURES = re.compile(r"^(\S+) r(\d+) (\d+):\s+(\w+)\s+cupy ([\d.]+)\b.*\s+torch ([\d.]+)\b")

Key = Tuple[int, str, str]  # tokens, op, library


def parse(lines: Iterable[str]) -> Tuple[Dict[Tuple[str, int, int], float], Dict[Key, Dict[str, Dict[int, float]]]]:
    """``(calibration per (tree, round, tokens), times[(tokens, op, lib)][tree][round])``."""
    calibration: Dict[Tuple[str, int, int], float] = {}
    times: Dict[Key, Dict[str, Dict[int, float]]] = collections.defaultdict(lambda: collections.defaultdict(dict))
    for line in lines:
        header = HEADER.match(line)
        if header:
            tree, rnd, tokens, us = header.groups()
            calibration[tree, int(rnd), int(tokens)] = float(us)
            continue
        figures = FIGURES.match(line)
        if figures:
            tree, rnd, tokens, op, cupy_us, torch_us = figures.groups()
            for lib, us in (("cupy", cupy_us), ("torch", torch_us)):
                times[int(tokens), op, lib][tree][int(rnd)] = float(us)
    return calibration, times


def compare(calibration, times, new: str = ".", tolerance: float = 0.1) -> List[str]:
    """One line per (tokens, op, library): old and new medians, ratios (all rounds, like-for-like
    rounds, calibrated)."""
    lines = []
    for (tokens, op, lib), trees in sorted(times.items()):
        old = next((t for t in trees if t != new), None)
        if old is None or new not in trees:
            continue
        rounds = sorted(set(trees[old]) & set(trees[new]))
        if not rounds:
            continue
        a = [trees[old][r] for r in rounds]
        b = [trees[new][r] for r in rounds]
        cal_a = [calibration.get((old, r, tokens)) for r in rounds]
        cal_b = [calibration.get((new, r, tokens)) for r in rounds]
        line = (f"{tokens:>5} {op:<7} {lib:<5} old {statistics.median(a):6.1f} new {statistics.median(b):6.1f} "
                f"ratio {statistics.median(b) / statistics.median(a):.3f}")
        if None not in cal_a and None not in cal_b:
            alike = [i for i in range(len(rounds)) if abs(cal_a[i] - cal_b[i]) <= tolerance * max(cal_a[i], cal_b[i])]
            if alike:
                ratio = statistics.median(b[i] / a[i] for i in alike)
                line += f" | like-for-like rounds {len(alike)}/{len(rounds)} ratio {ratio:.3f}"
            else:
                line += f" | like-for-like rounds 0/{len(rounds)}"
            scaled = statistics.median(b[i] / cal_b[i] for i in range(len(rounds))) / \
                statistics.median(a[i] / cal_a[i] for i in range(len(rounds)))
            line += f" | calibrated ratio {scaled:.3f}"
        lines.append(line)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", default=".", help="the new tree's name in the log (default .)")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="largest relative difference of two runs' interpreter figures that counts as alike")
    args = parser.parse_args(argv)
    calibration, times = parse(sys.stdin)
    lines = compare(calibration, times, args.new, args.tolerance)
    if not lines:
        print("loop_ab_summary: no paired runs of two trees in the input", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
