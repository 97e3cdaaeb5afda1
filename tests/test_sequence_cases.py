"""The sequences of the sequence soak, on the CPU: the drawing (tests/workers/sequence_cases.py),
the inputs and reference of small steps, and the soak's ``--list`` (tests/workers/sequence_soak.py)."""

import collections
import json
import textwrap

import numpy as np
import pytest
from _harness import WORKERS, describe, run_python, worker_records
from workers import memory_bounds as mb
from workers import random_cases as rc
from workers import sequence_cases as sc

from deepep_cupy.gpu.sm_budget import check_sm_budget
from deepep_cupy.reference import intranode as ref

SOAK = WORKERS / "sequence_soak.py"
SEQUENCES = sc.random_sequences(0, 200, 50)
STEPS = [(seq, step) for seq in SEQUENCES for step in seq["steps"]]


# ---------------------------------------------------------------------------------------------
# Drawing


def test_a_seed_gives_the_same_sequence_every_time():
    assert sc.random_sequences(0, 50, 50) == SEQUENCES[:50]
    assert [sc.random_sequence(s, 50) for s in (7, 199, 7)] == [SEQUENCES[7], SEQUENCES[199], SEQUENCES[7]]


def test_different_seeds_give_different_sequences():
    assert len({tuple(sc.describe_step(s) for s in seq["steps"]) for seq in SEQUENCES}) == len(SEQUENCES)


def test_a_longer_sequence_begins_with_the_shorter_one():
    assert sc.random_sequence(3, 80)["steps"][:50] == SEQUENCES[3]["steps"]


def test_rank_counts_are_2_to_4_and_rarely_8():
    counts = collections.Counter(seq["num_ranks"] for seq in SEQUENCES)
    assert set(counts) == {2, 3, 4, 8}
    assert counts[8] < 0.1 * len(SEQUENCES)


def test_every_sequence_fits_the_gpus_it_was_drawn_for():
    for seq in sc.random_sequences(0, 100, 5, num_gpus=1, sm_count=132):
        assert seq["num_sms"] % 2 == 0 and seq["num_sms"] >= 2
        check_sm_budget({0: seq["num_ranks"]}, seq["num_sms"], 132)
    for seq in SEQUENCES:
        check_sm_budget({0: rc.ranks_per_gpu(seq["num_ranks"], 2)}, seq["num_sms"], 132)


def test_experts_split_evenly_and_each_rank_has_top_k_of_them():
    for seq in SEQUENCES:
        assert seq["num_experts"] % seq["num_ranks"] == 0
        assert seq["num_experts"] // seq["num_ranks"] >= seq["num_topk"]
        assert 1 <= seq["num_topk"] <= sc.MAX_TOPK


def in_a_token_range(n):
    return any(lo <= n <= hi for lo, hi in sc.TOKEN_RANGES)


def test_every_step_draws_token_counts_within_the_issues_ranges():
    for seq, step in STEPS:
        assert len(step["tokens"]) == seq["num_ranks"]
        assert all(in_a_token_range(n) for n in step["tokens"]), step
    kinds = collections.Counter(next(i for i, (lo, hi) in enumerate(sc.TOKEN_RANGES) if lo <= n <= hi)
                                for _, step in STEPS for n in step["tokens"])
    assert set(kinds) == set(range(len(sc.TOKEN_RANGES)))


def test_token_counts_are_unrelated_across_ranks():
    uneven = sum(len(set(step["tokens"])) > 1 for _, step in STEPS if step["routing"] != "from_one")
    assert uneven > 0.5 * len(STEPS)


def test_routing_from_one_rank_leaves_the_others_without_tokens():
    for _, step in STEPS:
        assert step["routing"] in sc.ROUTINGS
        if step["routing"] == "from_one":
            assert all(n == 0 for r, n in enumerate(step["tokens"]) if r != step["target"]), step


def test_every_kind_routing_and_dtype_is_drawn():
    assert {step["kind"] for _, step in STEPS} == set(sc.KINDS)
    assert {step["routing"] for _, step in STEPS} == set(sc.ROUTINGS)
    assert {step["dtype"] for _, step in STEPS} == set(sc.DTYPES)
    assert {seq["framework"] for seq in SEQUENCES} == {"cupy", "torch"}
    assert any(step["repeat"] for _, step in STEPS)
    assert {step["worst_rows"] for _, step in STEPS if step["kind"] == "worst"} == {"most_received", "all_tokens"}


