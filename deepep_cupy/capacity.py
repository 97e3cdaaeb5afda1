"""How many rows a dispatch allocates for what it receives before the receive count is known.

A fresh dispatch learns how many tokens its rank receives only from the count exchange on the
GPU. Waiting for that count on the host before allocating the outputs leaves the GPU idle for a
host round trip per call. Instead the Buffer allocates from a guess, launches the transfer right
behind the count exchange, and returns exact-size views once the count arrives. The guess comes
from the previous dispatch (the same model sends similar routing step after step), scaled by this
call's token count, with headroom; when a rank receives more than its guess, every rank's
transfer moves nothing and the call is redone with exact sizes (kernels/notify.cu).
"""

from __future__ import annotations

from typing import Optional, Tuple

#: Headroom over the expected receive count: a fraction of it, plus some rows.
HEADROOM_FRACTION = 1 / 8
HEADROOM_ROWS = 64


class ReceiveCapacityGuess:
    """The rows to allocate ahead for a dispatch's received tokens, learned from earlier calls."""

    def __init__(self) -> None:
        self._last: Optional[Tuple[int, int]] = None  # (tokens sent, tokens received) of the last call

    def rows(self, num_tokens: int) -> Optional[int]:
        """Rows for a dispatch of ``num_tokens`` tokens, or None before any dispatch was seen."""
        if self._last is None:
            return None
        last_tokens, last_received = self._last
        expected = last_received if last_tokens in (0, num_tokens) else last_received * num_tokens / last_tokens
        return int(expected * (1 + HEADROOM_FRACTION)) + HEADROOM_ROWS

    def observe(self, num_tokens: int, num_received: int) -> None:
        """Remember what a dispatch of ``num_tokens`` tokens received."""
        self._last = (int(num_tokens), int(num_received))
