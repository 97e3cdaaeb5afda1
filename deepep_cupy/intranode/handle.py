"""The handle a fresh dispatch returns: its layout, reused by cached dispatch and by combine.

A handle's integer arrays live in one allocation of the caller's array library (one allocation
per dispatch instead of six), carved as :class:`HandleLayout` says; the arrays DeepEP's handle
tuple holds are views of it, made when the caller first looks at them. The kernels only need the
addresses, which the handle computes once. A dispatch that allocates ahead of its receive count
keeps its small outputs per received row there too (:class:`KeptOutputs`) when its array library
carves them (CuPy): it returns views of them, made once the count is known, instead of allocating
and trimming each.
"""

from __future__ import annotations

import functools
from typing import Any, List, NamedTuple, Optional, Tuple

from ..gpu.layout import INT_BYTES, DispatchLayout
from ..tensors import row_bytes as output_row_bytes

#: Bytes of an element of a handle's allocation: int64 words, so that the outputs a dispatch keeps
#: after the ints (:class:`KeptOutputs`, int64 top-k ids first) start on an 8-byte boundary. Its
#: int32 arrays are read from it reinterpreted, when the caller looks at them.
WORD_BYTES = 8


def _words(num_bytes: int) -> int:
    return -(-num_bytes // WORD_BYTES)


class HandleLayout(NamedTuple):
    """Int32 offsets of a handle's arrays in its allocation (R ranks, C channels, N tokens).

    ``rank_prefix_matrix [R, R]``, ``channel_prefix_matrix [R, C]``,
    ``recv_channel_prefix_matrix [R, C]``, ``send_head [N, R]``, then ``recv_src_idx`` with one
    entry per received row; a dispatch that the
    host does not wait for (``num_worst_tokens``) adds its verdict, its received row count and its
    per-expert counts after that (:data:`DEVICE_COUNTS_HEADER` + local experts ints).
    """
    num_ranks: int
    num_channels: int
    num_tokens: int
    rank_prefix: int
    channel_prefix: int
    recv_channel_prefix: int
    send_head: int
    recv_src_idx: int

    def total_ints(self, rows: int, device_counts: int = 0) -> int:
        """Ints to allocate for a handle with ``rows`` received rows (and ``device_counts`` local
        experts whose counts the device publishes there; 0: none)."""
        return self.recv_src_idx + rows + (DEVICE_COUNTS_HEADER + device_counts if device_counts else 0)

    def words(self, rows: int, device_counts: int = 0) -> int:
        """int64 words to allocate for :meth:`total_ints` ints."""
        return _words(INT_BYTES * self.total_ints(rows, device_counts))

    def with_kept_outputs(self, rows: int, kept_row_bytes: int) -> Tuple[int, int]:
        """``(int64 words to allocate, byte offset of the kept outputs)`` for a handle of ``rows``
        rows that keeps ``rows`` rows of ``kept_row_bytes`` bytes of outputs after its ints, from
        a word boundary on."""
        ints_words = _words(INT_BYTES * (self.recv_src_idx + rows))
        return ints_words + _words(rows * kept_row_bytes), WORD_BYTES * ints_words


#: Ints before the per-expert counts a dispatch publishes on the device: its verdict (0: it moved
#: the tokens), then the rows it received.
DEVICE_COUNTS_HEADER = 2


class KeptOutputs(NamedTuple):
    """Where a dispatch that allocates ahead keeps its outputs other than ``recv_x`` in its handle's
    allocation, after its ints (:meth:`HandleLayout.with_kept_outputs`): top-k ids first (8-byte
    elements), then top-k weights and FP8 scales (4 bytes), so that every element is aligned. Each
    region is as many rows long as the allocation, so none moves with the receive count.

    ``regions``: for each of ``[recv_x_scales, recv_topk_idx, recv_topk_weights]``, ``(bytes per
    row of the regions before it, extents after the rows, dtype name)``, or None when the dispatch
    does not return it. ``row_bytes``: bytes per row of all of them.
    """
    regions: Tuple[Optional[Tuple[int, Tuple[int, ...], str]], ...]
    row_bytes: int

    def pointers(self, start: int, rows: int) -> list:
        """Device addresses of the regions (0 for none) of an allocation of ``rows`` rows whose
        kept outputs start at address ``start``."""
        scales, topk, weights = self.regions  # unrolled: this runs on every fresh dispatch
        return [0 if scales is None else start + rows * scales[0], 0 if topk is None else start + rows * topk[0],
                0 if weights is None else start + rows * weights[0]]

    def views(self, offset: int, rows: int, num_recv: int) -> list:
        """What :meth:`ArrayLib.carve` takes for the regions' first ``num_recv`` rows, in an
        allocation of ``rows`` rows whose kept outputs start at byte ``offset``."""
        scales, topk, weights = self.regions
        return [None if scales is None else (offset + rows * scales[0], (num_recv, *scales[1]), scales[2]),
                None if topk is None else (offset + rows * topk[0], (num_recv, *topk[1]), topk[2]),
                None if weights is None else (offset + rows * weights[0], (num_recv, *weights[1]), weights[2])]


def kept_outputs(outputs) -> KeptOutputs:
    """:class:`KeptOutputs` of a dispatch returning ``outputs`` (a dispatch plan's ``outputs``)."""
    _, scales, topk, weights = outputs
    regions = {}
    row_bytes = 0
    for name, output in (("topk", topk), ("weights", weights), ("scales", scales)):  # largest elements first
        if output is not None:
            tail, dtype_name = output
            regions[name] = (row_bytes, tuple(tail), dtype_name)
            row_bytes += output_row_bytes(tail, dtype_name)
    return KeptOutputs(tuple(regions.get(name) for name in ("scales", "topk", "weights")), row_bytes)


@functools.lru_cache(maxsize=256)
def handle_layout(num_ranks: int, num_channels: int, num_tokens: int) -> HandleLayout:
    R, C, N = num_ranks, num_channels, num_tokens
    channel_prefix = R * R
    recv_channel_prefix = channel_prefix + R * C
    send_head = recv_channel_prefix + R * C
    return HandleLayout(R, C, N, 0, channel_prefix, recv_channel_prefix, send_head, send_head + N * R)


class DispatchHandle:
    """The layout of one dispatch, reusable by cached dispatch and by combine.

    Behaves as DeepEP's handle tuple ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`` (shapes and dtypes in
    docs/DESIGN.md), in the caller's array type: it unpacks, indexes and iterates like one. It also
    remembers the Buffer it was made by.

    Args:
        lib: the caller's array library.
        block: the int64 allocation holding the handle's arrays (int32, carved by ``layout``).
        layout: where each array lies in ``block``.
        num_recv_tokens: rows the dispatch received (None until known: see :meth:`publish_on_device`).
        is_token_in_rank: the caller's array, kept as given.
        in_rank_ptr: its device address.
        owner: ``id`` of the Buffer that made the handle.

    Attributes:
        num_worst_tokens: rows of the dispatch's outputs when it was given ``num_worst_tokens``
            (0: exact rows); :attr:`rows` is the row count either way.
        recv_count, recv_expert_counts: with ``num_worst_tokens``, the rows received (int32 [1])
            and the rows per local expert, rounded up to the alignment (int32 [local experts]), as
            device arrays of the caller's library that the dispatch writes (None otherwise).
        verdict_ptr: device address of that dispatch's verdict (0 when its host checked it).
    """

    # What a handle holds until a call sets it: class attributes, since a fresh dispatch makes a
    # handle on every call and sets few of them.
    num_worst_tokens = 0
    verdict_ptr = recv_count_ptr = recv_expert_counts_ptr = 0
    #: The buffer layout of the dispatch when it wrote its rows in place (``recv_x_in_buffer``),
    #: else None: a combine of x written where it put recv_x reads the ranks' rows there.
    rows_in_buffer: Optional[DispatchLayout] = None
    _num_local_experts = 0
    _device_counts: Optional[Tuple[Any, Any]] = None
    #: Set by a dispatch with ``expand=True``: the received row each expanded row copies (-1 for
    #: padding) and where each local expert's group starts (local experts + 1 ints).
    expanded_rows: Any = None
    expert_offsets: Optional[List[int]] = None
    _items = None
    _ints = None

    def __init__(self, lib, block, layout: HandleLayout, num_recv_tokens: Optional[int], is_token_in_rank: Any,
                 in_rank_ptr: int, owner: int):
        self.lib = lib
        self.block = block
        self.layout = layout
        self.num_recv_tokens = num_recv_tokens
        self.is_token_in_rank = is_token_in_rank
        self.owner = owner
        self.base_ptr = base = lib.pointer(block)
        self.rank_prefix_ptr = base + INT_BYTES * layout.rank_prefix
        self.channel_prefix_ptr = base + INT_BYTES * layout.channel_prefix
        self.recv_channel_prefix_ptr = base + INT_BYTES * layout.recv_channel_prefix
        self.send_head_ptr = base + INT_BYTES * layout.send_head
        self.recv_src_idx_ptr = base + INT_BYTES * layout.recv_src_idx
        self.in_rank_ptr = in_rank_ptr

    def route(self, is_token_in_rank: Any, in_rank_ptr: int) -> None:
        """Give a fresh dispatch's handle, made before its kernels were launched (by the call, or
        ahead of it: ``next_outputs.py``), the dispatch's routing."""
        self.is_token_in_rank = is_token_in_rank
        self.in_rank_ptr = in_rank_ptr

    def publish_on_device(self, rows: int, num_local_experts: int) -> None:
        """The dispatch has ``rows`` output rows (``num_worst_tokens``) and writes its verdict and
        counts into the handle's allocation (sized by ``total_ints(rows, num_local_experts)``)
        instead of telling the host."""
        self.num_worst_tokens = rows
        self.num_recv_tokens = None
        start = self.layout.recv_src_idx + rows
        self.verdict_ptr = self.base_ptr + INT_BYTES * start
        self.recv_count_ptr = self.verdict_ptr + INT_BYTES
        self.recv_expert_counts_ptr = self.recv_count_ptr + INT_BYTES
        self._num_local_experts = num_local_experts

    # The device counts' views are made when first looked at: a dispatch that never waits for the
    # host must not pay for arrays its caller may not read.
    @property
    def recv_count(self) -> Any:
        counts = self._counts_views()
        return None if counts is None else counts[0]

    @property
    def recv_expert_counts(self) -> Any:
        counts = self._counts_views()
        return None if counts is None else counts[1]

    def _counts_views(self) -> Optional[Tuple[Any, Any]]:
        if self._device_counts is None and self.num_worst_tokens:
            start = self.layout.recv_src_idx + self.num_worst_tokens
            self._device_counts = (self._view(start + 1, (1,)),
                                   self._view(start + DEVICE_COUNTS_HEADER, (self._num_local_experts,)))
        return self._device_counts

    @property
    def rows(self) -> int:
        """Rows of the dispatch's outputs (what a cached dispatch returns and a combine takes)."""
        rows = self.num_worst_tokens or self.num_recv_tokens
        if rows is None:  # publish_on_device gives a dispatch that never learns its count its worst-case rows
            raise ValueError("handle: its dispatch's row count is not known")
        return rows

    @property
    def num_channels(self) -> int:
        return self.layout.num_channels

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    def _view(self, start: int, shape) -> Any:
        """The int32 array of ``shape`` at int ``start`` of the allocation."""
        if self._ints is None:
            self._ints = self.lib.reinterpret(self.block, "int32")
        size = 1
        for extent in shape:
            size *= extent
        return self._ints[start:start + size].reshape(shape)

    @property
    def items(self) -> tuple:
        """DeepEP's handle tuple (made on first use)."""
        if self._items is None:
            L, R, C, N = self.layout, self.layout.num_ranks, self.layout.num_channels, self.layout.num_tokens
            self._items = (self._view(L.rank_prefix, (R, R)), self._view(L.channel_prefix, (R, C)),
                           self._view(L.recv_channel_prefix, (R, C)), self._view(L.recv_src_idx, (self.rows,)),
                           self.is_token_in_rank,
                           self._view(L.send_head, (N, R)))
        return self._items

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index):
        return self.items[index]

    def __iter__(self):
        return iter(self.items)

    def __repr__(self) -> str:
        return (f"DispatchHandle(num_tokens={self.num_tokens}, num_recv_tokens={self.num_recv_tokens}, "
                f"num_channels={self.num_channels}, lib={self.lib.name})")