def test_every_hidden_size_has_16_byte_rows_and_a_step_moves_at_most_the_cap():
    for seq, step in STEPS:
        row_step = rc.row_step(step["dtype"])
        assert step["hidden"] % row_step == 0 and row_step <= step["hidden"] <= sc.MAX_HIDDEN
        assert step["hidden"] * sc.ITEMSIZE[step["dtype"]] % 16 == 0
        moved = sc.moved_bytes(step, seq["num_topk"], seq["num_ranks"])
        assert moved <= sc.MOVED_BYTES_CAP or step["hidden"] == row_step, step
    assert len({step["hidden"] for _, step in STEPS}) > 100


def test_a_sequence_starts_fresh_and_a_cached_step_reuses_the_last_fresh_routing():
    for seq in SEQUENCES:
        steps = seq["steps"]
        assert steps[0]["kind"] == "fresh"
        last_fresh = None
        for step in steps:
            if step["kind"] == "cached":
                fresh = steps[last_fresh]
                assert step["routing_of"] == last_fresh
                assert (step["tokens"], step["routing"], step["target"]) == \
                    (fresh["tokens"], fresh["routing"], fresh["target"])
            else:
                assert step["routing_of"] == step["index"]
            if step["repeat"]:
                fresh = steps[last_fresh]
                assert all(step[k] == fresh[k] for k in ("tokens", "routing", "target", "dtype", "hidden"))
            if step["kind"] == "fresh":
                last_fresh = step["index"]


def test_a_step_combines_only_dtypes_combine_takes_and_worst_spares_are_bounded():
    for _, step in STEPS:
        assert not (step["combine"] and step["dtype"] == "float8_e4m3fn")
        assert 0 <= step["worst_spare"] <= sc.MAX_WORST_SPARE
    assert any(step["combine"] for _, step in STEPS)


def test_the_nvlink_buffer_holds_8192_tokens_of_every_steps_rows():
    for seq in SEQUENCES[:40]:
        nvl_bytes = sc.nvl_bytes_needed(seq)
        for step in seq["steps"]:
            most = mb.most_rows(seq["num_ranks"], sc.config_of(seq), step["dtype"], step["hidden"], seq["num_topk"],
                                nvl_bytes)
            assert most >= seq["num_ranks"] * sc.MAX_TOKENS


# ---------------------------------------------------------------------------------------------
# Inputs and reference


def small_steps(count=60):
    return [(seq, step) for seq, step in STEPS if sum(step["tokens"]) <= 200][:count]


def test_step_inputs_are_the_same_every_time_and_route_distinct_experts():
    for seq, step in small_steps():
        inputs, again = sc.step_inputs(seq, step), sc.step_inputs(seq, step)
        for rank, (mine, other) in enumerate(zip(inputs, again)):
            for key in ("x", "scales", "topk", "weights"):
                assert (mine[key] is None and other[key] is None) or np.array_equal(mine[key], other[key])
            topk = mine["topk"]
            assert topk.shape == (step["tokens"][rank], seq["num_topk"]) and topk.dtype == np.int64
            assert all(len(set(row)) == seq["num_topk"] for row in topk.tolist())
            assert topk.size == 0 or (0 <= topk.min() and topk.max() < seq["num_experts"])
            assert mine["x"].shape == (step["tokens"][rank], step["hidden"])
            assert (mine["scales"] is not None) == (step["dtype"] == "float8_e4m3fn")
            assert (mine["weights"] is not None) == seq["with_weights"]


def test_routing_to_one_rank_sends_every_token_there_only():
    checked = 0
    for seq, step in small_steps(400):
        if step["routing"] != "to_one" or not sum(step["tokens"]):
            continue
        per_rank = sum(ref.get_dispatch_layout(i["topk"], seq["num_experts"], seq["num_ranks"])[0]
                       for i in sc.step_inputs(seq, step))
        expected = [sum(step["tokens"]) if r == step["target"] else 0 for r in range(seq["num_ranks"])]
        assert per_rank.tolist() == expected
        checked += 1
    assert checked > 5


def test_a_cached_step_has_its_fresh_steps_routing_and_new_rows():
    checked = 0
    for seq, step in STEPS:
        if step["kind"] != "cached" or not 0 < sum(step["tokens"]) <= 500:
            continue
        fresh = seq["steps"][step["routing_of"]]
        for mine, theirs in zip(sc.step_inputs(seq, step), sc.step_inputs(seq, fresh)):
            assert np.array_equal(mine["topk"], theirs["topk"])
            if mine["x"].size and mine["x"].shape == theirs["x"].shape and mine["x"].dtype == theirs["x"].dtype:
                assert not np.array_equal(mine["x"], theirs["x"])
        checked += 1
    assert checked > 5


