"""The internode (hierarchical) path: dispatch and combine of a Buffer whose group spans nodes.

A token crosses the network at most once per destination node, to the rank with its own local
index there (its *forwarding rank*, on its rail), and an intranode dispatch on that node (this
library's NVLink kernels, through an *intranode engine*: the intranode Buffer of the node's
sub-group) delivers it to the ranks that own its experts. Combine goes back the same way: an
intranode combine sums each token's copies inside the node (float32, rounded to x's dtype), one
row per token per node crosses back, and the token's owner sums the nodes' rows in node order
(float32, its biases first) and rounds again. :mod:`deepep_cupy.internode_reference` is the model
of every result, bit for bit.

One call, on the host (the rail transport's host API needs the byte counts, so the host learns
them before it posts the transfers; DeepEP's kernels do not wait for the host, this path does):

1. Fresh dispatch: every token's destination nodes (from ``topk_idx``); the tokens of each node,
   in token order, packed as records (row, FP8 scales, top-k ids, weights) into one send buffer,
   the other nodes' blocks in node order then the own node's; the per-node counts exchanged over
   the rail (``alltoall_ints``); the blocks sent (``alltoallv``; the own block never leaves the GPU).
2. The received blocks and the own one, in node order, unpacked into the intranode dispatch's
   inputs with their top-k ids made node-local (``e - n*E/N``, -1 and weight 0 elsewhere); with
   one rank per node they are the outputs themselves.
3. Combine: the intranode combine with the intranode handle, the partial rows (and weights) sent
   back over the rail with the dispatch's counts reversed, and the owner's reduction.

The array work is CuPy's, on the call's stream, on views of the caller's arrays; outputs are
allocated by the caller's library. Receive order: by forwarding local rank, then source node,
then source token index. This module never imports the Buffer: its collaborators (the node
topology, the rail transport, the intranode engine) are given to it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from . import tensors
from .config import Config
from .events import EventOverlap
from .tensors import ITEMSIZE, STORAGE, check_array, check_int, describe

__all__ = ["InternodeHandle", "InternodePath", "RecordLayout", "create_internode_path"]

#: Element types of x that combine sums (FP8 is dispatched only).
COMBINE_DTYPES = ("bfloat16", "float16", "float32")
DISPATCH_DTYPES = COMBINE_DTYPES + ("float8_e4m3fn",)
#: Bytes a record of the rail transfer is padded to (rows stay 16-byte aligned in the buffers).
RECORD_ALIGN = 16


class RecordLayout(NamedTuple):
    """One token's record on a rail: its row, its FP8 scales, its int64 top-k ids, its float32
    weights (each part present or not), padded to 16 bytes."""
    row_bytes: int
    scale_bytes: int = 0
    num_topk: int = 0      # top-k ids carried (0: none)
    num_weights: int = 0   # weights carried (0: none)

    @property
    def scales_off(self) -> int:
        return self.row_bytes

    @property
    def topk_off(self) -> int:
        return self.scales_off + self.scale_bytes

    @property
    def weights_off(self) -> int:
        return self.topk_off + 8 * self.num_topk

    @property
    def bytes(self) -> int:
        end = self.weights_off + 4 * self.num_weights
        return -(-end // RECORD_ALIGN) * RECORD_ALIGN

    def pack(self, token_ids, rows, scales=None, topk=None, weights=None):
        """uint8 records ``[tokens, bytes]`` of the tokens ``token_ids`` (None: every row, in
        order); ``rows`` as uint8 ``[T, row_bytes]``, the others as ``[T, n]`` of their dtype."""
        cupy = _cupy()
        count = rows.shape[0] if token_ids is None else len(token_ids)
        records = cupy.empty((count, self.bytes), cupy.uint8)
        for offset, values in ((0, rows), (self.scales_off, scales), (self.topk_off, topk),
                               (self.weights_off, weights)):
            if values is not None:
                picked = values if token_ids is None else values[token_ids]
                part = cupy.ascontiguousarray(picked).view(cupy.uint8)
                records[:, offset:offset + part.shape[1]] = part
        return records

    def part(self, records, offset: int, width: int, dtype, shape: Tuple[int, ...]):
        """One part of every record, as contiguous ``dtype`` elements of ``shape``; ``records`` is
        an array of records or a sequence of them, read in order (the forwarded blocks, joined
        here part by part rather than copied whole first). A copy: the part of a single record is
        already contiguous, but only as aligned as ``offset``, and a view of int64 or float32
        elements there faults with a misaligned address."""
        blocks = records if isinstance(records, (list, tuple)) else (records,)
        return _cupy().concatenate([b[:, offset:offset + width] for b in blocks]).view(dtype).reshape(shape)


class _Forwarded(NamedTuple):
    """The intranode stage's inputs (CuPy arrays, storage dtypes), forwarded tokens in node order."""
    rows: Any
    scales: Any
    topk: Any
    weights: Any


