"""Random internode cases: ``internode_case(seed)`` -> a case dict for an internode Buffer over
simulated nodes (tests/workers/internode_random_worker.py runs them).

Plain Python and NumPy (importable without a GPU). The draws come from the generator of
tests/workers/random_cases.py with a stream key of their own, so internode seed ``s`` and
intranode seed ``s`` share nothing and the intranode cases draw exactly what they drew before.
A case draws, within the limits the internode path enforces:

* the node split: 2..4 nodes of 1..4 ranks each, 8 ranks at most (2x1, 2x2, 2x3, 2x4, 3x1, 3x2,
  4x1, 4x2);
* 0..1024 tokens per rank (a tuple: uneven; sometimes one int: every rank alike);
* every dtype the internode path takes (BF16, FP16, FP32, FP8 with ``[N, H/128]`` scales, row- or
  column-major, and with ``[N]`` scales), rows a multiple of 16 bytes up to hidden 8192;
* top-k 1..9 over up to 8192 experts (every node holds at least top-k of them), with or without
  weights; routing uniform, skewed toward node 0, every token to one node, or every token to its
  own node (nothing crosses the network), with or without -1 entries;
* ``expert_alignment`` 1..128, the intranode stage's config (``num_sms`` 2..32, chunks 1..1024,
  the receive chunk at least 1/64 of the tokens a rank forwards: :data:`MAX_QUEUE_ROUNDS`);
* CuPy or PyTorch, sync or async; a fresh dispatch exact or with ``num_worst_tokens``, then a
  cached dispatch and a combine (0..2 biases; after an FP8 dispatch the combine is BF16) or not;
* the caller's stream: its library's default stream or a side stream.

Sizes are log-uniform and capped (:data:`MOVED_BYTES_CAP`, random_cases' routing-key cap) so that
every rank can compute the whole NumPy reference of a case cheaply. A seed gives the same case on
every machine: no draw depends on the GPUs.
"""

from __future__ import annotations

from typing import Sequence

import random_cases as rc

from deepep_cupy.config import Config, get_nvl_buffer_size_hint, get_rdma_buffer_size_hint
from deepep_cupy.constants import MAX_RANKS

__all__ = ["SHAPES", "DTYPES", "ROUTINGS", "GPU_TEST_SEEDS", "internode_case", "internode_cases", "describe_case",
           "config_of", "combine_dtype", "nvl_bytes_needed", "rdma_bytes_needed", "token_counts", "worst_rows"]

#: Every dtype the internode path dispatches (FP8 with block scales and with per-token scales).
DTYPES = rc.DTYPES
token_counts = rc.token_counts

#: (nodes, ranks per node): 2..4 nodes of 1..4 ranks, at most MAX_RANKS ranks in all.
SHAPES = tuple((n, per_node) for n in range(2, 5) for per_node in range(1, 5) if n * per_node <= MAX_RANKS)
ROUTINGS = ("uniform", "skewed", "one_node", "own_node")
MAX_TOKENS = 1024
#: Queue round trips per channel of the intranode stage, at most: a rank's forwarded tokens over the
#: receive chunk (ranks sharing a GPU as processes take turns on it, and each round trip between
#: two of them costs time slices).
MAX_QUEUE_ROUNDS = 64
#: The intranode stage's num_sms, at most (ranks of one GPU are processes here: no SM budget).
MAX_NUM_SMS = 32
#: Bytes all ranks receive, at most: every rank computes every rank's reference.
MOVED_BYTES_CAP = 8 << 20
#: Share of top-k entries set to -1 in a case that drops.
DROP_FRACTION = 0.3
#: The seeds ``make test`` runs (tests/test_gpu_internode_random.py); ``make soak-internode``
#: starts at 1000 by default.
GPU_TEST_SEEDS = range(0, 20)
#: The stream of the internode draws (random_cases' is another).
_STREAM_KEY = 0x1A7E12


def _draw_shape(d: rc._Draws):
    return d.choice(SHAPES)


def _draw_tokens(d: rc._Draws, num_ranks: int):
    if d.chance(0.25):
        return d.log_int(0, MAX_TOKENS)
    return tuple(d.log_int(0, MAX_TOKENS) for _ in range(num_ranks))


