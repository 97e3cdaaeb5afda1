"""The decode calls across nodes: a token crosses to each node once and is forwarded over NVLink there.

Rank ``p`` of node ``n`` (global rank ``n * P + p``) has a rail peer on every node: the rank with
the same ``p`` (:meth:`deepep_cupy.groups.nodes.NodeTopology.rail_ranks`). A call is the node's own
decode call (a :class:`deepep_cupy.low_latency.path.LowLatencyPath` on the node's ``P`` ranks) with
the rail's fixed-size blocks around it:

* dispatch: every rank sends each node one block of ``M`` tokens
  (``M = num_max_dispatch_tokens_per_rank``): their top-k ids made that node's (-1 for the experts
  of other nodes) and their BF16 rows. The node call then dispatches, on each rank, the ``N * M``
  tokens of its rail (token ``t`` of node ``n'``'s rank as token ``n' * M + t``) to the node's
  ``P * L`` experts, casting to FP8 in its kernel as one node's call does. Its outputs have the
  shape DeepEP's have (``[L, P * N * M, H]`` is ``[L, R * M, H]``), and a kernel turns its handle
  into DeepEP's (source rank and token index). The rows of a local expert come node rank by node
  rank, and for one node rank node by node: each source rank's rows are one run, as
  ``layout_range`` says (:mod:`deepep_cupy.reference.low_latency_nodes` states the order).
* combine: every rank sends each node one block of the combine's top-k ids (made that node's) and
  weights; the node call sums each token's rows of the node's experts into one BF16 partial sum per
  (token, node), which goes back to the token's owner in one block per node, where a kernel adds
  the ``N`` partial sums.

Every size is fixed by ``M``, so no host waits: over a rail transport that queues device work alone
(``nccl``, ``local``) a call is captured in a CUDA graph as one node's calls are; over one that
waits on the host (``mpi``, ``torch``) a capture is refused, naming it. With ``return_recv_hook``,
the send half holds the routing block exchange and the node call's send, the hook the node call's
receive and (combine) the partial sums' exchange.

The rail moves ``(N - 1) * M`` token rows out of each rank per dispatch, whatever the routing (the
padding of a fixed size; :attr:`LowLatencyAcrossNodes.rail_bytes` counts them), against one
message per (token, destination rank) in DeepEP's design.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..constants import MAX_TOPK
from ..errors import RankMismatchError
from ..gpu.launch import fill_bytes
from ..tensors import ArrayLib, check_array, describe
from .arguments import checked_layout
from .handle import LowLatencyHandle, low_latency_handle
from .path import LowLatencyPath, Relay
from .relay_kernels import RelayKernels

__all__ = ["LowLatencyAcrossNodes", "NodesHandle"]

_ALIGN = 16
#: Environment variable: ``1`` makes each rank print its decode calls' rail bytes when its Buffer is destroyed.
RAIL_BYTES_REPORT_ENV = "DEEPEP_CUPY_REPORT_RAIL_BYTES"


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


class NodesHandle(LowLatencyHandle):
    """A dispatch's handle across nodes: DeepEP's tuple (``src_info``, ``layout_range`` as DeepEP
    states them), with ``node``, the node call's own handle, which the combine uses."""

    node: LowLatencyHandle


class _Blocks:
    """Where one block per node lays out its parts: the rail's send and receive buffers hold
    ``num_nodes`` blocks of ``block_bytes``; part ``i`` starts at ``offsets[i]``."""

    def __init__(self, num_nodes: int, part_bytes: Tuple[int, ...]):
        self.num_nodes = num_nodes
        self.part_bytes = part_bytes
        offsets, at = [], 0
        for size in part_bytes:
            offsets.append(at)
            at += _aligned(size)
        self.offsets = tuple(offsets)
        self.block_bytes = at

    @property
    def total_bytes(self) -> int:
        return self.num_nodes * self.block_bytes


