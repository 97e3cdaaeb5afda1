"""Where the data of the low-latency calls lie in their buffer, and the buffer size they need.

The header and signal words come first (kernels/low_latency.cu; fixed offsets, constants.LL_*),
then :data:`NUM_AREAS` equal data areas at places the buffer's size alone sets. The arithmetic
here is the kernels' (they are handed the offsets it computes) and the size hint's.
"""

from __future__ import annotations

import dataclasses

from ..constants import FP8_SCALE_BLOCK, LL_DATA_OFFSET, LL_SYNC_INT, MAX_RANKS
from ..tensors import check_int

__all__ = ["LowLatencyLayout", "get_low_latency_rdma_size_hint", "logfmt_unroll"]

#: LogFMT combines (DeepEP's) need hidden a multiple of this; with a multiple of 1024 their chunks
#: are 1024 channels (unroll 4), else 512 (unroll 2); at most 32 chunks (kernels/low_latency.cu).
LOGFMT_HIDDEN_MULTIPLE = 512
LOGFMT_MAX_CHUNKS = 32

#: Equal data areas of the buffer: dispatch half 0 and 1, combine half 0 and 1, zero-copy rows 0 and 1.
NUM_AREAS = 6
_AREA_ALIGN = 4096

#: The end (int index) of the shrink-mode words a clean keeps (constants.LL_MASK_INT, LL_SYNC_INT).
SHRINK_WORDS_END = LL_SYNC_INT + MAX_RANKS


def logfmt_unroll(hidden: int) -> int:
    """The int4 per lane of a LogFMT chunk (DeepEP's kNumSendUnrolls): 4 (1024 channels) when hidden
    is a multiple of 1024, else 2 (512)."""
    return 4 if hidden % 1024 == 0 else 2


@dataclasses.dataclass(frozen=True)
class LowLatencyLayout:
    """Where the data of calls of these sizes lie in a low-latency buffer of ``num_bytes``.

    The header and signal words come first (kernels/low_latency.cu; fixed offsets, constants.LL_*),
    then :data:`NUM_AREAS` equal areas at fixed places (the buffer's size alone sets them): the two
    dispatch halves (``[L][R][M]`` records), the two combine halves (``[E][M][hidden]`` BF16 rows)
    and the two zero-copy areas (``[L][R * M][hidden]`` BF16 rows). Calls of other sizes index the same areas
    differently, so a half is never written while a call of other sizes still reads the other.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_ranks: int
    num_experts: int
    num_bytes: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows_per_expert(self) -> int:
        return self.num_ranks * self.num_max_dispatch_tokens_per_rank

    @property
    def record_bytes(self) -> int:
        """A dispatched row: BF16 (or FP8 plus its scales, which is smaller), then 16 bytes that
        hold its source token index."""
        return -(-(self.hidden * 2 + 16) // 16) * 16

    @property
    def logfmt_slot_bytes(self) -> int:
        """A row's slot in a combine half with LogFMT (kernels/low_latency.cu): one (amax, amin) BF16
        pair per 128 channels, then at most the BF16 row."""
        return self.hidden * 2 + self.hidden // FP8_SCALE_BLOCK * 4

    def combine_slot_bytes(self, use_logfmt: bool) -> int:
        """A row's slot in a combine half: the BF16 row, or its LogFMT slot."""
        return self.logfmt_slot_bytes if use_logfmt else self.hidden * 2

    @property
    def area_bytes_needed(self) -> int:
        """The largest of the areas these sizes use (a dispatch half or, with LogFMT possible, a combine half)."""
        combine_slot = self.combine_slot_bytes(self.hidden % LOGFMT_HIDDEN_MULTIPLE == 0)
        return max(self.num_local_experts * self.rows_per_expert * self.record_bytes,
                   self.num_experts * self.num_max_dispatch_tokens_per_rank * combine_slot)

    @property
    def area_bytes(self) -> int:
        """Bytes of each data area of a buffer of :attr:`num_bytes`."""
        return max(0, (self.num_bytes - LL_DATA_OFFSET) // NUM_AREAS) // _AREA_ALIGN * _AREA_ALIGN

    @property
    def fits(self) -> bool:
        return self.area_bytes_needed <= self.area_bytes

    @property
    def bytes_needed(self) -> int:
        """The smallest buffer in which calls of these sizes fit."""
        return LL_DATA_OFFSET + NUM_AREAS * -(-self.area_bytes_needed // _AREA_ALIGN) * _AREA_ALIGN

    @property
    def dispatch_offset(self) -> int:
        return LL_DATA_OFFSET

    @property
    def dispatch_half_bytes(self) -> int:
        return self.area_bytes

    @property
    def combine_offset(self) -> int:
        return LL_DATA_OFFSET + 2 * self.area_bytes

    @property
    def combine_half_bytes(self) -> int:
        return self.area_bytes

    @property
    def zero_copy_offset(self) -> int:
        """The first zero-copy area (the second follows it: :meth:`zero_copy_offset_of`)."""
        return LL_DATA_OFFSET + 4 * self.area_bytes

    def zero_copy_offset_of(self, index: int) -> int:
        """Zero-copy area ``index`` (0 or 1): the one combine call ``n`` sends from is ``n & 1``."""
        return self.zero_copy_offset + (index & 1) * self.area_bytes

    @property
    def zero_copy_bytes(self) -> int:
        return self.num_local_experts * self.rows_per_expert * self.hidden * 2


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """Bytes of the low-latency buffer (a Buffer's ``num_rdma_bytes``) for calls of these sizes
    (DeepEP's name), rounded up to 2 MiB."""
    num_max_dispatch_tokens_per_rank = check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
    hidden = check_int(hidden, "hidden")
    num_ranks = check_int(num_ranks, "num_ranks")
    num_experts = check_int(num_experts, "num_experts")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: expected a multiple of num_ranks={num_ranks}, got {num_experts}")
    size = LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts).bytes_needed
    return -(-size // (2 << 20)) * (2 << 20)


assert MAX_RANKS <= 8  # the release words hold MAX_RANKS readers per (op, half)
