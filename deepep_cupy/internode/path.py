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
   (:class:`deepep_cupy.internode.vote.CallVote`): every rank's counts, or its failure, reach every rank, so that a
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

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .. import checks, tensors
from ..config import Config
from ..engine import Engine
from ..errors import RankMismatchError
from ..events import EventOverlap
from ..gpu.call_span import CallSpan
from ..tensors import check_array, check_int, describe
from . import arguments
from . import arrays as device
from .blocks import BlockCalls
from .handle import InternodeHandle
from .records import PackSources, RecordLayout
from .vote import CallVote

__all__ = ["InternodeHandle", "InternodePath", "RecordLayout"]

class _Route(NamedTuple):
    """A fresh dispatch's routing: this rank's counts (host) and where its tokens go (device)."""
    per_node: List[int]
    per_rank: List[int]
    per_expert: List[int]
    in_rank: Any        # bool [T, R] (CuPy)
    token_ids: Any      # int64: the tokens of each node, node after node
    slots: Any          # int32 [N, T]: token t's record in node n's block, -1 for none


class InternodePath(Engine):
    """Layout, dispatch and combine across nodes (see the module docstring).

    Args:
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology` (more than one node).
        transport: the rail's :class:`deepep_cupy.transports.RailTransport` (one rank per node,
            ``transport.rank`` = this rank's node).
        device_id: the GPU.
        intranode: the engine of the node's sub-group (an
            :class:`deepep_cupy.intranode.engine.IntranodeEngine`: ``dispatch``, ``combine``,
            ``check_kernel_errors``, ``release`` and ``destroy``), or None with one rank per node.
        order: the stream order of the internode calls (a :class:`deepep_cupy.gpu.streams.StreamOrder`).
        records: the record kernels (:class:`deepep_cupy.internode.records.RecordKernels`).
        vote: the whole group's allgather of one Python object per rank, with a deadline
            (``Group.allgather_within`` with the Buffer's timeout).
        on_destroy: callables run by :meth:`destroy` after the engine and the transport are
            closed (the sub-groups' ``free``).
        group_barrier: the whole group's host barrier (:meth:`barrier`).
        block_kernels: the kernels of the layout and of the calls in fixed-size blocks
            (:class:`deepep_cupy.internode.block_kernels.BlockKernels`).
    """

    kind = "internode"

    def __init__(self, topology, transport, device_id: int, intranode, order, *, records, vote: Callable[[Any], list],
                 block_kernels, on_destroy: Sequence[Callable[[], Any]] = (),
                 group_barrier: Optional[Callable[[], Any]] = None):
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
        # The calls with num_worst_tokens go in fixed-size blocks, with no host wait, where the
        # transport queues device work alone (BlockCalls); elsewhere the host learns the counts.
        self.block_kernels = block_kernels
        self.blocks = None if not transport.capturable else \
            BlockCalls(topology, transport, device_id, intranode, records=records, kernels=block_kernels)
        self._votes = CallVote(vote, topology.rank)
        self._on_destroy = list(on_destroy)
        self._group_barrier = group_barrier
        self._span = CallSpan(order, device_id, topology.rank)
        self._closed = False
        self._rows_sent_out = 0

    # -----------------------------------------------------------------------------------------
    # Streams and outputs

    def _finish(self, lib, caller: int, run_on: int, async_finish: bool, arrays, outputs) -> EventOverlap:
        return self._span.finish(lib, async_finish, [a for a in arrays if a is not None],
                                 [o for o in outputs if o is not None], run_on != caller)

    def _new_output(self, lib, shape: Tuple[int, ...], dtype_name: str):
        """``(array, view)``: a new C-contiguous array of the caller's library and a CuPy view of it."""
        return device.new_output(lib, shape, dtype_name, self.device_id)

    def _to_lib(self, lib, values, dtype_name: str):
        """``values`` (CuPy, storage dtype) as an array of the caller's library (a copy for PyTorch)."""
        return device.to_lib(lib, values, dtype_name, self.device_id)

    def _host_ints(self, lib, values: Sequence[int]):
        """Host ints as an int32 array of the caller's library."""
        return self._to_lib(lib, device.cupy_module().asarray(np.asarray(values, np.int32)), "int32")

    # -----------------------------------------------------------------------------------------
    # Layout

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP's internode layout: ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank
        int32 [N], num_tokens_per_expert int32 [E], is_token_in_rank bool [num_tokens, R], event)``;
        the per-node counts are the tokens with at least one expert on each node. Local: no rank
        waits for another."""
        R = self.topology.num_ranks
        num_experts = check_int(num_experts, "num_experts")
        if num_experts % R:
            raise ValueError(f"num_experts: expected a multiple of the rank count ({R}), got {num_experts}")
        info = describe(topk_idx, "topk_idx", self.device_id)
        check_array(info, "topk_idx", ("int64",), 2)
        lib = info.lib
        with self._span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as span, \
                span.current(lib):
            caller, run_on = span
            topk = device.device_view(topk_idx, info, self.device_id)
            outputs = self._layout_on_device(lib, run_on, topk, num_experts)
            event = self._finish(lib, caller, run_on, async_finish, (topk_idx, *outputs), outputs)
        return (*outputs, event)

    def _layout_on_device(self, lib, stream: int, topk, num_experts: int):
        """The layout's four arrays, made by one kernel into arrays of the caller's library (no CuPy
        temporaries, so that a CUDA graph can hold it)."""
        R, N, T = self.topology.num_ranks, self.topology.num_nodes, topk.shape[0]
        made = [self._new_output(lib, shape, dtype) for shape, dtype in
                (((R,), "int32"), ((N,), "int32"), ((num_experts,), "int32"), ((T, R), "bool"))]
        per_rank, per_node, per_expert, in_rank = (view for _, view in made)
        self.block_kernels.route(stream, topk, None, T, num_experts, R, self.topology.ranks_per_node, 0,
                                 in_rank_out=in_rank, per_rank=per_rank, per_node=per_node, per_expert=per_expert)
        return tuple(array for array, _ in made)

    def _in_rank_of(self, topk, num_experts: int):
        """bool ``[T, R]``: whether each token has an expert on each rank (ids out of range: none)."""
        cupy = device.cupy_module()
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
        lib = device.call_lib(checks.split_x(x)[0], topk_idx, is_token_in_rank)
        with self._span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as span, \
                span.current(lib):
            caller, run_on = span
            if handle is not None:
                checked = self._votes.voting("dispatch", lambda: self._check_cached(
                    x, handle, num_worst_tokens, expand, recv_x_in_buffer, config))
                return self._cached_dispatch(*checked, config, caller, run_on, async_finish)
            return self._fresh_dispatch(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                        expert_alignment, num_worst_tokens, config, expand, recv_x_in_buffer,
                                        caller, run_on, async_finish)

    def _check_cached(self, x, handle, num_worst_tokens, expand, recv_x_in_buffer,
                      config) -> arguments.CachedDispatchArgs:
        """A cached dispatch's checks, then what it allocates (the rail buffers): one vote for both."""
        self._raise_recorded_failures()
        info, scales_info, handle, x_rows, x_scales = arguments.check_cached(
            x, handle, num_worst_tokens, expand, recv_x_in_buffer, config, device_id=self.device_id, owner=id(self))
        self._refuse_capture("dispatch", in_blocks=bool(handle.block_tokens))
        layout = RecordLayout(x_rows.shape[1], 0 if x_scales is None else 4 * x_scales.shape[1])
        send = recv = None
        if not handle.block_tokens:
            send, recv = self._rail_buffers(info.lib, layout, handle.send_counts, handle.recv_counts)
        rows, scales = checks.split_x(x)
        return arguments.CachedDispatchArgs(rows, scales, info, scales_info, handle, x_rows, x_scales, layout, send,
                                            recv)

    def _route(self, args: arguments.FreshArgs) -> _Route:
        """Where this rank's tokens go: its counts per node, rank and expert reach the host in one
        copy (with whether an expert id is out of range); the tokens of each node and their slots
        stay on the device."""
        cupy = device.cupy_module()
        R, N = self.topology.num_ranks, self.topology.num_nodes
        T, E = args.x_rows.shape[0], args.num_experts
        in_rank = args.in_rank if args.in_rank is not None else self._in_rank_of(args.topk, E)
        in_node = in_rank.reshape(T, N, R // N).any(axis=2)
        per_expert = args.per_expert if args.per_expert is not None else device.counts(args.topk, E)
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

    def _raise_recorded_failures(self) -> None:
        """Raise, once, what the node's intranode kernels recorded (a refused dispatch that the host
        did not wait for, say) or what a dispatch in blocks left: more rows for this rank than
        ``num_worst_tokens`` (one rank per node). Called inside a call's first vote, so that every
        rank raises; reads host-mapped memory only, as a graph capture allows."""
        if self.intranode is not None:
            self.intranode.check_kernel_errors()
        found = None if self.blocks is None else self.block_kernels.take_overflow()
        if found is not None:
            wanted, rows = found
            raise ValueError(f"num_worst_tokens: rank {self.topology.rank} was sent {wanted} tokens by a dispatch "
                             f"with num_worst_tokens={rows}, which never waits for the host: its outputs hold the "
                             f"first {rows} (in DeepEP's order) and the rest were dropped. Pass a num_worst_tokens "
                             "of at least the most tokens a rank can receive; the Buffer stays usable")

    def _refuse_capture(self, what: str, in_blocks: bool) -> None:
        arguments.refuse_capture(self.order.capturing and not (in_blocks and self.blocks is not None), what,
                                 self.transport.name, self.transport.capturable)

    def _fresh_dispatch(self, x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                        num_worst_tokens, config, expand, recv_x_in_buffer, caller, run_on, async_finish):
        topo = self.topology
        R, N, L, me = topo.num_ranks, topo.num_nodes, topo.ranks_per_node, topo.rank
        failure = args = route = payload = None
        in_blocks = False
        try:
            self._raise_recorded_failures()
            args = arguments.check_fresh(x, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                         expert_alignment, num_worst_tokens, expand, recv_x_in_buffer, config,
                                         device_id=self.device_id, num_ranks=R)
            in_blocks = bool(args.num_worst_tokens) and self.blocks is not None
            self._refuse_capture("dispatch", in_blocks)
            if in_blocks:
                payload = (args.settings, args.x_rows.shape[0])
            else:
                route = self._route(args)
                payload = (args.settings, route.per_node, route.per_rank, route.per_expert)
        except Exception as exc:  # every rank raises from this call (the vote)
            failure = exc
        table = self._votes.vote("dispatch", failure, payload)
        if any(t[0] != table[0][0] for t in table):
            raise RankMismatchError(f"rank {me}: the ranks' dispatch arguments disagree (num_experts, x's dtype and "
                                    "shape, scales, top-k, weights, num_worst_tokens, expert_alignment by rank: "
                                    f"{[t[0] for t in table]})")
        if in_blocks:
            return self._block_dispatch(args, max(int(t[1]) for t in table), is_token_in_rank, topk_idx,
                                        topk_weights, config, caller, run_on, async_finish)
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
        send, recv = self._votes.voting("dispatch", lambda: self._rail_buffers(lib, layout, send_counts, recv_counts))
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

        outputs, inner, order = self._votes.voting("dispatch", move)
        self._rows_sent_out = sum(send_counts) - send_counts[topo.node]
        epr = E // R
        expert_list = [] if worst else [int(-(-int(c) // args.expert_alignment) * args.expert_alignment)
                                        for c in per_expert[:, me * epr:(me + 1) * epr].sum(axis=0)]
        in_rank_out = is_token_in_rank if is_token_in_rank is not None else self._to_lib(lib, route.in_rank, "bool")
        fields = (in_rank_out, None, None, None, self._host_ints(lib, np.cumsum(recv_counts)), None,
                  self._host_ints(lib, np.cumsum(per_rank[:, me])), None, None, None)
        handle = InternodeHandle(fields, owner=id(self), num_tokens=info.shape[0], send_token_idx=route.token_ids,
                                 send_counts=tuple(send_counts), recv_counts=tuple(recv_counts), slots=route.slots,
                                 intranode=inner, num_recv_tokens=num_recv, order=order,
                                 inverse=None if order is None else device.inverse_of(order), num_worst_tokens=worst,
                                 num_topk=K)
        recv_x, recv_scales, recv_topk, recv_weights = outputs
        event = self._finish(lib, caller, run_on, async_finish, (x, topk_idx, topk_weights, *outputs), outputs)
        return (recv_x if recv_scales is None else (recv_x, recv_scales)), recv_topk, recv_weights, expert_list, \
            handle, event

    def _block_dispatch(self, args: arguments.FreshArgs, block_tokens: int, is_token_in_rank, topk_idx,
                        topk_weights, config, caller, run_on, async_finish):
        """A fresh dispatch with num_worst_tokens in fixed-size blocks (:class:`BlockCalls`): no
        host wait after the vote on the arguments."""
        lib, blocks = args.info.lib, self.blocks
        assert blocks is not None  # chosen so by _fresh_dispatch
        outputs, handle = self._votes.voting("dispatch", lambda: blocks.dispatch(
            args, lib, run_on, block_tokens, config, id(self), is_token_in_rank))
        self._rows_sent_out = block_tokens * (self.topology.num_nodes - 1)
        recv_x, recv_scales, recv_topk, recv_weights = outputs
        event = self._finish(lib, caller, run_on, async_finish, (args.x_rows, topk_idx, topk_weights, *outputs),
                             outputs)
        return (recv_x if recv_scales is None else (recv_x, recv_scales)), recv_topk, recv_weights, [], handle, event

    def _rail_buffers(self, lib, layout: RecordLayout, send_counts: Sequence[int], recv_counts: Sequence[int]):
        """The send and receive buffers of a call's records (CuPy uint8 views of arrays of the
        caller's library, allocated on the call's stream)."""
        return tuple(device.new_bytes(lib, sum(counts), layout.bytes, self.device_id)
                     for counts in (send_counts, recv_counts))

    def _exchange(self, send, recv, record_bytes: int, send_counts: Sequence[int], recv_counts: Sequence[int],
                  run_on: int) -> None:
        """The rail's all-to-all of records, in node order (the own node's block a copy on the GPU)."""
        self.transport.alltoallv(device.device_pointer(send), [int(c) * record_bytes for c in send_counts],
                                 device.device_pointer(recv), [int(c) * record_bytes for c in recv_counts], run_on,
                                 owners=(send, recv))

    def _outputs(self, lib, rows: int, info, scales_info, num_topk: int, weights: bool, in_rank: int = 0):
        """``(arrays, views)`` of a dispatch's outputs of ``rows`` rows (:func:`arrays.dispatch_outputs`)."""
        return device.dispatch_outputs(lib, rows, info, scales_info, num_topk, weights, in_rank, self.device_id)

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
        order = device.deepep_order(from_sources, N, L)
        outputs = [recv_x, recv_scales, recv_topk, recv_weights]
        if order is None:
            return outputs, inner, None
        order = device.cupy_module().asarray(order)
        return [self._reordered(lib, a, order) for a in outputs], inner, order

    def _reordered(self, lib, array, order):
        """``array``'s first ``len(order)`` rows taken in ``order``, the rest (padding) as they are."""
        if array is None:
            return None
        info = describe(array, "output", self.device_id)
        source = device.device_view(array, info, self.device_id)
        out, view = self._new_output(lib, info.shape, info.dtype_name)
        n = order.shape[0]
        device.cupy_module().take(source, order, axis=0, out=view[:n])
        if info.shape[0] > n:
            view[n:] = source[n:]
        return out

    def _cached_dispatch(self, rows, scales, info, scales_info, handle: InternodeHandle, x_rows, x_scales,
                         layout: RecordLayout, send, recv, config, caller, run_on, async_finish):
        lib = info.lib

        def move():
            if handle.block_tokens:
                return self.blocks.cached_dispatch(lib, run_on, handle, layout, x_rows, x_scales, info, scales_info,
                                                   config)
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

        recv_x, recv_scales = self._votes.voting("dispatch", move)
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
        lib = device.call_lib(x, topk_weights)
        with self._span.begin(lib, previous_event, async_finish or allocate_on_comm_stream) as span, \
                span.current(lib):
            caller, run_on = span
            checked = self._votes.voting("combine", lambda: self._check_and_allocate_combine(
                x, handle, topk_weights, bias, config))
            return self._combine(x, topk_weights, *checked, config, caller, run_on, async_finish)

    def _check_and_allocate_combine(self, x, handle, topk_weights, bias, config) -> arguments.CombineArgs:
        """The combine's checks, then what it allocates (the rail buffers, the outputs): one vote for both."""
        self._raise_recorded_failures()
        handle, info, w_info, bias_views = arguments.check_combine(x, handle, topk_weights, bias, config,
                                                                   device_id=self.device_id, owner=id(self))
        self._refuse_capture("combine", in_blocks=bool(handle.block_tokens))
        lib, dtype = info.lib, info.dtype_name
        T, H = handle.num_tokens, info.shape[1]
        K = 0 if w_info is None else w_info.shape[1]
        layout = RecordLayout(tensors.row_bytes((H,), dtype), num_weights=K)
        send = recv = None
        if not handle.block_tokens:
            send, recv = self._rail_buffers(lib, layout, handle.recv_counts, handle.send_counts)
        out = self._new_output(lib, (T, H), dtype)
        out_w = None if not K else self._new_output(lib, (T, K), "float32")
        return arguments.CombineArgs(handle, info, w_info, bias_views, layout, send, recv, out, out_w)

    def _combine(self, x, weights, handle: InternodeHandle, info, w_info, bias_views, layout: RecordLayout, send,
                 recv, out_made, out_w, config, caller, run_on, async_finish):
        lib, dtype = info.lib, info.dtype_name
        out, out_view = out_made

        def move():
            biases = (bias_views + [None, None])[:2]
            if handle.block_tokens:
                self.blocks.combine(lib, run_on, x, info, weights, w_info, handle, layout, out_view,
                                    None if out_w is None else out_w[1], biases, config)
                return
            partial, partial_w = self._node_partials(lib, x, info, weights, w_info, handle, config)
            rows = device.byte_rows(partial)
            self.records.pack(run_on, send, layout, None, send.shape[0], PackSources(rows, weights=partial_w))
            self._exchange(send, recv, layout.bytes, handle.recv_counts, handle.send_counts, run_on)
            self.records.sum_nodes(run_on, self.intranode is None, dtype, out_view,
                                   None if out_w is None else out_w[1], recv, layout, handle.slots, biases)

        self._votes.voting("combine", move)
        outputs = (out, None if out_w is None else out_w[0])
        event = self._finish(lib, caller, run_on, async_finish, (x, weights, *outputs), outputs)
        return outputs[0], outputs[1], event

    def _node_partials(self, lib, x, info, weights, w_info, handle: InternodeHandle, config):
        """Each forwarded token's row to send back (CuPy views): the node's combine of x (put in
        the node stage's order first), or x itself with one rank per node."""
        dev = self.device_id
        forwarded = handle.num_forwarded
        if self.intranode is None:
            partial = device.device_view(x, info, dev)[:forwarded]
            partial_w = None if w_info is None else device.device_view(weights, w_info, dev)[:forwarded]
            return partial, partial_w
        if handle.inverse is not None:
            x = self._reordered(lib, x, handle.inverse)
            weights = None if weights is None else self._reordered(lib, weights, handle.inverse)
        partial, partial_w, _ = self.intranode.combine(x, handle.intranode, topk_weights=weights, config=config)
        partial = device.device_view(partial, describe(partial, "x", dev), dev)
        if partial_w is not None:
            partial_w = device.device_view(partial_w, describe(partial_w, "topk_weights", dev), dev)
        return partial, partial_w

    # -----------------------------------------------------------------------------------------

    def check_kernel_errors(self) -> None:
        """Raise what the intranode engine's kernels, the rail transport's device waits or a
        dispatch in blocks reported, if anything (the host-driven rail transfers raise at once)."""
        self._raise_recorded_failures()
        self.transport.check()

    def barrier(self) -> None:
        """Wait for this path's calls, then for every rank of the group (host barrier)."""
        self.order.synchronize()
        if self._group_barrier is not None:
            self._group_barrier()

    @property
    def comm_stream(self):
        """The stream of the calls that run on a stream of their own."""
        return self.order.stream

    @property
    def last_internode_rows(self) -> int:
        """Rows that left this rank for other nodes in the last dispatch (the benchmark reads it)."""
        return self._rows_sent_out

    @property
    def internode_transport(self) -> str:
        """The rail transport's name."""
        return self.transport.name

    def release(self) -> None:
        if self.intranode is not None:
            self.intranode.release()

    def destroy(self) -> None:
        """Destroy the intranode engine, close the transport and the block kernels' record, free the
        sub-groups (idempotent)."""
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
                self.block_kernels.close()
            finally:
                for release in self._on_destroy:
                    try:
                        release()
                    except Exception:
                        pass
                self._span.forget_streams()
