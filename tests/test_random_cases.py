"""The random cases of the GPU soak, on the CPU: the generator (tests/workers/random_cases.py),
the inputs and reference of tiny cases, and the soak runner (tests/workers/random_soak.py) with its
GPU parts replaced by fakes.
"""

import collections
import json
import textwrap

import numpy as np
import pytest
from _harness import WORKERS, describe, run_python, worker_records
from workers import gpu_worker
from workers import random_cases as rc
from workers.gpu_scenarios import BASE

from deepep_cupy.config import Config
from deepep_cupy.gpu import layout
from deepep_cupy.gpu.sm_budget import check_sm_budget, largest_num_sms
from deepep_cupy.intranode.capacity import ReceiveCapacityGuess
from deepep_cupy.intranode.plans import check_num_experts
from deepep_cupy.reference import intranode as ref

SOAK = WORKERS / "random_soak.py"
SEEDS = range(1000)
CASES = rc.random_cases(SEEDS[0], len(SEEDS))


def counts_of(case):
    return rc.token_counts(case)


def moved_bytes(case):
    """Bytes all ranks receive at most (the quantity MOVED_BYTES_CAP bounds)."""
    return (sum(counts_of(case)) * case["hidden"] * rc.ITEMSIZE[case["dtype"]]
            * min(case["num_topk"], case["num_ranks"]))


# ---------------------------------------------------------------------------------------------
# The generator


def test_a_seed_gives_the_same_case_every_time():
    assert rc.random_cases(0, 100) == CASES[:100]
    assert [rc.random_case(s) for s in (5, 999, 5)] == [CASES[5], CASES[999], CASES[5]]


def test_different_seeds_give_different_cases():
    assert len({rc.describe_case(c) for c in CASES}) == len(CASES)


def test_a_case_has_the_fields_run_scenario_reads():
    for case in CASES:
        assert set(case) == set(BASE) | {"name", "num_ranks"}, case
        assert case["name"] == f"random_{case['seed']}"


def _values(cases, key):
    return {c[key] for c in cases}


@pytest.mark.parametrize("cases", [pytest.param(CASES[:400], id="400 seeds"),
                                   pytest.param(rc.random_cases(rc.GPU_TEST_SEEDS[0], len(rc.GPU_TEST_SEEDS)),
                                                id="make test's seeds")])
def test_the_seeds_cover_every_rank_count_dtype_and_mode(cases):
    assert _values(cases, "num_ranks") == set(rc.RANK_COUNTS)
    assert _values(cases, "dtype") == set(rc.DTYPES)
    assert _values(cases, "mode") == {"sync", "async"}
    assert _values(cases, "framework") == {"cupy", "torch"}
    assert _values(cases, "cached") == {True, False}
    assert _values(cases, "routing") == set(rc.ROUTINGS)
    assert _values(cases, "allocation") == {"exact", "ahead", "retried"}
    assert {type(c["num_tokens"]) for c in cases} == {int, tuple}  # every rank alike, and uneven
    assert _values(cases, "bias") == {0, 1, 2} and _values(cases, "worst") == {True, False}
    assert _values(cases, "scales_layout") == {"row", "column"}


def test_four_hundred_seeds_reach_the_ends_of_every_range():
    cases = CASES[:400]
    every_count = [n for c in cases for n in counts_of(c)]
    assert 0 in every_count and max(every_count) >= 4000
    assert _values(cases, "num_topk") == set(range(rc.TOPK_RANGE[0], rc.TOPK_RANGE[1] + 1))
    assert any(c["num_experts"] == rc.most_experts(c["num_ranks"]) for c in cases)
    assert max(c["num_experts"] for c in cases) == 8192
    alignments = _values(cases, "expert_alignment")
    assert 1 in alignments and max(alignments) >= 64
    assert max(c["hidden"] for c in cases) >= 7168
    assert any(c["hidden"] % 128 for c in cases if c["dtype"] == "float8_e4m3fn_1d")
    assert 1 in _values(cases, "recv_chunk") and max(_values(cases, "recv_chunk")) >= 512
    assert 1 in _values(cases, "send_chunk")
    assert 2 in _values(cases, "num_sms")
    assert any(c["num_sms"] == largest_num_sms(rc.ranks_per_gpu(c["num_ranks"], 2), 132) for c in cases)
    for key in ("with_topk", "with_weights", "combine"):
        assert _values(cases, key) == {True, False}, key


