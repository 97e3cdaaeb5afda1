"""Old tree against new in the loop model, both in one process, alternated call block by call block.

    python3 scripts/loop_ab_in_process.py --old OLD_TREE [--new .] --tokens 128 [--rounds 16] [--calls 300]

Runs ``host_path_alone.py``'s loop model (the peer played by kernels: ``--exchange-us``,
``--transfer-us``) for two checkouts of the library in the same process: each tree's
``deepep_cupy`` and its ``scripts/`` helpers are imported once under their usual names and kept
as a set of modules, which is put into ``sys.modules`` before that tree's block runs (a lazy
import inside the library then finds its own tree). Rounds alternate the order (old, new, new,
old, ...), and every round times each op and library of both trees with ``--calls`` calls.

Running the trees in separate processes compared the host more than the code: on the one-GPU
machine the interpreter's speed changed by up to 2x from one process to the next (2026-12-01).
In one process both trees meet the same host, so the per-round ratio new / old is the figure;
the median over the rounds and its spread (min, max) are printed per op, library and measure:
the loop time, and as ``host_path_alone.py`` gives them, the host work besides the count wait and
the host work on the loop's path.
One token count per process: ``host_path_alone.alone_buffer`` patches its tree's kernel look-up
for one count of received rows.
"""
import argparse
import importlib
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import cupy

from deepep_cupy.gpu.check import exit_unless_gpu

#: The modules a tree brings: its library and the script helpers it is measured with.
SCRIPT_MODULES = ("host_path_alone", "_host_timing", "_mpi_timing")


def is_tree_module(name: str) -> bool:
    return name == "deepep_cupy" or name.startswith("deepep_cupy.") or name in SCRIPT_MODULES


def activate(modules: Dict[str, object]) -> None:
    """Put one tree's modules in ``sys.modules`` in place of the other's."""
    for name in [name for name in sys.modules if is_tree_module(name)]:
        del sys.modules[name]
    sys.modules.update(modules)


def import_tree(root: Path) -> Dict[str, object]:
    """``root``'s library and script helpers, imported fresh; returns the module set."""
    activate({})
    paths = [str(root / "scripts"), str(root)]
    sys.path[:0] = paths
    try:
        importlib.import_module("deepep_cupy")
        importlib.import_module("host_path_alone")
        importlib.import_module("deepep_cupy.bench.calls")
    finally:
        for path in paths:
            sys.path.remove(path)
    modules = {name: module for name, module in sys.modules.items() if is_tree_module(name)}
    here = str(Path(modules["deepep_cupy"].__file__).resolve())
    if not here.startswith(str(root.resolve())):
        raise RuntimeError(f"{root}: imported deepep_cupy from {here}")
    return modules


class TreeUnderTest:
    """One tree's Buffer with the peer played on the GPU, and its ops on ``num_tokens`` tokens."""

    def __init__(self, root: Path, args):
        self.name = str(root)
        self.modules = import_tree(root)
        alone = self.modules["host_path_alone"]
        timing = self.modules["_host_timing"]
        mpi_timing = self.modules["_mpi_timing"]
        num_recv = 2 * args.tokens  # as host_path_alone.main: about every token goes to both ranks
        num_local_experts = mpi_timing.NUM_EXPERTS // 2
        counts = [num_recv * mpi_timing.NUM_TOPK // num_local_experts] * num_local_experts
        self.buf = alone.alone_buffer(num_recv, counts, args.exchange_us, args.transfer_us)
        self.ops = {lib: timing.host_ops(self.buf, lib, args.tokens, alone.CONFIG, seed=0) for lib in args.libs}

    def measure(self, op: str, lib: str, calls: int) -> Tuple[float, float, float]:
        """``host_path_alone.loop_and_work_us`` of one op: median us per call of the loop, of the
        host work besides the count wait, and of the host work on the loop's path."""
        activate(self.modules)
        return self.modules["host_path_alone"].loop_and_work_us(self.ops[lib][op], calls, self.buf)


#: What each of :meth:`TreeUnderTest.measure`'s figures is called in the summary.
MEASURES = ("loop", "host work", "on the path")


def summary_lines(times: Dict[Tuple[str, str], Dict[str, List[Tuple[float, float, float]]]]) -> List[str]:
    """Per op, library and measure: the median of each tree's rounds and the median (min, max) of
    the rounds' new / old (a round times both trees back to back)."""
    lines = [f"  {'op':8s} {'lib':6s} {'measure':12s} {'old us':>8s} {'new us':>8s}  "
             "new/old median [min, max] of the rounds"]
    for (op, lib), by_tree in times.items():
        for index, measure in enumerate(MEASURES):
            old = [figures[index] for figures in by_tree["old"]]
            new = [figures[index] for figures in by_tree["new"]]
            ratios = [n / o for o, n in zip(old, new)]
            lines.append(f"  {op:8s} {lib:6s} {measure:12s} {statistics.median(old):8.1f} "
                         f"{statistics.median(new):8.1f}  {statistics.median(ratios):.3f} "
                         f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, default=Path("."))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--ops", default="fresh,cached")
    parser.add_argument("--libs", default="cupy,torch")
    parser.add_argument("--exchange-us", type=float, default=12.0)
    parser.add_argument("--transfer-us", type=float, default=15.0)
    args = parser.parse_args()
    args.libs = args.libs.split(",")
    exit_unless_gpu("scripts/loop_ab_in_process.py")
    cupy.cuda.Device(0).use()
    old, new = TreeUnderTest(args.old, args), TreeUnderTest(args.new, args)
    ops = args.ops.split(",")
    times = {(op, lib): {"old": [], "new": []} for op in ops for lib in args.libs}
    for round_index in range(args.rounds):
        order = [("old", old), ("new", new)] if round_index % 2 == 0 else [("new", new), ("old", old)]
        for op in ops:
            for lib in args.libs:
                for label, tree in order:
                    times[op, lib][label].append(tree.measure(op, lib, args.calls))
    print(f"loop model in one process (exchange {args.exchange_us:g} us, transfer {args.transfer_us:g} us), "
          f"{args.tokens} tokens, {args.rounds} rounds x {args.calls} calls, old={old.name} new={new.name}:")
    print("\n".join(summary_lines(times)))


if __name__ == "__main__":
    main()