class InternodeHandle:
    """What a fresh internode dispatch hands to the cached dispatches and combines that follow.

    Attributes:
        owner: id of the :class:`InternodePath` that made it.
        num_tokens: the dispatching rank's tokens.
        send_token_idx: int64 device array (CuPy), the tokens sent to each node in *packed order*:
            the other nodes' blocks in node order, then the own node's.
        send_counts, recv_counts: per node, the tokens this rank sends to it, and the tokens it
            forwards from it (in node order).
        num_forwarded: the tokens this rank forwards (the intranode stage's input rows).
        intranode: the intranode engine's handle (None with one rank per node).
        num_recv_tokens: the rows this rank received (None with ``num_worst_tokens`` on a node
            of several ranks: the intranode handle's ``recv_count`` has it on the device).
        num_worst_tokens: the dispatch's ``num_worst_tokens`` (0: none).
        rows: the rows of the dispatch's outputs (the rows combine takes).
        num_topk, hidden: the dispatch's top-k and x's extents after the first.
    """

    def __init__(self, owner: int, num_tokens: int, send_token_idx, send_counts: Sequence[int],
                 recv_counts: Sequence[int], intranode, num_recv_tokens: Optional[int], num_worst_tokens: int,
                 num_topk: int):
        self.owner = owner
        self.num_tokens = num_tokens
        self.send_token_idx = send_token_idx
        self.send_counts = tuple(int(c) for c in send_counts)
        self.recv_counts = tuple(int(c) for c in recv_counts)
        self.num_forwarded = sum(self.recv_counts)
        self.intranode = intranode
        self.num_recv_tokens = num_recv_tokens
        self.num_worst_tokens = num_worst_tokens
        self.num_topk = num_topk

    @property
    def rows(self) -> int:
        if self.num_worst_tokens:
            return self.num_worst_tokens
        return self.num_recv_tokens if self.intranode is None else self.intranode.rows


# ---------------------------------------------------------------------------------------------
# Argument checks (host only: they run before any GPU work, and the CPU tests run them)

def _split_x(x) -> Tuple[Any, Any]:
    if type(x) is tuple and len(x) == 2:
        return x
    return x, None


def check_rows(x, device_id: int, dtypes: Tuple[str, ...]) -> Tuple[Any, Any, tensors.ArrayInfo,
                                                                       Optional[tensors.ArrayInfo]]:
    """``(rows, scales or None, rows' info, scales' info)`` of ``x`` or ``(x_fp8, scales)``; raises
    TypeError/ValueError naming the argument."""
    rows, scales = _split_x(x)
    info = describe(rows, "x", device_id)
    check_array(info, "x", dtypes, 2)
    row_bytes = tensors.row_bytes(info.shape[1:], info.dtype_name)
    if row_bytes % 16:
        raise ValueError(f"x: rows of {row_bytes} bytes; expected a multiple of 16 bytes")
    scales_info = None
    if info.dtype_name == "float8_e4m3fn":
        if scales is None:
            raise ValueError("x: FP8 rows need their scales: pass x=(x_fp8, x_scales)")
        scales_info = describe(scales, "x[1]", device_id)
        check_array(scales_info, "x[1]", ("float32",), len(scales_info.shape), any_strides=True)
        if len(scales_info.shape) not in (1, 2) or scales_info.shape[0] != info.shape[0]:
            raise ValueError(f"x[1]: expected scales of shape ({info.shape[0]}, S) or ({info.shape[0]},), got "
                             f"{scales_info.shape}")
    elif scales is not None:
        raise ValueError(f"x: scales come only with FP8 rows, got {info.dtype_name} rows and scales")
    return rows, scales, info, scales_info


def check_topk(topk_idx, topk_weights, num_tokens: int, device_id: int):
    """``(topk info, weights info or None)``; top-k is required here (it routes the tokens)."""
    if topk_idx is None:
        raise ValueError("topk_idx: an internode dispatch routes tokens by their top-k experts; pass topk_idx")
    topk = describe(topk_idx, "topk_idx", device_id)
    check_array(topk, "topk_idx", ("int64",), 2, (num_tokens, None))
    weights = None
    if topk_weights is not None:
        weights = describe(topk_weights, "topk_weights", device_id)
        check_array(weights, "topk_weights", ("float32",), 2, topk.shape)
    return topk, weights


# ---------------------------------------------------------------------------------------------
# Device helpers (CuPy)

def _cupy():
    import cupy

    return cupy


def device_view(array, info: tensors.ArrayInfo, device_id: int):
    """A CuPy array over ``array``'s memory (storage dtype, shape and strides of ``info``)."""
    cupy = _cupy()
    dtype = STORAGE[info.dtype_name]
    if any(extent == 0 for extent in info.shape):
        return cupy.empty(info.shape, dtype)
    if info.lib.name == "cupy":
        return array.view(dtype)
    ptr = tensors.read(array)[1]
    extent = ITEMSIZE[info.dtype_name] + sum((n - 1) * s for n, s in zip(info.shape, info.strides))
    memory = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, extent, array, device_id), 0)
    return cupy.ndarray(info.shape, dtype, memory, strides=info.strides)


def device_pointer(values) -> int:
    """The device address of a CuPy array."""
    return values.data.ptr


def to_float32(values, dtype_name: str):
    """float32 of ``values`` stored as ``dtype_name`` (BF16: uint16 bits)."""
    cupy = _cupy()
    if dtype_name == "bfloat16":
        return (values.astype(cupy.uint32) << 16).view(cupy.float32)
    return values.astype(cupy.float32)


