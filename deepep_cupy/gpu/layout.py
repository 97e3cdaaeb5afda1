"""Where everything lives inside a rank's NVLink buffer.

This module is the one place that carves the buffer; the kernels receive the byte offsets it
computes. Every rank computes the same offsets (the settings are checked to agree), so an offset
is valid in a peer's buffer too. All regions start on 128-byte boundaries.

    [0, 128)            int signals[8]      barrier words; slot s written only by rank s (never reset);
                        int 16              this rank's verdict on the current call's settings (0: agreed)
                        int 24              abort mark: r + 1 once rank r gave up on the Buffer (timed
                                            out), written by that rank into every buffer; 0 until then
                        int 28, 29          this rank's call counters: barriers passed, notify areas used
                                            (advanced by the kernels, see constants.BARRIERS_INT)
                        int 30              arrival word of a transfer kernel's blocks waiting for its
                                            settings check (constants.GRID_SYNC_INT; resets itself)
    notify area 0, 1    int signature[R][8], rank_counts[R][R], expert_counts[R][E/R], recv_capacity[R]
                        (sized for 8 ranks and MAX_LOCAL_EXPERTS; dispatches alternate between the
                        two, so a rank can post the next counts while a slower peer still reads the
                        last ones, and the notify kernel needs no barrier before it writes)
    [DATA_OFFSET, ...)  the metadata and regions of the running transfer, one of:

    dispatch            int start[C*R], end[C*R], tail[C*R]                      (channel metadata)
                        x[R-1][T][row_bytes]
                        int src_idx[R-1][T]
                        int topk_idx[R-1][T][K]
                        float topk_weights[R-1][T][K]
                        float scales[R-1][T][S]

    dispatch in place   int start[C*R], end[C*R], tail[C*R]     (only start: the channels' first rows)
      (recv_x_in_buffer)  x[R*T][row_bytes]                     recv_x
                        int src_idx[R*T]
                        int64 topk_idx[R*T][K]                  recv_topk_idx
                        float topk_weights[R*T][K]              recv_topk_weights
                        float scales[R*T][S]                    recv_x_scales

    combine             int tail[C*R]
                        x[R-1][T][row_bytes]
                        float topk_weights[R-1][T][K]

Each other rank has one region of T slots (``region_tokens``) in a receiver's buffer, slot j
holding the j-th token that rank sends this one (kernels/dispatch.cu, kernels/combine.cu); a call
takes the largest T that fits the Buffer, and refuses to move anything when a rank sends another
more than T tokens. C = the dispatch's channels (``Config.num_channels``), K = top-k, S = scales
per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..constants import (
    ABORT_INT,
    BARRIERS_INT,
    GRID_SYNC_INT,
    MAX_LOCAL_EXPERTS,
    MAX_RANKS,
    NOTIFY_AREA_BYTES,
    NOTIFY_AREA_OFFSET,
    NOTIFY_CALLS_INT,
    SIGNATURE_INTS,
    VERDICT_INT,
)

ALIGNMENT = 128
SIGNAL_BYTES = 128
INT_BYTES = 4

#: The words of the header, by int index (the verdict's and the abort mark's are defined in
#: constants.py, which the kernels share).
HEADER_WORDS = {"signals": tuple(range(MAX_RANKS)), "verdict": (VERDICT_INT,), "abort mark": (ABORT_INT,),
                "call counters": (BARRIERS_INT, NOTIFY_CALLS_INT), "grid arrivals": (GRID_SYNC_INT,)}


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


assert NOTIFY_AREA_OFFSET == SIGNAL_BYTES
assert NOTIFY_AREA_BYTES == _align(INT_BYTES * MAX_RANKS * (SIGNATURE_INTS + MAX_RANKS + MAX_LOCAL_EXPERTS + 1))
NOTIFY_OFFSETS = (SIGNAL_BYTES, SIGNAL_BYTES + NOTIFY_AREA_BYTES)
DATA_OFFSET = SIGNAL_BYTES + 2 * NOTIFY_AREA_BYTES


class _Carver:
    """Hands out consecutive aligned regions starting at ``start``."""

    def __init__(self, start: int):
        self.offset = _align(start)

    def take(self, num_bytes: int) -> int:
        begin = self.offset
        self.offset = _align(begin + num_bytes)
        return begin


@dataclass(frozen=True)
class DispatchLayout:
    meta_off: int
    x_off: int
    src_idx_off: int
    topk_idx_off: int
    topk_weights_off: int
    scales_off: int
    #: slots of each region: the most tokens one rank may send another in this call
    region_tokens: int
    total_bytes: int
    #: the channel metadata that must be zero before a dispatch: ints from meta_off
    zero_count: int
    #: rows of the areas (with rows in place: the most rows the rank's outputs may have)
    rows: int = 0


@dataclass(frozen=True)
class CombineLayout:
    meta_off: int
    x_off: int
    topk_weights_off: int
    region_tokens: int
    total_bytes: int
    zero_count: int


@functools.lru_cache(maxsize=256)
def dispatch_layout(num_ranks: int, num_channels: int, region_tokens: int, row_bytes: int,
                    num_topk: int, num_scales: int, rows_in_buffer: bool = False) -> DispatchLayout:
    """Offsets of a dispatch's regions (see the module docstring). ``rows_in_buffer``: the senders
    write each token straight into its row of the receiver's outputs, which are the areas: a row
    for every token the rank may receive (R regions' worth, its own tokens included), top-k ids
    as int64."""
    channel_words = num_channels * num_ranks
    slots = num_ranks * region_tokens if rows_in_buffer else (num_ranks - 1) * region_tokens
    carve = _Carver(DATA_OFFSET)
    meta_off = carve.take(INT_BYTES * 3 * channel_words)
    x_off = carve.take(slots * row_bytes)
    src_idx_off = carve.take(INT_BYTES * slots)
    topk_idx_off = carve.take((2 if rows_in_buffer else 1) * INT_BYTES * slots * num_topk)
    topk_weights_off = carve.take(INT_BYTES * slots * num_topk)
    scales_off = carve.take(INT_BYTES * slots * num_scales)
    return DispatchLayout(meta_off, x_off, src_idx_off, topk_idx_off, topk_weights_off,
                          scales_off, region_tokens, carve.offset, 3 * channel_words, slots)


@functools.lru_cache(maxsize=256)
def combine_layout(num_ranks: int, num_channels: int, region_tokens: int, row_bytes: int,
                   num_topk: int) -> CombineLayout:
    """Offsets of a combine's regions (see the module docstring)."""
    channel_words = num_channels * num_ranks
    slots = (num_ranks - 1) * region_tokens
    carve = _Carver(DATA_OFFSET)
    meta_off = carve.take(INT_BYTES * channel_words)
    x_off = carve.take(slots * row_bytes)
    topk_weights_off = carve.take(INT_BYTES * slots * num_topk)
    return CombineLayout(meta_off, x_off, topk_weights_off, region_tokens, carve.offset, channel_words)


#: The most slots a region gets, however large the Buffer (kernels index slots with int32).
MAX_REGION_TOKENS = 1 << 30


def largest_fitting(make, num_nvl_bytes: int):
    """``make(T)`` (a layout for regions of T slots) for the largest T whose layout fits in
    ``num_nvl_bytes``, or None when not even one slot fits."""
    empty = make(0).total_bytes
    per_slot = -(-(make(1024).total_bytes - empty) // 1024)
    tokens = min(MAX_REGION_TOKENS, max(0, (num_nvl_bytes - empty) // per_slot))
    while tokens > 0 and make(tokens).total_bytes > num_nvl_bytes:  # alignment padding: a few slots at most
        tokens -= 1
    return make(tokens) if tokens > 0 else None