class _Scratch:
    """The rail buffers and node-call inputs of calls of one shape (``M`` tokens of ``hidden``
    channels, ``K`` top-k slots): CuPy memory of the path's, kept for its life (a graph replays the
    addresses), with views of each caller library made once."""

    def __init__(self, num_nodes: int, num_max: int, hidden: int, num_topk: int, device_id: int):
        import cupy

        self.tokens = _Blocks(num_nodes, (num_max * num_topk * 8, num_max * hidden * 2))
        self.routing = _Blocks(num_nodes, (num_max * num_topk * 8, num_max * num_topk * 4))
        rows = num_nodes * num_max

        def space(num_bytes):
            # All bits set: the top-k ids of a block a failed exchange never filled are -1 (no
            # expert), not garbage, until the rail's timeout is reported. A memset, not a CuPy
            # kernel: a kernel's first launch loads its module, which waits for the kernels running
            # on the GPU, among them those of the ranks sharing it that wait for this one.
            array = cupy.empty(max(num_bytes, _ALIGN), cupy.uint8)
            fill_bytes(array.data.ptr, 0xFF, array.nbytes, stream)
            return array

        with cupy.cuda.Device(device_id):
            stream = cupy.cuda.get_current_stream().ptr
            self.tokens_send, self.tokens_recv = space(self.tokens.total_bytes), space(self.tokens.total_bytes)
            self.routing_send, self.routing_recv = space(self.routing.total_bytes), space(self.routing.total_bytes)
            # The combine's routing is read by its receive, which a second combine's send may
            # precede (two calls in flight): one per call parity.
            self.memory = {
                "x": space(rows * hidden * 2), "topk": space(rows * num_topk * 8),
                "combine_topk_0": space(rows * num_topk * 8), "combine_topk_1": space(rows * num_topk * 8),
                "weights_0": space(rows * num_topk * 4), "weights_1": space(rows * num_topk * 4),
                "partials": space(rows * hidden * 2), "partials_recv": space(rows * hidden * 2)}
            # Once per shape: the fills are over before any stream of the calls reads the memory.
            cupy.cuda.runtime.streamSynchronize(stream)
        self.shapes = {"x": ((hidden,), "bfloat16"), "topk": ((num_topk,), "int64"),
                       "combine_topk_0": ((num_topk,), "int64"), "combine_topk_1": ((num_topk,), "int64"),
                       "weights_0": ((num_topk,), "float32"), "weights_1": ((num_topk,), "float32"),
                       "partials": ((hidden,), "bfloat16")}
        self.rows, self.device_id = rows, device_id
        self._views: Dict[Tuple[str, str], Any] = {}

    def ptr(self, name: str) -> int:
        return self.memory[name].data.ptr

    def view(self, lib: ArrayLib, name: str):
        """``name`` as a ``[rows, ...]`` array of ``lib`` (a node call's argument)."""
        key = (lib.name, name)
        view = self._views.get(key)
        if view is None:
            tail, dtype = self.shapes[name]
            memory = self.memory[name]
            window = lib.window(memory.data.ptr, memory.nbytes, self.device_id, memory)
            view = self._views[key] = lib.rows_in(window, self.rows, tail, dtype)
        return view


