"""CPU tests of deepep_cupy.bench: arguments, accounting, tables, JSON, configs, the NCCL index build."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from _harness import import_or_skip

from deepep_cupy import bench
from deepep_cupy.bench import calls, report

# ---------------------------------------------------------------------------------------------- import

def test_import_touches_no_gpu_stack():
    code = ("import sys, deepep_cupy.bench; "
            "print(sorted(m for m in ('cupy', 'mpi4py', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for name in ("time_op", "format_table", "results_to_json", "dispatch_bytes", "gbps", "build_parser",
                 "parse_args", "build_send_index", "copy_ceiling", "run_nccl_baseline"):
        assert callable(getattr(bench, name))


# ---------------------------------------------------------------------------------------------- arguments

def test_defaults_are_the_reference_workload():
    a = bench.parse_args([])
    assert (a.num_tokens, a.hidden, a.num_topk, a.num_experts) == (4096, 7168, 8, 256)
    assert a.routing == "uniform" and a.dtype == "both"
    assert a.num_sms == 24 and a.send_chunk is None and a.recv_chunk is None
    assert (a.warmup, a.iters) == (20, 100)
    assert a.num_ranks is None and a.launcher == "auto"
    assert a.check and a.flush_l2 and a.copy and not a.tune and a.allocate_ahead
    assert a.nccl == "auto"
    assert a.tokens_sweep is None and a.plot is None and a.json is None and a.save_config is None
    assert a.tune_sms == [8, 16, 24, 32, 48]
    assert a.tune_send == [4, 6, 8, 12, 16, 24, 32]
    assert a.tune_recv == [128, 256, 512]


def test_options_parse():
    a = bench.parse_args(["--num-tokens", "512", "--hidden", "2048", "--num-topk", "4", "--num-experts", "64",
                          "--routing", "skewed", "--skew", "2.5", "--dtype", "fp8", "--num-sms", "32",
                          "--send-chunk", "8", "--recv-chunk", "512", "--warmup", "3", "--iters", "7",
                          "--seed", "11", "--num-ranks", "4", "--tokens-sweep", "256, 512,1024",
                          "--tune", "--save-config", "c.json", "--json", "r.json", "--nccl", "cupy",
                          "--no-copy", "--no-check", "--no-flush-l2", "--launcher", "local",
                          "--no-allocate-ahead"])
    assert (a.num_tokens, a.hidden, a.num_topk, a.num_experts) == (512, 2048, 4, 64)
    assert (a.routing, a.skew, a.dtype, a.num_sms, a.send_chunk, a.recv_chunk) == ("skewed", 2.5, "fp8", 32, 8, 512)
    assert (a.warmup, a.iters, a.seed, a.num_ranks) == (3, 7, 11, 4)
    assert a.tokens_sweep == [256, 512, 1024]
    assert a.tune and a.save_config == "c.json" and a.json == "r.json" and a.nccl == "cupy"
    assert not a.copy and not a.check and not a.flush_l2 and a.launcher == "local"
    assert not a.allocate_ahead


def test_plot_implies_default_sweep():
    a = bench.parse_args(["--plot", "x.png"])
    assert a.tokens_sweep == list(bench.DEFAULT_TOKENS_SWEEP)
    assert bench.parse_args(["--plot", "x.png", "--tokens-sweep", "64"]).tokens_sweep == [64]


@pytest.mark.parametrize("argv", [["--hidden", "100"], ["--iters", "0"], ["--save-config", "c.json"],
                                  ["--dtype", "fp16"], ["--tokens-sweep", "a,b"], ["--num-topk", "300"],
                                  ["--tune-sms", "0,8"]])
def test_bad_arguments_are_rejected(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_detect_launcher():
    a = bench.parse_args([])
    assert bench.detect_launcher(a, {}) == "local"
    assert bench.detect_launcher(a, {"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert bench.detect_launcher(a, {"PMI_SIZE": "8"}) == "mpi"
    assert bench.detect_launcher(a, {"OMPI_COMM_WORLD_SIZE": "1"}) == "local"
    assert bench.detect_launcher(bench.parse_args(["--launcher", "mpi"]), {}) == "mpi"
    assert bench.detect_launcher(bench.parse_args(["--launcher", "local"]), {"PMI_SIZE": "2"}) == "local"


# ---------------------------------------------------------------------------------------------- accounting

def test_dispatch_bytes_bf16_and_fp8():
    assert bench.dispatch_bytes(4096, 7168, "bf16") == 4096 * 7168 * 2
    assert bench.FP8_FACTOR == pytest.approx((1 + 4 / 128) / 2)
    assert bench.dispatch_bytes(4096, 7168, "fp8") == pytest.approx(4096 * 7168 * 2 * (1 + 4 / 128) / 2)
    # FP8 = one byte per value + one float32 scale per 128 values
    assert bench.dispatch_bytes(10, 7168, "fp8") == pytest.approx(10 * (7168 + 7168 // 128 * 4))
    assert bench.dispatch_bytes(0, 7168, "bf16") == 0
    with pytest.raises(ValueError):
        bench.dispatch_bytes(1, 128, "fp32")


def test_gbps():
    assert bench.gbps(2e9, 1.0) == pytest.approx(2.0)
    assert bench.gbps(340e9 * 344e-6, 344e-6) == pytest.approx(340.0)
    assert math.isnan(bench.gbps(1.0, 0.0))


def test_cross_gpu_bytes_from_rank_prefix_matrix():
    # 3 ranks; sends[i][j] = tokens rank i sends to rank j
    sends = np.array([[5, 2, 0],
                      [1, 7, 3],
                      [4, 0, 6]])
    rpm = np.cumsum(sends, axis=0)  # inclusive prefix over senders
    for rank in range(3):
        total, cross = bench.recv_token_counts(rpm, rank)
        assert total == sends[:, rank].sum()
        assert cross == sends[:, rank].sum() - sends[rank, rank]
        assert bench.cross_gpu_bytes(rpm, rank, 256, "bf16") == cross * 256 * 2
        assert bench.cross_gpu_bytes(rpm, rank, 256, "fp8") == pytest.approx(cross * 256 * (1 + 4 / 128))
    assert bench.recv_token_counts(rpm, 1) == (9, 2)


# ---------------------------------------------------------------------------------------------- summaries

def _stats(times_s, nbytes, cross):
    return bench.op_stats(times_s, nbytes, cross)


def test_summarize_op_takes_slowest_rank_time_and_min_rate():
    r0 = _stats([100e-6, 120e-6, 110e-6], 1e6, 5e5)     # mean 110 us
    r1 = _stats([200e-6, 180e-6], 2e6, 1e6)             # mean 190 us
    row = bench.summarize_op("dispatch BF16", [r0, r1])
    assert row["time_mean_us"] == pytest.approx(190.0)
    assert row["time_min_us"] == pytest.approx(180.0)      # max over ranks of the per-rank minimum
    g0, g1 = 1e6 / 110e-6 / 1e9, 2e6 / 190e-6 / 1e9
    assert row["gbps"] == pytest.approx(min(g0, g1))
    assert row["gbps_avg"] == pytest.approx((g0 + g1) / 2)
    assert row["xgpu_gbps"] == pytest.approx(min(g0, g1) / 2)
    no_bytes = bench.summarize_op("layout", [_stats([1e-6], None, None)] * 2)
    assert no_bytes["gbps"] is None and no_bytes["xgpu_gbps"] is None


def test_the_op_table_reports_the_peak_device_memory_of_the_rank_that_held_most():
    r0 = bench.op_stats([100e-6], 1e6, 5e5, peak_bytes=3 << 20)
    r1 = bench.op_stats([100e-6], 1e6, 5e5, peak_bytes=5 << 20)
    row = bench.summarize_op("dispatch BF16", [r0, r1])
    assert row["peak_mib"] == 5.0 and [r["peak_mib"] for r in row["per_rank"]] == [3.0, 5.0]
    assert "peak MiB" in report.format_table([row]) and "5.0" in report.format_table([row])
    assert bench.summarize_op("layout", [_stats([1e-6], None, None)] * 2)["peak_mib"] is None


def test_the_peak_memory_hook_counts_the_pool_bytes_held_at_once():
    import_or_skip("cupy", "the CuPy memory hook")
    from deepep_cupy.bench.memory import peak_pool_bytes

    hook = peak_pool_bytes()
    for mem_size in (512, 1024):
        hook.malloc_postprocess(device_id=0, size=mem_size, mem_size=mem_size, mem_ptr=0, pmem_id=0)
    hook.free_postprocess(device_id=0, mem_size=512, mem_ptr=0, pmem_id=0)
    hook.malloc_postprocess(device_id=0, size=256, mem_size=256, mem_ptr=0, pmem_id=0)
    assert hook.peak_bytes == 1536 and hook.in_use == 1280


def test_format_table_contains_the_figures():
    # mean 342 us, min 340 us; bytes chosen for 300 GB/s overall and 150 GB/s cross-GPU
    row = bench.summarize_op("dispatch BF16", [_stats([344e-6, 340e-6], 300e9 * 342e-6, 150e9 * 342e-6)])
    layout = bench.summarize_op("layout", [_stats([12.5e-6], None, None)])
    text = bench.format_table([row, layout], title="deepep_cupy")
    assert text.splitlines()[0] == "deepep_cupy"
    for s in ("dispatch BF16", "layout", "342.0", "340.0", "300.0", "150.0", "GB/s", "xGPU", "12.5",
              "mean us", "min us"):
        assert s in text
    lines = text.splitlines()
    assert len({len(line) for line in lines[1:]}) == 1  # aligned columns
    assert "-" in lines[-1]  # missing rates print as '-'


def test_format_settings_line():
    s = {"num_ranks": 2, "mode": "in-process", "num_tokens": 4096, "hidden": 7168, "num_topk": 8,
         "num_experts": 256, "routing": "uniform", "device_name": "NVIDIA H200",
         "dispatch_config": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                             "num_max_nvl_chunked_recv_tokens": 256},
         "combine_config": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 4,
                            "num_max_nvl_chunked_recv_tokens": 256}, "allocate_ahead": False}
    line = bench.format_settings(s)
    for part in ("ranks=2", "tokens/rank=4096", "hidden=7168", "topk=8", "experts=256", "routing=uniform",
                 "num_sms=24", "6/256", "4/256", "allocate_ahead=False", "NVIDIA H200"):
        assert part in line
    assert "sum(range(200))" not in line  # a document from before the figure was recorded
    assert "host: sum(range(200)) 1.23 us" in bench.format_settings(dict(s, interpreter_us=1.234))


def test_the_interpreter_figure_is_a_plausible_median():
    from deepep_cupy.bench.timing import interpreter_us

    figure = interpreter_us(repeats=200)
    assert 0.01 < figure < 1000, figure


# ---------------------------------------------------------------------------------------------- JSON

def test_results_json_round_trips_with_all_settings(tmp_path):
    args = bench.parse_args(["--tokens-sweep", "512,1024", "--tune"])
    settings = {k: v for k, v in vars(args).items()}
    settings.update(num_ranks=2, device_name="NVIDIA H200", mode="in-process",
                    dispatch_config={"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                                     "num_max_nvl_chunked_recv_tokens": 256})
    ops = [bench.summarize_op("dispatch BF16", [_stats([1e-4, 2e-4], np.float64(1e6), np.int64(10))]),
           bench.summarize_op("layout", [_stats([np.float32(1e-5)], None, None)])]
    ops[0]["nan_field"] = float("nan")
    checks = {"dispatch BF16": {"ok": True, "failures": []}}
    nccl = {"backend": "cupy.cuda.nccl", "skipped": None, "ops": ops[:1]}
    copy = {"skipped": "needs two visible GPUs"}
    sweep = {"tokens": [512, 1024], "series": {"a": [1.0, None]}, "rows": []}
    tune = {"entries": [{"op": "dispatch", "num_sms": 24, "time_us": 300.0}], "best": {}}
    doc = bench.results_to_json(settings, checks, ops, nccl, copy, sweep, tune)
    path = tmp_path / "r.json"
    bench.write_json(str(path), doc)
    back = json.loads(path.read_text())
    assert back == doc
    for key, value in settings.items():
        assert back["settings"][key] == (list(value) if isinstance(value, tuple) else value), key
    assert back["ops"][0]["nan_field"] is None
    assert back["ops"][0]["per_rank"][0]["times_us"] == pytest.approx([100.0, 200.0])
    assert back["ops"][0]["gbps"] == pytest.approx(1e6 / 150e-6 / 1e9)
    assert set(back) >= {"settings", "checks", "ops", "nccl", "copy", "sweep", "tune"}
    text = bench.render_report(back)
    assert "PASS" in text and "dispatch BF16" in text and "copy ceiling skipped" in text


# ---------------------------------------------------------------------------------------------- configs

class _Cfg:
    def __init__(self, a, b, c):
        self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = a, b, c


def test_save_config_format(tmp_path):
    path = tmp_path / "cfg.json"
    best_dispatch = {"op": "dispatch", "num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                     "num_max_nvl_chunked_recv_tokens": 256, "time_us": 300.0}
    bench.save_config(str(path), 2, best_dispatch, _Cfg(32, 4, 512), "NVIDIA H200", {"dispatch_us": 300.0})
    raw = json.loads(path.read_text())
    assert raw["num_ranks"] == 2 and raw["device"] == "NVIDIA H200"
    assert raw["dispatch"] == {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                               "num_max_nvl_chunked_recv_tokens": 256}
    assert raw["combine"] == {"num_sms": 32, "num_max_nvl_chunked_send_tokens": 4,
                              "num_max_nvl_chunked_recv_tokens": 512}
    assert raw["measured"] == {"dispatch_us": 300.0}
    assert bench.load_config(str(path)) == raw
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_ranks": 2, "dispatch": {"num_sms": 24}, "combine": raw["combine"]}))
    with pytest.raises(ValueError):
        bench.load_config(str(bad))


def test_tune_grid_and_best():
    grid = bench.tune_grid([8, 13, 24], [4, 256], [128, 256])
    assert (8, 4, 128) in grid and (24, 4, 256) in grid
    assert all(s % 2 == 0 and a < b for s, a, b in grid)
    assert len(bench.tune_grid(bench.DEFAULT_TUNE_SMS, bench.DEFAULT_TUNE_SEND, bench.DEFAULT_TUNE_RECV)) == 105
    entries = [{"op": "dispatch", "num_sms": 8, "time_us": 500.0}, {"op": "dispatch", "num_sms": 24, "time_us": 300.0},
               {"op": "combine", "num_sms": 24, "time_us": None, "error": "rejected"},
               {"op": "combine", "num_sms": 32, "time_us": 350.0}]
    best = bench.best_configs(entries)
    assert best["dispatch"]["num_sms"] == 24 and best["combine"]["num_sms"] == 32


# ---------------------------------------------------------------------------------------------- NCCL index build

def _brute_force_index(mask):
    n, r = mask.shape
    counts = [sum(1 for t in range(n) if mask[t, j]) for j in range(r)]
    perm = [t for j in range(r) for t in range(n) if mask[t, j]]
    return counts, perm


@pytest.mark.parametrize("n,r,p", [(0, 2, 0.5), (1, 2, 1.0), (37, 3, 0.3), (200, 8, 0.5), (64, 4, 0.0)])
def test_build_send_index_matches_brute_force(n, r, p):
    mask = np.random.default_rng(n * 31 + r).random((n, r)) < p
    counts, perm = bench.build_send_index(mask)
    want_counts, want_perm = _brute_force_index(mask)
    assert counts.dtype == np.int64 and perm.dtype == np.int64
    assert counts.tolist() == want_counts
    assert perm.tolist() == want_perm
    # the rows for rank j are perm[offsets[j]:offsets[j+1]]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for j in range(r):
        assert mask[perm[offsets[j]:offsets[j + 1]], j].all()


def test_token_rank_mask():
    topk = np.array([[0, 5, -1], [7, 6, 4], [-1, -1, -1], [3, 2, 1]])
    mask = bench.token_rank_mask(topk, 8, 2)      # experts 0..3 on rank 0, 4..7 on rank 1
    assert mask.tolist() == [[True, True], [False, True], [False, False], [True, False]]
    rng = np.random.default_rng(3)
    topk = rng.integers(-1, 64, size=(100, 4))
    mask = bench.token_rank_mask(topk, 64, 8)
    brute = np.array([[any(e >= 0 and e // 8 == r for e in row) for r in range(8)] for row in topk])
    assert (mask == brute).all()


def test_expected_recv_sources_order():
    masks = [np.array([[1, 0], [1, 1], [0, 1]], bool), np.array([[0, 1], [1, 0]], bool)]
    src_rank, src_tok = bench.expected_recv_sources(masks, 0)
    assert src_rank.tolist() == [0, 0, 1] and src_tok.tolist() == [0, 1, 1]
    src_rank, src_tok = bench.expected_recv_sources(masks, 1)
    assert src_rank.tolist() == [0, 0, 1] and src_tok.tolist() == [1, 2, 0]


# ---------------------------------------------------------------------------------------------- checks

def test_compare_exact():
    a = np.arange(6, dtype=np.uint16).reshape(2, 3)
    assert bench.compare_exact("x", a, a.copy())[0]
    b = a.copy()
    b[1, 2] = 99
    ok, msg = bench.compare_exact("x", b, a)
    assert not ok and "1 of 6" in msg and "(1, 2)" in msg
    assert not bench.compare_exact("x", a[:1], a)[0]
    w = np.array([0.5, np.nan], np.float32)
    assert bench.compare_exact("w", w, w.copy())[0]
    assert bench.compare_exact("l", [1, 2, 3], [1, 2, 3])[0]
    assert not bench.compare_exact("l", [1, 2, 4], [1, 2, 3])[0]


def test_aggregate_reports_check_failures_and_rows():
    args = bench.parse_args([])
    ok = [(True, "recv_x: ok")]
    ranks = [{"rank": 0, "checks": {"dispatch BF16": ok, "combine BF16": ok},
              "ops": {"dispatch BF16": _stats([1e-4], 1e6, 5e5)}},
             {"rank": 1, "checks": {"dispatch BF16": [(False, "recv_x: 3 of 9 differ")], "combine BF16": ok},
              "ops": {"dispatch BF16": _stats([2e-4], 1e6, 5e5)}}]
    agg = bench.aggregate(ranks, None, {"skipped": "disabled"}, args)
    assert not agg["checks"]["dispatch BF16"]["ok"]
    assert agg["checks"]["dispatch BF16"]["failures"] == ["rank 1: recv_x: 3 of 9 differ"]
    assert agg["checks"]["combine BF16"]["ok"]
    assert agg["ops"][0]["time_mean_us"] == pytest.approx(200.0)
    assert agg["nccl"]["skipped"] == "disabled"
    doc = bench.results_to_json({"num_ranks": 2}, agg["checks"], agg["ops"], agg["nccl"], {"skipped": "x"})
    text = bench.render_report(doc)
    assert "FAIL" in text and "rank 1: recv_x" in text and "NCCL baseline skipped: disabled" in text


def test_report_shows_tuning_and_best_config():
    args = bench.parse_args(["--tune"])
    cfg = {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6, "num_max_nvl_chunked_recv_tokens": 256}
    ranks = []
    for r in range(2):
        tune = [dict(op=op, **cfg, **_stats([t * 1e-6], 1e6, 5e5))
                for op, t in (("dispatch", 300 + r), ("combine", 400))]
        tune.append(dict(op="dispatch", num_sms=8, num_max_nvl_chunked_send_tokens=4,
                         num_max_nvl_chunked_recv_tokens=128, error="rejected"))
        ranks.append({"rank": r, "ops": {"layout": _stats([1e-5], None, None)}, "tune": tune})
    agg = bench.aggregate(ranks, None, {"skipped": "x"}, args)
    assert agg["tune"]["best"]["dispatch"]["time_us"] == pytest.approx(301.0)
    assert agg["tune"]["entries"][2]["error"] == "rejected"
    doc = bench.results_to_json({"num_ranks": 2}, agg["checks"], agg["ops"], agg["nccl"], None, None, agg["tune"])
    text = bench.render_report(json.loads(json.dumps(doc)))
    assert "tune dispatch: best 1 of 1 (1 configs rejected)" in text
    assert ("best dispatch config: Config(num_sms=24, num_max_nvl_chunked_send_tokens=6, "
            "num_max_nvl_chunked_recv_tokens=256)") in text
    assert "best combine config" in text


def _library():
    import deepep_cupy as ep
    from deepep_cupy.reference import intranode as reference

    return ep, reference


def test_buffer_size_is_the_largest_hint_over_the_configs_with_recv_x_in_the_buffer():
    ep, _ = _library()
    args = bench.parse_args([])
    small, large = ep.Config(8, 4, 128), ep.Config(48, 32, 512)
    want = ep.get_nvl_buffer_size_hint(7168 * 2, 2, large, num_topk=8, recv_x_in_buffer=True)
    assert bench.nvl_buffer_bytes(ep, args, 2, [small, large]) == want
    assert want > ep.get_nvl_buffer_size_hint(7168 * 2, 2, small, num_topk=8, recv_x_in_buffer=True)
    assert want > ep.get_nvl_buffer_size_hint(7168 * 2, 2, large, num_topk=8)


def test_checks_against_the_reference_pass_and_catch_a_flipped_bit():
    ep, reference = _library()
    args = bench.parse_args(["--num-tokens", "40", "--hidden", "256", "--num-experts", "16", "--num-topk", "4"])
    R = 2
    hosts = [bench.make_workload(reference, args, r, args.num_tokens) for r in range(R)]
    ref = bench.reference_outputs(reference, hosts, args.num_experts, 12, True)
    for rank in range(R):
        # a perfect "GPU": the reference's own outputs, in the shapes Buffer returns
        rb, rf = ref["bf16"][rank], ref["fp8"][rank]
        per_rank, per_expert, in_rank = reference.get_dispatch_layout(hosts[rank]["topk_idx"], 16, R)
        combined_x, combined_w = ref["combine"][rank]
        gpu = {"layout": (per_rank, per_expert, in_rank),
               "bf16": {k: rb[k] for k in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx",
                                          "rank_prefix_matrix", "num_recv_tokens_per_expert_list")},
               "fp8": {k: rf[k] for k in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_src_idx")},
               "cached_recv_x": rb["recv_x"],
               "combined_x": reference.round_to_dtype(combined_x, "bfloat16"), "combined_topk_weights": combined_w}
        checks = bench.compare_rank(reference, gpu, ref, hosts[rank], rank, 16, R)
        assert set(checks) == {"layout", "dispatch BF16", "dispatch FP8", "cached dispatch BF16", "combine BF16"}
        assert all(ok for items in checks.values() for ok, _ in items), checks
        bad = dict(gpu, combined_x=gpu["combined_x"].copy())
        bad["combined_x"][0, 0] ^= 1
        checks = bench.compare_rank(reference, bad, ref, hosts[rank], rank, 16, R)
        assert not all(ok for ok, _ in checks["combine BF16"])
        assert all(ok for ok, _ in checks["dispatch BF16"])


# ---------------------------------------------------------------------------------------------- what a loop sees

def _calls_rank(scale, libs=("cupy", "torch"), tokens=(128, 4096)):
    points = []
    for n in tokens:
        for lib in libs:
            ops = {op: {"loop_us": scale * (10 + i) * n / 128, "host_us": scale * (5 + i)}
                   for i, op in enumerate(calls.OPS)}
            ops["dispatch BF16"].update(wait_us=scale, host_work_us=scale * 4)
            points.append({"lib": lib, "num_tokens": n, "ops": ops})
    return {"points": points}


def test_calls_figures_are_the_slowest_ranks():
    summary = report.summarize_calls([_calls_rank(1.0), _calls_rank(2.0)])
    row = next(r for r in summary["rows"] if (r["op"], r["lib"], r["num_tokens"]) == ("layout", "torch", 4096))
    assert row["loop_us"] == 2.0 * 10 * 32 and row["host_us"] == 2.0 * 5
    dispatch = next(r for r in summary["rows"] if r["op"] == "dispatch BF16")
    assert dispatch["wait_us"] == 2.0 and dispatch["host_work_us"] == 8.0


def test_the_calls_table_shows_every_op_library_and_token_count_next_to_deepep():
    text = report.render_calls(report.summarize_calls([_calls_rank(1.0)]))
    for op in calls.OPS:
        assert op in text
    assert "128 tok" in text and "4096 tok" in text and "DeepEP V1 (torch)" in text
    assert "450" in text  # DeepEP V1's fresh BF16 dispatch at 4096 tokens
    assert "waiting for counts" in text


def test_the_calls_plot_is_written(tmp_path):
    import_or_skip("matplotlib", "the benchmark's plots (the plots extra)")
    path = tmp_path / "calls.png"
    assert report.plot_calls(str(path), report.summarize_calls([_calls_rank(1.0)]), {"num_ranks": 2}) is None
    assert path.stat().st_size > 0


def test_calls_options_parse_and_refuse_unknown_libraries(capsys):
    args = bench.parse_args(["--calls-tokens", "128,256", "--calls-libs", "torch", "--calls-iters", "5"])
    assert (args.calls_tokens, args.calls_libs, args.calls_iters, args.calls) == ([128, 256], ["torch"], 5, True)
    assert bench.parse_args(["--no-calls"]).calls is False
    with pytest.raises(SystemExit):
        bench.parse_args(["--calls-libs", "jax"])


def test_calls_run_in_rounds_whose_median_is_reported():
    assert bench.parse_args([]).calls_rounds == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--calls-rounds", "0"])
    rounds = [{"loop_us": 50.0, "host_us": 40.0}, {"loop_us": 90.0, "host_us": 80.0},
              {"loop_us": 60.0, "host_us": 45.0}]
    assert calls._median_figures(rounds) == {"loop_us": 60.0, "host_us": 45.0}


def test_calls_are_in_the_json_document():
    doc = bench.results_to_json({}, calls=report.summarize_calls([_calls_rank(1.0)]))
    assert json.loads(json.dumps(doc))["calls"]["rows"]


def test_the_captured_step_is_layout_then_a_worst_case_dispatch_then_combine():
    from deepep_cupy.bench import graphs

    log = []

    class Recording:
        num_ranks = 2

        def get_dispatch_layout(self, topk_idx, num_experts):
            log.append(("layout", num_experts))
            return "per_rank", None, "per_expert", "in_rank", None

        def dispatch(self, x, **kwargs):
            log.append(("dispatch", kwargs["num_worst_tokens"], kwargs["config"]))
            return "recv_x", None, "recv_w", [], "handle", None

        def combine(self, x, handle, topk_weights, config):
            log.append(("combine", x, handle, topk_weights, config))

    a = {"x": np.zeros((128, 16)), "topk_idx": None, "topk_weights": None}
    graphs.step(Recording(), a, 64, "d", "c")()
    assert log == [("layout", 64), ("dispatch", 256, "d"), ("combine", "recv_x", "handle", "recv_w", "c")]
    assert set(graphs.STEP_OPS) <= set(calls.OPS)


# --- SM sweep --------------------------------------------------------------------------------

def test_sm_plot_implies_the_default_sm_sweep():
    assert bench.parse_args(["--sm-plot", "sms.png"]).sm_sweep == [4, 8, 16, 24, 32]
    assert bench.parse_args(["--sm-sweep", "8,24"]).sm_sweep == [8, 24]
    assert bench.parse_args([]).sm_sweep is None


@pytest.mark.parametrize("counts", ["7", "0,8"])
def test_sm_sweep_counts_must_be_even_and_at_least_two(counts, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sm-sweep", counts])


def _sm_sweep_rank(scale):
    stats = lambda us: report.op_stats([us * scale * 1e-6] * 3, 1e9, 5e8)  # noqa: E731
    return {"sm_sweep": {"points": [{"num_sms": n, "cached dispatch BF16": stats(2000 / n),
                                     "combine BF16": stats(3000 / n)} for n in (8, 24)]}}


def test_the_sm_sweep_takes_the_slowest_rank_at_each_sm_count():
    summary = report.summarize_sm_sweep([_sm_sweep_rank(1.0), _sm_sweep_rank(1.5)])
    assert summary["sms"] == [8, 24]
    assert summary["series"]["cached dispatch BF16"] == pytest.approx([375.0, 125.0])
    assert summary["series"]["combine BF16"] == pytest.approx([562.5, 187.5])
    assert [row["op"] for row in summary["rows"]][:2] == ["cached dispatch BF16 @ 8 SMs", "combine BF16 @ 8 SMs"]


def test_the_sm_sweep_plot_is_written_with_deepep_v1_beside(tmp_path):
    import_or_skip("matplotlib", "the benchmark's plots (the plots extra)")
    path = tmp_path / "sms.png"
    summary = report.summarize_sm_sweep([_sm_sweep_rank(1.0)])
    assert set(summary["deepep_v1"]) >= {"cached dispatch BF16", "combine BF16"}
    assert report.plot_sm_sweep(str(path), summary, {"num_ranks": 2}) is None
    assert path.stat().st_size > 0


def test_the_sm_plot_places_deepep_v1_at_its_sm_counts_after_a_json_round_trip(monkeypatch):
    from unittest import mock

    plt, fig, ax = mock.MagicMock(), mock.MagicMock(), mock.MagicMock()
    plt.subplots.return_value = (fig, ax)
    monkeypatch.setattr(report, "_pyplot", lambda: plt)
    sweep = json.loads(json.dumps({"sms": [8, 16, 24], "series": {"combine BF16": [540.0, 330.0, 228.0]},
                                   "deepep_v1": {"combine BF16": {8: 990, 16: 547, 24: 404}}}))
    assert report.plot_sm_sweep("out.png", sweep, {}) is None
    v1 = [c for c in ax.plot.call_args_list if c.kwargs.get("label") == "DeepEP V1 combine BF16"]
    assert [list(a) for a in v1[0].args] == [[8, 16, 24], [990, 547, 404]]


# ---------------------------------------------------------------------------------------------- decode

def test_the_decode_table_is_an_option_with_decode_token_counts():
    a = bench.parse_args(["--decode", "--decode-tokens", "1,64"])
    assert a.decode and a.decode_tokens == [1, 64]
    assert not bench.parse_args([]).decode


def test_decode_bytes_count_fp8_rows_with_scales_and_bf16_rows():
    from deepep_cupy.bench.decode import decode_bytes

    assert decode_bytes(10, 7168) == {"dispatch": 10 * (7168 + 56 * 4), "combine": 10 * 7168 * 2}


def test_the_eager_decode_table_shows_each_library_and_medians_over_the_ranks():
    from deepep_cupy.bench.decode import eager_table

    row = dict(lib="cupy", tokens=128, dispatch_loop_us=30.0, dispatch_host_us=9.0, dispatch_host_alone_us=5.0,
               combine_loop_us=40.0, combine_host_us=8.0, combine_host_alone_us=4.0)
    torch_row = dict(row, lib="torch", dispatch_host_us=12.0)
    other = [dict(row, dispatch_loop_us=50.0, combine_host_us=6.0), dict(torch_row, dispatch_host_us=14.0)]
    third = [dict(row, dispatch_loop_us=40.0, combine_host_us=7.0, combine_host_alone_us=2.0),
             dict(torch_row, dispatch_host_us=16.0)]
    lines = eager_table([[row, torch_row], other, third]).splitlines()
    assert lines[0] == ("| library | tokens/rank | dispatch loop us | dispatch host us | dispatch host alone us "
                        "| combine loop us | combine host us | combine host alone us |")
    assert lines[1] == "|---|---|---|---|---|---|---|---|"
    assert lines[2] == "| cupy | 128 | 40.0 | 9.0 | 5.0 | 40.0 | 7.0 | 4.0 |"
    assert lines[3] == "| torch | 128 | 30.0 | 14.0 | 5.0 | 40.0 | 8.0 | 4.0 |"


def test_host_alone_has_the_ranks_call_in_turns_and_each_make_every_call(monkeypatch):
    from deepep_cupy.bench.decode import host_alone_us

    cupy = import_or_skip("cupy", "host_alone_us synchronizes a CuPy stream")
    events = []

    class Group:
        size = 3

        def __init__(self, rank):
            self.rank = rank

        def barrier(self):
            events.append("barrier")

    calls = []
    synced = []
    monkeypatch.setattr(cupy.cuda.runtime, "streamSynchronize", synced.append)
    us = host_alone_us(Group(1), lambda: calls.append(events.count("barrier")), 4, 7)
    # Rank 1 calls in its turn: after the second barrier and before the third.
    assert calls == [2, 2, 2, 2]
    assert events.count("barrier") == 5 and synced == [7]
    assert us >= 0.0


def test_the_decode_table_shows_medians_over_the_ranks():
    from deepep_cupy.bench.decode import decode_table

    row = dict(tokens=32, dispatch_us=10.0, combine_us=20.0, step_host_us=5.0, dispatch_bytes=100, combine_bytes=200)
    other = dict(row, dispatch_us=30.0, combine_us=40.0, step_host_us=7.0)
    third = dict(row, dispatch_us=20.0, combine_us=30.0, step_host_us=6.0)
    lines = decode_table([[row], [other], [third]]).splitlines()
    assert lines[0].startswith("| tokens/rank | dispatch us (GPU) | combine us (GPU) | step host us/replay")
    assert lines[2] == "| 32 | 20.0 | 30.0 | 6.0 | 100 | 200 |"
