"""Condense a worker's RESULT/ERROR lines (stdin) to one line per scenario."""
import json
import sys

scenarios = {}
for line in sys.stdin:
    if line.startswith("RESULT "):
        e = json.loads(line[7:])
        s = scenarios.setdefault(e["scenario"], {"ok": 0, "fail": [], "seconds": 0.0})
        if e["ok"]:
            s["ok"] += 1
        else:
            s["fail"].append(f"r{e['rank']}: " + (e["error"] or "").splitlines()[0][:200])
        s["seconds"] = max(s["seconds"], e.get("seconds", 0))
    elif line.startswith(("ERROR ", "CONFIG ")):
        print(line.strip()[:600])
for name, s in scenarios.items():
    print(f"{name:32s} ok_ranks={s['ok']:2d} {s['seconds']:6.2f}s {'; '.join(s['fail'][:2])}")
print(f"scenarios: {len(scenarios)}, all ranks ok: {sum(1 for s in scenarios.values() if not s['fail'])}")
