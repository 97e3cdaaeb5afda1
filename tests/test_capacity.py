"""The guess of how many rows a fresh dispatch receives, before its counts are known, and its
bound (CPU only).

How the Buffer uses it (allocate ahead, redo exactly when too small, allocate exactly when the
guess is above the bound) is specified in test_host_path.py.
"""

import numpy as np

from deepep_cupy.intranode.capacity import HEADROOM_FRACTION, HEADROOM_ROWS, ReceiveCapacityGuess, with_headroom

#: No limit from the Buffer's size in these tests.
ANY_ROWS = 1 << 30


def test_the_first_dispatch_has_no_guess():
    assert ReceiveCapacityGuess().rows(4096, ANY_ROWS) is None


def test_the_guess_is_the_last_receive_count_plus_headroom():
    guess = ReceiveCapacityGuess()
    guess.observe(4096, 8000)
    assert guess.rows(4096, ANY_ROWS) == int(8000 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert guess.rows(4096, ANY_ROWS) > 8000


def test_the_guess_scales_with_the_token_count():
    guess = ReceiveCapacityGuess()
    guess.observe(4096, 8000)
    assert guess.rows(1024, ANY_ROWS) == int(2000 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS


def test_a_rank_that_sent_nothing_guesses_from_what_it_received():
    guess = ReceiveCapacityGuess()
    guess.observe(0, 300)
    assert guess.rows(0, ANY_ROWS) == int(300 * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS
    assert guess.rows(100, ANY_ROWS) == guess.rows(0, ANY_ROWS)


def test_a_guess_above_the_largest_count_seen_is_not_used():
    # The steps: one token sent and 2,698 rows received, then 2,255 tokens sent. Scaled by
    # the token count the guess was 6.8 million rows (96.79 GiB of 15,184-byte rows).
    guess = ReceiveCapacityGuess()
    guess.observe(1, 2698)
    assert guess.rows(2255, ANY_ROWS) is None
    assert guess.bound(ANY_ROWS) == with_headroom(2698)


def test_a_guess_up_to_the_largest_count_seen_is_used():
    guess = ReceiveCapacityGuess()
    guess.observe(4096, 9000)
    guess.observe(512, 1000)
    assert guess.rows(4096, ANY_ROWS) == with_headroom(8000)  # scaled back up: under 9000 with headroom


def test_no_guess_is_for_more_rows_than_a_rank_can_receive():
    guess = ReceiveCapacityGuess()
    guess.observe(4096, 8000)
    assert guess.rows(4096, 5000) == 5000 and guess.bound(5000) == 5000


def test_the_rows_allocated_ahead_stay_under_the_bound_whatever_the_history():
    rng = np.random.default_rng(0)
    guess = ReceiveCapacityGuess()
    for _ in range(2000):
        sent = int(rng.choice([0, 1, rng.integers(2, 65), rng.integers(1000, 8193)]))
        received = int(rng.choice([0, 1, rng.integers(2, 65), rng.integers(1000, 65537)]))
        most_rows = int(rng.integers(1, 1 << 20))
        rows = guess.rows(sent, most_rows)
        assert rows is None or rows <= min(with_headroom(guess.largest_received), most_rows)
        guess.observe(sent, received)