class LowLatencyAcrossNodes:
    """A rank's decode calls across nodes (the module docstring); the low-latency engine's path where
    the group spans nodes.

    Args:
        node: the node's :class:`LowLatencyPath` (``P`` ranks; owned: closed by :meth:`close`).
        transport: the rail's :class:`deepep_cupy.transports.base.RailTransport` (owned).
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology`.
        kernels: a :class:`RelayKernels` (or the CPU tests' stand-in).
        on_close: called by :meth:`close` (the node sub-group's release).
        allgather: the Buffer group's allgather with the Buffer's deadline, through which the ranks
            agree on each new call shape before its memory is used (None: not consulted).
    """

    def __init__(self, node: LowLatencyPath, transport, topology, kernels: RelayKernels,
                 on_close: Tuple[Callable[[], Any], ...] = (),
                 allgather: Optional[Callable[[Any], List[Any]]] = None):
        self.node = node
        self.transport = transport
        self.topology = topology
        self.kernels = kernels
        self._allgather = allgather
        self._on_close = on_close
        self.rank, self.num_ranks = topology.rank, topology.num_ranks
        self.num_nodes, self.ranks_per_node = topology.num_nodes, topology.ranks_per_node
        self.device_id = node.device_id
        self._scratch: Dict[Tuple[int, int, int], _Scratch] = {}
        self._combine_calls = 0
        #: Bytes this rank's calls handed the rail transport for other nodes, per op (counted on the host).
        self.rail_bytes = {"dispatch": 0, "combine": 0}

    # What get_local_buffer_tensor(use_rdma_buffer=True) reads: this rank's low-latency buffer.
    @property
    def local_ptr(self) -> int:
        return self.node.local_ptr

    @property
    def num_bytes(self) -> int:
        return self.node.num_bytes

    @property
    def _owner(self):
        return self.node._owner

    # -----------------------------------------------------------------------------------------

    def _shape(self, num_max: int, hidden: int, num_topk: int) -> _Scratch:
        key = (num_max, hidden, num_topk)
        scratch = self._scratch.get(key)
        if scratch is None:
            scratch = _Scratch(self.num_nodes, num_max, hidden, num_topk, self.device_id)
            # Every rank makes its memory before any launches the call: making it may wait for the
            # GPU, where the kernels of ranks sharing it would spin for this one. And the rail's
            # blocks are laid out alike on every rank, or not at all.
            if self._allgather is not None:
                self._check_same_shape(key, self._allgather(key))
            self._scratch[key] = scratch
        return scratch

    def _check_same_shape(self, key: Tuple[int, int, int], keys: List[Any]) -> None:
        for rank, other in enumerate(keys):
            if tuple(other) != key:
                names = ("num_max_dispatch_tokens_per_rank", "hidden", "num_topk")
                raise RankMismatchError(
                    f"rank {self.rank}: the ranks' decode calls across nodes disagree: rank {rank} has "
                    f"{dict(zip(names, other))}, rank {self.rank} {dict(zip(names, key))}; every rank must call with "
                    "the same sizes. Nothing was moved; the Buffer stays usable")

    def _refuse_capture(self, lib: ArrayLib, what: str) -> None:
        if self.transport.capturable:
            return
        from cupy.cuda import runtime

        if runtime.streamIsCapturing(lib.current_stream(self.device_id)):
            raise ValueError(f"{what}: the '{self.transport.name}' rail transport waits on the host, so a decode call "
                             "across nodes over it cannot be captured in a CUDA graph; use the 'nccl' transport (or "
                             "'local' for in-process ranks), or run the call outside the capture")

    def _stats_view(self, stats, name: str):
        """This node's ``P`` entries of a per-rank statistics array (what its node call adds to)."""
        if stats is None:
            return None
        check_array(describe(stats, name, self.device_id), name, ("int64",), 1, (self.num_ranks,))
        first = self.topology.node * self.ranks_per_node
        return stats[first:first + self.ranks_per_node]

    def _routing(self, topk_idx, x_info, num_max: int):
        topk = describe(topk_idx, "topk_idx", self.device_id)
        check_array(topk, "topk_idx", ("int64",), 2)
        if x_info is not None and topk.lib is not x_info.lib:
            raise TypeError("topk_idx: expected an array of the same library as x")
        num_tokens, num_topk = topk.shape
        if not 0 < num_topk <= MAX_TOPK:
            raise ValueError(f"topk_idx: expected 1..{MAX_TOPK} columns, got {num_topk}")
        if num_tokens > num_max:
            raise ValueError(f"topk_idx: {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={num_max}")
        return topk, num_tokens, num_topk

    def _exchange(self, send, recv, block_bytes: int, stream: int) -> None:
        self.transport.exchange_blocks(send.data.ptr, recv.data.ptr, block_bytes, stream, owners=(send, recv))
        # A device wait of the exchange that timed out must stop the node calls that read its blocks.
        if self.transport.device_error_ptr:
            self.kernels.rail_failed(stream, self.transport.device_error_ptr, self.transport.size,
                                     self.ranks_per_node, self.node.shared_arguments)

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                 use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                 async_finish: bool = False, return_recv_hook: bool = False):
        """See :meth:`deepep_cupy.Buffer.low_latency_dispatch`."""
        info = describe(x, "x", self.device_id)
        check_array(info, "x", ("bfloat16",), 2)
        hidden = info.shape[1]
        layout = checked_layout(num_max_dispatch_tokens_per_rank, hidden, num_experts, self.num_ranks,
                                self.num_bytes)
        M, E, N, P = layout.num_max_dispatch_tokens_per_rank, layout.num_experts, self.num_nodes, self.ranks_per_node
        topk, num_tokens, num_topk = self._routing(topk_idx, info, M)
        if info.shape[0] != num_tokens:
            raise ValueError(f"topk_idx: expected one row per token of x ({info.shape[0]}), got {num_tokens}")
        lib = info.lib
        self._refuse_capture(lib, "low_latency_dispatch")
        wait_view = self._stats_view(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")
        scratch = self._shape(M, hidden, num_topk)
        L = layout.num_local_experts
        with self.node._on_device:
            src_info = lib.empty((L, self.num_ranks * M), "int32", self.device_id)
            layout_range = lib.empty((L, self.num_ranks), "int64", self.device_id)
        x_ptr, topk_ptr, blocks = lib.pointer(x), lib.pointer(topk_idx), scratch.tokens

        def before(stream: int) -> None:
            self.kernels.relay_tokens(stream, x_ptr, topk_ptr, num_tokens, M, num_topk, hidden, E, N,
                                      self.topology.node, scratch.tokens_send.data.ptr, blocks.block_bytes,
                                      blocks.offsets[1])
            self._exchange(scratch.tokens_send, scratch.tokens_recv, blocks.block_bytes, stream)
            recv = scratch.tokens_recv.data.ptr
            self.kernels.gather_blocks(stream, scratch.ptr("topk"), recv, blocks.part_bytes[0], blocks.block_bytes, N)
            self.kernels.gather_blocks(stream, scratch.ptr("x"), recv + blocks.offsets[1], blocks.part_bytes[1],
                                       blocks.block_bytes, N)

        def after(stream: int, outputs: Tuple[Any, ...]) -> None:
            node_src_info, node_layout_range = outputs[-2], outputs[-1]
            self.kernels.global_handle(stream, lib.pointer(node_src_info), lib.pointer(node_layout_range),
                                       lib.pointer(src_info), lib.pointer(layout_range), L, P, N, M)

        recv_x, recv_count, node_handle, event, hook = self.node.dispatch(
            scratch.view(lib, "x"), scratch.view(lib, "topk"), N * M, P * L, cumulative_local_expert_recv_stats,
            wait_view, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
            relay=Relay(before, after, (x, topk_idx, src_info, layout_range)))
        self.rail_bytes["dispatch"] += (N - 1) * blocks.block_bytes
        handle = NodesHandle(src_info, layout_range, M, hidden, E)
        handle.node = node_handle
        return recv_x, recv_count, handle, event, hook

    # -----------------------------------------------------------------------------------------
    # Combine

    def combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False, zero_copy: bool = False,
                async_finish: bool = False, return_recv_hook: bool = False, out=None,
                combine_wait_recv_cost_stats=None):
        """See :meth:`deepep_cupy.Buffer.low_latency_combine`."""
        low_latency_handle(handle)
        if not isinstance(handle, NodesHandle):
            raise ValueError("handle: expected the handle of this Buffer's low_latency_dispatch (a dispatch across "
                             "nodes), got one of a Buffer on one node")
        M, hidden, N = handle.num_max_dispatch_tokens_per_rank, handle.hidden, self.num_nodes
        topk, num_tokens, num_topk = self._routing(topk_idx, None, M)
        weights = describe(topk_weights, "topk_weights", self.device_id)
        check_array(weights, "topk_weights", ("float32",), 2, (num_tokens, num_topk))
        lib = topk.lib
        if out is not None:
            check_array(describe(out, "out", self.device_id), "out", ("bfloat16",), 2, (num_tokens, hidden))
        self._refuse_capture(lib, "low_latency_combine")
        wait_view = self._stats_view(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats")
        scratch = self._shape(M, hidden, num_topk)
        parity = self._combine_calls & 1
        with self.node._on_device:
            if out is None:  # on the caller's current stream, as dispatch's outputs
                out = lib.empty((num_tokens, hidden), "bfloat16", self.device_id)
        topk_ptr, weights_ptr, out_ptr, blocks = lib.pointer(topk_idx), lib.pointer(topk_weights), lib.pointer(out), \
            scratch.routing
        E = handle.num_experts

        def before(stream: int) -> None:
            self.kernels.relay_routing(stream, topk_ptr, weights_ptr, num_tokens, M, num_topk, E, N, self.topology.node,
                                       scratch.routing_send.data.ptr, blocks.block_bytes, blocks.offsets[1])
            self._exchange(scratch.routing_send, scratch.routing_recv, blocks.block_bytes, stream)
            recv = scratch.routing_recv.data.ptr
            self.kernels.gather_blocks(stream, scratch.ptr(f"combine_topk_{parity}"), recv, blocks.part_bytes[0],
                                       blocks.block_bytes, N)
            self.kernels.gather_blocks(stream, scratch.ptr(f"weights_{parity}"), recv + blocks.offsets[1],
                                       blocks.part_bytes[1], blocks.block_bytes, N)

        def after(stream: int, outputs: Tuple[Any, ...]) -> None:
            self._exchange(scratch.memory["partials"], scratch.memory["partials_recv"], M * hidden * 2, stream)
            self.kernels.sum_partials(stream, out_ptr, scratch.ptr("partials_recv"), num_tokens, M, N, hidden)

        _, event, hook = self.node.combine(
            x, scratch.view(lib, f"combine_topk_{parity}"), scratch.view(lib, f"weights_{parity}"), handle.node,
            use_logfmt, zero_copy, async_finish, return_recv_hook, out=scratch.view(lib, "partials"),
            combine_wait_recv_cost_stats=wait_view, relay=Relay(before, after, (topk_idx, topk_weights, out)))
        self._combine_calls += 1
        self.rail_bytes["combine"] += (N - 1) * (blocks.block_bytes + M * hidden * 2)
        return out, event, hook

    # -----------------------------------------------------------------------------------------
    # The rest is the node's

    def next_combine_buffer(self, handle):
        low_latency_handle(handle)
        if not isinstance(handle, NodesHandle):
            raise ValueError("handle: expected the handle of this Buffer's low_latency_dispatch")
        return self.node.next_combine_buffer(handle.node)

    def update_mask(self, rank_to_mask: Any, mask: bool = False) -> None:
        self.node.update_mask(rank_to_mask, mask)

    def query_mask(self, mask_status: Any) -> None:
        self.node.query_mask(mask_status)

    def clean_mask(self) -> None:
        self.node.clean_mask()

    def clean(self, barrier) -> None:
        self.node.clean(barrier)

    def check(self) -> None:
        """Raise what a wait of the rail transport on the device left behind."""
        self.transport.check()

    def close(self) -> None:
        if os.environ.get(RAIL_BYTES_REPORT_ENV) == "1":
            sent = self.rail_bytes
            print(f"deepep_cupy rank {self.rank}: decode across nodes sent other nodes {sent['dispatch']} dispatch "
                  f"bytes and {sent['combine']} combine bytes over the '{self.transport.name}' rail transport",
                  file=sys.stderr, flush=True)
        self.node.close()
        self.transport.close()
        self._scratch.clear()
        on_close, self._on_close = self._on_close, ()
        for release in on_close:
            release()
