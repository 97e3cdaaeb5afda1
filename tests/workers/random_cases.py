"""Random dispatch/combine cases for the GPU soak: ``random_case(seed)`` -> a scenario dict.

Plain Python and NumPy (importable without a GPU). A case has every field of
``gpu_scenarios.BASE`` (what ``gpu_worker.run_scenario`` honours) plus ``num_ranks``, drawn
within the limits the library enforces:

* 2..8 ranks, 0..5000 tokens per rank (a tuple: uneven; sometimes one int: every rank alike);
* every dtype (BF16, FP16, FP32, FP8 with ``[N, H/128]`` scales and with ``[N]`` scales), hidden
  sizes whose rows are a multiple of 16 bytes, up to 8192 (a multiple of 128 for FP8 with
  per-block scales);
* top-k 1..9 over up to 8192 experts (a multiple of the rank count, at most 4096 per rank),
  routing uniform, skewed, with -1 entries, or avoiding the last rank;
* ``expert_alignment`` 1..128, ``num_sms`` 2..what fits when ranks share a GPU, chunk sizes
  1..1024 (send <= receive; the NVLink buffer sized for the case's tokens);
* CuPy or PyTorch, sync or async, with or without top-k and weights, with or without cached
  dispatch and combine, and how the first fresh dispatch sizes its outputs;
* DeepEP's layouts and calls: FP8 scales column-major, combine with 0..2 biases, a fresh
  dispatch with ``num_worst_tokens``, and one with ``expand=True``.

Sizes are log-uniform (most cases small, a tail of large ones) and capped so that the NumPy
reference stays cheap: :data:`MOVED_BYTES_CAP` for the rows all ranks receive, :data:`ROUTING_KEYS_CAP` for
the routing draw (``reference.random_routing`` sorts one key per token and expert).

Every value comes from ``rng.random()`` alone (the one NumPy generator call whose stream is
pinned), so a seed gives the same case on every machine with the same GPU count and SM count;
those two only bound ``num_sms`` (and, through the buffer cap, the queue size).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from deepep_cupy.config import Config, get_nvl_buffer_size_hint
from deepep_cupy.constants import FP8_SCALE_BLOCK, MAX_EXPERTS, MAX_LOCAL_EXPERTS, MAX_RANKS
from deepep_cupy.gpu.sm_budget import largest_num_sms

RANK_COUNTS = tuple(range(2, MAX_RANKS + 1))
MAX_TOKENS = 5000
MAX_HIDDEN = 8192
#: The issue's top-k range (the library takes up to 32).
TOPK_RANGE = (1, 9)
MAX_ALIGNMENT = 128
MAX_RECV_CHUNK = 1024
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e4m3fn_1d")
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e4m3fn_1d": 1}
ROUTINGS = ("uniform", "skewed", "drop", "avoid_last_rank")
#: Model sizes drawn now and then besides the log-uniform ones (all multiples of 128).
COMMON_HIDDEN = (2048, 4096, 7168, 8192)
#: The seeds ``make test`` runs (tests/test_gpu_random.py); ``make soak`` starts at 1000 by default.
GPU_TEST_SEEDS = range(0, 50)
#: The machine the soak is sized for: 2 x H200.
DEFAULT_GPUS = 2
DEFAULT_SM_COUNT = 132

#: Bytes all ranks receive, at most (tokens x row bytes x the most ranks a token can reach):
#: bounds the reference's copies and conversions, and the host transfers and comparisons.
MOVED_BYTES_CAP = 24 << 20
#: Tokens (all ranks) x experts: bounds random_routing's Gumbel keys and their sort.
ROUTING_KEYS_CAP = 400_000
#: NVLink buffer per rank, at most (MOVED_BYTES_CAP keeps every case well under it).
NVL_BYTES_CAP = 1 << 30
#: A "retried" first dispatch is allocated ahead for 64 rows (see gpu_worker.run_scenario).
RETRY_GUESS_ROWS = 64
#: Rows past the received ones that a case's ``num_worst_tokens`` dispatch asks for
#: (gpu_worker.check_worst_case).
WORST_SPARE_ROWS = 37
#: Mixed into every seed so that a case's draws never share a stream with its inputs (make_inputs
#: seeds its own generator with the case seed).
_STREAM_KEY = 0x15500C


class _Draws:
    """Draws built on ``rng.random()`` only; ``key`` names the stream (another kind of case, e.g.
    tests/workers/internode_cases.py, draws from its own key, so that its seeds share nothing
    with these)."""

    def __init__(self, seed: int, key: int = _STREAM_KEY):
        self._rng = np.random.default_rng([int(key), int(seed)])

    def uniform(self) -> float:
        return float(self._rng.random())

    def chance(self, p: float) -> bool:
        return self.uniform() < p

    def choice(self, options: Sequence):
        return options[min(int(self.uniform() * len(options)), len(options) - 1)]

    def int_between(self, lo: int, hi: int) -> int:
        """Uniform in ``[lo, hi]``."""
        return lo + min(int(self.uniform() * (hi - lo + 1)), hi - lo)

    def log_int(self, lo: int, hi: int) -> int:
        """In ``[lo, hi]``, log-uniform in ``value - lo + 1``: small values common, ``hi`` possible."""
        span = hi - lo + 1
        return lo + min(int(math.exp(self.uniform() * math.log(span + 1))) - 1, span - 1)


def token_counts(case) -> tuple:
    """Tokens of every rank (a case's ``num_tokens`` is an int when all ranks have the same)."""
    n = case["num_tokens"]
    return tuple(n) if isinstance(n, tuple) else (n,) * case["num_ranks"]


def row_step(dtype: str) -> int:
    """The hidden sizes allowed are the multiples of this."""
    return FP8_SCALE_BLOCK if dtype == "float8_e4m3fn" else 16 // ITEMSIZE[dtype]


def config_of(case) -> Config:
    """The Config the case's dispatch and combine run with."""
    return Config(case["num_sms"], case["send_chunk"], case["recv_chunk"])


def nvl_bytes_needed(case) -> int:
    """NVLink bytes per rank the case needs: ``get_nvl_buffer_size_hint`` for its config, top-k,
    rows (FP8 rows counted at BF16 width, as the hint asks, so that their scales are included) and
    the most tokens a rank dispatches (plus the spare rows of a ``num_worst_tokens`` dispatch, which
    a recv_x in the buffer must have room for too)."""
    row_bytes = case["hidden"] * max(2, ITEMSIZE[case["dtype"]])
    spare = WORST_SPARE_ROWS if case["recv_in_buffer"] else 0
    return get_nvl_buffer_size_hint(row_bytes, case["num_ranks"], config_of(case), num_topk=case["num_topk"],
                                    num_max_tokens_per_rank=max(1, *token_counts(case)) + spare,
                                    recv_x_in_buffer=case["recv_in_buffer"])


def ranks_per_gpu(num_ranks: int, num_gpus: int) -> int:
    """The most ranks on one GPU with rank ``r`` on GPU ``r % num_gpus``."""
    return -(-num_ranks // max(1, min(num_gpus, num_ranks)))


def _draw_tokens(d: _Draws, num_ranks: int, most: int):
    if d.chance(0.25):
        return d.log_int(0, most)
    return tuple(d.log_int(0, most) for _ in range(num_ranks))


def _draw_hidden(d: _Draws, dtype: str, total_tokens: int, fan_out: int) -> int:
    step = row_step(dtype)
    if d.chance(0.2):
        hidden = d.choice(COMMON_HIDDEN)
    else:
        hidden = step * d.log_int(1, MAX_HIDDEN // step)
    # Big batches get narrower rows, so that no case costs the reference more than the cap.
    widest = MOVED_BYTES_CAP // max(1, total_tokens * ITEMSIZE[dtype] * fan_out) // step * step
    return max(step, min(hidden, widest))


def most_experts(num_ranks: int) -> int:
    """The most experts ``num_ranks`` ranks can have: a multiple of the rank count within both limits."""
    return min(MAX_LOCAL_EXPERTS, MAX_EXPERTS // num_ranks) * num_ranks


def _draw_experts(d: _Draws, num_ranks: int, num_topk: int, routing: str, total_tokens: int) -> int:
    # avoid_last_rank routes over the experts of ranks 0..R-2 only: they must hold top-k distinct ones.
    owners = num_ranks - 1 if routing == "avoid_last_rank" else num_ranks
    fewest = -(-num_topk // owners)
    per_rank = d.log_int(fewest, most_experts(num_ranks) // num_ranks)
    affordable = ROUTING_KEYS_CAP // max(1, total_tokens * num_ranks)
    return max(fewest, min(per_rank, affordable)) * num_ranks


def _draw_num_sms(d: _Draws, num_ranks: int, num_gpus: int, sm_count: int) -> int:
    # Ranks sharing a GPU must fit on it together (sm_budget.check_sm_budget).
    cap = largest_num_sms(ranks_per_gpu(num_ranks, num_gpus), sm_count)
    return 2 * d.log_int(1, max(1, cap // 2))


def _can_force_retry(routing: str, counts: tuple) -> bool:
    """Whether a 64-row guess is sure to be too small for some rank: without -1 entries every token
    goes to at least one rank, so some rank receives at least the mean of all tokens."""
    return routing != "drop" and sum(counts) > RETRY_GUESS_ROWS * len(counts)


def random_case(seed: int, num_gpus: int = DEFAULT_GPUS, sm_count: int = DEFAULT_SM_COUNT) -> dict:
    """The case of ``seed`` for ranks placed on ``num_gpus`` GPUs of ``sm_count`` SMs each."""
    d = _Draws(seed)
    num_ranks = d.choice(RANK_COUNTS)
    dtype = d.choice(DTYPES)
    # Now and then the most experts the library takes, with only as many tokens as the routing
    # draw affords at that size.
    at_expert_limit = d.chance(0.04)
    most_tokens = ROUTING_KEYS_CAP // most_experts(num_ranks) // num_ranks if at_expert_limit else MAX_TOKENS
    num_tokens = _draw_tokens(d, num_ranks, most_tokens)
    counts = num_tokens if isinstance(num_tokens, tuple) else (num_tokens,) * num_ranks
    num_topk = d.int_between(*TOPK_RANGE)
    hidden = _draw_hidden(d, dtype, sum(counts), min(num_topk, num_ranks))
    routing = d.choice(ROUTINGS)
    num_experts = (most_experts(num_ranks) if at_expert_limit
                   else _draw_experts(d, num_ranks, num_topk, routing, sum(counts)))
    with_topk = d.chance(0.85)
    with_weights = with_topk and d.chance(0.75)
    expert_alignment = 1 if d.chance(0.3) else d.log_int(1, MAX_ALIGNMENT)
    num_sms = _draw_num_sms(d, num_ranks, num_gpus, sm_count)
    recv_chunk = d.log_int(1, MAX_RECV_CHUNK)
    send_chunk = d.log_int(1, recv_chunk)
    mode = "async" if d.chance(0.35) else "sync"
    framework = "torch" if d.chance(0.3) else "cupy"
    cached = d.chance(0.7)
    # FP8 has no combine (combine reduces 16/32-bit floats): say so in the case.
    combine = not dtype.startswith("float8") and d.chance(0.8)
    allocations = ("exact", "ahead", "retried") if _can_force_retry(routing, counts) else ("exact", "ahead")
    allocation = d.choice(allocations)
    # DeepEP's input layouts and calls (drawn last: the draws above stay those of earlier seeds).
    scales_layout = "column" if dtype == "float8_e4m3fn" and d.chance(0.5) else "row"
    bias = d.choice((0, 0, 1, 2)) if combine else 0
    worst = d.chance(0.2)
    expand = with_topk and d.chance(0.2)
    recv_in_buffer = d.chance(0.25)
    combine_in_place = recv_in_buffer and combine and d.chance(0.5)
    case = dict(name=f"random_{seed}", seed=int(seed), num_ranks=num_ranks, num_tokens=num_tokens, hidden=hidden,
                num_topk=num_topk, num_experts=num_experts, num_sms=num_sms, dtype=dtype, with_topk=with_topk,
                with_weights=with_weights, expert_alignment=expert_alignment, routing=routing, cached=cached,
                combine=combine, mode=mode, framework=framework, send_chunk=send_chunk, recv_chunk=recv_chunk,
                allocation=allocation, scales_layout=scales_layout, bias=bias, worst=worst, expand=expand,
                recv_in_buffer=recv_in_buffer, combine_in_place=combine_in_place)
    return case


def random_cases(first_seed: int, count: int, num_gpus: int = DEFAULT_GPUS,
                 sm_count: int = DEFAULT_SM_COUNT) -> list:
    """The cases of seeds ``first_seed .. first_seed + count - 1``."""
    return [random_case(s, num_gpus, sm_count) for s in range(first_seed, first_seed + count)]


def describe_case(case) -> str:
    """One line naming everything the case draws."""
    counts = token_counts(case)
    tokens = f"{counts[0]} each" if isinstance(case["num_tokens"], int) else "/".join(map(str, counts))
    topk = (f"top-{case['num_topk']}{'+weights' if case['with_weights'] else ''}" if case["with_topk"]
            else f"top-{case['num_topk']} (layout only)")
    steps = ["dispatch"] + ["cached"] * case["cached"] + ["combine"] * case["combine"]
    return (f"seed {case['seed']}: {case['num_ranks']} ranks, tokens {tokens}, "
            f"{case['dtype']} hidden {case['hidden']}, "
            f"{topk} of {case['num_experts']} experts ({case['routing']}), alignment {case['expert_alignment']}, "
            f"num_sms {case['num_sms']}, chunks {case['send_chunk']}/{case['recv_chunk']}, {case['mode']}, "
            f"{case['framework']}, {'+'.join(steps)}, first dispatch {case['allocation']}, "
            f"scales {case['scales_layout']}, {case['bias']} biases{', num_worst_tokens' if case['worst'] else ''}"
            f"{', expand' if case['expand'] else ''}{', recv_x in buffer' if case['recv_in_buffer'] else ''}"
            f"{', combined in place' if case['combine_in_place'] else ''}")
