"""The random internode cases on the CPU: the drawing (tests/workers/internode_cases.py), the
intranode cases left as they were, the inputs, the cases run end to end against the internode path
with fake hardware (tests/internode_fakes.py) bit-exactly, and the soak's launcher."""

import hashlib
import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _harness import REPO_ROOT, WORKERS, describe, records_by, run_mpi, run_python, worker_records
from internode_fakes import FakeInternodeBuffer, fake_cupy_module, make_paths, run_ranks, use_host_arrays

sys.path.insert(0, str(WORKERS))  # the workers import their siblings as scripts do

import internode_cases as ic  # noqa: E402
import internode_random_worker as worker  # noqa: E402
import internode_soak  # noqa: E402
import random_cases as rc  # noqa: E402

from deepep_cupy.constants import MAX_EXPERTS, MAX_LOCAL_EXPERTS, MAX_RANKS  # noqa: E402
from deepep_cupy.gpu import layout

CASES = ic.internode_cases(0, 400)


def counts_of(case):
    return ic.token_counts(case)


def _values(cases, key):
    return {c[key] for c in cases}


# ---------------------------------------------------------------------------------------------
# The drawing


def test_a_seed_gives_the_same_case_every_time():
    assert ic.internode_cases(0, 50) == CASES[:50]
    assert [ic.internode_case(s) for s in (7, 399, 7)] == [CASES[7], CASES[399], CASES[7]]


def test_different_seeds_give_different_cases():
    assert len({ic.describe_case(c) for c in CASES}) == len(CASES)


def test_the_node_shapes_are_2_to_4_nodes_of_1_to_4_ranks_and_at_most_8_ranks():
    assert set(ic.SHAPES) == {(2, 1), (2, 2), (2, 3), (2, 4), (3, 1), (3, 2), (4, 1), (4, 2)}
    for case in CASES:
        assert (case["num_nodes"], case["ranks_per_node"]) in ic.SHAPES
        assert case["num_ranks"] == case["num_nodes"] * case["ranks_per_node"] <= MAX_RANKS


@pytest.mark.parametrize("cases", [pytest.param(CASES, id="400 seeds"),
                                   pytest.param(ic.internode_cases(ic.GPU_TEST_SEEDS[0], len(ic.GPU_TEST_SEEDS)),
                                                id="make test's seeds")])
def test_the_seeds_cover_every_shape_dtype_routing_and_step(cases):
    assert {(c["num_nodes"], c["ranks_per_node"]) for c in cases} == set(ic.SHAPES)
    assert _values(cases, "dtype") == set(ic.DTYPES)
    assert _values(cases, "routing") == set(ic.ROUTINGS)
    for key in ("drop", "with_weights", "worst", "cached", "combine"):
        assert _values(cases, key) == {True, False}, key
    assert _values(cases, "mode") == {"sync", "async"} and _values(cases, "framework") == {"cupy", "torch"}
    assert _values(cases, "bias") == {0, 1, 2}
    assert {type(c["num_tokens"]) for c in cases} == {int, tuple}


def test_four_hundred_seeds_reach_the_ends_of_every_range():
    every_count = [n for c in CASES for n in counts_of(c)]
    assert 0 in every_count and max(every_count) >= 900
    assert any(sum(counts_of(c)) == 0 for c in CASES)  # nobody dispatches anything
    assert _values(CASES, "num_topk") == set(range(rc.TOPK_RANGE[0], rc.TOPK_RANGE[1] + 1))
    assert _values(CASES, "scales_layout") == {"row", "column"}
    assert max(c["hidden"] for c in CASES) >= 7168
    alignments = _values(CASES, "expert_alignment")
    assert 1 in alignments and max(alignments) >= 64
    assert 2 in _values(CASES, "num_sms") and max(_values(CASES, "num_sms")) >= 24
    assert 1 in _values(CASES, "recv_chunk") and max(_values(CASES, "recv_chunk")) >= 512
    one_node = [c for c in CASES if c["routing"] == "one_node"]
    assert {c["node"] for c in one_node} == {0, 1, 2, 3}


