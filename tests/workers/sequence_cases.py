"""Random *sequences* of calls on one Buffer for the sequence soak (issue 36):
``random_sequence(seed, steps)`` -> a dict, and each step's inputs.

Plain Python and NumPy (importable without a GPU). A sequence fixes what a Buffer's plans share
(rank count, framework, experts, top-k, weights, config, alignment) and draws ``steps`` calls:

* every rank's token count per step, unrelated across ranks: 0, 1, 2..64 or 1,000..8,192;
* the routing per step: ``uniform`` (every rank sends, any expert), ``to_one`` (every rank sends,
  to experts of one rank only) or ``from_one`` (one rank sends, any expert; the others send 0);
* the dtype (BF16, FP16, FP32, FP8 with ``[N, hidden / 128]`` scales) and the hidden size per
  step, the hidden size shrunk for big steps so that the rows moved stay under
  :data:`MOVED_BYTES_CAP` (the NumPy reference stays cheap);
* the call: ``fresh`` (now and then ``repeat``: the previous fresh dispatch's dtype, hidden size,
  token counts and routing kind, new routing and rows: the steady loop that allocates ahead),
  ``cached`` (the routing and token counts of the last fresh dispatch, new rows, maybe of another
  dtype and hidden size) or ``worst`` (a fresh dispatch with ``num_worst_tokens``: the most rows
  any rank receives plus spare rows, or every rank's tokens plus spare rows);
* each followed by a combine where the dtype allows (not FP8).

Every value comes from ``rng.random()`` alone (random_cases._Draws), so a seed gives the same
sequence on every machine with the same GPU count and SM count (they only bound ``num_sms``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from deepep_cupy.config import Config, get_nvl_buffer_size_hint
from deepep_cupy.gpu.sm_budget import largest_num_sms

try:  # run by a worker script: its folder is on sys.path
    from random_cases import _Draws, ranks_per_gpu, row_step
except ImportError:  # imported by the tests, as workers.sequence_cases
    from workers.random_cases import _Draws, ranks_per_gpu, row_step

#: Rank counts and how often each is drawn (8 ranks are slow: rarely).
RANK_COUNTS = ((2, 0.4), (3, 0.2), (4, 0.35), (8, 0.05))
#: Token counts per rank and step: one of these kinds, then uniform within it.
TOKEN_RANGES = ((0, 0), (1, 1), (2, 64), (1000, 8192))
TOKEN_RANGE_WEIGHTS = (0.12, 0.12, 0.38, 0.38)
MAX_TOKENS = 8192
ROUTINGS = ("uniform", "to_one", "from_one")
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
KINDS = ("fresh", "cached", "worst")
MAX_HIDDEN = 8192
COMMON_HIDDEN = (2048, 4096, 7168, 8192)
MAX_TOPK = 8
#: Rows all ranks receive in a step, in bytes, at most (tokens x row bytes x the ranks a token
#: reaches): bounds the reference's copies and the host comparisons per step.
MOVED_BYTES_CAP = 8 << 20
#: Spare rows of a ``worst`` step's ``num_worst_tokens``, at most.
MAX_WORST_SPARE = 64
RECV_CHUNK = 256
#: The sequences and steps ``make test`` runs (tests/test_gpu_sequences.py); ``make soak`` starts at 1000.
GPU_TEST_SEQUENCES = range(0, 20)
GPU_TEST_STEPS = 50
DEFAULT_STEPS = 50
#: The machine the soak is sized for: 2 x H200.
DEFAULT_GPUS = 2
DEFAULT_SM_COUNT = 132
#: Mixed into every seed: a sequence's draws share no stream with a random case's or its inputs.
_STREAM_KEY = 0x5E9500C


class _SequenceDraws(_Draws):
    def __init__(self, seed: int):
        self._rng = np.random.default_rng([_STREAM_KEY, int(seed)])

    def weighted(self, options, weights):
        u, total = self.uniform(), 0.0
        for option, weight in zip(options, weights):
            total += weight
            if u < total:
                return option
        return options[-1]


def fan_out(routing: str, num_topk: int, num_ranks: int) -> int:
    """The most ranks one token of ``routing`` reaches."""
    return 1 if routing == "to_one" else min(num_topk, num_ranks)


def moved_bytes(step: dict, num_topk: int, num_ranks: int) -> int:
    """Bytes all ranks receive in ``step`` at most (what :data:`MOVED_BYTES_CAP` bounds)."""
    return (sum(step["tokens"]) * step["hidden"] * ITEMSIZE[step["dtype"]]
            * fan_out(step["routing"], num_topk, num_ranks))


def _draw_tokens(d: _SequenceDraws, routing: str, target: int, num_ranks: int) -> tuple:
    def one():
        lo, hi = d.weighted(TOKEN_RANGES, TOKEN_RANGE_WEIGHTS)
        return d.int_between(lo, hi)

    counts = tuple(one() for _ in range(num_ranks))
    if routing == "from_one":
        counts = tuple(n if r == target else 0 for r, n in enumerate(counts))
    return counts


def _draw_hidden(d: _SequenceDraws, dtype: str, tokens: tuple, routing: str, num_topk: int) -> int:
    step = row_step(dtype)
    hidden = d.choice(COMMON_HIDDEN) if d.chance(0.3) else step * d.log_int(1, MAX_HIDDEN // step)
    reached = sum(tokens) * ITEMSIZE[dtype] * fan_out(routing, num_topk, len(tokens))
    widest = MOVED_BYTES_CAP // max(1, reached) // step * step
    return max(step, min(hidden, widest))


def _shape(d: _SequenceDraws, num_ranks: int, num_topk: int) -> dict:
    routing = d.choice(ROUTINGS)
    target = d.int_between(0, num_ranks - 1)
    tokens = _draw_tokens(d, routing, target, num_ranks)
    dtype = d.choice(DTYPES)
    hidden = _draw_hidden(d, dtype, tokens, routing, num_topk)
    return dict(routing=routing, target=target, tokens=tokens, dtype=dtype, hidden=hidden)


def _draw_steps(d: _SequenceDraws, count: int, num_ranks: int, num_topk: int) -> list:
    steps, last_fresh = [], None
    for index in range(count):
        kind = "fresh" if last_fresh is None else d.weighted(KINDS, (0.55, 0.25, 0.2))
        step = dict(index=index, kind=kind, repeat=False, routing_of=index, worst_rows=None, worst_spare=0)
        if kind == "cached":
            fresh = steps[last_fresh]
            dtype = d.choice(DTYPES)
            step.update(routing=fresh["routing"], target=fresh["target"], tokens=fresh["tokens"], dtype=dtype,
                        hidden=_draw_hidden(d, dtype, fresh["tokens"], fresh["routing"], num_topk),
                        routing_of=fresh["routing_of"])
        elif kind == "fresh" and last_fresh is not None and d.chance(0.25):
            fresh = steps[last_fresh]
            step.update({key: fresh[key] for key in ("routing", "target", "tokens", "dtype", "hidden")}, repeat=True)
        else:
            step.update(_shape(d, num_ranks, num_topk))
        if kind == "worst":
            step.update(worst_rows=d.choice(("most_received", "all_tokens")),
                        worst_spare=d.int_between(0, MAX_WORST_SPARE))
        step["combine"] = step["dtype"] != "float8_e4m3fn" and d.chance(0.8)
        if kind == "fresh":
            last_fresh = index
        steps.append(step)
    return steps


def random_sequence(seed: int, steps: int = DEFAULT_STEPS, num_gpus: int = DEFAULT_GPUS,
                    sm_count: int = DEFAULT_SM_COUNT) -> dict:
    """The sequence of ``seed``, ``steps`` calls long, for ranks on ``num_gpus`` GPUs of ``sm_count`` SMs."""
    d = _SequenceDraws(seed)
    num_ranks = d.weighted(*zip(*RANK_COUNTS))
    framework = "torch" if d.chance(0.35) else "cupy"
    num_topk = d.int_between(1, MAX_TOPK)
    # Experts per rank: at least top-k (routing to one rank picks top-k distinct experts of it).
    per_rank = max(num_topk, -(-256 // num_ranks)) if d.chance(0.5) else d.int_between(num_topk, 32)
    with_weights = d.chance(0.75)
    expert_alignment = 1 if d.chance(0.7) else d.choice((2, 4, 16, 128))
    cap = largest_num_sms(ranks_per_gpu(num_ranks, num_gpus), sm_count)
    num_sms = 2 * d.log_int(1, max(1, min(cap, 24) // 2))
    send_chunk = d.log_int(1, 32)
    return dict(seed=int(seed), num_ranks=num_ranks, framework=framework, num_topk=num_topk,
                num_experts=per_rank * num_ranks, with_weights=with_weights, expert_alignment=expert_alignment,
                num_sms=num_sms, send_chunk=send_chunk, recv_chunk=RECV_CHUNK,
                steps=_draw_steps(d, steps, num_ranks, num_topk))


def random_sequences(first_seed: int, count: int, steps: int = DEFAULT_STEPS, num_gpus: int = DEFAULT_GPUS,
                     sm_count: int = DEFAULT_SM_COUNT) -> list:
    return [random_sequence(s, steps, num_gpus, sm_count) for s in range(first_seed, first_seed + count)]


def config_of(seq: dict) -> Config:
    return Config(seq["num_sms"], seq["send_chunk"], seq["recv_chunk"])


def widest_row_bytes(seq: dict) -> int:
    """The widest row of the sequence's steps, FP8 counted at BF16 width (as the size hint asks)."""
    return max(s["hidden"] * max(2, ITEMSIZE[s["dtype"]]) for s in seq["steps"])


