"""The kernels of an internode call in fixed-size blocks (kernels/internode_blocks.cu): what the
host learned from the counts otherwise, found on the device.

:class:`BlockKernels` launches them on CuPy arrays (views of the caller's arrays and of arrays the
call allocated); it knows no operation. The CPU tests give the internode path a NumPy stand-in with
the same methods (tests/internode_fakes.py).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..gpu import kernels
from ..gpu.launch import KernelCall, every_argument_per_call, fill_bytes
from ..gpu.slots import MappedInts

#: Blocks of the kernels that loop over tokens or rows in steps of the grid.
GRID_BLOCKS = 132


def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _zero(stream: int, *arrays) -> None:
    for array in arrays:
        if array is not None and array.nbytes:
            fill_bytes(array.data.ptr, 0, array.nbytes, stream)


class BlockKernels:
    """Launches the block kernels on ``stream`` (a raw ``cudaStream_t``); every instance is loaded
    when the object is made (a kernel loaded lazily by a rank sharing a GPU could wait for a
    peer's running kernel)."""

    def __init__(self) -> None:
        kernels.load(kernels.SOURCES["internode_blocks.cu"])
        self._calls: Dict[str, KernelCall] = {}
        # [rows wanted, rows there were] of a number_rows that had too few rows (host-mapped: read
        # with no CUDA call, at the next call, since nothing waits for the kernel).
        self._overflow = MappedInts(2)

    def _call(self, kernel: str, grid: int) -> KernelCall:
        call = self._calls.get(kernel)
        if call is None:
            call = self._calls[kernel] = every_argument_per_call(f"deepep_cupy::blocks::{kernel}", grid)
        return call

    def zero(self, stream: int, array) -> None:
        """Zero a C-contiguous CuPy array on ``stream``."""
        _zero(stream, array)

    def route(self, stream: int, topk: Optional[Any], in_rank_in: Optional[Any], num_tokens: int, num_experts: int,
              num_ranks: int, ranks_per_node: int, block_tokens: int, *, in_rank_out=None, per_rank=None,
              per_node=None, per_expert=None, slots=None) -> None:
        """Each token's is_token_in_rank row (from ``in_rank_in``, bool ``[T, R]`` any strides, or
        from ``topk``, int64 ``[T, K]``), the counts per rank, node and expert (int32, zeroed
        here) and the combine's ``slots`` (int32 ``[N, T]``); None: not written."""
        _zero(stream, per_rank, per_node, per_expert)
        if topk is not None and topk.shape[1] > 1 and topk.strides[1] != 8:  # the kernel steps over tokens only
            import cupy

            topk = cupy.ascontiguousarray(topk)
        topk_stride = 0 if topk is None else topk.strides[0] // 8
        num_topk = 0 if topk is None else topk.shape[1]
        strides = (0, 0) if in_rank_in is None else in_rank_in.strides
        self._call("route", GRID_BLOCKS).run(
            stream, _ptr(topk), topk_stride, num_topk, _ptr(in_rank_in), strides[0], strides[1], num_tokens,
            num_experts, num_ranks, ranks_per_node, block_tokens, _ptr(in_rank_out), _ptr(per_rank), _ptr(per_node),
            _ptr(per_expert), _ptr(slots))

    def number_rows(self, stream: int, records, record_bytes: int, in_rank_off: int, rank: int, num_blocks: int,
                    block_tokens: int, num_rows: int, row_of, counts, block_prefix) -> None:
        """``row_of`` (int64 ``[num_blocks * block_tokens]``) and ``counts`` (int32
        ``[num_blocks + 1]``) of the received records meant for ``rank`` (one rank per node);
        ``block_prefix`` (int32 ``[num_blocks]``) the records received up to each block. More
        rows wanted than ``num_rows`` are dropped, and :meth:`take_overflow` tells of them."""
        self._call("number_rows", 1).run(stream, _ptr(records), record_bytes, in_rank_off, rank, num_blocks,
                                         block_tokens, num_rows, _ptr(row_of), _ptr(counts), _ptr(block_prefix),
                                         self._overflow.device_ptr(0))

    def take_overflow(self) -> Optional[Tuple[int, int]]:
        """``(rows wanted, rows there were)`` of a :meth:`number_rows` the GPU has run since the
        last time this was asked, that had too few rows; None when none had (or it has not run yet)."""
        values = self._overflow.values
        if values[0] <= 0:
            return None
        found = (int(values[0]), int(values[1]))
        values[:] = 0
        return found

    def close(self) -> None:
        """Free the host-mapped overflow record (idempotent; after the GPU finished the calls)."""
        self._overflow.free()

    def stage_counts(self, stream: int, in_rank, topk: Optional[Any], num_rows: int, num_node_experts: int,
                     per_rank, per_expert) -> None:
        """The node stage's rows per local rank and per node expert (int32, zeroed here)."""
        _zero(stream, per_rank, per_expert)
        num_topk = 0 if topk is None else topk.shape[1]
        self._call("stage_counts", GRID_BLOCKS).run(stream, _ptr(in_rank), _ptr(topk), num_rows, in_rank.shape[1],
                                                    num_topk, num_node_experts, _ptr(per_rank), _ptr(per_expert))

    def deepep_order(self, stream: int, rank_prefix, recv_src_idx, local_rank: int, ranks_per_node: int,
                     num_nodes: int, block_tokens: int, num_rows: int, order, inverse, gbl_prefix,
                     block_prefix) -> None:
        """The node stage's rows in DeepEP's order: ``order``/``inverse`` int64 ``[num_rows]``,
        ``gbl_prefix`` int32 ``[R]``; ``block_prefix`` (int32 ``[num_nodes]``) the records
        received up to each node's block."""
        self._call("deepep_order", 1).run(stream, _ptr(rank_prefix), _ptr(recv_src_idx), local_rank, ranks_per_node,
                                          num_nodes, block_tokens, num_rows, _ptr(order), _ptr(inverse),
                                          _ptr(gbl_prefix), _ptr(block_prefix))

    def take_rows(self, stream: int, dst, src, order, num_rows: int, row_bytes: int) -> None:
        """``dst[p] = src[order[p]]`` for the first ``num_rows`` rows (C-contiguous, ``row_bytes`` each)."""
        if num_rows and row_bytes:
            self._call("take_rows", GRID_BLOCKS).run(stream, _ptr(dst), _ptr(src), _ptr(order), num_rows, row_bytes)
