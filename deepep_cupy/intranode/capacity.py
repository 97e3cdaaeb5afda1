"""How many rows a dispatch allocates for what it receives before the receive count is known.

A fresh dispatch learns how many tokens its rank receives only from the count exchange on the
GPU. Waiting for that count on the host before allocating the outputs leaves the GPU idle for a
host round trip per call. Instead the Buffer allocates from a guess, launches the transfer right
behind the count exchange, and returns exact-size views once the count arrives. The guess comes
from the previous dispatch (the same model sends similar routing step after step), scaled by this
call's token count, with headroom; when a rank receives more than its guess, every rank's
transfer moves nothing and the call is redone with exact sizes (kernels/count_exchange.cuh).

**The bound.** What a rank receives depends on what the *other* ranks send, so scaling by the
rank's own token count can be off by any factor (one token sent and thousands received, then
thousands sent). A guess is therefore used only when it is at most

    largest receive count seen * (1 + HEADROOM_FRACTION) + HEADROOM_ROWS

and never for more than ``most_rows``, the most rows a rank can receive in the call (every rank
sends it at most a transfer region's tokens, or the call is refused: ranks x region tokens, from
the Buffer's size and the call's rows). A guess above the first is not used: the call allocates
exactly, after its count exchange tells it its count. So the rows a call allocates ahead never
exceed ``min(that bound, most_rows)``, for any history of calls; the steady loop, whose guess
follows the last count, is never above it. The outputs prepared for the next call
(``next_outputs.py``) hold at most an eighth more rows than that, never more than
``most_rows``, and at most ``next_outputs.MAX_BYTES``.
"""

from __future__ import annotations

from typing import Optional, Tuple

#: Headroom over the expected receive count: a fraction of it, plus some rows.
HEADROOM_FRACTION = 1 / 8
HEADROOM_ROWS = 64


def with_headroom(rows: float) -> int:
    return int(rows * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS


class ReceiveCapacityGuess:
    """The rows to allocate ahead for a dispatch's received tokens, learned from earlier calls."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[int, int]] = None  # (tokens sent, tokens received) of the last call
        #: The largest receive count seen (the bound grows with it).
        self.largest_received = 0
        self._most_ahead = with_headroom(0)  # with_headroom(largest_received), kept with it

    def bound(self, most_rows: int) -> int:
        """The most rows a call may allocate ahead (see the module docstring)."""
        return min(self._most_ahead, most_rows)

    def rows(self, num_tokens: int, most_rows: int) -> Optional[int]:
        """Rows for a dispatch of ``num_tokens`` tokens that receives at most ``most_rows`` rows, or
        None when the call is to allocate exactly: before any dispatch was seen, or when the guess
        is above the largest count seen with headroom (the module docstring)."""
        last = self._last
        if last is None:
            return None
        last_tokens, last_received = last
        guess = with_headroom(last_received if last_tokens == num_tokens or not last_tokens
                              else last_received * num_tokens / last_tokens)
        if guess > self._most_ahead:
            return None
        return guess if guess < most_rows else most_rows

    def observe(self, num_tokens: int, num_received: int) -> None:
        """Remember what a dispatch of ``num_tokens`` tokens (an int) received (an int)."""
        self._last = (num_tokens, num_received)
        if num_received > self.largest_received:
            self.largest_received = num_received
            self._most_ahead = with_headroom(num_received)