def test_every_case_is_within_the_internode_limits():
    for case in CASES:
        R, L, N = case["num_ranks"], case["ranks_per_node"], case["num_nodes"]
        K, E, H, dtype = case["num_topk"], case["num_experts"], case["hidden"], case["dtype"]
        config = ic.config_of(case)  # raises if not valid
        assert config.num_sms <= ic.MAX_NUM_SMS and case["send_chunk"] <= case["recv_chunk"] <= rc.MAX_RECV_CHUNK
        forwarded = N * max(counts_of(case))
        assert forwarded <= ic.MAX_QUEUE_ROUNDS * case["recv_chunk"], case  # the round trips are capped
        assert E % R == 0 and E <= MAX_EXPERTS and E // R <= MAX_LOCAL_EXPERTS
        assert rc.TOPK_RANGE[0] <= K <= E // N, case  # a node holds top-k experts: one_node routing draws there
        counts = counts_of(case)
        assert len(counts) == R and all(0 <= n <= ic.MAX_TOKENS for n in counts)
        assert 0 < H <= rc.MAX_HIDDEN and (H * rc.ITEMSIZE[dtype]) % 16 == 0
        if dtype == "float8_e4m3fn":
            assert H % 128 == 0
        else:
            assert case["scales_layout"] == "row"
        assert 1 <= case["expert_alignment"] <= rc.MAX_ALIGNMENT
        assert (case["node"] is not None) == (case["routing"] == "one_node")
        assert case["node"] is None or 0 <= case["node"] < N
        assert case["combine"] or case["bias"] == 0
        # The intranode stage of a node forwards at most its rail's tokens: the Buffer the worker
        # makes holds what its dispatch and combine ask for.
        if L > 1:
            forwarded = N * max(counts)
            row_bytes = H * max(2, rc.ITEMSIZE[dtype])
            dispatch = layout.dispatch_layout(L, config.num_channels, forwarded, row_bytes, K, max(1, H // 128))
            combine = layout.combine_layout(L, config.num_channels, forwarded, row_bytes, K)
            assert max(dispatch.total_bytes, combine.total_bytes) <= ic.nvl_bytes_needed(case)
        assert ic.rdma_bytes_needed(case) > 0


def test_the_reference_cost_of_a_case_is_capped():
    for case in CASES:
        moved = sum(counts_of(case)) * case["hidden"] * rc.ITEMSIZE[case["dtype"]] * \
            min(case["num_topk"], case["num_ranks"])
        assert moved <= ic.MOVED_BYTES_CAP or case["hidden"] == rc.row_step(case["dtype"]), case
        fewest = -(-case["num_topk"] // case["ranks_per_node"]) * case["num_ranks"]
        assert sum(counts_of(case)) * case["num_experts"] <= max(rc.ROUTING_KEYS_CAP, sum(counts_of(case)) * fewest)


# ---------------------------------------------------------------------------------------------
# The intranode cases draw what they drew before

#: sha256 of ``json.dumps(random_case(s, num_gpus=G), sort_keys=True)``, one line per seed, for
#: seeds 0..199 and 1000..1099, as drawn before the internode cases were added (commit 7bada6d).
INTRANODE_DIGESTS = {1: "785afd80b8f558b18a50ce67bd6e5e25a197557ea44cbf217838e4325ff9c572",
                     2: "23cbc2570652fa3e29549bb8332a71805cada52b5fa14f2fb0d075405c9dd9a4",
                     8: "3a887f9001da30740172bee38e3a2c0afa95da929a529e377c146b50698da228"}
PINNED_COMMIT = "7bada6da8fb117353b9f82968aec33f68955076d"
DIGEST_SEEDS = [*range(0, 200), *range(1000, 1100)]


def _digest(module, num_gpus):
    text = "\n".join(json.dumps(module.random_case(s, num_gpus=num_gpus), sort_keys=True) for s in DIGEST_SEEDS)
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("num_gpus", sorted(INTRANODE_DIGESTS))
def test_the_intranode_seeds_draw_what_they_drew_before(num_gpus):
    assert _digest(rc, num_gpus) == INTRANODE_DIGESTS[num_gpus]


def test_the_intranode_seeds_match_the_drawing_of_the_pinned_commit(tmp_path):
    try:
        old = subprocess.run(["git", "show", f"{PINNED_COMMIT}:tests/workers/random_cases.py"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"git is not usable here: {exc}")
    if old.returncode != 0:
        pytest.skip(f"commit {PINNED_COMMIT[:7]} is not in this clone: {old.stderr.strip()}")
    path = tmp_path / "random_cases_before.py"
    # The package's modules moved into folders since (deepep_cupy/gpu/sm_budget.py).
    path.write_text(old.stdout.replace("deepep_cupy.sm_budget", "deepep_cupy.gpu.sm_budget"))
    spec = importlib.util.spec_from_file_location("random_cases_before", path)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    for seed in (0, 1, 7, 49, 999, 1000, 1999):
        assert rc.random_case(seed) == before.random_case(seed), seed
        assert rc.describe_case(rc.random_case(seed)) == before.describe_case(before.random_case(seed))
    assert _digest(before, 2) == INTRANODE_DIGESTS[2]


def test_an_internode_seed_draws_from_its_own_stream():
    first = rc._Draws(5, ic._STREAM_KEY).uniform()
    assert first != rc._Draws(5).uniform()
    assert ic.internode_case(5)["num_nodes"] == ic.SHAPES[min(int(first * len(ic.SHAPES)), len(ic.SHAPES) - 1)][0]


# ---------------------------------------------------------------------------------------------
# Inputs


def small(keep=lambda case: True, count=1, cases=CASES):
    found = [c for c in cases if 0 < sum(counts_of(c)) <= 600 and c["hidden"] <= 1024 and keep(c)]
    assert len(found) >= count
    return found[:count]


@pytest.mark.parametrize("routing", ic.ROUTINGS)
def test_the_inputs_follow_the_routing(routing):
    case = small(lambda c: c["routing"] == routing and not c["drop"] and sum(counts_of(c)) >= 50)[0]
    inputs = worker.make_inputs(case)
    N, L, E = case["num_nodes"], case["ranks_per_node"], case["num_experts"]
    nodes_hit = np.zeros(N, int)
    for r, (inp, n) in enumerate(zip(inputs, counts_of(case))):
        assert inp["x"].shape == (n, case["hidden"]) and inp["topk"].shape == (n, case["num_topk"])
        assert (inp["topk"] >= 0).all()
        for row in inp["topk"]:
            assert len(set(row.tolist())) == len(row)  # distinct experts
        nodes = inp["topk"] // (E // N)
        if routing == "one_node":
            assert (nodes == case["node"]).all()
        elif routing == "own_node":
            assert (nodes == r // L).all()
        nodes_hit += np.bincount(nodes.ravel(), minlength=N)
    if routing == "skewed":
        assert nodes_hit[0] > nodes_hit[1:].max()


def test_a_case_that_drops_has_minus_one_entries_and_no_others_do():
    dropping = small(lambda c: c["drop"] and sum(counts_of(c)) >= 50)[0]
    assert any((i["topk"] == -1).any() for i in worker.make_inputs(dropping))
    keeping = small(lambda c: not c["drop"] and sum(counts_of(c)) >= 50)[0]
    assert not any((i["topk"] == -1).any() for i in worker.make_inputs(keeping))


def test_fp8_inputs_have_block_or_per_token_scales():
    block = small(lambda c: c["dtype"] == "float8_e4m3fn")[0]
    per_token = small(lambda c: c["dtype"] == "float8_e4m3fn_1d")[0]
    for case, shape in ((block, lambda n: (n, block["hidden"] // 128)), (per_token, lambda n: (n,))):
        for inp, n in zip(worker.make_inputs(case), counts_of(case)):
            assert inp["x"].dtype == np.uint8 and inp["x"].shape == (n, case["hidden"])
            assert inp["x"].flags.c_contiguous and inp["scales"].shape == shape(n)


# ---------------------------------------------------------------------------------------------
# The cases end to end on the internode path with fake hardware


def as_cupy_case(case):
    """The case with CuPy arrays (the fakes have no PyTorch)."""
    return dict(case, framework="cupy")


#: A handful of small cases: every shape, every dtype, block scales column-major, every routing,
#: num_worst_tokens, async, -1 entries, combine with biases, ranks without tokens and a case without any.
END_TO_END = [*(small(lambda c, s=s: (c["num_nodes"], c["ranks_per_node"]) == s)[0] for s in ic.SHAPES),
              *(small(lambda c, d=d: c["dtype"] == d)[0] for d in ic.DTYPES),
              small(lambda c: c["scales_layout"] == "column")[0],
              *(small(lambda c, r=r: c["routing"] == r)[0] for r in ic.ROUTINGS),
              small(lambda c: c["worst"] and c["combine"] and c["bias"] == 2)[0],
              small(lambda c: c["mode"] == "async" and c["cached"])[0],
              small(lambda c: 0 in counts_of(c) and c["drop"] and c["combine"])[0],
              next(c for c in CASES if sum(counts_of(c)) == 0 and c["ranks_per_node"] > 1 and c["combine"])]
END_TO_END = list({c["seed"]: c for c in END_TO_END}.values())


def test_the_end_to_end_cases_cover_what_they_say():
    cases = END_TO_END
    assert {(c["num_nodes"], c["ranks_per_node"]) for c in cases} == set(ic.SHAPES)
    assert _values(cases, "dtype") == set(ic.DTYPES) and _values(cases, "routing") == set(ic.ROUTINGS)
    assert _values(cases, "scales_layout") == {"row", "column"}
    for key in ("worst", "cached", "combine", "drop", "with_weights"):
        assert _values(cases, key) == {True, False}, key
    assert _values(cases, "mode") == {"sync", "async"} and _values(cases, "bias") == {0, 1, 2}


@pytest.mark.parametrize("case", END_TO_END, ids=lambda c: f"seed {c['seed']}")
def test_a_random_case_passes_on_the_internode_path_bit_exactly(monkeypatch, case):
    use_host_arrays(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    case = as_cupy_case(case)
    paths = make_paths(case["num_nodes"], case["ranks_per_node"])
    infos = run_ranks(paths, lambda rank, path: worker.run_case(FakeInternodeBuffer(path), case))
    want = worker.reference_dispatch(case, worker.make_inputs(case))
    assert [i["received"] for i in infos] == [len(w["recv_x"]) for w in want]
    L = case["ranks_per_node"]
    assert [i["internode_rows"] for i in infos] == \
        [sum(w["send_counts"]) - w["send_counts"][r // L] for r, w in enumerate(want)]


#: Random cases with num_worst_tokens, which over a transport that a graph can hold go in
#: fixed-size blocks: every shape.
IN_BLOCKS = [small(lambda c, s=s: c["worst"] and (c["num_nodes"], c["ranks_per_node"]) == s)[0] for s in ic.SHAPES]


@pytest.mark.parametrize("case", IN_BLOCKS, ids=lambda c: f"seed {c['seed']}")
def test_a_random_case_with_num_worst_tokens_passes_in_fixed_size_blocks_bit_exactly(monkeypatch, case):
    use_host_arrays(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    case = as_cupy_case(case)
    paths = make_paths(case["num_nodes"], case["ranks_per_node"], in_blocks=True)
    infos = run_ranks(paths, lambda rank, path: worker.run_case(FakeInternodeBuffer(path), case))
    want = worker.reference_dispatch(case, worker.make_inputs(case))
    assert [i["received"] for i in infos] == [len(w["recv_x"]) for w in want]
    block = max(counts_of(case))
    assert all(p.blocks is not None and p.last_internode_rows == block * (case["num_nodes"] - 1) for p in paths)


def test_a_wrong_result_is_reported_as_a_mismatch(monkeypatch):
    use_host_arrays(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    case = as_cupy_case(small(lambda c: c["ranks_per_node"] == 1 and c["dtype"] == "float32"
                              and min(counts_of(c)) > 0)[0])
    paths = make_paths(case["num_nodes"], 1)

    def corrupted(rank, path):
        buf = FakeInternodeBuffer(path)
        dispatch = buf.dispatch

        def dispatch_flipping_a_bit(*args, **kwargs):
            out = dispatch(*args, **kwargs)
            rows = out[0][0] if isinstance(out[0], tuple) else out[0]
            if rank == 0 and rows.shape[0]:
                np.asarray(rows).view(np.uint8)[0, 0] ^= 1
            return out

        buf.dispatch = dispatch_flipping_a_bit
        return worker.run_on_rank(buf, case, stream=None)

    outcomes = run_ranks(paths, corrupted)
    assert outcomes[0][0] is False and "Mismatch: recv_x" in outcomes[0][1]
    assert all(ok for ok, _, _ in outcomes[1:]), [e for _, e, _ in outcomes[1:]]


def test_a_pytorch_case_without_pytorch_runs_with_cupy_and_says_so(monkeypatch):
    use_host_arrays(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    case = small(lambda c: c["framework"] == "torch" and c["ranks_per_node"] == 1)[0]
    outcomes = run_ranks(make_paths(case["num_nodes"], 1),
                         lambda rank, path: worker.run_on_rank(FakeInternodeBuffer(path), case, stream=None))
    for ok, error, info in outcomes:
        assert ok, error
        assert info["framework"] == "cupy: PyTorch is not installed"


# ---------------------------------------------------------------------------------------------
# The worker's arguments and the soak's launcher


def test_the_worker_takes_a_list_of_seeds_or_a_range():
    assert worker.parse_args(["--seeds", "3", "17"]).seeds == [3, 17]
    assert worker.parse_args(["--seed", "5", "--cases", "3"]).seeds == [5, 6, 7]
    with pytest.raises(SystemExit):
        worker.parse_args(["--seeds", "3", "--cases", "2"])


def test_the_worker_runs_cases_by_shape_in_seed_order():
    batches = worker.by_shape(CASES[:60])
    shapes = list(batches)
    assert shapes == sorted(shapes, key=lambda s: (s[0] * s[1], s[1]))
    for (N, L), batch in batches.items():
        assert [c["seed"] for c in batch] == sorted(c["seed"] for c in batch)
        assert all((c["num_nodes"], c["ranks_per_node"]) == (N, L) for c in batch)


def test_the_soak_lists_the_cases_without_a_gpu():
    run = run_python([WORKERS / "internode_soak.py", "--list", "--seed", 7, "--cases", 3], timeout=120)
    assert run.returncode == 0, describe(run)
    assert run.stdout.splitlines() == [ic.describe_case(ic.internode_case(s)) for s in (7, 8, 9)]


@pytest.mark.parametrize("args, message", [(["--cases", 0], "--cases: expected at least 1"),
                                           (["--seed", -1], "--seed: expected a non-negative seed")])
def test_the_soak_refuses_bad_arguments(args, message):
    run = run_python([WORKERS / "internode_soak.py", *args], timeout=120)
    assert run.returncode == 2 and message in run.stderr, describe(run)


@pytest.mark.parametrize("gpus, shared", [(1, True), (4, True), (8, False)])
def test_the_soak_runs_the_worker_under_mpiexec_sharing_gpu_0_when_gpus_are_fewer_than_ranks(gpus, shared):
    command = internode_soak.mpiexec_command("/bin/mpiexec", 8, gpus, ["--seed", "1000", "--cases", "5"])
    assert command[:3] == ["/bin/mpiexec", "-n", "8"] and command[3] == sys.executable
    worker_at = command.index(str(WORKERS / "internode_random_worker.py"))
    assert command[4:worker_at] == ([str(WORKERS / "one_gpu_ranks.py")] if shared else [])
    assert command[worker_at + 1:] == ["--seed", "1000", "--cases", "5"]


# The worker's job under mpiexec with its GPU parts replaced: no device or stream, a Buffer that
# counts itself, a run_on_rank told which seeds fail on rank 1.
FAKE_GPU_DRIVER = textwrap.dedent('''
    import contextlib, json, sys
    sys.path.insert(0, sys.argv[1])  # the worker imports its siblings as a script does
    import deepep_cupy as ep
    import internode_random_worker as worker

    plan = json.loads(sys.argv[2])
    buffers = []
    made = 0

    class FakeBuffer:
        def __init__(self, comm, nvl_bytes, rdma_bytes, *, ranks_per_node, internode_transport, timeout_s):
            global made
            assert nvl_bytes > 0 and rdma_bytes > 0 and internode_transport == "mpi"
            made += 1
            if plan.get("no_buffer_for") is not None and made == 2:
                raise RuntimeError("no Buffer now")  # the second Buffer, made for the second case
            self.rank, self.num_ranks = comm.Get_rank(), comm.Get_size()
            buffers.append(f"{self.num_ranks // ranks_per_node}x{ranks_per_node}")

        def destroy(self):
            pass

    def run_on_rank(buf, case, stream):
        assert buf.num_ranks == case["num_ranks"]
        if case["seed"] in plan["fail"] and buf.rank == 1:
            return False, "Mismatch: recv_x: 1 of 8 elements differ", {}
        return True, None, {"received": buf.rank}

    class NoStream(contextlib.nullcontext):
        ptr = 0

    ep.Buffer = FakeBuffer
    worker.run_on_rank = run_on_rank
    worker.use_gpu = lambda rank: NoStream()
    code = worker.main(sys.argv[3:])
    print("BUFFERS " + json.dumps(buffers), flush=True)
    sys.exit(code)
''')


def test_the_worker_job_runs_each_case_on_its_shape_and_reports_every_rank(tmp_path):
    seeds = [c["seed"] for c in CASES[:40]]
    cases = {c["seed"]: c for c in CASES[:40]}
    fits = [s for s in seeds if cases[s]["num_ranks"] <= 4]
    too_big = [s for s in seeds if cases[s]["num_ranks"] > 4]
    fail = [s for s in fits if cases[s]["num_ranks"] >= 2][:2]
    assert fits and too_big and len(fail) == 2
    driver = tmp_path / "fake_gpu_internode_job.py"
    driver.write_text(FAKE_GPU_DRIVER)
    run = run_mpi(4, [driver, WORKERS, json.dumps({"fail": fail}), "--seeds", *map(str, seeds), "--records"],
                  timeout=180)
    assert run.returncode != 0, describe(run)  # the failing and the unrunnable cases
    results = records_by(run.stdout, "seed")
    assert sorted(results) == sorted(fits), describe(run)
    for seed in fits:
        assert sorted(r["rank"] for r in results[seed]) == list(range(cases[seed]["num_ranks"]))
        assert all(r["ok"] == (seed not in fail or r["rank"] != 1) for r in results[seed])
    failures = {f["seed"]: f for f in worker_records(run.stdout, "FAIL")}
    assert sorted(failures) == sorted(fail + too_big)
    for seed in fail:
        assert list(failures[seed]["errors"]) == ["1"] and "Mismatch: recv_x" in failures[seed]["errors"]["1"]
        assert failures[seed]["reproduce"] == f"make soak-internode SOAK_INTERNODE_SEED={seed} SOAK_INTERNODE_CASES=1"
        assert failures[seed]["case"] == ic.describe_case(cases[seed])
    for seed in too_big:
        assert "needs" in failures[seed]["errors"]["all"]
    assert sorted(r["seed"] for r in worker_records(run.stdout, "CASE")) == sorted(seeds)
    summary = worker_records(run.stdout, "SUMMARY")[-1]
    assert summary["cases"] == len(seeds) and summary["failed"] == sorted(fail + too_big)
    # One Buffer per rank of each shape, and a new one on every rank of the shape for the case after
    # a failing one.
    made = [b for record in worker_records(run.stdout, "BUFFERS") for b in record]
    by_shape = {}
    for seed in fits:
        by_shape.setdefault(f"{cases[seed]['num_nodes']}x{cases[seed]['ranks_per_node']}", []).append(seed)
    for shape, shape_seeds in by_shape.items():
        again = sum(s in fail for s in shape_seeds[:-1])
        assert made.count(shape) == cases[shape_seeds[0]]["num_ranks"] * (1 + again), (shape, made)


def test_a_buffer_that_cannot_be_made_fails_its_case_and_the_next_case_tries_again(tmp_path):
    seeds = [c["seed"] for c in CASES if (c["num_nodes"], c["ranks_per_node"]) == (2, 1)][:3]
    driver = tmp_path / "fake_gpu_internode_job.py"
    driver.write_text(FAKE_GPU_DRIVER)
    # The first case fails: the second Buffer, made for the second case, is refused.
    run = run_mpi(2, [driver, WORKERS, json.dumps({"fail": [seeds[0]], "no_buffer_for": seeds[1]}), "--seeds",
                      *map(str, seeds)], timeout=180)
    assert run.returncode == 1, describe(run)
    failures = worker_records(run.stdout, "FAIL")
    assert [f["seed"] for f in failures] == seeds[:2], describe(run)
    assert sorted(failures[1]["errors"]) == ["0", "1"]
    assert all("the Buffer: RuntimeError: no Buffer now" in e for e in failures[1]["errors"].values())
    assert worker_records(run.stdout, "SUMMARY")[-1]["failed"] == seeds[:2]
    assert all(r["ok"] for r in records_by(run.stdout, "seed")[seeds[2]])
    # Made for the first case, refused for the second, made again for the third (each of 2 ranks).
    assert [b for record in worker_records(run.stdout, "BUFFERS") for b in record].count("2x1") == 4
