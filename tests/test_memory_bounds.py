"""The memory bounds the GPU workers check (tests/workers/memory_bounds.py) and issue 36's steps
(tests/workers/bounded_memory_worker.py), on the CPU."""

import gc

import numpy as np
import pytest
from _harness import WORKERS, describe, run_python
from workers import bounded_memory_worker as bmw
from workers import memory_bounds as mb

from deepep_cupy.config import Config, get_nvl_buffer_size_hint
from deepep_cupy.intranode.capacity import ReceiveCapacityGuess, with_headroom
from deepep_cupy.intranode.next_outputs import MAX_BYTES, prepared_rows
from deepep_cupy.reference import intranode as ref

CONFIG = Config(24, 4, 256)


# ---------------------------------------------------------------------------------------------
# The bound


def test_the_ahead_bound_is_the_capacity_guess_bound():
    guess = ReceiveCapacityGuess()
    for sent, received in ((2697, 0), (1, 2698), (2255, 2246), (0, 0)):
        guess.observe(sent, received)
        for most in (10, 3000, 10 ** 6):
            assert mb.ahead_bound(guess.largest_received, most) == guess.bound(most)


def test_a_guess_is_never_above_the_ahead_bound():
    guess, largest = ReceiveCapacityGuess(), 0
    rng = np.random.default_rng(0)
    for _ in range(2000):
        sent, most = int(rng.choice([0, 1, 40, 3000, 8192])), int(rng.integers(100, 70000))
        rows = guess.rows(sent, most)
        assert rows is None or rows <= mb.ahead_bound(largest, most)
        received = int(rng.integers(0, 20000))
        guess.observe(sent, received)
        largest = max(largest, received)


def test_issue_36_step_b_may_allocate_only_its_exact_rows():
    guess = ReceiveCapacityGuess()
    guess.observe(1, 2698)  # step A on rank 1
    assert guess.rows(2255, 10 ** 6) is None  # the 96.79 GiB guess: allocated exactly instead
    assert mb.allowed_rows(2246, 2698, 10 ** 6) == with_headroom(2698)
    assert mb.allowed_rows(5000, 2698, 10 ** 6) == 5000


def test_allowed_rows_are_the_exact_count_or_the_bound_whichever_is_larger():
    assert mb.allowed_rows(0, 0, 1000) == with_headroom(0)
    assert mb.allowed_rows(900, 100, 1000) == 900
    assert mb.allowed_rows(10, 5000, 1000) == 1000  # never above the most rows a call can receive
    assert mb.allowed_rows(10, 800, 10 ** 6, steady=True) == prepared_rows(with_headroom(800))


def test_the_peak_limit_counts_each_buffers_next_outputs_once():
    assert mb.peak_limit(100, 50) == 150 + MAX_BYTES + mb.PEAK_SLACK_BYTES
    assert mb.peak_limit(100, 50, 2) == 150 + 2 * MAX_BYTES + mb.PEAK_SLACK_BYTES


def test_output_row_bytes_count_the_row_its_scales_top_k_weights_and_source_index():
    assert mb.output_row_bytes("bfloat16", 7592, 8, True) == 15184 + 64 + 32 + 4
    assert mb.output_row_bytes("float32", 16, 2, False) == 64 + 16 + 4
    assert mb.output_row_bytes("float8_e4m3fn", 256, 1, False) == 256 + 8 + 8 + 4


@pytest.mark.parametrize("num_ranks, dtype, hidden, tokens", [(2, "bfloat16", 7592, 8192), (4, "float32", 64, 1000),
                                                              (3, "float8_e4m3fn", 7168, 4096)])
def test_a_buffer_sized_for_t_tokens_receives_at_least_t_per_rank(num_ranks, dtype, hidden, tokens):
    widest = hidden * max(2, mb.ITEMSIZE[dtype])
    nvl_bytes = get_nvl_buffer_size_hint(widest, num_ranks, CONFIG, num_topk=8, num_max_tokens_per_rank=tokens)
    most = mb.most_rows(num_ranks, CONFIG, dtype, hidden, 8, nvl_bytes)
    assert most >= num_ranks * tokens
    assert mb.most_rows(num_ranks, CONFIG, dtype, hidden, 8, 2 * nvl_bytes) > most


# ---------------------------------------------------------------------------------------------
# Counting CuPy's allocations


class HostMalloc:
    """A malloc over host memory (a CuPy MemoryPointer needs no GPU to exist)."""

    def __init__(self):
        self.blocks = []

    def __call__(self, size):
        from cupy.cuda import memory

        block = np.empty(size, np.uint8)
        self.blocks.append(block)
        return memory.MemoryPointer(memory.UnownedMemory(block.ctypes.data, size, block, device_id=0), 0)


def test_the_cupy_counter_counts_bytes_in_use_until_the_last_view_is_gone():
    counter = mb.CupyMemoryCounter()
    malloc = counter.wrap(HostMalloc())
    first, second = malloc(1000), malloc(500)
    assert (counter.in_use, counter.peak) == (1500, 1500)
    view = first + 100  # a view keeps the allocation
    del first
    gc.collect()
    assert counter.in_use == 1500
    del view
    gc.collect()
    assert (counter.in_use, counter.peak) == (500, 1500)
    assert counter.reset_peak() == 500 and counter.peak == 500
    third = malloc(200)
    assert (counter.in_use, counter.peak) == (700, 700)
    del second, third
    gc.collect()
    assert counter.in_use == 0


# ---------------------------------------------------------------------------------------------
# Issue 36's steps


def received_by_rank(step):
    inputs = bmw.step_inputs(step)
    return sum(ref.get_dispatch_layout(i["topk"], bmw.NUM_EXPERTS, bmw.NUM_RANKS)[0] for i in inputs)


def test_step_a_sends_every_token_to_rank_1_which_receives_2698_rows():
    a = bmw.STEPS[0]
    assert a.tokens == (2697, 1) and a.hidden == 1240
    assert received_by_rank(a).tolist() == [0, 2698]


def test_step_b_has_rank_1_send_2255_tokens_with_uniform_routing_and_rank_0_none():
    b = bmw.STEPS[1]
    assert b.tokens == (0, 2255) and b.hidden == 7592
    topk = bmw.step_inputs(b)[1]["topk"]
    assert topk.shape == (2255, 8) and all(len(set(row)) == 8 for row in topk.tolist())
    assert topk.min() < 128 <= topk.max()
    assert bmw.STEPS[3].tokens == (0, 8192) and bmw.STEPS[3].hidden == 7592


def test_step_inputs_are_the_same_in_every_process():
    for mine, again in zip(bmw.step_inputs(bmw.STEPS[0]), bmw.step_inputs(bmw.STEPS[0])):
        for key in mine:
            assert np.array_equal(mine[key], again[key])


def test_the_worker_lists_its_steps_without_a_gpu():
    run = run_python([WORKERS / "bounded_memory_worker.py", "--list"], timeout=120)
    assert run.returncode == 0, describe(run)
    assert run.stdout.splitlines() == [bmw.describe_step(s) for s in bmw.STEPS]
