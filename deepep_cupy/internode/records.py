"""The records that cross the rail between nodes: their layout and the kernels that pack, unpack
and sum them (kernels/internode.cu).

A record is one token's row, its FP8 scales, its int64 top-k ids, its float32 weights and its
``is_token_in_rank`` row (each part present or not), padded to 16 bytes. The internode path packs
the records of every destination node into one send buffer, in node order, and reads the records
of every source node from one receive buffer, in node order too.

:class:`RecordKernels` launches the kernels on CuPy arrays (views of the caller's arrays and the
path's buffers); it knows no operation. The CPU tests give the internode path a NumPy stand-in
with the same methods (tests/internode_fakes.py).
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

from ..gpu import kernels
from ..gpu.launch import KernelCall

#: Bytes a record is padded to (rows stay 16-byte aligned in the buffers).
RECORD_ALIGN = 16

#: Blocks per launch: the kernels loop over records (or tokens) in steps of the grid.
GRID_BLOCKS = 264


class RecordLayout(NamedTuple):
    """Where each part of a token's record lies, in bytes."""
    row_bytes: int
    scale_bytes: int = 0
    num_topk: int = 0      # top-k ids carried (0: none)
    num_weights: int = 0   # weights carried (0: none)
    num_in_rank: int = 0   # is_token_in_rank entries carried (0: none)

    @property
    def scales_off(self) -> int:
        return self.row_bytes

    @property
    def topk_off(self) -> int:
        # int64 ids: 8-byte aligned after an odd number of float32 scales (one per token)
        return -(-(self.scales_off + self.scale_bytes) // 8) * 8

    @property
    def weights_off(self) -> int:
        return self.topk_off + 8 * self.num_topk

    @property
    def in_rank_off(self) -> int:
        return self.weights_off + 4 * self.num_weights

    @property
    def bytes(self) -> int:
        end = self.in_rank_off + self.num_in_rank
        return -(-end // RECORD_ALIGN) * RECORD_ALIGN


class PackSources(NamedTuple):
    """What :meth:`RecordKernels.pack` reads per token (CuPy arrays, one row per token; None: no
    such part): rows as uint8 ``[T, row_bytes]``; scales float32 ``[T, S]``; top-k int64 and
    weights float32 ``[T, K]``; is_token_in_rank bool ``[T, R]``. Any strides but the rows'."""
    rows: Any
    scales: Any = None
    topk: Any = None
    weights: Any = None
    in_rank: Any = None


class UnpackTargets(NamedTuple):
    """What :meth:`RecordKernels.unpack` writes (C-contiguous CuPy arrays of ``out_rows`` rows;
    None: not written): rows uint8; scales float32 ``[., S]``; top-k int64 and weights float32
    ``[., K]``; is_token_in_rank bool ``[., num_in_rank]``."""
    rows: Any
    scales: Any = None
    topk: Any = None
    weights: Any = None
    in_rank: Any = None


def _ptr(array) -> int:
    return 0 if array is None else array.data.ptr


def _strides(array, count: int) -> Tuple[int, int]:
    """(bytes between tokens, bytes between elements) of a ``[T, count]`` array (0s for None)."""
    if array is None:
        return 0, 0
    token = array.strides[0] if array.ndim else 0
    element = array.strides[1] if array.ndim > 1 and count > 1 else array.itemsize
    return token, element


class RecordKernels:
    """Launches the record kernels on ``stream`` (a raw ``cudaStream_t``); each kernel instance
    is bound once, and every instance is loaded when the object is made (kernels that a path
    sharing a GPU loads lazily could wait for a peer's running kernel)."""

    def __init__(self) -> None:
        self._calls: Dict[Tuple[str, Tuple[str, ...]], KernelCall] = {}
        kernels.load(kernels.SOURCES["internode.cu"])

    def _call(self, kernel: str, template_args: Tuple[str, ...] = ()) -> KernelCall:
        key = (kernel, template_args)
        call = self._calls.get(key)
        if call is None:
            names = [name for name, _ in kernels.SIGNATURES[kernel]]
            call = self._calls[key] = KernelCall(kernel, template_args, grid=GRID_BLOCKS, per_call=names)
        return call

    def pack(self, stream: int, records, layout: RecordLayout, token_ids: Optional[Any], count: int,
             sources: PackSources) -> None:
        """Records ``[count, layout.bytes]`` (uint8) of the tokens ``token_ids`` (int64; None: tokens
        0..count-1) from ``sources``."""
        rows, scales, topk, weights, in_rank = sources
        scale_token, scale_step = _strides(scales, layout.scale_bytes // 4)
        in_rank_token, in_rank_step = _strides(in_rank, layout.num_in_rank)
        self._call("deepep_cupy::internode::notify").run(
            stream, _ptr(records), layout.bytes, _ptr(token_ids), count,
            _ptr(rows), rows.strides[0], layout.row_bytes,
            _ptr(scales), scale_token, scale_step, layout.scale_bytes // 4, layout.scales_off,
            _ptr(topk), _strides(topk, 1)[0], layout.num_topk, layout.topk_off,
            _ptr(weights), _strides(weights, 1)[0], layout.num_weights, layout.weights_off,
            _ptr(in_rank), in_rank_token, in_rank_step, layout.num_in_rank, layout.in_rank_off)

    def unpack(self, stream: int, writes_outputs: bool, records, layout: RecordLayout, count: int, out_rows: int,
               targets: UnpackTargets, first_expert: int = 0, num_local_experts: int = 0,
               in_rank_from: int = 0, row_of: Optional[Any] = None, num_valid: Optional[Any] = None) -> None:
        """The parts of ``count`` records into ``targets`` (``out_rows`` rows: rows past ``count``
        get top-k ids -1); top-k ids made local to ``[first_expert, first_expert +
        num_local_experts)`` (-1 and weight 0 elsewhere); ``targets.in_rank`` takes the record's
        entries from ``in_rank_from`` on. ``row_of`` (int64 ``[count]``, -1: none): the row of each
        record, else the record's index; ``num_valid`` (int32 device scalar): the rows written,
        else ``count``. ``writes_outputs``: the call's outputs (DeepEP's
        ``dispatch`` stage) rather than the node stage's inputs."""
        rows, scales, topk, weights, in_rank = targets
        kernel = "deepep_cupy::internode::dispatch" if writes_outputs else "deepep_cupy::internode::forward"
        self._call(kernel).run(
            stream, _ptr(records), layout.bytes, count, _ptr(rows), layout.row_bytes,
            _ptr(scales), layout.scale_bytes // 4, layout.scales_off, _ptr(topk), _ptr(weights), layout.num_topk,
            layout.topk_off, layout.weights_off, first_expert, num_local_experts, _ptr(in_rank), in_rank_from,
            0 if in_rank is None else in_rank.shape[1], layout.in_rank_off, out_rows, _ptr(row_of), _ptr(num_valid))

    def sum_nodes(self, stream: int, writes_outputs: bool, dtype_name: str, out, out_weights, records,
                  layout: RecordLayout, slots, biases: Tuple[Any, Any]) -> None:
        """``out[t]`` = the float32 sum of the biases, then of the rows each node sent back for
        token ``t`` (``slots[n, t]``: its record, -1 for none), in node order, rounded to
        ``dtype_name``; ``out_weights`` likewise from the records' weights. ``writes_outputs``:
        no node combine ran before (DeepEP's ``combine`` stage)."""
        kernel = "deepep_cupy::internode::combine" if writes_outputs else "deepep_cupy::internode::sum_nodes"
        num_nodes, num_tokens = slots.shape
        self._call(kernel, (kernels.COMBINE_ELEMENTS[dtype_name],)).run(
            stream, _ptr(out), _ptr(out_weights), _ptr(records), layout.bytes, _ptr(slots), num_tokens, num_nodes,
            layout.row_bytes, layout.num_weights, layout.weights_off, _ptr(biases[0]), _ptr(biases[1]))
