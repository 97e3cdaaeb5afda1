"""Sizing a fresh dispatch's outputs before its receive count is known (CPU only).

The Buffer allocates rows from a guess learned from the previous dispatch, launches the transfer
right behind the count exchange, and redoes the call with exact sizes when any rank receives more
than its guess (notify_dispatch then refuses the transfer on every rank).
"""

import re
from types import SimpleNamespace

from deepep_cupy import buffer as buffer_module, kernels
from deepep_cupy.buffer import Buffer
from deepep_cupy.capacity import HEADROOM_FRACTION, HEADROOM_ROWS, ReceiveCapacityGuess


def test_the_first_dispatch_has_no_guess():
    assert ReceiveCapacityGuess().rows(4096) is None


def test_the_guess_is_the_last_receive_count_plus_headroom():
    guess = ReceiveCapacityGuess()
    guess.observe(4096, 8000)
    assert guess.rows(4096) == int(8000 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert guess.rows(4096) > 8000


def test_the_guess_scales_with_the_token_count():
    guess = ReceiveCapacityGuess()
    guess.observe(4096, 8000)
    assert guess.rows(1024) == int(2000 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS


def test_a_rank_that_sent_nothing_guesses_from_what_it_received():
    guess = ReceiveCapacityGuess()
    guess.observe(0, 300)
    assert guess.rows(0) == int(300 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert guess.rows(100) == guess.rows(0)


def test_the_over_capacity_verdict_is_the_kernels():
    source = kernels.read_source("notify.cu")
    define = re.search(r"#define VERDICT_OVER_CAPACITY (\d+)", source)
    assert define and int(define.group(1)) == buffer_module._VERDICT_OVER_CAPACITY
    assert "recv_capacity" in [name for name, _ in kernels.SIGNATURES["notify_dispatch_kernel"]]


class _Handle:
    def __init__(self, num_recv_tokens):
        self.num_recv_tokens = num_recv_tokens


def _buffer_with_exchange(results, allocate_ahead=True):
    """A Buffer whose count exchange + transfer is replaced by ``results`` (None = too few rows)."""
    buf = Buffer.__new__(Buffer)  # no GPU here: only the host-side decisions are exercised
    buf.allocate_ahead = allocate_ahead
    buf._capacity_guess = ReceiveCapacityGuess()
    buf.last_dispatch_allocation = None
    calls = []

    def exchange(call, config, rows_ahead, *rest):
        calls.append(rows_ahead)
        num_recv = results[len(calls) - 1]
        return None if num_recv is None else ("recv_x", None, None, [], _Handle(num_recv), None)

    buf._fresh_call = lambda *args: SimpleNamespace(rows=_Rows(100))
    buf._exchange_and_dispatch = exchange
    return buf, calls


class _Rows:
    """Stands for x: a fresh dispatch only reads its token count."""

    def __init__(self, num_tokens):
        self.shape = (num_tokens, 7168)


def _dispatch(buf):
    return buf._fresh_dispatch(None, None, None, None, None, None, 1, None, None, False, False)


def test_the_first_dispatch_waits_for_the_counts():
    buf, calls = _buffer_with_exchange([180])
    _dispatch(buf)
    assert calls == [None] and buf.last_dispatch_allocation == "exact"


def test_the_next_dispatch_allocates_ahead_from_the_last_count():
    buf, calls = _buffer_with_exchange([180, 170])
    _dispatch(buf)
    _dispatch(buf)
    assert calls == [None, int(180 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS]
    assert buf.last_dispatch_allocation == "ahead"


def test_a_dispatch_that_outgrows_its_guess_is_redone_with_exact_sizes():
    buf, calls = _buffer_with_exchange([10, None, 400, 390])
    _dispatch(buf)
    out = _dispatch(buf)
    assert calls[1:] == [int(10 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS, None]
    assert buf.last_dispatch_allocation == "retried" and out[4].num_recv_tokens == 400
    _dispatch(buf)  # the retried call's count is the next guess
    assert calls[3] == int(400 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS


def test_without_allocate_ahead_every_dispatch_waits_for_the_counts():
    buf, calls = _buffer_with_exchange([180, 170], allocate_ahead=False)
    _dispatch(buf)
    _dispatch(buf)
    assert calls == [None, None] and buf.last_dispatch_allocation == "exact"
