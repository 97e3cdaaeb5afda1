"""Checks of the low-latency calls' sizes that hold for every call of a Buffer: the layout they
need fits its buffer, LogFMT can carry the rows, the clean's arguments are sizes.

They raise ``ValueError``/``TypeError`` naming the argument before anything runs. The checks of
the arrays themselves are made once per kind of arguments, with the plans (:mod:`.path`).
"""

from __future__ import annotations

from typing import Any

from ..constants import MAX_EXPERTS
from ..tensors import check_int
from .layout import LOGFMT_HIDDEN_MULTIPLE, LOGFMT_MAX_CHUNKS, LowLatencyLayout, logfmt_unroll

__all__ = ["check_logfmt", "checked_layout", "clean_arguments"]


def checked_layout(num_max: Any, hidden: int, num_experts: Any, num_ranks: int, num_bytes: int) -> LowLatencyLayout:
    """The layout of calls of these sizes in a buffer of ``num_bytes`` on ``num_ranks`` ranks;
    raises unless they fit it."""
    num_max = check_int(num_max, "num_max_dispatch_tokens_per_rank")
    num_experts = check_int(num_experts, "num_experts")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of the rank count {num_ranks}, got {num_experts}")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts: at most {MAX_EXPERTS}, got {num_experts}")
    layout = LowLatencyLayout(num_max, hidden, num_ranks, num_experts, num_bytes)
    if not layout.fits:
        raise ValueError(
            f"num_rdma_bytes: the low-latency buffer has {num_bytes} bytes, calls with "
            f"num_max_dispatch_tokens_per_rank={num_max}, hidden={hidden}, num_experts={num_experts} on "
            f"{num_ranks} ranks need {layout.bytes_needed}; create the Buffer with "
            f"Buffer.get_low_latency_rdma_size_hint({num_max}, {hidden}, {num_ranks}, {num_experts}) bytes")
    return layout


def check_logfmt(hidden: int, zero_copy: bool) -> None:
    """Raise unless a combine of rows of ``hidden`` channels may send them LogFMT-compressed."""
    if zero_copy:
        raise ValueError("use_logfmt=True with zero_copy=True: the LogFMT cast reads x itself (DeepEP refuses "
                         "them together too); pass one of them")
    if hidden % LOGFMT_HIDDEN_MULTIPLE:
        raise ValueError(f"use_logfmt=True: LogFMT needs hidden a multiple of {LOGFMT_HIDDEN_MULTIPLE}, got {hidden}")
    if hidden // (256 * logfmt_unroll(hidden)) > LOGFMT_MAX_CHUNKS:
        raise ValueError(f"use_logfmt=True: hidden {hidden} is more than {LOGFMT_MAX_CHUNKS} LogFMT chunks")


def clean_arguments(num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> None:
    """Check :meth:`Buffer.clean_low_latency_buffer`'s arguments (sizes it no longer needs: the signal
    words sit at fixed places)."""
    check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
    check_int(hidden, "hidden")
    check_int(num_experts, "num_experts")