def test_the_reference_of_small_steps_runs():
    for seq, step in small_steps(20):
        inputs = sc.step_inputs(seq, step)
        results = ref.dispatch([i["x"] for i in inputs], [i["topk"] for i in inputs], seq["num_experts"],
                               sc.config_of(seq).num_channels,
                               x_scales=[i["scales"] for i in inputs] if inputs[0]["scales"] is not None else None)
        assert sum(r["recv_x"].shape[0] for r in results) <= sum(step["tokens"]) * seq["num_ranks"]


# ---------------------------------------------------------------------------------------------
# The soak's command line


def test_the_soak_lists_its_sequences_without_a_gpu():
    run = run_python([SOAK, "--list", "--seed", 4, "--sequences", 2, "--steps", 7], timeout=120)
    assert run.returncode == 0, describe(run)
    expected = []
    for seq in sc.random_sequences(4, 2, 7):
        expected += [sc.describe_sequence(seq)] + ["  " + sc.describe_step(s) for s in seq["steps"]]
    assert run.stdout.splitlines() == expected


@pytest.mark.parametrize("args, message", [(["--sequences", 0], "--sequences: expected at least 1"),
                                           (["--steps", 0], "--steps: expected at least 1"),
                                           (["--seed", -1], "--seed: expected a non-negative seed"),
                                           (["--gpus", 0], "--gpus: expected at least 1"),
                                           (["--timeout", 0], "--timeout: expected a positive number")])
def test_the_soak_refuses_bad_arguments(args, message):
    run = run_python([SOAK, *args], timeout=120)
    assert run.returncode == 2 and message in run.stderr, describe(run)


# ---------------------------------------------------------------------------------------------
# The soak with its GPU parts replaced: rank threads without devices, a Buffer that does nothing,
# a run_step told which steps fail (a wrong result, rows above the bound, a device peak above the
# limit) or hang.
FAKE_GPU_DRIVER = textwrap.dedent('''
    import contextlib, json, sys, time
    sys.path.insert(0, sys.argv[1])  # the soak imports its sibling workers as a script does
    import deepep_cupy as ep
    import sequence_soak as soak

    plan = {kind: [tuple(k) for k in keys] for kind, keys in json.loads(sys.argv[2]).items()}

    class FakeBuffer:
        def __init__(self, group, nvl_bytes, timeout_s):
            self.group = group

        def destroy(self):
            pass

    def run_step(ctx, state, seq, step, memo):
        rank, key = ctx["group"].rank, (seq["seed"], step["index"])
        if key in plan["hang"]:
            time.sleep(60)
        if key in plan["mismatch"] and rank == 1:
            return False, "Mismatch: recv_x: 1 of 8 elements differ", {}
        info = {"rank": rank, "recv": 100, "device": ctx["device"], "peak": 4 << 20 if ctx["leader"] else None,
                "exact_bytes": 2 << 20, "bound_bytes": 0, "allocation": "ahead"}
        if step["kind"] == "fresh":
            rows = 10 ** 6 if key in plan["rows"] and rank == 0 else 150
            info.update(rows_allocated=rows, allowed=164, largest_before=0, guess_largest=100, bound=164,
                        steady=False, most_rows=10 ** 6)
        if key in plan["peak"] and ctx["leader"]:
            info["peak"] = 1 << 40
        return True, None, info

    run_local_group = ep.run_local_group
    ep.run_local_group = lambda fn, n, devices, *, timeout_s, num_sms: run_local_group(
        fn, n, devices, timeout_s=timeout_s, use_devices=False)
    ep.Buffer = FakeBuffer
    soak.run_step = run_step
    soak.warm_combine_kernels = lambda num_ranks: None
    soak.visible_gpus = lambda args: (1, 132)
    soak.torch_stream = lambda seq, device: contextlib.nullcontext()
    sys.exit(soak.main(sys.argv[3:]))
''')


def run_fake_soak(tmp_path, args, timeout=120, **plan):
    driver = tmp_path / "fake_gpu_sequence_soak.py"
    driver.write_text(FAKE_GPU_DRIVER)
    kinds = {kind: [list(k) for k in plan.get(kind, ())] for kind in ("mismatch", "rows", "peak", "hang")}
    return run_python([driver, WORKERS, json.dumps(kinds), *args], timeout=timeout)


