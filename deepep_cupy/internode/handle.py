"""The handle of an internode dispatch: DeepEP's tuple, plus what this library's cached
dispatches and combines read from it."""

from __future__ import annotations

from typing import Any, Optional, Sequence

#: DeepEP's internode handle, field by field (``handle[-4]`` is ``recv_gbl_rank_prefix_sum``).
FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
          "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
          "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


class InternodeHandle(tuple):
    """What a fresh internode dispatch hands to the cached dispatches and combines that follow.

    As a tuple it is DeepEP's: ``(is_token_in_rank, None, None, None, recv_rdma_rank_prefix_sum,
    None, recv_gbl_rank_prefix_sum, None, None, None)`` (arrays of the caller's library; the
    channel matrices, source metadata and send heads of DeepEP's kernels have no counterpart
    here). ``is_token_in_rank`` is bool ``[num_tokens, R]``, the routing;
    ``recv_rdma_rank_prefix_sum`` int32 ``[N]`` the inclusive prefix of the tokens this rank
    forwards from each node; ``recv_gbl_rank_prefix_sum`` int32 ``[R]`` the inclusive prefix of
    the rows it received from each source rank (its rows are grouped so).

    Attributes:
        owner: id of the path that made it.
        num_tokens: the dispatching rank's tokens.
        send_token_idx: int64 CuPy array, the tokens sent to each node, node after node.
        send_counts, recv_counts: per node, the tokens this rank sends to it, and the tokens it
            forwards from it.
        slots: int32 CuPy array ``[N, num_tokens]``: where token ``t``'s record lies in the block
            of node ``n`` (-1: not sent there); combine sums the rows coming back by it.
        intranode: the node stage's handle (None with one rank per node).
        num_recv_tokens: the rows this rank received.
        order: int64 CuPy array or None: for each row in DeepEP's order, its row in the node stage's
            outputs (None: the same order); ``inverse`` the other way round.
        num_worst_tokens, num_topk: the dispatch's.
        block_tokens: the records of each node's block of a dispatch in fixed-size blocks
            (:mod:`deepep_cupy.internode.blocks`), 0 for one whose host learned the counts. Such a
            handle's counts stay on the device: ``send_counts``/``recv_counts`` are the blocks,
            ``send_token_idx`` is None, ``num_recv_tokens`` is ``num_worst_tokens``,
            ``recv_rdma_rank_prefix_sum`` counts the blocks' records.
        row_of, num_valid: with one rank per node, the output row of each received record (int64,
            -1: none) and the rows received (an int32 device scalar); None otherwise.
    """

    def __new__(cls, fields: Sequence[Any], **attributes):
        if len(fields) != len(FIELDS):
            raise ValueError(f"an internode handle has {len(FIELDS)} fields, got {len(fields)}")
        handle = super().__new__(cls, fields)
        handle.__dict__.update(attributes)
        return handle

    owner: int
    num_tokens: int
    send_token_idx: Any
    send_counts: tuple
    recv_counts: tuple
    slots: Any
    intranode: Any
    num_recv_tokens: int
    order: Optional[Any]
    inverse: Optional[Any]
    num_worst_tokens: int
    num_topk: int
    block_tokens: int = 0
    row_of: Optional[Any] = None
    num_valid: Optional[Any] = None

    @property
    def num_forwarded(self) -> int:
        """The tokens this rank forwards (the node stage's input rows)."""
        return sum(self.recv_counts)

    @property
    def rows(self) -> int:
        """The rows of the dispatch's outputs (the rows combine takes)."""
        return self.num_worst_tokens or self.num_recv_tokens

    def __repr__(self) -> str:
        return (f"InternodeHandle(num_tokens={self.num_tokens}, rows={self.rows}, send_counts={self.send_counts}, "
                f"recv_counts={self.recv_counts})")
