"""Statistics, tables, the JSON document, tuning results, and the text report and plot."""

from __future__ import annotations

import argparse
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..config import CONFIG_KEYS, _jsonable
from .calls import DEEPEP_V1
from .calls import OPS as CALL_OPS
from .workload import gbps

# ----------------------------------------------------------------------------------------------
# Statistics and tables
# ----------------------------------------------------------------------------------------------


def op_stats(times: Sequence[float], nbytes: Optional[float] = None,
             cross_bytes: Optional[float] = None, peak_bytes: Optional[int] = None) -> Dict[str, Any]:
    """One rank's figures for one op: ``times`` in seconds, bytes it received (or ``None``), and
    the peak device memory its timed calls held at once (``memory.peak_pool_bytes``; or ``None``)."""
    times = [float(t) for t in times]
    return {"times_us": [t * 1e6 for t in times],
            "mean_us": float(np.mean(times)) * 1e6 if times else float("nan"),
            "min_us": float(np.min(times)) * 1e6 if times else float("nan"),
            "bytes": None if nbytes is None else float(nbytes),
            "cross_bytes": None if cross_bytes is None else float(cross_bytes),
            "peak_mib": None if peak_bytes is None else peak_bytes / 2 ** 20}


def summarize_op(name: str, per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Combine the ranks' :func:`op_stats` of one op into a table row.

    Time mean/min: the max over ranks of each rank's mean/min (a collective is as slow as its
    slowest rank). GB/s: each rank's bytes over its mean time; ``gbps`` is the minimum over ranks,
    ``gbps_avg`` the mean; ``xgpu_*`` the same for the bytes received from other ranks. Peak MiB:
    the most device memory one rank's calls held at once (``peak_mib``, max over ranks; per rank in
    ``per_rank``).
    """
    row: Dict[str, Any] = {"op": name,
                           "time_mean_us": max(r["mean_us"] for r in per_rank),
                           "time_min_us": max(r["min_us"] for r in per_rank)}
    peaks = [r.get("peak_mib") for r in per_rank]
    known = [p for p in peaks if p is not None]
    row["peak_mib"] = max(known) if len(known) == len(peaks) else None   # None: some rank did not measure
    for key, out in (("bytes", "gbps"), ("cross_bytes", "xgpu_gbps")):
        if all(r.get(key) is not None for r in per_rank):
            rates = [gbps(r[key], r["mean_us"] * 1e-6) for r in per_rank]
            row[out], row[out + "_avg"] = min(rates), float(np.mean(rates))
        else:
            row[out] = row[out + "_avg"] = None
    row["per_rank"] = [dict(r) for r in per_rank]
    return row


OP_COLUMNS = (("op", "op", "{}"), ("time_mean_us", "mean us", "{:.1f}"), ("time_min_us", "min us", "{:.1f}"),
              ("gbps", "GB/s", "{:.1f}"), ("gbps_avg", "GB/s avg", "{:.1f}"),
              ("xgpu_gbps", "xGPU GB/s", "{:.1f}"), ("xgpu_gbps_avg", "xGPU avg", "{:.1f}"),
              ("peak_mib", "peak MiB", "{:.1f}"))


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_table(rows: Sequence[Dict[str, Any]], columns: Sequence[Tuple[str, str, str]] = OP_COLUMNS,
                 title: Optional[str] = None) -> str:
    """Rows (dicts) as an aligned text table; ``columns`` = (key, header, format) triples."""
    cells = [[h for _, h, _ in columns]]
    cells += [[_cell(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    if title:
        lines.append(title)
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_settings(s: Dict[str, Any]) -> str:
    """The one-line workload/config summary printed above the tables."""
    d, c = s.get("dispatch_config") or {}, s.get("combine_config") or {}
    return (f"ranks={s.get('num_ranks')} ({s.get('mode')}) tokens/rank={s.get('num_tokens')} "
            f"hidden={s.get('hidden')} topk={s.get('num_topk')} experts={s.get('num_experts')} "
            f"routing={s.get('routing')}{'' if s.get('routing') == 'uniform' else '(skew=%s)' % s.get('skew')} "
            f"num_sms={d.get('num_sms')} dispatch chunks={d.get('num_max_nvl_chunked_send_tokens')}/"
            f"{d.get('num_max_nvl_chunked_recv_tokens')} combine chunks={c.get('num_max_nvl_chunked_send_tokens')}/"
            f"{c.get('num_max_nvl_chunked_recv_tokens')} "
            f"allocate_ahead={s.get('allocate_ahead', True)} device={s.get('device_name')}"
            + ("" if s.get("interpreter_us") is None
               else f" host: sum(range(200)) {s['interpreter_us']:.2f} us (host times follow it)"))


# ----------------------------------------------------------------------------------------------
# JSON, tuning results
# ----------------------------------------------------------------------------------------------


def results_to_json(settings: Dict[str, Any], checks: Optional[Dict[str, Any]] = None,
                    ops: Sequence[Dict[str, Any]] = (), nccl: Optional[Dict[str, Any]] = None,
                    copy: Optional[Dict[str, Any]] = None, sweep: Optional[Dict[str, Any]] = None,
                    tune: Optional[Dict[str, Any]] = None, calls: Optional[Dict[str, Any]] = None,
                    sm_sweep: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every figure and the settings as one JSON-ready dict (NaN becomes ``null``)."""
    return _jsonable({"format": "deepep_cupy.bench/1", "settings": settings, "checks": checks or {},
                      "ops": list(ops), "nccl": nccl, "copy": copy, "sweep": sweep, "tune": tune, "calls": calls,
                      "sm_sweep": sm_sweep})