def nvl_bytes_needed(seq: dict) -> int:
    """NVLink bytes per rank: every step's rows fit, whatever its tokens (at most :data:`MAX_TOKENS`)."""
    return get_nvl_buffer_size_hint(widest_row_bytes(seq), seq["num_ranks"], config_of(seq),
                                    num_topk=seq["num_topk"], num_max_tokens_per_rank=MAX_TOKENS)


def describe_sequence(seq: dict) -> str:
    return (f"sequence {seq['seed']}: {seq['num_ranks']} ranks, {seq['framework']}, "
            f"top-{seq['num_topk']}{'+weights' if seq['with_weights'] else ''} of {seq['num_experts']} experts, "
            f"alignment {seq['expert_alignment']}, num_sms {seq['num_sms']}, send chunk {seq['send_chunk']}, "
            f"{len(seq['steps'])} steps")


def describe_step(step: dict) -> str:
    routing = {"uniform": "uniform", "to_one": f"all to rank {step['target']}",
               "from_one": f"all from rank {step['target']}"}[step["routing"]]
    kind = step["kind"]
    if kind == "cached":
        kind = f"cached (routing of step {step['routing_of']})"
    elif kind == "worst":
        kind = f"num_worst_tokens ({step['worst_rows']} + {step['worst_spare']})"
    elif step["repeat"]:
        kind = "fresh (repeat)"
    return (f"step {step['index']}: {kind}, tokens {'/'.join(map(str, step['tokens']))}, {routing}, "
            f"{step['dtype']} hidden {step['hidden']}{', combine' if step['combine'] else ''}")