@pytest.mark.parametrize("num_gpus", [1, 2, 8])
def test_every_case_is_within_the_library_limits(num_gpus):
    cases = CASES if num_gpus == 2 else rc.random_cases(0, 300, num_gpus=num_gpus)
    for case in cases:
        R, K, E, H, dtype = case["num_ranks"], case["num_topk"], case["num_experts"], case["hidden"], case["dtype"]
        config = Config(case["num_sms"], case["send_chunk"], case["recv_chunk"])  # raises if not valid
        assert case["recv_chunk"] <= rc.MAX_RECV_CHUNK
        devices = [r % num_gpus for r in range(R)]
        check_sm_budget(collections.Counter(devices), case["num_sms"], 132)
        assert check_num_experts(E, R) == E
        assert rc.TOPK_RANGE[0] <= K <= rc.TOPK_RANGE[1] and K <= E
        if case["routing"] == "avoid_last_rank":
            assert K <= E - E // R, case
        counts = counts_of(case)
        assert len(counts) == R and all(0 <= n <= rc.MAX_TOKENS for n in counts)
        row_bytes = H * rc.ITEMSIZE[dtype]
        assert 0 < H <= rc.MAX_HIDDEN and row_bytes % 16 == 0
        if dtype == "float8_e4m3fn":
            assert H % 128 == 0
        assert 1 <= case["expert_alignment"] <= rc.MAX_ALIGNMENT
        assert case["with_topk"] or not case["with_weights"]
        assert not (dtype.startswith("float8") and case["combine"])
        # What the Buffer's checks will ask for (plans.check_fresh_dispatch, check_combine) fits the
        # buffer the soak makes for the case, and that stays under the cap.
        num_scales = 0 if not dtype.startswith("float8") else 1 if dtype.endswith("_1d") else H // 128
        topk = K if case["with_topk"] else 0
        dispatch = layout.dispatch_layout(R, config.num_channels, max(counts), row_bytes, topk, num_scales)
        combine = layout.combine_layout(R, config.num_channels, max(counts), row_bytes,
                                        K if case["with_weights"] else 0)
        needed = rc.nvl_bytes_needed(case)
        assert max(dispatch.total_bytes, combine.total_bytes) <= needed <= rc.NVL_BYTES_CAP, case


def test_the_reference_cost_of_a_case_is_capped():
    for case in CASES:
        assert moved_bytes(case) <= rc.MOVED_BYTES_CAP or case["hidden"] == rc.row_step(case["dtype"]), case
        fewest_experts = -(-case["num_topk"] // (case["num_ranks"] - 1)) * case["num_ranks"]
        assert sum(counts_of(case)) * case["num_experts"] <= max(rc.ROUTING_KEYS_CAP,
                                                                 sum(counts_of(case)) * fewest_experts), case
    # Most cases are small, a tail is large (the soak's time budget: a case at the cap costs the
    # reference ~0.1-0.5 s, a median one ~15 ms).
    moved = [moved_bytes(c) for c in CASES]
    assert np.median(moved) < rc.MOVED_BYTES_CAP / 8 and np.mean(moved) < rc.MOVED_BYTES_CAP / 2


# ---------------------------------------------------------------------------------------------
# Inputs and reference of tiny cases


def tiny_cases(count, keep=lambda case: True):
    found = [c for c in CASES if sum(counts_of(c)) <= 400 and c["hidden"] <= 1024 and c["num_experts"] <= 512
             and keep(c)]
    assert len(found) >= count
    return found[:count]


def reference_of(case):
    """What gpu_worker.run_scenario computes on the host for a case: inputs, dispatch, combine."""
    inputs = gpu_worker.make_inputs(case, case["num_ranks"])
    scaled = inputs[0]["scales"] is not None
    results = ref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], case["num_experts"],
                           case["num_sms"] // 2,
                           topk_weights=[i["weights"] for i in inputs] if case["with_weights"] else None,
                           x_scales=[i["scales"] for i in inputs] if scaled else None,
                           expert_alignment=case["expert_alignment"])
    return inputs, results


TINY = tiny_cases(8) + tiny_cases(2, lambda c: c["dtype"] == "float8_e4m3fn") + \
    tiny_cases(2, lambda c: c["dtype"] == "float8_e4m3fn_1d" and c["hidden"] % 128 != 0) + \
    tiny_cases(2, lambda c: c["combine"] and c["with_weights"])