def _draw_hidden(d: rc._Draws, dtype: str, total_tokens: int, fan_out: int) -> int:
    step = rc.row_step(dtype)
    hidden = d.choice(rc.COMMON_HIDDEN) if d.chance(0.2) else step * d.log_int(1, rc.MAX_HIDDEN // step)
    # Big batches get narrower rows, so that no case costs the reference more than the cap.
    widest = MOVED_BYTES_CAP // max(1, total_tokens * rc.ITEMSIZE[dtype] * fan_out) // step * step
    return max(step, min(hidden, widest))


def _draw_experts(d: rc._Draws, num_ranks: int, ranks_per_node: int, num_topk: int, total_tokens: int) -> int:
    # Every node holds at least top-k experts: a token may have all its experts on one node.
    fewest = -(-num_topk // ranks_per_node)
    per_rank = d.log_int(fewest, rc.most_experts(num_ranks) // num_ranks)
    affordable = rc.ROUTING_KEYS_CAP // max(1, total_tokens * num_ranks)
    return max(fewest, min(per_rank, affordable)) * num_ranks


def internode_case(seed: int) -> dict:
    """The internode case of ``seed``."""
    d = rc._Draws(seed, _STREAM_KEY)
    num_nodes, ranks_per_node = _draw_shape(d)
    num_ranks = num_nodes * ranks_per_node
    dtype = d.choice(DTYPES)
    num_tokens = _draw_tokens(d, num_ranks)
    counts = num_tokens if isinstance(num_tokens, tuple) else (num_tokens,) * num_ranks
    num_topk = d.int_between(*rc.TOPK_RANGE)
    hidden = _draw_hidden(d, dtype, sum(counts), min(num_topk, num_ranks))
    num_experts = _draw_experts(d, num_ranks, ranks_per_node, num_topk, sum(counts))
    routing = d.choice(ROUTINGS)
    node = d.int_between(0, num_nodes - 1) if routing == "one_node" else None
    drop = d.chance(0.35)
    with_weights = d.chance(0.75)
    expert_alignment = 1 if d.chance(0.3) else d.log_int(1, rc.MAX_ALIGNMENT)
    num_sms = 2 * d.log_int(1, MAX_NUM_SMS // 2)
    forwarded = num_nodes * max(counts)
    recv_chunk = min(rc.MAX_RECV_CHUNK, max(d.log_int(1, rc.MAX_RECV_CHUNK), -(-forwarded // MAX_QUEUE_ROUNDS)))
    send_chunk = d.log_int(1, recv_chunk)
    mode = "async" if d.chance(0.35) else "sync"
    framework = "torch" if d.chance(0.3) else "cupy"
    scales_layout = "column" if dtype == "float8_e4m3fn" and d.chance(0.5) else "row"
    worst = d.chance(0.25)
    cached = d.chance(0.7)
    combine = d.chance(0.8)
    bias = d.choice((0, 0, 1, 2)) if combine else 0
    # The caller's stream: its library's default (PyTorch's legacy default stream, CuPy's null
    # stream) or a side stream. Drawn last, so that the draws above stay those of earlier seeds.
    stream = "default" if d.chance(0.5) else "side"
    return dict(name=f"internode_{seed}", seed=int(seed), num_nodes=num_nodes, ranks_per_node=ranks_per_node,
                num_ranks=num_ranks, num_tokens=num_tokens, dtype=dtype, hidden=hidden, num_topk=num_topk,
                num_experts=num_experts, routing=routing, node=node, drop=drop, with_weights=with_weights,
                expert_alignment=expert_alignment, num_sms=num_sms, send_chunk=send_chunk, recv_chunk=recv_chunk,
                mode=mode, framework=framework, scales_layout=scales_layout, worst=worst, cached=cached,
                combine=combine, bias=bias, stream=stream)


def internode_cases(first_seed: int, count: int) -> list:
    """The cases of seeds ``first_seed .. first_seed + count - 1``."""
    return [internode_case(s) for s in range(first_seed, first_seed + count)]


def config_of(case) -> Config:
    """The intranode stage's Config (dispatch and combine)."""
    return Config(case["num_sms"], case["send_chunk"], case["recv_chunk"])


def combine_dtype(case) -> str:
    """x's dtype in the case's combine: the dispatched dtype, BF16 after an FP8 dispatch."""
    return "bfloat16" if case["dtype"].startswith("float8") else case["dtype"]


def _row_bytes(case) -> int:
    # FP8 rows counted at BF16 width, as the hints ask (their scales and the BF16 combine fit).
    return case["hidden"] * max(2, rc.ITEMSIZE[case["dtype"]])


def nvl_bytes_needed(case) -> int:
    """NVLink bytes per rank for the case's intranode stage: a rank forwards at most the tokens of
    its rail peers (one per node), and the hint wants at least 2 ranks."""
    forwarded = case["num_nodes"] * max(1, *token_counts(case))
    return get_nvl_buffer_size_hint(_row_bytes(case), max(2, case["ranks_per_node"]), config_of(case),
                                    num_topk=case["num_topk"], num_max_tokens_per_rank=forwarded)


def rdma_bytes_needed(case) -> int:
    """``num_rdma_bytes`` for the case (DeepEP's hint)."""
    return get_rdma_buffer_size_hint(_row_bytes(case), case["num_ranks"], num_topk=case["num_topk"],
                                     num_max_tokens_per_rank=max(1, *token_counts(case)))


def worst_rows(received: Sequence[int]) -> int:
    """The ``num_worst_tokens`` of a case whose ranks receive ``received`` rows: the same on every
    rank, with spare rows past the most any rank receives."""
    return max(received) + rc.WORST_SPARE_ROWS


def describe_case(case) -> str:
    """One line naming everything the case draws."""
    counts = token_counts(case)
    tokens = f"{counts[0]} each" if isinstance(case["num_tokens"], int) else "/".join(map(str, counts))
    routing = case["routing"] + (f" {case['node']}" if case["node"] is not None else "")
    steps = ["dispatch" + (" num_worst_tokens" if case["worst"] else "")] + ["cached"] * case["cached"] + \
        ["combine"] * case["combine"]
    scales = f", scales {case['scales_layout']}" if case["dtype"] == "float8_e4m3fn" else ""
    return (f"seed {case['seed']}: {case['num_nodes']}x{case['ranks_per_node']} ({case['num_ranks']} ranks), "
            f"tokens {tokens}, {case['dtype']} hidden {case['hidden']}{scales}, "
            f"top-{case['num_topk']}{'+weights' if case['with_weights'] else ''} of {case['num_experts']} experts "
            f"({routing}{', -1 entries' if case['drop'] else ''}), alignment {case['expert_alignment']}, "
            f"num_sms {case['num_sms']}, chunks {case['send_chunk']}/{case['recv_chunk']}, {case['mode']}, "
            f"{case['framework']}, {'+'.join(steps)}, {case['bias']} biases")
