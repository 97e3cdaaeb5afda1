"""Rows in place (``recv_x_in_buffer``): which dispatch's rows lie in the NVLink buffer's areas,
and the inputs no call may take from there.

A dispatch with rows in place returns views of this rank's NVLink buffer, which the next dispatch
or combine overwrites; a combine in place reads the rows there. The engine owns one
:class:`RowsInBuffer` and hands it to its dispatch and combine paths: it is the state those two
hand each other.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from .handle import DispatchHandle
from .plans import DispatchPlan


class RowsInBuffer:
    """Attributes: ``used``: a plan made views of the buffer (from then on every call's inputs are
    checked against it); ``of``: the handle of the dispatch whose rows in place the areas hold, or
    None."""

    def __init__(self) -> None:
        self.used = False
        self.of: Optional[DispatchHandle] = None

    def note_dispatch(self, plan: DispatchPlan, handle: DispatchHandle) -> None:
        """A dispatch with ``handle`` writes the buffer's areas (its kernels are queued, or about to
        be): with rows in place they then hold its rows (the handle keeps their layout, a combine
        in place reads them there); otherwise what they held is gone."""
        if plan.windows is not None:
            handle.rows_in_buffer = plan.spec.layout
            self.of = handle
        else:
            self.of = None

    def refuse_inputs(self, nvl: Any, args: Tuple[str, ...], *pointers: int) -> None:
        """Refuse an input (``args``: the arguments' names, ``pointers``: their device addresses, 0
        for none) that lies in this rank's NVLink buffer ``nvl`` (an output of a
        ``recv_x_in_buffer`` dispatch): the call would overwrite it while it reads it. Nothing can
        lie there before a plan of such a dispatch was made: callers check :attr:`used` first."""
        begin = nvl.local_ptr
        end = begin + nvl.num_bytes
        for ptr in pointers:
            if begin <= ptr < end:
                arg = args[pointers.index(ptr)]
                raise ValueError(f"{arg}: lies in this Buffer's NVLink buffer (an output of a dispatch with "
                                 "recv_x_in_buffer), which this call overwrites while it reads it; pass a copy")
