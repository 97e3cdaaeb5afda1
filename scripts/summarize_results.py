"""Condense a worker's RESULT/ERROR/CONFIG records (stdin) to one line per scenario or case.

    python3 tests/workers/gpu_worker.py ... | python3 scripts/summarize_results.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' record parser
from _harness import worker_records  # noqa: E402

output = sys.stdin.read()
for tag in ("ERROR", "CONFIG"):
    for record in worker_records(output, tag):
        print(f"{tag} {record}"[:600])
groups = {}
for e in worker_records(output):
    s = groups.setdefault(e.get("scenario", e.get("case")), {"ok": 0, "fail": [], "seconds": 0.0})
    if e["ok"]:
        s["ok"] += 1
    else:
        s["fail"].append(f"r{e['rank']}: " + (e["error"] or "").splitlines()[0][:200])
    s["seconds"] = max(s["seconds"], e.get("seconds", 0))
for name, s in groups.items():
    print(f"{name:32s} ok_ranks={s['ok']:2d} {s['seconds']:6.2f}s {'; '.join(s['fail'][:2])}")
print(f"groups: {len(groups)}, all ranks ok: {sum(1 for s in groups.values() if not s['fail'])}")
