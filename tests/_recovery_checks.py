"""What the recovery and concurrency cases of tests/workers/failure_worker.py must show in their
RESULT records, whichever transport ran them (mpiexec, one process per rank, or both ranks in one
process): test_gpu_recovery.py asserts each behaviour with these, once per transport.

Every check takes ``results`` (``{case: [record per rank]}``) and ``described`` (the run's output,
for the failure message).
"""

from __future__ import annotations

from typing import Dict, List

NUM_RANKS = 2


def by_rank(results: Dict[str, List[dict]], case: str, described: str) -> Dict[int, dict]:
    """The case's record of every rank, by rank."""
    entries = results.get(case, [])
    ranks = sorted(e["rank"] for e in entries)
    assert ranks == list(range(NUM_RANKS)), f"{case}: results of ranks {ranks}, expected {NUM_RANKS}\n{described}"
    return {e["rank"]: e for e in entries}


def _failure(entry: dict) -> str:
    return f"rank {entry['rank']}: {entry.get('error')}"


def recovered_with_exact_results(results, case: str, described: str) -> None:
    """Every rank destroyed its Buffer and made a new one whose rounds were all bit-exact."""
    for entry in by_rank(results, case, described).values():
        assert "destroy_seconds" in entry, _failure(entry)  # destroy() returned
        assert entry.get("exact_rounds") == entry["rounds"], _failure(entry)


def a_missing_peer_made_rank_0_time_out(results, described: str) -> None:
    """The rank that dispatched alone raised DeepEPTimeoutError within its timeout plus one second."""
    rank_0 = by_rank(results, "recovery_after_a_peer_never_joins", described)[0]
    assert rank_0.get("message") and "notify_dispatch timed out after" in rank_0["message"], _failure(rank_0)
    assert rank_0["raise_seconds"] <= rank_0["timeout_s"] + 1.0, rank_0


def a_late_peer_failed_at_once(results, described: str) -> None:
    """The late rank's dispatch raised PeerAbortedError naming rank 0, well before its own timeout."""
    late = by_rank(results, "recovery_after_a_late_peer", described)[1]
    assert late.get("late_error") == "PeerAbortedError", _failure(late)
    assert "rank 0 had given up" in late["message"], late["message"]
    assert late["late_seconds"] <= late["late_limit_s"] < late["timeout_s"], late
    rank_0 = by_rank(results, "recovery_after_a_late_peer", described)[0]
    assert rank_0.get("message") and "notify_dispatch timed out after" in rank_0["message"], _failure(rank_0)


def every_round_exact(results, case: str, described: str) -> None:
    """Every rank ran the case without a failure and all its rounds were bit-exact."""
    for entry in by_rank(results, case, described).values():
        assert entry["ok"], _failure(entry)
        assert entry["exact_rounds"] == entry["rounds"] > 0, entry


def async_combines_were_asynchronous(results, described: str) -> None:
    """The combines of the overlap case really returned events (otherwise nothing overlapped)."""
    for entry in by_rank(results, "dispatch_while_an_async_combine_is_in_flight", described).values():
        assert entry.get("async_combines") == entry["rounds"], _failure(entry)