# ---------------------------------------------------------------------------------------------
# A step's inputs (the same in every rank thread: drawn from the sequence seed, step and rank)


def routing_of(seq: dict, step: dict, rank: int) -> np.ndarray:
    """int64 ``[tokens, top-k]``: distinct experts per token (sorted), of every rank or, with
    ``to_one``, of the target rank only. A cached step has its fresh step's."""
    index = step["routing_of"]
    rng = np.random.default_rng([_STREAM_KEY, seq["seed"], index, rank, 0])
    n, k = step["tokens"][rank], seq["num_topk"]
    num_experts, num_ranks = seq["num_experts"], seq["num_ranks"]
    if step["routing"] == "to_one":
        per_rank = num_experts // num_ranks
        first, count = step["target"] * per_rank, per_rank
    else:
        first, count = 0, num_experts
    if n == 0:
        return np.zeros((0, k), np.int64)
    chosen = np.argpartition(rng.random((n, count)), k - 1, axis=1)[:, :k]
    return (np.sort(chosen, axis=1) + first).astype(np.int64)


def weights_of(seq: dict, step: dict, rank: int) -> Optional[np.ndarray]:
    if not seq["with_weights"]:
        return None
    rng = np.random.default_rng([_STREAM_KEY, seq["seed"], step["routing_of"], rank, 1])
    return rng.random((step["tokens"][rank], seq["num_topk"]), dtype=np.float32) + 0.5


def rows_of(seq: dict, step: dict, rank: int):
    """``(x in its storage dtype, FP8 scales or None)`` of ``rank`` in ``step``."""
    from deepep_cupy.reference import intranode as ref

    rng = np.random.default_rng([_STREAM_KEY, seq["seed"], step["index"], rank, 2])
    n, hidden, dtype = step["tokens"][rank], step["hidden"], step["dtype"]
    if dtype == "float8_e4m3fn":
        return ref.fp8_e4m3_scaled_random(rng, n, hidden)
    values = rng.standard_normal((n, hidden), dtype=np.float32)
    if dtype == "bfloat16":
        return ref.float32_to_bfloat16_bits(values), None
    return values.astype(np.float16) if dtype == "float16" else values, None


def step_inputs(seq: dict, step: dict) -> list:
    """Every rank's ``dict(x, scales, topk, weights)`` of ``step``."""
    inputs = []
    for rank in range(seq["num_ranks"]):
        x, scales = rows_of(seq, step, rank)
        inputs.append(dict(x=x, scales=scales, topk=routing_of(seq, step, rank), weights=weights_of(seq, step, rank)))
    return inputs