@pytest.mark.parametrize("case", TINY, ids=[f"seed {c['seed']}" for c in TINY])
def test_a_tiny_case_runs_through_the_reference(case):
    R, H, dtype = case["num_ranks"], case["hidden"], case["dtype"]
    inputs, results = reference_of(case)
    for inp, n in zip(inputs, counts_of(case)):
        assert inp["x"].shape == (n, H) and inp["x"].flags.c_contiguous
        if dtype == "float8_e4m3fn":
            assert inp["scales"].shape == (n, H // 128)
        elif dtype == "float8_e4m3fn_1d":
            assert inp["scales"].shape == (n,)
    layouts = [ref.get_dispatch_layout(i["topk"], case["num_experts"], R) for i in inputs]
    total = sum(counts_of(case))
    for j, result in enumerate(results):
        received = sum(int(per_rank[j]) for per_rank, _, _ in layouts)
        assert result["recv_x"].shape == (received, H)
        assert int(result["rank_prefix_matrix"][-1, j]) == received
        assert all(n % case["expert_alignment"] == 0 for n in result["num_recv_tokens_per_expert_list"])
        # The "ahead" allocation (gpu_worker.run_scenario) leaves room for what this rank receives.
        guess = ReceiveCapacityGuess()
        guess.observe(counts_of(case)[j], total)
        assert guess.rows(counts_of(case)[j], 1 << 30) >= received
    if case["combine"]:
        weights = [r["recv_topk_weights"] for r in results] if case["with_weights"] else None
        combined = ref.combine([r["recv_x"] for r in results], results, topk_weights=weights)
        for m, (x, w) in enumerate(combined):
            assert x.shape == (counts_of(case)[m], H)
            nowhere = ~results[m]["is_token_in_rank"].any(axis=1)
            assert not x[nowhere].any()
            assert ref.round_to_dtype(x, dtype).shape == x.shape
            assert (w is None) == (weights is None)


def test_a_retried_case_receives_more_than_the_guess_on_some_rank():
    # The cheapest of them to draw inputs for (the guarantee needs more than 64 tokens per rank).
    retried = sorted((c for c in CASES if c["allocation"] == "retried"),
                     key=lambda c: sum(counts_of(c)) * (c["hidden"] + c["num_experts"]))[:6]
    assert len(retried) == 6
    for case in retried:
        inputs = gpu_worker.make_inputs(case, case["num_ranks"])
        per_rank = sum(ref.get_dispatch_layout(i["topk"], case["num_experts"], case["num_ranks"])[0] for i in inputs)
        assert per_rank.max() > rc.RETRY_GUESS_ROWS, case


def test_fp8_rows_with_a_per_token_scale_need_only_16_bytes():
    case = dict(BASE, dtype="float8_e4m3fn_1d", hidden=48, num_tokens=(5, 0, 3), seed=3)
    inputs = gpu_worker.make_inputs(case, 3)
    assert [i["x"].shape for i in inputs] == [(5, 48), (0, 48), (3, 48)]
    assert [i["scales"].shape for i in inputs] == [(5,), (0,), (3,)]
    assert all(i["x"].flags.c_contiguous for i in inputs)
    # Finite e4m3 codes only: never the NaN patterns 0x7F / 0xFF.
    assert not any(np.isin(i["x"], (0x7F, 0xFF)).any() for i in inputs)


# ---------------------------------------------------------------------------------------------
# The soak runner


def test_the_soak_lists_the_case_of_each_seed_alone_or_in_a_range():
    run = run_python([SOAK, "--list", "--seed", 7, "--cases", 3], timeout=120)
    assert run.returncode == 0, describe(run)
    assert run.stdout.splitlines() == [rc.describe_case(rc.random_case(s)) for s in (7, 8, 9)]
    alone = run_python([SOAK, "--list", "--seed", 8, "--cases", 1], timeout=120)
    assert alone.stdout.splitlines() == run.stdout.splitlines()[1:2], describe(alone)


@pytest.mark.parametrize("args, message", [(["--cases", 0], "--cases: expected at least 1"),
                                           (["--seed", -1], "--seed: expected a non-negative seed"),
                                           (["--gpus", 0], "--gpus: expected at least 1"),
                                           (["--timeout", 0], "--timeout: expected a positive number")])
def test_the_soak_refuses_bad_arguments(args, message):
    run = run_python([SOAK, *args], timeout=120)
    assert run.returncode == 2 and message in run.stderr, describe(run)


# The soak with its GPU parts replaced: rank threads without devices (run_local_group's
# use_devices=False), a Buffer that only counts itself, a run_scenario told which seeds fail or hang.
FAKE_GPU_DRIVER = textwrap.dedent('''
    import json, sys, threading, time
    sys.path.insert(0, sys.argv[1])  # the soak imports its sibling workers as a script does
    import deepep_cupy as ep
    import gpu_worker, random_soak

    plan = json.loads(sys.argv[2])
    buffers = []
    lock = threading.Lock()

    class FakeBuffer:
        def __init__(self, group, nvl_bytes, timeout_s):
            if group.size in plan["broken_rank_counts"]:
                raise RuntimeError(f"no buffer for {group.size} ranks")
            self.group = group
            with lock:
                buffers.append(group.size)

        def destroy(self):
            pass

    def run_scenario(buf, case):
        if case["seed"] in plan["hang"]:
            time.sleep(60)
        if case["seed"] in plan["fail"] and buf.group.rank == 1:
            raise gpu_worker.Mismatch("recv_x: 1 of 8 elements differ")

    run_local_group = ep.run_local_group
    ep.run_local_group = lambda fn, n, devices, *, timeout_s, num_sms: run_local_group(
        fn, n, devices, timeout_s=timeout_s, use_devices=False)
    ep.Buffer = FakeBuffer
    gpu_worker.run_scenario = run_scenario
    gpu_worker.kernel_error = lambda buf: ""
    random_soak.visible_gpus = lambda args: (2, 132)
    random_soak.warm_combine_kernels = lambda num_ranks: None
    code = random_soak.main(sys.argv[3:])
    print("BUFFERS " + json.dumps({str(r): buffers.count(r) for r in sorted(set(buffers))}), flush=True)
    sys.exit(code)
''')


def run_fake_soak(tmp_path, args, fail=(), hang=(), broken_rank_counts=(), timeout=120):
    driver = tmp_path / "fake_gpu_soak.py"
    driver.write_text(FAKE_GPU_DRIVER)
    plan = {"fail": list(fail), "hang": list(hang), "broken_rank_counts": list(broken_rank_counts)}
    return run_python([driver, WORKERS, json.dumps(plan), *args], timeout=timeout)


def test_the_soak_reports_each_failing_seed_and_goes_on(tmp_path):
    seeds = range(20, 44)
    cases = {c["seed"]: c for c in rc.random_cases(seeds[0], len(seeds))}
    fail = [21, 30]
    run = run_fake_soak(tmp_path, ["--seed", seeds[0], "--cases", len(seeds), "--records"], fail=fail)
    assert run.returncode == 1, describe(run)
    failures = worker_records(run.stdout, "FAIL")
    assert [f["seed"] for f in sorted(failures, key=lambda f: f["seed"])] == fail
    for failure in failures:
        assert list(failure["errors"]) == ["1"] and "Mismatch: recv_x" in failure["errors"]["1"]
        assert failure["reproduce"] == f"make soak-cases SOAK_SEED={failure['seed']} SOAK_CASES=1"
        assert failure["case"] == rc.describe_case(cases[failure["seed"]])
    records = worker_records(run.stdout, "CASE")
    assert sorted(r["seed"] for r in records) == list(seeds)
    assert {r["seed"] for r in records if not r["ok"]} == set(fail)
    summary = worker_records(run.stdout, "SUMMARY")[-1]
    assert summary["cases"] == len(seeds) and summary["failed"] == fail and summary["seeds"] == [20, 43]
    per_count = collections.Counter(c["num_ranks"] for c in cases.values())
    assert {int(r): b["cases"] for r, b in summary["per_rank_count"].items()} == dict(per_count)
    # One Buffer per rank per rank count, and a new one on every rank after each failing case.
    buffers = {int(r): n for r, n in worker_records(run.stdout, "BUFFERS")[-1].items()}
    assert buffers == {r: r * (1 + sum(cases[s]["num_ranks"] == r for s in fail)) for r in per_count}
    assert f"soak: {len(seeds)} cases, seeds 20..43, 2 failed" in run.stdout


def test_a_soak_without_failures_exits_with_0_and_prints_no_case_records(tmp_path):
    run = run_fake_soak(tmp_path, ["--seed", 3, "--cases", 10])
    assert run.returncode == 0, describe(run)
    assert not worker_records(run.stdout, "FAIL") and not worker_records(run.stdout, "CASE")
    assert worker_records(run.stdout, "SUMMARY")[-1]["failed"] == []


def test_a_rank_count_whose_group_breaks_down_fails_its_cases_and_the_rest_run(tmp_path):
    seeds = range(20, 44)
    cases = rc.random_cases(seeds[0], len(seeds))
    broken = cases[0]["num_ranks"]
    run = run_fake_soak(tmp_path, ["--seed", seeds[0], "--cases", len(seeds)], broken_rank_counts=[broken])
    assert run.returncode == 1, describe(run)
    errors = worker_records(run.stdout, "ERROR")
    assert len(errors) == 1 and errors[0]["ranks"] == broken and f"no buffer for {broken} ranks" in errors[0]["message"]
    assert sorted(f["seed"] for f in worker_records(run.stdout, "FAIL")) == \
        [c["seed"] for c in cases if c["num_ranks"] == broken]
    summary = worker_records(run.stdout, "SUMMARY")[-1]
    assert summary["cases"] == len(seeds)


def test_a_hung_case_is_named_and_ends_the_soak(tmp_path):
    seeds = range(20, 30)
    hung = 24
    run = run_fake_soak(tmp_path, ["--seed", seeds[0], "--cases", len(seeds), "--timeout", 1, "--case-deadline", 2],
                        hang=[hung], timeout=60)
    assert run.returncode == 3, describe(run)
    hangs = worker_records(run.stdout, "HANG")
    assert [h["seed"] for h in hangs] == [hung], describe(run)
    assert "most recent call first" in run.stderr, describe(run)  # faulthandler's stack dump
