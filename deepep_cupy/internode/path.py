"""The internode (hierarchical) path: dispatch and combine of a Buffer whose group spans nodes.

A token crosses the network at most once per destination node, to the rank with its own local
index there (its *forwarding rank*, on its rail), and an intranode dispatch on that node (this
library's NVLink kernels, through the node's intranode engine) delivers it to the ranks that
``is_token_in_rank`` names. Combine goes back the same way: the node's intranode combine sums
each token's copies inside the node (float32, rounded to x's dtype), one row per token per node
crosses back, and the token's owner sums the nodes' rows in node order (float32, its biases
first) and rounds again. :mod:`deepep_cupy.reference.internode` is the model of every result, bit
for bit; received rows are in DeepEP's order (by source rank, then source token).

One call, on the host (the rail transport's host API needs the byte counts, so the host learns
them before it posts the transfers):

1. Every rank reads its arguments and, for a fresh dispatch, routes its tokens (per node, per
   rank and per expert counts, one copy to the host); then the whole group votes
   (:meth:`InternodePath._vote`): every rank's counts, or its failure, reach every rank, so that a
   bad argument on one rank makes every rank raise from the same call, before anything moves.
2. Every rank allocates what the call needs and votes again (ready), then the records (row, FP8
   scales, top-k ids, weights, ``is_token_in_rank`` row) are packed per destination node on the GPU
   (kernels/internode.cu), sent over the rail (``alltoallv``, in node order), and unpacked into the
   outputs (one rank per node) or into the node stage's inputs, whose outputs are then put in
   DeepEP's order. A last vote makes a failure anywhere in between (a node stage's refusal, a
   transport's timeout) raise on every rank.
3. Combine: the node's intranode combine, the partial rows sent back over the rail, and the
   owner's sum of the nodes' rows (kernels/internode.cu).

The array work runs on the call's stream, on views of the caller's arrays; outputs are allocated
by the caller's library. This module never imports the Buffer: its collaborators (the node
topology, the rail transport, the intranode engine, the group's vote) are given to it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .. import tensors
from ..config import Config
from ..errors import PeerFailedError, RankMismatchError
from ..events import EventOverlap
from ..tensors import ITEMSIZE, STORAGE, check_array, check_int, describe
from .handle import InternodeHandle
from .records import PackSources, RecordLayout, UnpackTargets

__all__ = ["InternodeHandle", "InternodePath", "RecordLayout", "create_internode_path"]

#: Element types of x that combine sums (FP8 is dispatched only).
COMBINE_DTYPES = ("bfloat16", "float16", "float32")
DISPATCH_DTYPES = COMBINE_DTYPES + ("float8_e4m3fn",)


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
    """``(topk info or None, weights info or None)``: the top-k travels with the tokens when given."""
    if topk_idx is None:
        if topk_weights is not None:
            raise ValueError("topk_weights: they travel with topk_idx; pass both or neither")
        return None, None
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


def deepep_order(counts: np.ndarray, num_nodes: int, ranks_per_node: int) -> Optional[np.ndarray]:
    """For each row of a receiver in DeepEP's order (by source rank ``g = m*L + j``, then source
    token), its row in the node stage's order (by forwarding local rank ``j``, then source node
    ``m``, then source token); ``counts[g]``: the rows from source rank ``g``. None when the two
    orders are the same."""
    c = np.asarray(counts, np.int64).reshape(num_nodes, ranks_per_node)   # [m, j]
    stage_start = (np.cumsum(c.T.ravel()) - c.T.ravel()).reshape(ranks_per_node, num_nodes).T
    deepep_start = (np.cumsum(c.ravel()) - c.ravel()).reshape(num_nodes, ranks_per_node)
    shift = (stage_start - deepep_start).ravel()
    if not shift.any():
        return None
    return np.repeat(shift, c.ravel()) + np.arange(int(c.sum()), dtype=np.int64)


class _Route(NamedTuple):
    """A fresh dispatch's routing: this rank's counts (host) and where its tokens go (device)."""
    per_node: List[int]
    per_rank: List[int]
    per_expert: List[int]
    in_rank: Any        # bool [T, R] (CuPy)
    token_ids: Any      # int64: the tokens of each node, node after node
    slots: Any          # int32 [N, T]: token t's record in node n's block, -1 for none


class InternodePath:
    """Layout, dispatch and combine across nodes (see the module docstring).

    Args:
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology` (more than one node).
        transport: the rail's :class:`deepep_cupy.transports.rail.RailTransport` (one rank per node,
            ``transport.rank`` = this rank's node).
        device_id: the GPU.
        intranode: the engine of the node's sub-group: an object with the intranode Buffer's
            ``dispatch``, ``combine`` and ``destroy`` (the Buffer passes an intranode Buffer), or
            None with one rank per node.
        order: the stream order of the internode calls (a :class:`deepep_cupy.gpu.streams.StreamOrder`).
        records: the record kernels (:class:`deepep_cupy.internode.records.RecordKernels`).
        vote: the whole group's allgather of one Python object per rank, with a deadline
            (``Group.allgather_within`` with the Buffer's timeout).
        on_destroy: callables run by :meth:`destroy` after the engine and the transport are
            closed (the sub-groups' ``free``).
        group_barrier: the whole group's host barrier (:meth:`barrier`).
    """

    def __init__(self, topology, transport, device_id: int, intranode, order, *, records, vote: Callable[[Any], list],
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
        self.records = records
        self._vote_all = vote
        self._on_destroy = list(on_destroy)
        self._group_barrier = group_barrier
        self._streams: dict = {}
        self._closed = False
        #: Rows that left this rank for other nodes in the last dispatch (the benchmark reads it).
        self.last_internode_rows = 0

    # -----------------------------------------------------------------------------------------
    # Streams, the vote, outputs

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
        ``run_on`` (:meth:`_on`); yields ``(caller's stream, run_on)``. Leaving by an exception
        tells the stream order that work may be queued on ``run_on`` already (``order.abandon``),
        so that the next call and destroy() come after it."""
        caller = lib.current_stream(self.device_id)
        run_on = self.order.begin(caller, previous_event, async_finish or allocate_on_comm_stream,
                                  self.topology.rank)
        with self._on(lib, run_on):
            try:
                yield caller, run_on
            except BaseException:
                self.order.abandon(run_on)
                raise

    def _vote(self, what: str, failure: Optional[BaseException], payload: Any = None) -> List[Any]:
        """Every rank's ``payload``, once every rank has said whether its part of the call so far
        went well: when one failed, every rank raises from this call (the failing rank its own
        exception, the others :class:`deepep_cupy.PeerFailedError` naming it and what it raised)."""
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        table = self._vote_all((mine, None if failure is not None else payload))
        failed = [r for r, (error, _) in enumerate(table) if error is not None]
        if failure is not None:
            raise failure
        if failed:
            r = failed[0]
            raise PeerFailedError(f"rank {self.topology.rank}: the internode {what} failed on rank {r} "
                                  f"({table[r][0]}); every rank raises from this call", peer=r)
        return [p for _, p in table]

    def _voting(self, what: str, step: Callable[[], Any]) -> Any:
        """``step()``'s result once every rank's step went well (:meth:`_vote`)."""
        try:
            result = step()
        except Exception as exc:  # told to every rank; re-raised by _vote
            self._vote(what, exc)
            raise  # pragma: no cover - _vote re-raises exc
        self._vote(what, None)
        return result

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

    def _host_ints(self, lib, values: Sequence[int]):
        """Host ints as an int32 array of the caller's library."""
        return self._to_lib(lib, _cupy().asarray(np.asarray(values, np.int32)), "int32")

    # -----------------------------------------------------------------------------------------
    # Layout

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode layout: ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank
        int32 [N], num_tokens_per_expert int32 [E], is_token_in_rank bool [num_tokens, R], event)``;
        the per-node counts are the tokens with at least one expert on each node. Local: no rank
        waits for another."""
        R, N = self.topology.num_ranks, self.topology.num_nodes
        num_experts = check_int(num_experts, "num_experts")
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of the rank count ({R}), got {num_experts}")
        info = describe(topk_idx, "topk_idx", self.device_id)
        check_array(info, "topk_idx", ("int64",), 2)
        lib = info.lib
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            topk = device_view(topk_idx, info, self.device_id)
            in_rank = self._in_rank_of(topk, num_experts)
            per_expert = _counts(topk, num_experts)
            per_rank = in_rank.sum(axis=0).astype(_cupy().int32)
            per_node = in_rank.reshape(topk.shape[0], N, R // N).any(axis=2).sum(axis=0).astype(_cupy().int32)
            outputs = (self._to_lib(lib, per_rank, "int32"), self._to_lib(lib, per_node, "int32"),
                       self._to_lib(lib, per_expert, "int32"), self._to_lib(lib, in_rank, "bool"))
            event = self._finish(lib, caller, run_on, async_finish, (topk_idx, *outputs), outputs)
        return (*outputs, event)

    def _in_rank_of(self, topk, num_experts: int):
        """bool ``[T, R]``: whether each token has an expert on each rank (ids out of range: none)."""
        cupy = _cupy()
        R = self.topology.num_ranks
        valid = (topk >= 0) & (topk < num_experts)
        rank_of = cupy.where(valid, topk // (num_experts // R), -1)
        return (rank_of[:, :, None] == cupy.arange(R)[None, None, :]).any(axis=1)

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, x, handle: Optional[InternodeHandle] = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *, expand: bool = False,
                 recv_x_in_buffer: bool = False):
        """Internode dispatch (DeepEP's arguments; see ``Buffer.dispatch``).

        A fresh dispatch is routed by ``is_token_in_rank`` (bool ``[num_tokens, R]``) or, without
        it, by the experts of ``topk_idx``; ``num_tokens_per_expert`` (int32 ``[E]``, from
        :meth:`get_dispatch_layout`) gives the expert count and the receivers' expert counts (the
        sums of the senders'); the top-k ids and weights, optional, travel with the tokens.
        ``num_tokens_per_rank`` and ``num_tokens_per_rdma_rank`` are accepted (DeepEP passes them)
        and not read. ``config`` is the intranode stage's (pass the same to combine). ``expand``
        and ``recv_x_in_buffer`` are intranode only. An argument that is wrong on one rank makes
        every rank raise from the call, before anything moves.
        """
        lib = _call_lib(_split_x(x)[0], topk_idx, is_token_in_rank)
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            if handle is not None:
                checked = self._voting("dispatch", lambda: self._check_cached(x, handle, num_worst_tokens, expand,
                                                                              recv_x_in_buffer, config))
                return self._cached_dispatch(*checked, config, caller, run_on, async_finish)
            return self._fresh_dispatch(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                        expert_alignment, num_worst_tokens, config, expand, recv_x_in_buffer,
                                        caller, run_on, async_finish)

    def _check_common(self, expand: bool, recv_x_in_buffer: bool, config) -> None:
        if expand:
            raise ValueError("expand: not available across nodes; expand the received rows yourself")
        if recv_x_in_buffer:
            raise ValueError("recv_x_in_buffer: not available across nodes (the rows arrive through the rail "
                             "transport and the node's intranode dispatch)")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected deepep_cupy.Config, got {type(config).__name__}")

    def _check_handle(self, handle) -> InternodeHandle:
        if not isinstance(handle, InternodeHandle):
            raise TypeError(f"handle: expected the handle returned by Buffer.dispatch, got {type(handle).__name__}")
        if handle.owner != id(self):
            raise ValueError("handle: it was made by another Buffer; a handle is only valid on the Buffer "
                             "whose dispatch returned it")
        return handle

    def _check_cached(self, x, handle, num_worst_tokens, expand, recv_x_in_buffer, config):
        self._check_common(expand, recv_x_in_buffer, config)
        rows, scales, info, scales_info = check_rows(x, self.device_id, DISPATCH_DTYPES)
        if num_worst_tokens:
            raise ValueError("num_worst_tokens: a cached dispatch receives the handle's row count; pass 0")
        handle = self._check_handle(handle)
        if info.shape[0] != handle.num_tokens:
            raise ValueError(f"x: expected {handle.num_tokens} rows (the tokens of the handle's dispatch), got "
                             f"{info.shape[0]}")
        x_rows, x_scales = self._read_x(rows, scales, info, scales_info)
        layout = RecordLayout(x_rows.shape[1], 0 if x_scales is None else 4 * x_scales.shape[1])
        send, recv = self._rail_buffers(layout, handle.send_counts, handle.recv_counts)
        return rows, scales, info, scales_info, handle, x_rows, x_scales, layout, send, recv

    def _check_fresh(self, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                     num_worst_tokens, expand, recv_x_in_buffer, config) -> "_FreshArgs":
        self._check_common(expand, recv_x_in_buffer, config)
        rows, scales, info, scales_info = check_rows(x, self.device_id, DISPATCH_DTYPES)
        T, dev, R = info.shape[0], self.device_id, self.topology.num_ranks
        topk_info, weights_info = check_topk(topk_idx, topk_weights, T, dev)
        in_rank = None
        if is_token_in_rank is not None:
            in_rank_info = describe(is_token_in_rank, "is_token_in_rank", dev)
            check_array(in_rank_info, "is_token_in_rank", ("bool",), 2, (T, R), any_strides=True)
            in_rank = device_view(is_token_in_rank, in_rank_info, dev)
        elif topk_info is None:
            raise ValueError("is_token_in_rank: a dispatch without topk_idx is routed by is_token_in_rank; pass the "
                             "one get_dispatch_layout returned")
        per_expert = None
        if num_tokens_per_expert is not None:
            per_expert_info = describe(num_tokens_per_expert, "num_tokens_per_expert", dev)
            check_array(per_expert_info, "num_tokens_per_expert", ("int32",), 1)
            num_experts = per_expert_info.shape[0]
            per_expert = device_view(num_tokens_per_expert, per_expert_info, dev)
        else:
            raise ValueError("num_tokens_per_expert: required (its length is the expert count, and the receivers' "
                             "expert counts are the senders' sums); pass the one get_dispatch_layout returned")
        if num_experts == 0 or num_experts % R:
            raise ValueError(f"num_tokens_per_expert: expected a multiple of the rank count ({R}) of experts, got "
                             f"{num_experts}")
        expert_alignment = check_int(expert_alignment, "expert_alignment")
        num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens", 0)
        x_rows, x_scales = self._read_x(rows, scales, info, scales_info)
        topk = None if topk_info is None else device_view(topk_idx, topk_info, dev)
        weights = None if weights_info is None else device_view(topk_weights, weights_info, dev)
        num_topk = 0 if topk_info is None else topk_info.shape[1]
        settings = (num_experts, info.dtype_name, info.shape[1:],
                    None if scales_info is None else scales_info.shape[1:], num_topk, weights_info is not None,
                    num_worst_tokens, expert_alignment)
        return _FreshArgs(info, scales_info, x_rows, x_scales, topk, weights, in_rank, per_expert,
                          num_experts, expert_alignment, num_worst_tokens, settings)

    def _read_x(self, rows, scales, info, scales_info):
        """x as uint8 rows ``[T, row bytes]`` and its scales as ``[T, S]`` (None without), CuPy views."""
        dev = self.device_id
        x_rows = _byte_rows(device_view(rows, info, dev))
        x_scales = None if scales_info is None else _scale_rows(device_view(scales, scales_info, dev), scales_info)
        return x_rows, x_scales

    def _route(self, args: "_FreshArgs") -> _Route:
        """Where this rank's tokens go: its counts per node, rank and expert reach the host in one
        copy (with whether an expert id is out of range); the tokens of each node and their slots
        stay on the device."""
        cupy = _cupy()
        R, N = self.topology.num_ranks, self.topology.num_nodes
        T, E = args.x_rows.shape[0], args.num_experts
        in_rank = args.in_rank if args.in_rank is not None else self._in_rank_of(args.topk, E)
        in_node = in_rank.reshape(T, N, R // N).any(axis=2)
        per_expert = args.per_expert if args.per_expert is not None else _counts(args.topk, E)
        bad = cupy.zeros(1, cupy.int64)
        if args.topk is not None and args.topk.size:
            bad = ((args.topk < -1) | (args.topk >= E)).any().reshape(1).astype(cupy.int64)
        host = cupy.asnumpy(cupy.concatenate([in_node.sum(axis=0).astype(cupy.int64),
                                              in_rank.sum(axis=0).astype(cupy.int64),
                                              per_expert.astype(cupy.int64), bad]))
        if host[-1]:
            raise ValueError(f"topk_idx: expert ids out of [-1, {E}) on rank {self.topology.rank}; no tokens were "
                             "moved")
        # The set entries of [node, token] in node-major order: each goes to its rank among them
        # (flatnonzero's order, without its host sync: the host knows their number).
        flat = in_node.T.ravel()
        positions = cupy.cumsum(flat, dtype=cupy.int64) - 1
        per_node = [int(c) for c in host[:N]]
        total = sum(per_node)
        picked = cupy.empty(total + 1, cupy.int64)
        picked[cupy.where(flat, positions, total)] = cupy.arange(flat.size, dtype=cupy.int64)
        slots = cupy.where(flat, positions, -1).astype(cupy.int32).reshape(N, T)
        return _Route(per_node, [int(c) for c in host[N:N + R]], [int(c) for c in host[N + R:-1]], in_rank,
                      picked[:total] % max(T, 1), slots)

    def _fresh_dispatch(self, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                        num_worst_tokens, config, expand, recv_x_in_buffer, caller, run_on, async_finish):
        topo = self.topology
        R, N, L, me = topo.num_ranks, topo.num_nodes, topo.ranks_per_node, topo.rank
        failure = args = route = None
        try:
            args = self._check_fresh(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                     expert_alignment, num_worst_tokens, expand, recv_x_in_buffer, config)
            route = self._route(args)
        except Exception as exc:  # every rank raises from this call (_vote)
            failure = exc
        table = self._vote("dispatch", failure, None if route is None else
                           (args.settings, route.per_node, route.per_rank, route.per_expert))
        if any(t[0] != table[0][0] for t in table):
            raise RankMismatchError(f"rank {me}: the ranks' dispatch arguments disagree (num_experts, x's dtype and "
                                    "shape, scales, top-k, weights, num_worst_tokens, expert_alignment by rank: "
                                    f"{[t[0] for t in table]})")
        per_node = np.array([t[1] for t in table], np.int64)     # [source rank, node]
        per_rank = np.array([t[2] for t in table], np.int64)     # [source rank, receiver]
        per_expert = np.array([t[3] for t in table], np.int64)   # [source rank, expert]
        info, lib, worst = args.info, args.info.lib, args.num_worst_tokens
        received = per_rank.sum(axis=0)
        if worst and received.max() > worst:
            r = int(received.argmax())
            raise ValueError(f"num_worst_tokens: rank {r} would receive {int(received[r])} tokens, more than "
                             f"num_worst_tokens ({worst}); no tokens were moved")
        rail = [m * L + topo.local_rank for m in range(N)]
        send_counts, recv_counts = per_node[me].tolist(), per_node[rail, topo.node].tolist()
        E = args.num_experts
        K = 0 if args.topk is None else args.topk.shape[1]
        layout = RecordLayout(args.x_rows.shape[1], 0 if args.x_scales is None else 4 * args.x_scales.shape[1], K,
                              0 if args.weights is None else K, R if L > 1 else 0)
        send, recv = self._voting("dispatch", lambda: self._rail_buffers(layout, send_counts, recv_counts))
        num_recv = int(received[me])

        def move():
            sources = PackSources(args.x_rows, args.x_scales, args.topk, args.weights, route.in_rank if L > 1 else None)
            self.records.pack(run_on, send, layout, route.token_ids, send.shape[0], sources)
            self._exchange(send, recv, layout.bytes, send_counts, recv_counts, run_on)
            if L == 1:
                return self._unpack_outputs(run_on, lib, recv, layout, info, args.scales_info, num_recv, worst,
                                            me * (E // R), E // R), None, None
            engine_counts = (per_rank[rail][:, topo.node * L:(topo.node + 1) * L].sum(axis=0),
                             per_expert[rail][:, topo.node * (E // N):(topo.node + 1) * (E // N)].sum(axis=0))
            return self._through_node(run_on, lib, recv, layout, info, args.scales_info, engine_counts, E,
                                      args.expert_alignment, worst, config, per_rank[:, me])

        outputs, inner, order = self._voting("dispatch", move)
        self.last_internode_rows = sum(send_counts) - send_counts[topo.node]
        epr = E // R
        expert_list = [] if worst else [int(-(-int(c) // args.expert_alignment) * args.expert_alignment)
                                        for c in per_expert[:, me * epr:(me + 1) * epr].sum(axis=0)]
        in_rank_out = is_token_in_rank if is_token_in_rank is not None else self._to_lib(lib, route.in_rank, "bool")
        fields = (in_rank_out, None, None, None, self._host_ints(lib, np.cumsum(recv_counts)), None,
                  self._host_ints(lib, np.cumsum(per_rank[:, me])), None, None, None)
        handle = InternodeHandle(fields, owner=id(self), num_tokens=info.shape[0], send_token_idx=route.token_ids,
                                 send_counts=tuple(send_counts), recv_counts=tuple(recv_counts), slots=route.slots,
                                 intranode=inner, num_recv_tokens=num_recv, order=order,
                                 inverse=None if order is None else _inverse(order), num_worst_tokens=worst,
                                 num_topk=K)
        recv_x, recv_scales, recv_topk, recv_weights = outputs
        event = self._finish(lib, caller, run_on, async_finish, (x, topk_idx, topk_weights, *outputs), outputs)
        return (recv_x if recv_scales is None else (recv_x, recv_scales)), recv_topk, recv_weights, expert_list, \
            handle, event

    def _rail_buffers(self, layout: RecordLayout, send_counts: Sequence[int], recv_counts: Sequence[int]):
        cupy = _cupy()
        return (cupy.empty((sum(send_counts), layout.bytes), cupy.uint8),
                cupy.empty((sum(recv_counts), layout.bytes), cupy.uint8))

    def _exchange(self, send, recv, record_bytes: int, send_counts: Sequence[int], recv_counts: Sequence[int],
                  run_on: int) -> None:
        """The rail's all-to-all of records, in node order (the own node's block a copy on the GPU)."""
        self.transport.alltoallv(device_pointer(send), [int(c) * record_bytes for c in send_counts],
                                 device_pointer(recv), [int(c) * record_bytes for c in recv_counts], run_on,
                                 owners=(send, recv))

    def _outputs(self, lib, rows: int, info, scales_info, num_topk: int, weights: bool, in_rank: int = 0):
        """``(arrays, views)`` of a dispatch's outputs of ``rows`` rows: rows, scales, top-k, weights
        (and, for the node stage's inputs, is_token_in_rank ``[rows, in_rank]``)."""
        made = [self._new_output(lib, (rows, *info.shape[1:]), info.dtype_name),
                None if scales_info is None else self._new_output(lib, (rows, *scales_info.shape[1:]), "float32"),
                None if not num_topk else self._new_output(lib, (rows, num_topk), "int64"),
                None if not weights else self._new_output(lib, (rows, num_topk), "float32"),
                None if not in_rank else self._new_output(lib, (rows, in_rank), "bool")]
        arrays = [None if m is None else m[0] for m in made]
        views = [None if m is None else m[1] for m in made]
        views[0] = views[0].view(_cupy().uint8).reshape(rows, tensors.row_bytes(info.shape[1:], info.dtype_name))
        if views[1] is not None:
            views[1] = views[1].reshape(rows, (scales_info.shape + (1,))[1])
        return arrays, UnpackTargets(*views)

    def _unpack_outputs(self, run_on: int, lib, recv, layout: RecordLayout, info, scales_info, num_recv: int,
                        worst: int, first_expert: int, num_local_experts: int):
        """The received records as the dispatch's outputs (one rank per node; ``worst`` rows if set)."""
        arrays, targets = self._outputs(lib, worst or num_recv, info, scales_info, layout.num_topk,
                                        layout.num_weights > 0)
        self.records.unpack(run_on, True, recv, layout, num_recv, worst or num_recv, targets, first_expert,
                            num_local_experts)
        return arrays[:4]

    def _through_node(self, run_on: int, lib, recv, layout: RecordLayout, info, scales_info, engine_counts,
                      num_experts: int, expert_alignment: int, worst: int, config, from_sources):
        """The forwarded records through the node's intranode dispatch; its outputs in DeepEP's order.
        Returns ``(outputs, the node stage's handle, the order or None)``."""
        topo = self.topology
        L, N = topo.ranks_per_node, topo.num_nodes
        forwarded = recv.shape[0]
        arrays, targets = self._outputs(lib, forwarded, info, scales_info, layout.num_topk, layout.num_weights > 0, L)
        per_node_experts = num_experts // N
        self.records.unpack(run_on, False, recv, layout, forwarded, forwarded, targets,
                            topo.node * per_node_experts, per_node_experts, topo.node * L)
        x_in, scales_in, topk_in, weights_in, in_rank_in = arrays
        per_rank, per_expert = engine_counts
        recv_x, recv_topk, recv_weights, _, inner, _ = self.intranode.dispatch(
            x_in if scales_in is None else (x_in, scales_in), num_tokens_per_rank=self._host_ints(lib, per_rank),
            is_token_in_rank=in_rank_in, num_tokens_per_expert=self._host_ints(lib, per_expert), topk_idx=topk_in,
            topk_weights=weights_in, expert_alignment=expert_alignment, num_worst_tokens=worst, config=config)
        recv_x, recv_scales = recv_x if scales_in is not None else (recv_x, None)
        order = deepep_order(from_sources, N, L)
        outputs = [recv_x, recv_scales, recv_topk, recv_weights]
        if order is None:
            return outputs, inner, None
        order = _cupy().asarray(order)
        return [self._reordered(lib, a, order) for a in outputs], inner, order

    def _reordered(self, lib, array, order):
        """``array``'s first ``len(order)`` rows taken in ``order``, the rest (padding) as they are."""
        if array is None:
            return None
        info = describe(array, "output", self.device_id)
        source = device_view(array, info, self.device_id)
        out, view = self._new_output(lib, info.shape, info.dtype_name)
        n = order.shape[0]
        _cupy().take(source, order, axis=0, out=view[:n])
        if info.shape[0] > n:
            view[n:] = source[n:]
        return out

    def _cached_dispatch(self, rows, scales, info, scales_info, handle: InternodeHandle, x_rows, x_scales,
                         layout: RecordLayout, send, recv, config, caller, run_on, async_finish):
        lib = info.lib

        def move():
            self.records.pack(run_on, send, layout, handle.send_token_idx, send.shape[0], PackSources(x_rows, x_scales))
            self._exchange(send, recv, layout.bytes, handle.send_counts, handle.recv_counts, run_on)
            if self.intranode is None:
                return self._unpack_outputs(run_on, lib, recv, layout, info, scales_info, handle.num_recv_tokens,
                                            handle.num_worst_tokens, 0, 0)[:2]
            forwarded = recv.shape[0]
            arrays, targets = self._outputs(lib, forwarded, info, scales_info, 0, False)
            self.records.unpack(run_on, False, recv, layout, forwarded, forwarded, targets)
            x_in, scales_in = arrays[:2]
            recv_x = self.intranode.dispatch(x_in if scales_in is None else (x_in, scales_in), handle=handle.intranode,
                                             config=config)[0]
            recv_x, recv_scales = recv_x if scales_in is not None else (recv_x, None)
            if handle.order is None:
                return [recv_x, recv_scales]
            return [self._reordered(lib, a, handle.order) for a in (recv_x, recv_scales)]

        recv_x, recv_scales = self._voting("dispatch", move)
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
        dtype), in node order, rounded to x's dtype. An argument that is wrong on one rank makes
        every rank raise from the call, before anything moves."""
        lib = _call_lib(x, topk_weights)
        with self._call(lib, previous_event, async_finish, allocate_on_comm_stream) as (caller, run_on):
            checked = self._voting("combine", lambda: self._check_and_allocate_combine(x, handle, topk_weights, bias,
                                                                                        config))
            return self._combine(x, topk_weights, *checked, config, caller, run_on, async_finish)

    def _check_and_allocate_combine(self, x, handle, topk_weights, bias, config):
        """The combine's checks, then what it allocates (the rail buffers, the outputs): one vote for both."""
        handle, info, w_info, bias_views = self._check_combine(x, handle, topk_weights, bias, config)
        lib, dtype = info.lib, info.dtype_name
        T, H = handle.num_tokens, info.shape[1]
        K = 0 if w_info is None else w_info.shape[1]
        layout = RecordLayout(tensors.row_bytes((H,), dtype), num_weights=K)
        send, recv = self._rail_buffers(layout, handle.recv_counts, handle.send_counts)
        out = self._new_output(lib, (T, H), dtype)
        out_w = None if not K else self._new_output(lib, (T, K), "float32")
        return handle, info, w_info, bias_views, layout, send, recv, out, out_w

    def _check_combine(self, x, handle, topk_weights, bias, config):
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
        views = []
        for i, b in enumerate(biases):
            if b is None:
                continue
            b_info = describe(b, f"bias[{i}]", self.device_id)
            check_array(b_info, f"bias[{i}]", (info.dtype_name,), 2, (handle.num_tokens, info.shape[1]))
            views.append(device_view(b, b_info, self.device_id))
        return handle, info, w_info, views

    def _combine(self, x, weights, handle: InternodeHandle, info, w_info, bias_views, layout: RecordLayout, send,
                 recv, out_made, out_w, config, caller, run_on, async_finish):
        lib, dtype = info.lib, info.dtype_name
        out, out_view = out_made

        def move():
            partial, partial_w = self._node_partials(lib, x, info, weights, w_info, handle, config)
            rows = _byte_rows(partial)
            self.records.pack(run_on, send, layout, None, send.shape[0], PackSources(rows, weights=partial_w))
            self._exchange(send, recv, layout.bytes, handle.recv_counts, handle.send_counts, run_on)
            biases = (bias_views + [None, None])[:2]
            self.records.sum_nodes(run_on, self.intranode is None, dtype, out_view,
                                   None if out_w is None else out_w[1], recv, layout, handle.slots, biases)

        self._voting("combine", move)
        outputs = (out, None if out_w is None else out_w[0])
        event = self._finish(lib, caller, run_on, async_finish, (x, weights, *outputs), outputs)
        return outputs[0], outputs[1], event

    def _node_partials(self, lib, x, info, weights, w_info, handle: InternodeHandle, config):
        """Each forwarded token's row to send back (CuPy views): the node's combine of x (put in
        the node stage's order first), or x itself with one rank per node."""
        dev = self.device_id
        forwarded = handle.num_forwarded
        if self.intranode is None:
            partial = device_view(x, info, dev)[:forwarded]
            partial_w = None if w_info is None else device_view(weights, w_info, dev)[:forwarded]
            return partial, partial_w
        if handle.inverse is not None:
            x = self._reordered(lib, x, handle.inverse)
            weights = None if weights is None else self._reordered(lib, weights, handle.inverse)
        partial, partial_w, _ = self.intranode.combine(x, handle.intranode, topk_weights=weights, config=config)
        partial = device_view(partial, describe(partial, "x", dev), dev)
        if partial_w is not None:
            partial_w = device_view(partial_w, describe(partial_w, "topk_weights", dev), dev)
        return partial, partial_w

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
                self._streams.clear()


class _FreshArgs(NamedTuple):
    """A fresh dispatch's checked arguments (CuPy views of the caller's arrays)."""
    info: tensors.ArrayInfo
    scales_info: Optional[tensors.ArrayInfo]
    x_rows: Any
    x_scales: Any
    topk: Any
    weights: Any
    in_rank: Any         # a view of the caller's is_token_in_rank, or None
    per_expert: Any
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int
    settings: tuple      # what every rank must pass alike


def _counts(ids, length: int):
    """int32 occurrences of each id in ``[0, length)`` among ``ids`` (any shape; other values, -1
    included, are not counted). No host sync: ``cupy.bincount`` and a boolean mask both read a size
    back to the host, a scatter-add into one spare bin for the ids not counted does not."""
    cupy = _cupy()
    bins = cupy.zeros(length + 1, cupy.int32)
    if ids.size:
        cupy.add.at(bins, cupy.where((ids >= 0) & (ids < length), ids, length).ravel(), 1)
    return bins[:length]


def _call_lib(*arrays) -> tensors.ArrayLib:
    """The array library of a call: its first argument's that has one (an argument of no library
    is refused by the checks, on every rank, in the call's vote), else CuPy's."""
    for array in arrays:
        lib = None if array is None else tensors.lib_of(array)
        if lib is not None:
            return lib
    return tensors.library("cupy")


def _inverse(order):
    """The permutation that undoes ``order`` (a CuPy int64 permutation)."""
    cupy = _cupy()
    inverse = cupy.empty_like(order)
    inverse[order] = cupy.arange(order.shape[0], dtype=order.dtype)
    return inverse


def create_internode_path(group, topology, *, device_id: int, timeout_s: float, transport_kind: Optional[str],
                          make_intranode: Callable[[Any], Any], shares_gpu: bool = False) -> InternodePath:
    """Build an :class:`InternodePath` for ``group`` (collective): the node sub-group
    (``group.split``), the rail transport (``transports.make_transport`` of the rail's ranks), the node's intranode
    engine (``make_intranode(node_group)``, only with more than one rank per node), the record
    kernels and a stream order.

    Args:
        group: the Buffer's :class:`deepep_cupy.groups.group.Group`.
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology`.
        transport_kind: ``"nccl"``, ``"mpi"``, ``"torch"``, ``"local"`` or None (automatic).
        make_intranode: makes the intranode engine of a node sub-group (the Buffer passes a
            function making an intranode Buffer).
        shares_gpu: other in-process ranks run on this GPU (the stream order waits for each call).
    """
    from ..gpu.streams import StreamOrder
    from ..transports.rail import make_transport
    from .records import RecordKernels

    node_group = group.split(topology.node_partition())
    releases: List[Callable[[], Any]] = [node_group.free]
    transport = engine = None
    try:
        transport = make_transport(transport_kind, group, topology.rail_ranks(), device_id, timeout_s)
        engine = make_intranode(node_group) if topology.ranks_per_node > 1 else None
        order = StreamOrder.create(device_id, shares_gpu)
        return InternodePath(topology, transport, device_id, engine, order, records=RecordKernels(),
                             vote=lambda obj: group.allgather_within(obj, timeout_s), on_destroy=releases,
                             group_barrier=group.barrier)
    except BaseException:
        if engine is not None:
            engine.destroy()
        if transport is not None:
            transport.close()
        for release in releases:
            release()
        raise
