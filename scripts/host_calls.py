"""How many Python calls of the library does each op make? On the CPU, without noise.

    python3 scripts/host_calls.py [--tree DIR] [--tokens 128] [--ops fresh,cached,combine] [--detail] [--opcodes]

Runs a Buffer's host path on fake hardware (tests/host_fakes.py: fake device arrays, recorded
launches, counts played by a script), a steady loop of each op (fresh dispatch allocated ahead,
cached dispatch, combine; BF16, hidden 7168, top-8 of 64 experts, 2 ranks), under cProfile, and
prints per op the calls into ``deepep_cupy`` per call (``--detail``: by function). Host time on a
GPU machine moves with the host's speed from one process to the next (docs/PERFORMANCE.md); a call
count does not, so it compares two trees exactly: ``--tree`` points at another checkout (its own
package and fakes are imported). ``--opcodes`` also counts the Python bytecodes the library runs
per call (traced; as exact, and closer to the time than the calls: a call's own cost is counted
once whatever it does).
"""

import argparse
import cProfile
import os
import pstats
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("fresh", "cached", "combine")
H, K, E, R = 7168, 8, 64, 2


def steady_ops(num_tokens: int):
    """The ops as calls on one fake Buffer, each called once already."""
    import numpy as np
    from _pytest.monkeypatch import MonkeyPatch
    from host_fakes import fake_buffer, on_device

    import deepep_cupy as ep
    from deepep_cupy.reference import intranode as ref

    config = ep.Config(8, 4, 32)
    received = 2 * num_tokens
    buf, _, _ = fake_buffer(MonkeyPatch(), received=(received,) * 1_000_000,
                            expert_counts=[received // (E // R)] * (E // R))
    rng = np.random.default_rng(0)
    topk = ref.random_routing(rng, num_tokens, E, K)
    per_rank, per_expert, in_rank = ref.get_dispatch_layout(topk, E, R)
    w = dict(x=on_device(np.zeros((num_tokens, H), np.uint16)),
             num_tokens_per_rank=on_device(per_rank.astype(np.int32)), is_token_in_rank=on_device(in_rank),
             num_tokens_per_expert=on_device(per_expert.astype(np.int32)), topk_idx=on_device(topk),
             topk_weights=on_device(rng.random((num_tokens, K), dtype=np.float32)))
    out = buf.dispatch(**w, config=config)
    handle = out[4]
    return {"fresh": lambda: buf.dispatch(**w, config=config),
            "cached": lambda: buf.dispatch(w["x"], handle=handle, config=config),
            "combine": lambda: buf.combine(out[0], handle, topk_weights=out[2], config=config)}


def library_calls(fn, calls: int = 200):
    """``{function: calls per op}`` of the functions in ``deepep_cupy`` that ``fn`` runs."""
    for _ in range(20):
        fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    per_function = {}
    for (file_name, _, name), (_, num_calls, *_rest) in pstats.Stats(profile).stats.items():
        if f"{os.sep}deepep_cupy{os.sep}" in file_name:
            where = file_name.split(f"{os.sep}deepep_cupy{os.sep}")[1]
            per_function[f"{where}:{name}"] = num_calls / calls
    return per_function


def library_opcodes(fn, calls: int = 20) -> float:
    """Bytecodes run per call of ``fn`` in the functions of ``deepep_cupy``."""
    for _ in range(20):
        fn()
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if f"{os.sep}deepep_cupy{os.sep}" not in frame.f_code.co_filename:
            return None
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return trace

    sys.settrace(trace)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.settrace(None)
    return count / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=REPO, help="the checkout whose package is measured (default: this one)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--detail", action="store_true", help="the calls by function")
    parser.add_argument("--opcodes", action="store_true", help="also the bytecodes run in the library per call")
    args = parser.parse_args(argv)
    tree = os.path.abspath(args.tree)
    sys.path[:0] = [tree, os.path.join(tree, "tests")]
    import deepep_cupy

    if not os.path.abspath(deepep_cupy.__file__).startswith(tree + os.sep):
        raise SystemExit(f"host_calls.py: imported {deepep_cupy.__file__}, not the package of {tree}")
    ops = steady_ops(args.tokens)
    for op in args.ops.split(","):
        per_function = library_calls(ops[op])
        opcodes = f", {library_opcodes(ops[op]):.0f} bytecodes" if args.opcodes else ""
        print(f"{op:<8} {sum(per_function.values()):5.1f} library calls per call{opcodes} ({tree})")
        if args.detail:
            for name, count in sorted(per_function.items()):
                print(f"    {count:4.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
