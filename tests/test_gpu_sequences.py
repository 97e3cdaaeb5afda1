"""Random sequences of calls on one Buffer on real GPUs: the sequences ``make test`` runs (issue 36).

tests/workers/sequence_soak.py runs the sequences of ``sequence_cases.GPU_TEST_SEQUENCES``, each
``GPU_TEST_STEPS`` steps long (fresh, cached and ``num_worst_tokens`` dispatches with a combine,
token counts, routing, dtypes and hidden sizes switching per step), every rank a thread of one
process, rank ``r`` on GPU ``r % G``. Every step is compared bit-exactly with the reference, and
every fresh dispatch's rows and every device's peak allocation with the bound
(tests/workers/memory_bounds.py). It runs as a subprocess with a wall-clock limit, so a hang
cannot hang pytest. 200 sequences are ``make soak`` (or ``make soak-sequences``).

Environment: ``DEEPEP_TEST_LOCAL_GPUS`` (as for test_gpu_local.py): use only GPUs ``0..G-1``.
"""

import pytest
from _harness import WORKERS, describe, local_gpu_args, run_python, worker_records
from workers.memory_bounds import peak_limit
from workers.sequence_cases import GPU_TEST_SEQUENCES, GPU_TEST_STEPS

SOAK = WORKERS / "sequence_soak.py"
SEQUENCES, STEPS = GPU_TEST_SEQUENCES, GPU_TEST_STEPS
# Kernel compiles per rank count and dtype, then 1,000 steps (each with its NumPy reference).
TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def soak_run():
    run = run_python([SOAK, "--seed", SEQUENCES[0], "--sequences", len(SEQUENCES), "--steps", STEPS, "--records",
                      *local_gpu_args()], timeout=TIMEOUT_S)
    sequences = {record["seed"]: record for record in worker_records(run.stdout, "SEQUENCE")}
    return run, sequences, worker_records(run.stdout, "STEP")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("seed", SEQUENCES)
def test_sequence_matches_reference_within_the_memory_bound(soak_run, seed):
    run, sequences, _ = soak_run
    record = sequences.get(seed)
    assert record is not None, f"no result for sequence {seed}\n{describe(run)}"
    errors = "\n".join(f"--- rank {rank}: {error}" for rank, error in record["errors"].items())
    assert record["ok"], (f"{record['sequence']}\nstep {record['failed_step']}: {record['step_description']}\n"
                          f"run it alone: {record['reproduce']}\n{errors}")
    assert record["steps"] == STEPS


@pytest.mark.gpu(1)
def test_every_fresh_dispatch_allocated_at_most_its_exact_rows_or_the_bound(soak_run):
    run, _, steps = soak_run
    checked = 0
    for step in steps:
        for rank in step["ranks"]:
            if "rows_allocated" in rank:
                assert rank["rows_allocated"] <= max(rank["recv"], rank["bound"]) == rank["allowed"], (step, rank)
                checked += 1
    assert checked, describe(run)


@pytest.mark.gpu(1)
def test_every_devices_peak_during_a_dispatch_stayed_within_the_limit(soak_run):
    run, _, steps = soak_run
    devices = [device for step in steps for device in step["devices"]]
    assert devices, describe(run)
    for device in devices:
        assert device["limit_bytes"] == peak_limit(device["exact_bytes"], device["bound_bytes"], len(device["ranks"]))
        assert device["peak_bytes"] <= device["limit_bytes"], device


@pytest.mark.gpu(1)
def test_sequence_soak_reports_every_sequence_and_its_worst_ratios(soak_run):
    run, sequences, steps = soak_run
    summaries = worker_records(run.stdout, "SUMMARY")
    assert summaries, describe(run)
    summary = summaries[-1]
    assert summary["sequences"] == len(SEQUENCES) and not summary["failed"], summary
    assert summary["steps"] == len(SEQUENCES) * STEPS == len(steps)
    assert summary["worst_rows"]["ratio"] > 0 and summary["worst_peak"]["ratio"] > 0, summary
    assert sorted(sequences) == list(SEQUENCES), describe(run)
    assert run.returncode == 0, describe(run)
