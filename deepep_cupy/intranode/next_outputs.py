"""The allocations a fresh dispatch makes for the next one while it waits for its own counts.

A dispatch that allocates ahead of its receive count (``capacity.py``) needs its outputs before
its count exchange is launched (so that a host that cannot allocate them can still take part, to
refuse the call on every rank). Allocated during the call, they delay the count exchange, which
the host then waits for. In a steady loop the next dispatch has this
one's token count and about its receive count, so a dispatch allocates the next one's outputs
while its host would otherwise wait for the count: the next dispatch finds them ready and
launches one kernel that makes the count exchange and the transfer.

Ready outputs are kept only for a call like the one that made them (same plan, token count,
stream and allocation stream) and only up to :data:`MAX_BYTES` (the reference workload's outputs,
4096 tokens of hidden 7168 on 2 to 8 ranks, are 130 to 310 MB; larger calls, whose GPU time dwarfs
the host's, allocate their own). A call whose plan or token count differs from the
previous call's prepares nothing, so a loop of varying sizes (or one alternating between two
kinds of calls) does not pay for allocations it never uses.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

#: The most bytes a Buffer holds between two dispatches for the next one's outputs.
MAX_BYTES = 512 << 20


def prepared_rows(rows_guessed: int) -> int:
    """Rows of the outputs prepared for the next call by a call whose receive count was guessed at
    ``rows_guessed`` rows (``capacity.py``; not the rows it was given, which may be a prepared
    eighth more already): the next call's guess follows this call's count, which varies from call
    to call, so they get an eighth more."""
    return rows_guessed + rows_guessed // 8


class ReadyOutputs(NamedTuple):
    """A fresh dispatch's allocations, made ahead of the call that uses them.

    Made by a call for one with its plan and token count; ``caller``, ``on_comm_stream``: the
    caller's stream and whether the allocations are the communication stream's; ``rows``: the rows
    they hold; ``handle``: the call's handle, on its allocation (with the
    outputs it keeps, ``kept_offset`` bytes in), its routing yet to be given; ``outputs``: the
    outputs allocated apart (None with rows in place); ``pointers``: the addresses of ``[recv_x,
    recv_scales, recv_topk_idx, recv_topk_weights]`` (0 for none)."""
    caller: int
    on_comm_stream: bool
    rows: int
    handle: Any  # a handle.DispatchHandle
    kept_offset: int
    outputs: Optional[list]
    pointers: list


class NextOutputs:
    """The one set of :class:`ReadyOutputs` a Buffer holds between fresh dispatches."""

    def __init__(self) -> None:
        self.ready: Optional[ReadyOutputs] = None
        #: Whether the last fresh dispatch had the plan and the token count of the one before it:
        #: only such a call prepares the next one's outputs.
        self.steady = False
        #: Whether the last steady call made nothing for the next one because it would have held
        #: more than :data:`MAX_BYTES` (:meth:`fits`).
        self.over_limit = False
        self._last_call: tuple = (None, -1)

    def take(self, plan: Any, num_tokens: int, caller: int, on_comm_stream: bool,
             rows: int) -> Optional[ReadyOutputs]:
        """For every fresh dispatch: the ready outputs when they are for this call (see
        :class:`ReadyOutputs`) and hold at least ``rows`` rows (0 for a round sized by its count
        exchange, which may take them too); None otherwise. Either way none are left, and
        :attr:`steady` tells whether this call is like the one before."""
        last_plan, last_tokens = self._last_call
        self.steady = last_plan is plan and last_tokens == num_tokens
        self._last_call = (plan, num_tokens)
        ready, self.ready = self.ready, None
        # Ready outputs are made by the call before (a take clears them), for a call like it.
        if ready is None or not self.steady or ready.caller != caller \
                or ready.on_comm_stream != on_comm_stream or ready.rows < rows:
            return None
        return ready

    def fits(self, num_bytes: int) -> bool:
        """Whether a steady call may allocate ``num_bytes`` for the next one (noted in
        :attr:`over_limit`)."""
        self.over_limit = num_bytes > MAX_BYTES
        return not self.over_limit

    def keep(self, ready: ReadyOutputs) -> None:
        self.ready = ready

    def drop(self) -> None:
        self.ready = None
        self.over_limit = False
        self._last_call = (None, -1)