def round_float32(values, dtype_name: str):
    """``values`` (float32) rounded to ``dtype_name``'s storage: round to nearest even, NaN to the
    canonical 0x7FFF for BF16 (as reference.float32_to_bfloat16_bits and the combine kernels)."""
    cupy = _cupy()
    if dtype_name == "bfloat16":
        u = cupy.ascontiguousarray(values).view(cupy.uint32)
        bits = ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16)
        return cupy.where(cupy.isnan(values), cupy.uint16(0x7FFF), bits)
    if dtype_name == "float16":
        return values.astype(cupy.float16)
    return values


class InternodePath:
    """Layout, dispatch and combine across nodes (see the module docstring).

    Args:
        topology: this rank's :class:`deepep_cupy.nodes.NodeTopology` (more than one node).
        transport: the rail's :class:`deepep_cupy.transports.RailTransport` (one rank per node,
            ``transport.rank`` = this rank's node).
        device_id: the GPU.
        intranode: the engine of the node's sub-group: an object with the intranode Buffer's
            ``get_dispatch_layout``, ``dispatch``, ``combine`` and ``destroy`` (the Buffer passes
            an intranode Buffer), or None with one rank per node.
        order: the stream order of the internode calls (a :class:`deepep_cupy.streams.StreamOrder`).
        on_destroy: callables run by :meth:`destroy` after the engine and the transport are
            closed (the sub-groups' ``free``).
        group_barrier: the whole group's host barrier (:meth:`barrier`).
    """

    def __init__(self, topology, transport, device_id: int, intranode, order, *,
                 on_destroy: Sequence[Callable[[], Any]] = (), group_barrier: Optional[Callable[[], Any]] = None):
        if topology.num_nodes < 2:
            raise ValueError(f"topology: the internode path needs at least 2 nodes, got {topology.num_nodes}")
        if (intranode is None) != (topology.ranks_per_node == 1):
            raise ValueError("intranode: expected an engine exactly when a node has more than one rank "
                             f"(ranks_per_node={topology.ranks_per_node})")
        if transport.size != topology.num_nodes or transport.rank != topology.node:
            raise ValueError(f"transport: expected rank {topology.node} of {topology.num_nodes} (the rail's), got "
                             f"rank {transport.rank} of {transport.size}")
        self.topology = topology
        self.transport = transport
        self.device_id = device_id
        self.intranode = intranode
        self.order = order
        self._on_destroy = list(on_destroy)
        self._group_barrier = group_barrier
        self._streams = {}
        self._closed = False
        #: Rows that left this rank for other nodes in the last dispatch (the benchmark reads it).
        self.last_internode_rows = 0
        N, me = topology.num_nodes, topology.node
        #: Node order of the send buffer: the other nodes ascending, then the own node.
        self.packed_nodes = [n for n in range(N) if n != me] + [me]

    # -----------------------------------------------------------------------------------------
    # Streams

    def _cupy_stream(self, ptr: int):
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = _cupy().cuda.ExternalStream(ptr, self.device_id)
        return stream

    @contextlib.contextmanager
    def _on(self, lib, run_on: int):
        """CuPy's current stream (and the caller's library's) is ``run_on`` inside: the CuPy work
        and the intranode engine's calls are ordered there."""
        cupy = _cupy()
        stream = self._cupy_stream(run_on)
        with cupy.cuda.Device(self.device_id), stream:
            if lib.name == "cupy":
                yield
            else:
                with lib.allocating_on(stream, self.device_id):
                    yield

    @contextlib.contextmanager
    def _call(self, lib, previous_event, async_finish, allocate_on_comm_stream) -> Iterator[Tuple[int, int]]:
        """The span of one call: ordered after the caller's work (``order.begin``), its GPU work on
        ``run_on`` (:meth:`_on`); yields ``(caller's stream, run_on)``. Leaving by an exception (bad
        ids, a transport's timeout, an intranode refusal) tells the stream order that work may be
        queued on ``run_on`` already (``order.abandon``), so that the next call and destroy() come
        after it."""
        caller = lib.current_stream(self.device_id)
        run_on = self.order.begin(caller, previous_event, async_finish or allocate_on_comm_stream,
                                  self.topology.rank)
        with self._on(lib, run_on):
            try:
                yield caller, run_on
            except BaseException:
                self.order.abandon(run_on)
                raise

    def _finish(self, lib, caller: int, run_on: int, async_finish: bool, arrays, outputs) -> EventOverlap:
        return self.order.finish(caller, run_on, lib, async_finish, [a for a in arrays if a is not None],
                                 [o for o in outputs if o is not None], run_on != caller)

    def _new_output(self, lib, shape: Tuple[int, ...], dtype_name: str):
        """``(array, view)``: a new C-contiguous array of the caller's library and a CuPy view of it."""
        out = lib.empty(shape, dtype_name, self.device_id)
        if lib.name == "cupy":
            return out, out
        info = tensors.ArrayInfo(lib, dtype_name, None, tuple(shape), True, _c_strides(shape, dtype_name))
        return out, device_view(out, info, self.device_id)

    def _to_lib(self, lib, values, dtype_name: str):
        """``values`` (CuPy, storage dtype) as an array of the caller's library (a copy for PyTorch)."""
        if lib.name == "cupy":
            return values
        out, view = self._new_output(lib, values.shape, dtype_name)
        if values.size:
            view[...] = values
        return out

    # -----------------------------------------------------------------------------------------
    # Layout

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode layout: ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank
        int32 [N], num_tokens_per_expert int32 [E], is_token_in_rank bool [num_tokens, R], event)``;
        the per-node counts are the tokens with at least one expert on each node."""
        R, N = self.topology.num_ranks, self.topology.num_nodes
        num_experts = check_int(num_experts, "num_experts")
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of the rank count ({R}), got {num_experts}")
        info = describe(topk_idx, "topk_idx", self.device_id)
        check_array(info, "topk_idx", ("int64",), 2)
        lib = info.lib
        cupy = _cupy()
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            topk = device_view(topk_idx, info, self.device_id)
            T = topk.shape[0]
            per_expert = _counts(topk, num_experts)
            valid = (topk >= 0) & (topk < num_experts)
            rank_of = cupy.where(valid, topk // (num_experts // R), -1)
            in_rank = (rank_of[:, :, None] == cupy.arange(R)[None, None, :]).any(axis=1)
            per_rank = in_rank.sum(axis=0).astype(cupy.int32)
            per_node = in_rank.reshape(T, N, R // N).any(axis=2).sum(axis=0).astype(cupy.int32)
            outputs = (self._to_lib(lib, per_rank, "int32"), self._to_lib(lib, per_node, "int32"),
                       self._to_lib(lib, per_expert, "int32"), self._to_lib(lib, in_rank, "bool"))
            event = self._finish(lib, caller, run_on, async_finish, (topk_idx, *outputs), outputs)
        return (*outputs, event)

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, x, handle: Optional[InternodeHandle] = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *, expand: bool = False,
                 recv_x_in_buffer: bool = False):
        """Internode dispatch (DeepEP's arguments; see ``Buffer.dispatch``).

        ``num_tokens_per_expert`` (int32 [E], from :meth:`get_dispatch_layout`) gives the expert
        count and ``topk_idx`` the routing; ``num_tokens_per_rank``, ``num_tokens_per_rdma_rank``
        and ``is_token_in_rank`` are accepted (DeepEP passes them) and not read. ``config`` is
        the intranode stage's (pass the same to combine). ``expand`` and ``recv_x_in_buffer``
        are intranode only.
        """
        if expand:
            raise ValueError("expand: not available across nodes; expand the received rows yourself")
        if recv_x_in_buffer:
            raise ValueError("recv_x_in_buffer: not available across nodes (the rows arrive through the rail "
                             "transport and the node's intranode dispatch)")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected deepep_cupy.Config, got {type(config).__name__}")
        rows, scales, info, scales_info = check_rows(x, self.device_id, DISPATCH_DTYPES)
        if handle is not None:
            if num_worst_tokens:
                raise ValueError("num_worst_tokens: a cached dispatch receives the handle's row count; pass 0")
            handle = self._check_handle(handle)
            if info.shape[0] != handle.num_tokens:
                raise ValueError(f"x: expected {handle.num_tokens} rows (the tokens of the handle's dispatch), got "
                                 f"{info.shape[0]}")
            return self._cached_dispatch(rows, scales, info, scales_info, handle, config, previous_event,
                                         async_finish, allocate_on_comm_stream)
        num_tokens = info.shape[0]
        topk, weights = check_topk(topk_idx, topk_weights, num_tokens, self.device_id)
        if num_tokens_per_expert is None:
            raise ValueError("num_tokens_per_expert: required (its length is the expert count); pass the one "
                             "get_dispatch_layout returned")
        per_expert = describe(num_tokens_per_expert, "num_tokens_per_expert", self.device_id)
        check_array(per_expert, "num_tokens_per_expert", ("int32",), 1)
        num_experts = per_expert.shape[0]
        R = self.topology.num_ranks
        if num_experts == 0 or num_experts % R:
            raise ValueError(f"num_tokens_per_expert: expected a multiple of the rank count ({R}) of experts, got "
                             f"{num_experts}")
        if num_tokens_per_rdma_rank is not None:
            rdma = describe(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", self.device_id)
            check_array(rdma, "num_tokens_per_rdma_rank", ("int32",), 1, (self.topology.num_nodes,))
        expert_alignment = check_int(expert_alignment, "expert_alignment")
        num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens", 0)
        return self._fresh_dispatch(rows, scales, info, scales_info, topk_idx, topk, topk_weights, weights,
                                    num_experts, expert_alignment, num_worst_tokens, config, previous_event,
                                    async_finish, allocate_on_comm_stream)

    def _check_handle(self, handle) -> InternodeHandle:
        if not isinstance(handle, InternodeHandle):
            raise TypeError(f"handle: expected the handle returned by Buffer.dispatch, got {type(handle).__name__}")
        if handle.owner != id(self):
            raise ValueError("handle: it was made by another Buffer; a handle is only valid on the Buffer "
                             "whose dispatch returned it")
        return handle

    def _exchange(self, send_buffer, record_bytes: int, send_counts: Sequence[int], recv_counts: Sequence[int],
                  run_on: int):
        """Send the other nodes' blocks of ``send_buffer`` (packed order, the own block last and not
        sent); return the received blocks (node order, the own node's missing)."""
        cupy = _cupy()
        me = self.topology.node
        send_bytes = [0 if n == me else int(c) * record_bytes for n, c in enumerate(send_counts)]
        recv_bytes = [0 if n == me else int(c) * record_bytes for n, c in enumerate(recv_counts)]
        received = cupy.empty((sum(c for n, c in enumerate(recv_counts) if n != me), record_bytes), cupy.uint8)
        self.transport.alltoallv(device_pointer(send_buffer), send_bytes, device_pointer(received), recv_bytes, run_on,
                                 owners=(send_buffer, received))
        return received

    def _in_node_order(self, received, own_block, recv_counts: Sequence[int]) -> Tuple[Any, Any, Any]:
        """The forwarded records in node order, as three blocks: the received ones from the nodes
        before this one, its own, those after (:meth:`RecordLayout.part` reads them in order)."""
        before = sum(recv_counts[:self.topology.node])
        return received[:before], own_block, received[before:]

    def _fresh_dispatch(self, rows, scales, info, scales_info, topk_idx, topk_info, topk_weights, weights_info,
                        num_experts, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                        allocate_on_comm_stream):
        lib, dev = info.lib, self.device_id
        N = self.topology.num_nodes
        experts_per_node = num_experts // N
        T, K = topk_info.shape
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            x_rows, x_scales = self._read_x(rows, scales, info, scales_info)
            topk = device_view(topk_idx, topk_info, dev)
            weights = None if weights_info is None else device_view(topk_weights, weights_info, dev)
            send_counts, token_ids, bad = self._route(topk, num_experts)
            # A rank with expert ids out of range tells its rail peers (-1 counts), so that they raise too.
            recv_counts = self.transport.alltoall_ints([-1] * N if bad else send_counts)
            if bad or any(c < 0 for c in recv_counts):
                self._refuse_on_the_node(lib, info, scales_info, weights_info, K, experts_per_node, expert_alignment,
                                         num_worst_tokens, config)
                raise ValueError(f"topk_idx: expert ids out of [-1, {num_experts}) on "
                                 f"{'this rank' if bad else 'a rank of this rail'}; no tokens were moved")
            layout = RecordLayout(x_rows.shape[1], 0 if x_scales is None else 4 * x_scales.shape[1], K,
                                  0 if weights is None else K)
            forwarded = self._forward(layout.pack(token_ids, x_rows, x_scales, topk, weights), layout, send_counts,
                                      recv_counts, run_on)
            inputs = self._node_inputs(forwarded, sum(recv_counts), layout, info, scales_info, experts_per_node)
            outputs, expert_list, inner, num_recv = self._deliver(lib, inputs, info, experts_per_node,
                                                                  expert_alignment, num_worst_tokens, config)
            handle = InternodeHandle(id(self), T, token_ids, send_counts, recv_counts, inner, num_recv,
                                     num_worst_tokens, K)
            event = self._finish(lib, caller, run_on, async_finish,
                                 (rows, scales, topk_idx, topk_weights, *outputs), outputs)
        recv_x, recv_scales, recv_topk, recv_weights = outputs
        recv = recv_x if recv_scales is None else (recv_x, recv_scales)
        return recv, recv_topk, recv_weights, expert_list, handle, event

    def _read_x(self, rows, scales, info, scales_info):
        """x as uint8 rows ``[T, row bytes]`` and its scales as ``[T, S]`` (None without), CuPy views."""
        dev = self.device_id
        x_rows = _byte_rows(device_view(rows, info, dev))
        x_scales = None if scales_info is None else _scale_rows(device_view(scales, scales_info, dev), scales_info)
        return x_rows, x_scales

    def _route(self, topk, num_experts: int):
        """``(send_counts per node, the tokens of each node in packed order, whether an id is out of
        range)``: the counts and the verdict reach the host in one copy."""
        cupy = _cupy()
        N, me = self.topology.num_nodes, self.topology.node
        T, K = topk.shape
        node_of = cupy.where(topk >= 0, topk // (num_experts // N), -1)
        in_node = (node_of[None, :, :] == cupy.arange(N)[:, None, None]).any(axis=2)  # [N, T]
        bad = ((topk < -1) | (topk >= num_experts)).any() if T and K else cupy.zeros((), cupy.bool_)
        bad = cupy.asarray(bad).reshape(1).astype(cupy.int64)
        host = cupy.asnumpy(cupy.concatenate([in_node.sum(axis=1), bad]))
        send_counts = [int(c) for c in host[:N]]
        # The set entries' flat indices in packed order (as flatnonzero, without its host sync: the
        # host knows their number): each goes to its rank among them, the others to a spare slot.
        total = sum(send_counts)
        flat = cupy.concatenate([in_node[:me], in_node[me + 1:], in_node[me:me + 1]]).ravel()
        slots = cupy.where(flat, cupy.cumsum(flat, dtype=cupy.int64) - 1, total)
        picked = cupy.empty(total + 1, cupy.int64)
        picked[slots] = cupy.arange(flat.size, dtype=cupy.int64)
        token_ids = picked[:total] % max(T, 1)
        return send_counts, token_ids, bool(host[N])

    def _forward(self, packed, layout: RecordLayout, send_counts: Sequence[int], recv_counts: Sequence[int],
                 run_on: int):
        """Send ``packed`` (records in packed order) over the rail; the forwarded records in node order
        (:meth:`_in_node_order`'s blocks)."""
        remote = packed.shape[0] - send_counts[self.topology.node]
        received = self._exchange(packed, layout.bytes, send_counts, recv_counts, run_on)
        self.last_internode_rows = remote
        return self._in_node_order(received, packed[remote:], recv_counts)

    def _node_inputs(self, forwarded, M: int, layout: RecordLayout, info, scales_info,
                     experts_per_node: int) -> _Forwarded:
        """The ``M`` forwarded records unpacked, top-k made node-local (-1 and weight 0 where the id
        is not)."""
        cupy = _cupy()
        K = layout.num_topk
        topk = layout.part(forwarded, layout.topk_off, 8 * K, cupy.int64, (M, K))
        first = self.topology.node * experts_per_node
        local = (topk >= first) & (topk < first + experts_per_node)
        weights = None
        if layout.num_weights:
            weights = layout.part(forwarded, layout.weights_off, 4 * K, cupy.float32, (M, K))
            weights = cupy.where(local, weights, cupy.float32(0))
        rows = layout.part(forwarded, 0, layout.row_bytes, STORAGE[info.dtype_name], (M, *info.shape[1:]))
        scales = None if scales_info is None else \
            layout.part(forwarded, layout.scales_off, layout.scale_bytes, cupy.float32, (M, *scales_info.shape[1:]))
        return _Forwarded(rows, scales, cupy.where(local, topk - first, -1), weights)

    def _deliver(self, lib, inputs: _Forwarded, info, experts_per_node: int, expert_alignment: int,
                 num_worst_tokens: int, config):
        """The forwarded tokens to the ranks of this node owning their experts: ``(outputs [recv_x,
        recv_scales, recv_topk, recv_weights], expert counts, intranode handle, received rows)``."""
        M = inputs.rows.shape[0]
        if self.intranode is None and num_worst_tokens:  # one rank per node, outputs of fixed size
            outputs = self._pad_rows(lib, num_worst_tokens, M, (inputs.rows, info.dtype_name),
                                     (inputs.scales, "float32"), (inputs.topk, "int64"), (inputs.weights, "float32"))
            return outputs, [], None, M
        x_in = self._to_lib(lib, inputs.rows, info.dtype_name)
        scales_in = None if inputs.scales is None else self._to_lib(lib, inputs.scales, "float32")
        topk_in = self._to_lib(lib, inputs.topk, "int64")
        weights_in = None if inputs.weights is None else self._to_lib(lib, inputs.weights, "float32")
        if self.intranode is None:  # one rank per node: the forwarded tokens are the outputs
            counts = _cupy().asnumpy(_counts(inputs.topk, experts_per_node))
            expert_list = [int(-(-int(c) // expert_alignment) * expert_alignment) for c in counts]
            return [x_in, scales_in, topk_in, weights_in], expert_list, None, M
        engine = self.intranode
        per_rank, _, per_expert, in_rank, _ = engine.get_dispatch_layout(topk_in, experts_per_node)
        recv_x, recv_topk, recv_weights, expert_list, inner, _ = engine.dispatch(
            x_in if scales_in is None else (x_in, scales_in), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_in, topk_weights=weights_in,
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, config=config)
        recv_x, recv_scales = recv_x if scales_in is not None else (recv_x, None)
        return [recv_x, recv_scales, recv_topk, recv_weights], expert_list, inner, \
            None if num_worst_tokens else inner.num_recv_tokens

    def _refuse_on_the_node(self, lib, info, scales_info, weights_info, num_topk: int, experts_per_node: int,
                            expert_alignment: int, num_worst_tokens: int, config) -> None:
        """Make the other ranks of this node raise too (they are on other rails: nothing told them):
        an intranode dispatch of one token with an expert id out of range, with this call's kinds
        of arguments, which the intranode count exchange refuses on every rank of the node
        (``ValueError``; with ``num_worst_tokens`` at their next call, as intranode)."""
        if self.intranode is None:
            return  # one rank per node: every rank is on this rail and raises
        cupy = _cupy()
        topk = cupy.full((1, num_topk), -1, cupy.int64)
        topk[0, 0] = experts_per_node
        rows = self._to_lib(lib, cupy.zeros((1, *info.shape[1:]), STORAGE[info.dtype_name]), info.dtype_name)
        x = rows if scales_info is None else \
            (rows, self._to_lib(lib, cupy.ones((1, *scales_info.shape[1:]), cupy.float32), "float32"))
        weights = None if weights_info is None else self._to_lib(lib, cupy.zeros((1, num_topk), cupy.float32),
                                                                 "float32")
        topk = self._to_lib(lib, topk, "int64")
        per_rank, _, per_expert, in_rank, _ = self.intranode.get_dispatch_layout(topk, experts_per_node)
        try:
            self.intranode.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights,
                                    expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                    config=config)
        except ValueError:
            pass  # the refusal this rank raises anyway, with its own message

    def _pad_rows(self, lib, rows: int, received: int, *arrays):
        """Outputs of ``rows`` rows (one rank per node, ``num_worst_tokens``): the ``received``
        rows first; top-k ids -1 after them (the other outputs unwritten there)."""
        if received > rows:
            raise ValueError(f"num_worst_tokens: this rank received {received} tokens, more than num_worst_tokens "
                             f"({rows})")
        out = []
        for values, dtype_name in arrays:
            if values is None:
                out.append(None)
                continue
            padded, view = self._new_output(lib, (rows, *values.shape[1:]), dtype_name)
            view[:received] = values
            if dtype_name == "int64":
                view[received:] = -1
            out.append(padded)
        return out

    def _cached_dispatch(self, rows, scales, info, scales_info, handle: InternodeHandle, config, previous_event,
                         async_finish, allocate_on_comm_stream):
        cupy = _cupy()
        lib = info.lib
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            x_rows, x_scales = self._read_x(rows, scales, info, scales_info)
            layout = RecordLayout(x_rows.shape[1], 0 if x_scales is None else 4 * x_scales.shape[1])
            forwarded = self._forward(layout.pack(handle.send_token_idx, x_rows, x_scales), layout, handle.send_counts,
                                      handle.recv_counts, run_on)
            M = handle.num_forwarded
            fw_rows = layout.part(forwarded, 0, layout.row_bytes, STORAGE[info.dtype_name], (M, *info.shape[1:]))
            fw_scales = None if scales_info is None else layout.part(
                forwarded, layout.scales_off, layout.scale_bytes, cupy.float32, (M, *scales_info.shape[1:]))
            if self.intranode is not None:
                x_in = self._to_lib(lib, fw_rows, info.dtype_name)
                scales_in = None if fw_scales is None else self._to_lib(lib, fw_scales, "float32")
                recv_x = self.intranode.dispatch(x_in if scales_in is None else (x_in, scales_in),
                                                 handle=handle.intranode, config=config)[0]
                recv_x, recv_scales = recv_x if scales_in is not None else (recv_x, None)
            elif handle.num_worst_tokens:
                recv_x, recv_scales = self._pad_rows(lib, handle.num_worst_tokens, M, (fw_rows, info.dtype_name),
                                                     (fw_scales, "float32"))
            else:
                recv_x = self._to_lib(lib, fw_rows, info.dtype_name)
                recv_scales = None if fw_scales is None else self._to_lib(lib, fw_scales, "float32")
            outputs = (recv_x, recv_scales)
            event = self._finish(lib, caller, run_on, async_finish, (rows, scales, *outputs), outputs)
        recv = recv_x if recv_scales is None else (recv_x, recv_scales)
        return recv, None, None, None, handle, event

    # -----------------------------------------------------------------------------------------
    # Combine

    def combine(self, x, handle: InternodeHandle, topk_weights=None, bias=None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Internode combine: ``(combined_x [num_tokens, hidden] like x, combined_topk_weights
        float32 or None, event)``. ``combined_x[t]`` is the float32 sum of the biases, then of
        each node's partial sum of the token's copies (the intranode combine's, rounded to x's
        dtype), in node order, rounded to x's dtype."""
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected deepep_cupy.Config, got {type(config).__name__}")
        handle = self._check_handle(handle)
        info = describe(x, "x", self.device_id)
        check_array(info, "x", COMBINE_DTYPES, 2)
        if info.shape[0] != handle.rows:
            received = "its num_worst_tokens" if handle.num_worst_tokens else "the tokens its dispatch received"
            raise ValueError(f"x: expected {handle.rows} rows ({received}), got {info.shape[0]}")
        if tensors.row_bytes(info.shape[1:], info.dtype_name) % 16:
            raise ValueError("x: rows must be a multiple of 16 bytes")
        w_info = None
        if topk_weights is not None:
            w_info = describe(topk_weights, "topk_weights", self.device_id)
            check_array(w_info, "topk_weights", ("float32",), 2, (handle.rows, None))
        biases = bias if isinstance(bias, (tuple, list)) else (bias,)
        if len(biases) > 2:
            raise ValueError(f"bias: expected an array or a pair of arrays, got a sequence of {len(biases)}")
        bias_infos = []
        for i, b in enumerate(biases):
            if b is None:
                continue
            b_info = describe(b, f"bias[{i}]", self.device_id)
            check_array(b_info, f"bias[{i}]", (info.dtype_name,), 2, (handle.num_tokens, info.shape[1]))
            bias_infos.append((b, b_info))
        return self._combine(x, info, topk_weights, w_info, bias_infos, handle, config, previous_event,
                             async_finish, allocate_on_comm_stream)

    def _combine(self, x, info, topk_weights, w_info, bias_infos, handle, config, previous_event, async_finish,
                 allocate_on_comm_stream):
        cupy = _cupy()
        lib, dev, dtype = info.lib, self.device_id, info.dtype_name
        topo = self.topology
        N, me = topo.num_nodes, topo.node
        T, H = handle.num_tokens, info.shape[1]
        M = handle.num_forwarded
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            if self.intranode is not None:
                partial, partial_w, _ = self.intranode.combine(x, handle.intranode, topk_weights=topk_weights,
                                                               config=config)
                partial = device_view(partial, describe(partial, "x", dev), dev)
                if partial_w is not None:
                    partial_w = device_view(partial_w, describe(partial_w, "topk_weights", dev), dev)
            else:
                partial = device_view(x, info, dev)[:M]
                partial_w = None if w_info is None else device_view(topk_weights, w_info, dev)[:M]
            K = 0 if partial_w is None else partial_w.shape[1]
            layout = RecordLayout(tensors.row_bytes((H,), dtype), num_weights=K)
            records = layout.pack(None, _byte_rows(partial), weights=partial_w)
            # Rows in node order; the other nodes' blocks go back over the rail, the own one stays.
            before, own = sum(handle.recv_counts[:me]), handle.recv_counts[me]
            send = cupy.concatenate([records[:before], records[before + own:]])
            received = self._exchange(send, layout.bytes, handle.recv_counts, handle.send_counts, run_on)
            own_block = records[before:before + own]

            combined = cupy.zeros((T, H), cupy.float32)
            for b, b_info in bias_infos:
                combined += to_float32(device_view(b, b_info, dev), dtype)
            combined_w = None if partial_w is None else cupy.zeros((T, K), cupy.float32)
            offsets, offset = {}, 0
            for n in self.packed_nodes:
                offsets[n] = offset
                offset += handle.send_counts[n]
            for n in range(N):  # node order: the summation order is the contract
                begin, count = offsets[n], handle.send_counts[n]
                if not count:
                    continue
                tokens = handle.send_token_idx[begin:begin + count]
                # Packed order, as send_token_idx: the received blocks, then the own one.
                block = own_block if n == me else received[begin:begin + count]
                rows = layout.part(block, 0, layout.row_bytes, STORAGE[dtype], (count, H))
                combined[tokens] = combined[tokens] + to_float32(rows, dtype)
                if combined_w is not None:
                    weights = layout.part(block, layout.weights_off, 4 * K, cupy.float32, (count, K))
                    combined_w[tokens] = combined_w[tokens] + weights
            out = self._to_lib(lib, round_float32(combined, dtype), dtype)
            out_w = None if combined_w is None else self._to_lib(lib, combined_w, "float32")
            outputs = (out, out_w)
            event = self._finish(lib, caller, run_on, async_finish,
                                 (x, topk_weights, *[b for b, _ in bias_infos], *outputs), outputs)
        return out, out_w, event

    # -----------------------------------------------------------------------------------------

    def check_kernel_errors(self) -> None:
        """Raise what the intranode engine's kernels reported, if anything (the rail transfers
        raise at once)."""
        if self.intranode is not None:
            self.intranode.check_kernel_errors()

    def barrier(self) -> None:
        """Wait for this path's calls, then for every rank of the group (host barrier)."""
        self.order.synchronize()
        if self._group_barrier is not None:
            self._group_barrier()

    def destroy(self) -> None:
        """Destroy the intranode engine, close the transport, free the sub-groups (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.order.synchronize()
        except Exception:
            pass
        try:
            if self.intranode is not None:
                self.intranode.destroy()
        finally:
            try:
                self.transport.close()
            finally:
                for release in self._on_destroy:
                    try:
                        release()
                    except Exception:
                        pass


def _counts(ids, length: int):
    """int32 occurrences of each id in ``[0, length)`` among ``ids`` (any shape; other values, -1
    included, are not counted). No host sync: ``cupy.bincount`` and a boolean mask both read a size
    back to the host, a scatter-add into one spare bin for the ids not counted does not."""
    cupy = _cupy()
    bins = cupy.zeros(length + 1, cupy.int32)
    if ids.size:
        cupy.add.at(bins, cupy.where((ids >= 0) & (ids < length), ids, length).ravel(), 1)
    return bins[:length]


def _byte_rows(values):
    """The ``[T, H]`` ``values`` as uint8 rows ``[T, row bytes]`` (a copy unless C-contiguous)."""
    return _cupy().ascontiguousarray(values).view(_cupy().uint8)


def _scale_rows(values, info: tensors.ArrayInfo):
    """FP8 scales ``[T, S]`` or ``[T]`` (any strides) as ``[T, S]``."""
    return values if len(info.shape) == 2 else values.reshape(info.shape[0], 1)


def _c_strides(shape: Tuple[int, ...], dtype_name: str) -> Tuple[int, ...]:
    strides, step = [], ITEMSIZE[dtype_name]
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def create_internode_path(group, topology, *, device_id: int, timeout_s: float, transport_kind: Optional[str],
                          make_intranode: Callable[[Any], Any], shares_gpu: bool = False) -> InternodePath:
    """Build an :class:`InternodePath` for ``group`` (collective): the node sub-group
    (``group.split``), the rail transport (``transports.make_transport`` of the rail's ranks), the node's intranode
    engine (``make_intranode(node_group)``, only with more than one rank per node) and a stream order.

    Args:
        group: the Buffer's :class:`deepep_cupy.comm.Group`.
        topology: this rank's :class:`deepep_cupy.nodes.NodeTopology`.
        transport_kind: ``"nccl"``, ``"mpi"``, ``"local"`` or None (automatic).
        make_intranode: makes the intranode engine of a node sub-group (the Buffer passes a
            function making an intranode Buffer).
        shares_gpu: other in-process ranks run on this GPU (the stream order waits for each call).
    """
    from .streams import StreamOrder
    from .transports import make_transport

    node_group = group.split(topology.node_partition())
    releases: List[Callable[[], Any]] = [node_group.free]
    transport = engine = None
    try:
        transport = make_transport(transport_kind, group, topology.rail_ranks(), device_id, timeout_s)
        engine = make_intranode(node_group) if topology.ranks_per_node > 1 else None
        order = StreamOrder.create(device_id, shares_gpu)
        return InternodePath(topology, transport, device_id, engine, order, on_destroy=releases,
                             group_barrier=group.barrier)
    except BaseException:
        if engine is not None:
            engine.destroy()
        if transport is not None:
            transport.close()
        for release in releases:
            release()
        raise