def tune_grid(sms: Sequence[int], send: Sequence[int], recv: Sequence[int]) -> List[Tuple[int, int, int]]:
    """The ``(num_sms, send_chunk, recv_chunk)`` triples of ``--tune``: even SM counts, send < recv."""
    return [(s, a, b) for s in sms if s % 2 == 0 for a in send for b in recv if a < b]


def best_configs(entries: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per op (``"dispatch"``/``"combine"``), the tuning entry with the lowest ``time_us``."""
    best: Dict[str, Dict[str, Any]] = {}
    for e in entries:
        t = e.get("time_us")
        if t is None or not math.isfinite(t):
            continue
        if e["op"] not in best or t < best[e["op"]]["time_us"]:
            best[e["op"]] = e
    return best


# ----------------------------------------------------------------------------------------------
# Aggregation across ranks, report, plot
# ----------------------------------------------------------------------------------------------


def aggregate(rank_results: Sequence[Dict[str, Any]], nccl_ranks: Optional[Sequence[Dict[str, Any]]],
              nccl_info: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    """Turn the ranks' raw results into checks, op rows, NCCL rows, sweep series and tuning results."""
    out: Dict[str, Any] = {}
    checks: Dict[str, Any] = {}
    if args.check and rank_results and "checks" in rank_results[0]:
        for op in rank_results[0]["checks"]:
            msgs = [(r["rank"], ok, m) for r in rank_results for ok, m in r["checks"][op]]
            checks[op] = {"ok": all(ok for _, ok, _ in msgs),
                          "failures": [f"rank {rk}: {m}" for rk, ok, m in msgs if not ok]}
    if nccl_ranks and args.check and all("check" in r for r in nccl_ranks):
        checks["nccl all-to-all (baseline)"] = {
            "ok": all(r["check"][0] for r in nccl_ranks),
            "failures": [f"rank {k}: {r['check'][1]}" for k, r in enumerate(nccl_ranks) if not r["check"][0]]}
    out["checks"] = checks
    op_names = list(rank_results[0]["ops"])
    out["ops"] = [summarize_op(n, [r["ops"][n] for r in rank_results]) for n in op_names]
    nccl: Dict[str, Any] = {"backend": nccl_info.get("backend"), "skipped": nccl_info.get("skipped"), "ops": []}
    if nccl_ranks:
        nccl["ops"] = [summarize_op(n, [r[n] for r in nccl_ranks]) for n in nccl_ranks[0] if n != "check"]
    out["nccl"] = nccl
    sweep: Optional[Dict[str, Any]] = None
    if args.tokens_sweep and "sweep" in rank_results[0]:
        sweep = {"tokens": [], "series": {"deepep_cupy dispatch BF16": [], "deepep_cupy combine BF16": [],
                                          "NCCL a2a transfer": [], "NCCL dispatch (all steps)": []}, "rows": []}
        nccl_sweep = {p["num_tokens"]: p["ranks"] for p in nccl_info.get("sweep", [])}
        for k, point in enumerate(rank_results[0]["sweep"]["points"]):
            n = point["num_tokens"]
            sweep["tokens"].append(n)
            for op, series in (("dispatch BF16", "deepep_cupy dispatch BF16"),
                               ("combine BF16", "deepep_cupy combine BF16")):
                row = summarize_op(f"{op} @ {n}", [r["sweep"]["points"][k][op] for r in rank_results])
                sweep["series"][series].append(row["gbps"])
                sweep["rows"].append(row)
            ranks = nccl_sweep.get(n)
            for op, series in (("nccl a2a dispatch", "NCCL a2a transfer"),
                               ("nccl dispatch (all steps)", "NCCL dispatch (all steps)")):
                if ranks:
                    row = summarize_op(f"{op} @ {n}", [ranks[r][op] for r in sorted(ranks)])
                    sweep["series"][series].append(row["gbps"])
                    sweep["rows"].append(row)
                else:
                    sweep["series"][series].append(None)
    out["sweep"] = sweep
    tune = None
    if args.tune and "tune" in rank_results[0]:
        entries = []
        for k, e in enumerate(rank_results[0]["tune"]):
            per = [r["tune"][k] for r in rank_results]
            entry = {key: e[key] for key in ("op",) + CONFIG_KEYS}
            if any("error" in p for p in per):
                entry["error"] = next(p["error"] for p in per if "error" in p)
                entry["time_us"] = None
            else:
                row = summarize_op(e["op"], per)
                entry.update(time_us=row["time_mean_us"], gbps=row["gbps"], xgpu_gbps=row["xgpu_gbps"])
            entries.append(entry)
        tune = {"entries": entries, "best": best_configs(entries)}
    out["tune"] = tune
    out["calls"] = summarize_calls([r["calls"] for r in rank_results]) if "calls" in rank_results[0] else None
    out["sm_sweep"] = summarize_sm_sweep(rank_results) if "sm_sweep" in rank_results[0] else None
    return out


# ----------------------------------------------------------------------------------------------
# SM sweep

#: DeepEP V1 (92fe2de) on 2 x H200 at the reference workload, same hour as deepep_cupy 04e7fd6:
#: time per call in us by SM count (issue "Dispatch and combine near the NVLink limit").
DEEPEP_V1_BY_SMS = {"cached dispatch BF16": {8: 874, 16: 460, 24: 327},
                    "cached dispatch FP8": {8: 656, 16: 347, 24: 246},
                    "combine BF16": {8: 990, 16: 547, 24: 404}}


def _pyplot():
    """matplotlib.pyplot on a file backend, or why it cannot be used (a string)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib is not importable ({exc})"
    return plt


def _save(plt, fig, path: str, dpi: int) -> None:
    """Write ``fig`` to ``path`` and free it (the plots' ``None``: written)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def workload_title(settings: Dict[str, Any]) -> str:
    """``2 x NVIDIA H200, hidden 7168, top-8 of 256``: the machine and the workload of a run."""
    return (f"{settings.get('num_ranks')} x {settings.get('device_name')}, hidden {settings.get('hidden')}, "
            f"top-{settings.get('num_topk')} of {settings.get('num_experts')}")


def summarize_sm_sweep(rank_results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Every rank's SM-sweep points -> ``{sms, rows, series: {op: [mean us]}, deepep_v1}``."""
    points = rank_results[0]["sm_sweep"]["points"]
    out: Dict[str, Any] = {"sms": [p["num_sms"] for p in points], "rows": [], "series": {},
                           "deepep_v1": DEEPEP_V1_BY_SMS}
    for k, point in enumerate(points):
        for op in (name for name in point if name != "num_sms"):
            per_rank = [r["sm_sweep"]["points"][k][op] for r in rank_results]
            row = summarize_op(f"{op} @ {point['num_sms']} SMs", per_rank)
            out["rows"].append(row)
            out["series"].setdefault(op, []).append(row["time_mean_us"])
    return out


def plot_sm_sweep(path: str, sm_sweep: Dict[str, Any], settings: Dict[str, Any]) -> Optional[str]:
    """PNG of time per call vs SMs, with DeepEP V1's figures. Returns ``None`` on success, else why not."""
    plt = _pyplot()
    if isinstance(plt, str):
        return plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (op, times) in enumerate(sm_sweep["series"].items()):
        color = f"C{k}"
        ax.plot(sm_sweep["sms"], times, marker="o", color=color, label=f"deepep_cupy {op}")
        v1 = sm_sweep.get("deepep_v1", {}).get(op)
        if v1:
            # SM counts come back as strings from JSON (a gathered or reloaded report): plot numbers.
            sms, v1_times = zip(*sorted((int(n), t) for n, t in v1.items()))
            ax.plot(sms, v1_times, marker="x", linestyle="--", color=color, label=f"DeepEP V1 {op}")
    ax.set_xticks(sm_sweep["sms"])
    ax.set_xlabel("SMs (num_sms)")
    ax.set_ylabel("us per call (mean, max over ranks)")
    ax.set_yscale("log")
    ax.set_title(f"{workload_title(settings)}, {settings.get('num_tokens')} tokens/rank", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    _save(plt, fig, path, 120)
    return None


TUNE_COLUMNS = (("op", "op", "{}"), ("num_sms", "SMs", "{}"), ("num_max_nvl_chunked_send_tokens", "send", "{}"),
                ("num_max_nvl_chunked_recv_tokens", "recv", "{}"), ("time_us", "mean us", "{:.1f}"),
                ("gbps", "GB/s", "{:.1f}"), ("xgpu_gbps", "xGPU GB/s", "{:.1f}"))


COPY_COLUMNS = (("op", "copy ceiling", "{}"), ("time_mean_us", "mean us", "{:.1f}"),
                ("time_min_us", "min us", "{:.1f}"), ("gbps", "GB/s per direction", "{:.1f}"),
                ("gbps_total", "GB/s total", "{:.1f}"))


def render_report(doc: Dict[str, Any]) -> str:
    """The text report of a :func:`results_to_json` document."""
    s = doc["settings"]
    parts = [format_settings(s)]
    if doc.get("checks"):
        lines = ["correctness (bit-exact against deepep_cupy.reference.intranode):"]
        for op, c in doc["checks"].items():
            lines.append(f"  {op:<28} {'PASS' if c['ok'] else 'FAIL'}")
            lines += [f"      {m}" for m in c["failures"][:8]]
        parts.append("\n".join(lines))
    else:
        parts.append("correctness: not checked (--no-check)")
    parts.append(format_table(doc["ops"], title="deepep_cupy (time: max over ranks; GB/s: min over ranks, avg)"))
    nccl = doc.get("nccl") or {}
    if nccl.get("skipped"):
        parts.append(f"NCCL baseline skipped: {nccl['skipped']}")
    elif nccl.get("ops"):
        parts.append(format_table(nccl["ops"], title=f"NCCL baseline ({nccl.get('backend')}), same routing"))
    copy = doc.get("copy") or {}
    if copy.get("skipped"):
        parts.append(f"copy ceiling skipped: {copy['skipped']}")
    elif copy.get("rows"):
        parts.append(format_table(copy["rows"], COPY_COLUMNS,
                                  title=f"copy-kernel ceiling ({copy['bytes'] / 2**20:.0f} MiB, 16-byte vectors)"))
    if doc.get("calls"):
        parts.append(render_calls(doc["calls"]))
    sweep = doc.get("sweep")
    if sweep:
        parts.append(format_table(sweep["rows"], title="tokens sweep"))
    if doc.get("sm_sweep"):
        parts.append(format_table(doc["sm_sweep"]["rows"], title="SM sweep (recommended chunk sizes)"))
    tune = doc.get("tune")
    if tune:
        for op in ("dispatch", "combine"):
            ok = sorted((e for e in tune["entries"] if e["op"] == op and e.get("time_us") is not None),
                        key=lambda e: e["time_us"])
            bad = sum(1 for e in tune["entries"] if e["op"] == op and e.get("time_us") is None)
            parts.append(format_table(ok[:5], TUNE_COLUMNS, title=f"tune {op}: best {min(5, len(ok))} of {len(ok)}"
                                      + (f" ({bad} configs rejected)" if bad else "")))
            best = tune.get("best", {}).get(op)
            if best:
                parts[-1] += (f"\nbest {op} config: Config(num_sms={best['num_sms']}, "
                              f"num_max_nvl_chunked_send_tokens={best['num_max_nvl_chunked_send_tokens']}, "
                              f"num_max_nvl_chunked_recv_tokens={best['num_max_nvl_chunked_recv_tokens']})")
    return "\n\n".join(parts)


def plot_sweep(path: str, sweep: Dict[str, Any], settings: Dict[str, Any]) -> Optional[str]:
    """PNG of GB/s vs tokens per rank. Returns ``None`` on success, else why it was skipped."""
    plt = _pyplot()
    if isinstance(plt, str):
        return plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in sweep["series"].items():
        pts = [(t, v) for t, v in zip(sweep["tokens"], values) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sweep["tokens"])
    ax.set_xticklabels([str(t) for t in sweep["tokens"]])
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("GB/s per rank (DeepEP accounting, min over ranks)")
    ax.set_title(workload_title(settings), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path, 120)
    return None


# ----------------------------------------------------------------------------------------------
# What a training loop sees (deepep_cupy.bench.calls)


def summarize_calls(rank_results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Every rank's points -> rows ``{op, lib, num_tokens, loop_us, host_us[, wait_us, host_work_us]}``
    (maximum over ranks), plus DeepEP V1's reference figures."""
    rows = []
    for k, point in enumerate(rank_results[0]["points"]):
        for op in point["ops"]:
            per_rank = [r["points"][k]["ops"][op] for r in rank_results]
            row = {"op": op, "lib": point["lib"], "num_tokens": point["num_tokens"]}
            for key in per_rank[0]:
                row[key] = max(p[key] for p in per_rank)
            rows.append(row)
    reference = [{"op": op, "lib": "DeepEP V1 (torch)", "num_tokens": n, "loop_us": loop, "host_us": host}
                 for op, figures in DEEPEP_V1.items() for n, (loop, host) in figures.items()]
    return {"rows": rows, "deepep_v1": reference}


def render_calls(calls: Dict[str, Any]) -> str:
    """One table per op: a row per library (and DeepEP V1), a column per token count, cells
    ``loop (host)`` in us; a fresh dispatch adds a row of the host time spent waiting for counts."""
    rows = calls["rows"] + calls["deepep_v1"]
    tokens = sorted({r["num_tokens"] for r in calls["rows"]})
    parts = []
    for op in CALL_OPS:
        table = []
        libs = [lib for lib in dict.fromkeys(r["lib"] for r in rows if r["op"] == op)]
        for lib in libs:
            cells = {r["num_tokens"]: r for r in rows if r["op"] == op and r["lib"] == lib}
            entry = {"lib": lib}
            for n in tokens:
                r = cells.get(n)
                host = None if r is None else r.get("host_us")
                entry[str(n)] = None if r is None else (f"{r['loop_us']:.0f} ({host:.0f})" if host is not None
                                                         else f"{r['loop_us']:.0f}")
            table.append(entry)
            if any("wait_us" in c for c in cells.values()):
                table.append({"lib": f"  {lib}: of host, waiting for counts",
                              **{str(n): None if n not in cells else f"{cells[n]['wait_us']:.0f}" for n in tokens}})
        columns = [("lib", op, "{}")] + [(str(n), f"{n} tok", "{}") for n in tokens]
        parts.append(format_table(table, columns))
    return ("loop time per call (median host time per call), us; median over rounds, max over ranks\n\n"
            + "\n\n".join(parts))


def plot_calls(path: str, calls: Dict[str, Any], settings: Dict[str, Any]) -> Optional[str]:
    """PNG: loop time against tokens per rank, one panel per op, a line per library, DeepEP V1 as
    crosses. Returns None on success, else why it was skipped."""
    plt = _pyplot()
    if isinstance(plt, str):
        return plt
    fig, axes = plt.subplots(2, -(-len(CALL_OPS) // 2), figsize=(21, 7.5), squeeze=False)
    for ax in axes.flat[len(CALL_OPS):]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, CALL_OPS):
        for lib in dict.fromkeys(r["lib"] for r in calls["rows"]):
            pts = sorted((r["num_tokens"], r["loop_us"]) for r in calls["rows"] if r["op"] == op and r["lib"] == lib)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"deepep_cupy, {lib}")
        ref = sorted((r["num_tokens"], r["loop_us"]) for r in calls["deepep_v1"] if r["op"] == op)
        if ref:
            ax.plot([p[0] for p in ref], [p[1] for p in ref], "x", markersize=9, label="DeepEP V1, torch")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op, fontsize=10)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("loop time per call, us")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{workload_title(settings)} ({settings.get('mode')})", fontsize=10)
    _save(plt, fig, path, 110)
    return None
