"""The guess of how many rows a fresh dispatch receives, before its counts are known (CPU only).

How the Buffer uses it (allocate ahead, redo exactly when too small) is specified in
test_host_path.py.
"""

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