def first_fresh_step(seq, after=0):
    return next(s["index"] for s in seq["steps"][after:] if s["kind"] == "fresh")


def test_the_soak_reports_each_failing_sequence_at_its_step_and_goes_on(tmp_path):
    seqs = {s["seed"]: s for s in sc.random_sequences(30, 8, 12, num_gpus=1)}
    rows_step = first_fresh_step(seqs[33], 3)
    plan = dict(mismatch=[(31, 4)], rows=[(33, rows_step)], peak=[(36, 0)])
    run = run_fake_soak(tmp_path, ["--seed", 30, "--sequences", 8, "--steps", 12, "--records"], **plan)
    assert run.returncode == 1, describe(run)
    failures = {f["seed"]: f for f in worker_records(run.stdout, "FAIL")}
    assert sorted(failures) == [31, 33, 36], describe(run)
    assert failures[31]["failed_step"] == 4 and "Mismatch: recv_x" in failures[31]["errors"]["1"]
    assert failures[33]["failed_step"] == rows_step and failures[33]["errors"]["0"].startswith("bound: allocated")
    assert failures[36]["failed_step"] == 0 and "bound: device 0 peaked" in failures[36]["errors"]["0"]
    for seed, failure in failures.items():
        assert failure["reproduce"] == f"make soak-sequences SOAK_SEQUENCE_SEED={seed} SOAK_SEQUENCES=1 SOAK_STEPS=12"
        assert failure["sequence"] == sc.describe_sequence(seqs[seed])
        assert failure["step_description"] == sc.describe_step(seqs[seed]["steps"][failure["failed_step"]])
    sequences = {r["seed"]: r for r in worker_records(run.stdout, "SEQUENCE")}
    assert sorted(sequences) == list(range(30, 38))
    assert {s: r["steps"] for s, r in sequences.items()} == {
        s: failures[s]["failed_step"] + 1 if s in failures else 12 for s in seqs}
    steps = worker_records(run.stdout, "STEP")
    assert len(steps) == sum(r["steps"] for r in sequences.values())
    assert all(len(s["ranks"]) == seqs[s["seed"]]["num_ranks"] for s in steps)
    summary = worker_records(run.stdout, "SUMMARY")[-1]
    assert summary["failed"] == [31, 33, 36] and summary["sequences"] == 8 and summary["seeds"] == [30, 37]
    # The worst ratios include the steps that failed for them.
    assert summary["worst_rows"] == {"ratio": 10 ** 4, "seed": 33, "step": rows_step, "rank": 0, "rows": 10 ** 6,
                                     "recv": 100}
    assert summary["worst_peak"]["seed"] == 36 and summary["worst_peak"]["step"] == 0
    assert summary["worst_peak_of_limit"]["seed"] == 36 and summary["worst_peak_of_limit"]["ratio"] > 1
    passing = run_fake_soak(tmp_path, ["--seed", 30, "--sequences", 2, "--steps", 3])
    summary = worker_records(passing.stdout, "SUMMARY")[-1]
    # 4 MiB of peak per device over 2 MiB of exact outputs per rank (one GPU: every rank on it).
    fewest_ranks = min(seqs[s]["num_ranks"] for s in (30, 31))
    assert summary["worst_rows"]["ratio"] == 1.5 and summary["worst_peak"]["ratio"] == round(2 / fewest_ranks, 3)
    limit = mb.peak_limit(fewest_ranks * (2 << 20), 0, fewest_ranks)
    assert summary["worst_peak_of_limit"]["ratio"] == round((4 << 20) / limit, 3)


def test_a_soak_without_failures_exits_with_0_and_prints_no_step_records(tmp_path):
    run = run_fake_soak(tmp_path, ["--seed", 3, "--sequences", 4, "--steps", 5])
    assert run.returncode == 0, describe(run)
    assert not worker_records(run.stdout, "FAIL") and not worker_records(run.stdout, "STEP")
    assert worker_records(run.stdout, "SUMMARY")[-1]["steps"] == 20
    assert "sequence soak: 4 sequences of 5 steps, seeds 3..6, 0 failed" in run.stdout


def test_a_sequence_past_its_deadline_is_named_and_ends_the_soak(tmp_path):
    run = run_fake_soak(tmp_path, ["--seed", 5, "--sequences", 2, "--steps", 4, "--sequence-deadline", 2],
                        hang=[(5, 2)])
    assert run.returncode == 3, describe(run)
    hang = worker_records(run.stdout, "HANG")
    assert hang and hang[0]["seed"] == 5 and hang[0]["step"] == 2, describe(run)
