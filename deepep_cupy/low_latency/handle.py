"""What a low-latency dispatch hands its combine: DeepEP's handle, as a tuple."""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import checks

__all__ = ["LowLatencyHandle", "low_latency_handle"]


class LowLatencyHandle(NamedTuple):
    """What a low-latency dispatch hands its combine (DeepEP's handle, as a tuple).

    ``src_info`` int32 ``[L, R * M]``: the source token index of each received row;
    ``layout_range`` int64 ``[L, R]``: ``(first row from source r) << 32 | rows from r``. Both are
    device arrays of the caller's library, written by the receive.
    """

    src_info: Any
    layout_range: Any
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


def low_latency_handle(handle: Any) -> None:
    """Raise unless ``handle`` is a low-latency dispatch's."""
    checks.check_handle(handle, LowLatencyHandle, "low_latency_dispatch")
