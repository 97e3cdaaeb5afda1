"""Internode dispatch and combine in fixed-size blocks: the calls with ``num_worst_tokens``, which
never wait for the host, so that a CUDA graph can hold them.

When the outputs' size is fixed, so can the rail's blocks be. Every rank sends every node a block
of ``block_tokens`` records (the group's largest token count, learned in the call's vote): record
``t`` is its token ``t`` with its ``is_token_in_rank`` row, or zeros past its tokens. The
receivers find on the device which records are theirs (kernels/internode_blocks.cu):

* one rank per node: the records meant for this rank are numbered in block order, which is
  DeepEP's (source rank, then token), and unpacked into the outputs;
* several: every record goes to the node's intranode dispatch (with ``num_worst_tokens``; a
  record meant for no rank of the node is routed nowhere), whose outputs are put in DeepEP's
  order from its handle.

Combine mirrors it: every node sends each source node back a block of ``block_tokens`` rows (the
node's partial sums, or the rows themselves with one rank per node), and the owner sums the rows
of the nodes its tokens went to. The bytes sent are ``N * block_tokens`` records per call whatever
the routing. Arrays are allocated by the caller's library, on the call's stream, so that a
capture's allocations belong to its graph.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .. import tensors
from ..tensors import describe
from . import arrays as device
from .arguments import FreshArgs
from .handle import InternodeHandle
from .records import PackSources, RecordLayout


class BlockCalls:
    """The fixed-block dispatch and combine of an internode path (see the module docstring).

    Args:
        topology: this rank's :class:`deepep_cupy.groups.nodes.NodeTopology`.
        transport: the rail transport (:meth:`exchange_blocks`).
        device_id: the GPU.
        intranode: the node's intranode engine, or None with one rank per node.
        records: the record kernels (:class:`deepep_cupy.internode.records.RecordKernels`).
        kernels: the block kernels (:class:`deepep_cupy.internode.block_kernels.BlockKernels`).
    """

    def __init__(self, topology, transport, device_id: int, intranode, *, records, kernels):
        self.topology = topology
        self.transport = transport
        self.device_id = device_id
        self.intranode = intranode
        self.records = records
        self.kernels = kernels

    def _new(self, lib, shape: Tuple[int, ...], dtype_name: str):
        return device.new_output(lib, shape, dtype_name, self.device_id)

    def _view(self, array, name: str):
        return device.device_view(array, describe(array, name, self.device_id), self.device_id)

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, args: FreshArgs, lib, stream: int, block_tokens: int, config, owner: int, is_token_in_rank):
        """A fresh dispatch: ``(outputs [recv_x, recv_scales, recv_topk, recv_weights], handle)``
        (``is_token_in_rank``: the caller's, or None)."""
        topo = self.topology
        R, N, L, me = topo.num_ranks, topo.num_nodes, topo.ranks_per_node, topo.rank
        T, E, worst = args.x_rows.shape[0], args.num_experts, args.num_worst_tokens
        K = 0 if args.topk is None else args.topk.shape[1]
        layout = RecordLayout(args.x_rows.shape[1], 0 if args.x_scales is None else 4 * args.x_scales.shape[1], K,
                              0 if args.weights is None else K, R)
        B = block_tokens
        if args.in_rank is None:
            in_rank_out, in_rank = self._new(lib, (T, R), "bool")
        else:
            in_rank_out, in_rank = None, args.in_rank
        slots = self._new(lib, (N, T), "int32")[1]
        self.kernels.route(stream, args.topk, args.in_rank, T, E, R, L, B,
                           in_rank_out=None if in_rank_out is None else in_rank, slots=slots)
        recv = self._send_and_receive(lib, stream, layout, B,
                                      PackSources(args.x_rows, args.x_scales, args.topk, args.weights, in_rank),
                                      each_block=T)
        info, scales_info = args.info, args.scales_info
        block_prefix = self._new(lib, (N,), "int32")
        attributes = dict(owner=owner, num_tokens=T, send_token_idx=None, send_counts=(B,) * N, recv_counts=(B,) * N,
                          slots=slots, num_recv_tokens=worst, num_worst_tokens=worst, num_topk=K, block_tokens=B)
        if L == 1:
            row_of = self._new(lib, (N * B,), "int64")[1]
            counts_out, counts = self._new(lib, (N + 1,), "int32")
            self.kernels.number_rows(stream, recv, layout.bytes, layout.in_rank_off, me, N, B, worst, row_of, counts,
                                     block_prefix[1])
            outputs, targets = device.dispatch_outputs(lib, worst, info, scales_info, K, args.weights is not None, 0,
                                                       self.device_id)
            self.records.unpack(stream, True, recv, layout, N * B, worst, targets, me * (E // R), E // R,
                                row_of=row_of, num_valid=counts[N - 1:N])
            prefix = counts_out[:N]
            attributes.update(intranode=None, order=None, inverse=None, row_of=row_of, num_valid=counts[N - 1:N])
        else:
            outputs, prefix, inner, order, inverse = self._through_node(lib, stream, recv, layout, args, B, config,
                                                                        block_prefix[1])
            attributes.update(intranode=inner, order=order, inverse=inverse, row_of=None, num_valid=None)
        in_rank_field = in_rank_out if in_rank_out is not None else is_token_in_rank
        fields = (in_rank_field, None, None, None, block_prefix[0], None, prefix, None, None, None)
        return outputs[:4], InternodeHandle(fields, **attributes)

    def _send_and_receive(self, lib, stream: int, layout: RecordLayout, block_tokens: int, sources: PackSources, *,
                          each_block: Optional[int] = None, token_ids: Optional[Any] = None):
        """Pack the records, exchange the blocks and return the received ones (``[N *
        block_tokens, layout.bytes]``, CuPy uint8). ``each_block``: every node's block holds the
        first ``each_block`` tokens of ``sources`` (the rest zeroed: no rank's); otherwise record
        ``i`` of the send buffer is source row ``token_ids[i]`` (-1: not written) or ``i``."""
        N, B = self.topology.num_nodes, block_tokens
        send = device.new_bytes(lib, N * B, layout.bytes, self.device_id)
        recv = device.new_bytes(lib, N * B, layout.bytes, self.device_id)
        if each_block is not None:
            for n in range(N):
                block = send[n * B:(n + 1) * B]
                self.records.pack(stream, block, layout, None, each_block, sources)
                self.kernels.zero(stream, block[each_block:])
        else:
            self.records.pack(stream, send, layout, token_ids, N * B, sources)
        self.transport.exchange_blocks(device.device_pointer(send), device.device_pointer(recv), B * layout.bytes,
                                       stream, owners=(send, recv))
        return recv

    def _through_node(self, lib, stream: int, recv, layout: RecordLayout, args: FreshArgs, block_tokens: int, config,
                      block_prefix):
        """Every received record through the node's intranode dispatch, its outputs put in
        DeepEP's order: ``(outputs, recv_gbl_rank_prefix_sum, the node stage's handle, order, inverse)``."""
        topo = self.topology
        R, N, L = topo.num_ranks, topo.num_nodes, topo.ranks_per_node
        E, K, worst = args.num_experts, layout.num_topk, args.num_worst_tokens
        forwarded = N * block_tokens
        stage, targets = device.dispatch_outputs(lib, forwarded, args.info, args.scales_info, K,
                                                 args.weights is not None, L, self.device_id)
        self.records.unpack(stream, False, recv, layout, forwarded, forwarded, targets, topo.node * (E // N), E // N,
                            topo.node * L)
        per_rank_out, per_rank = self._new(lib, (L,), "int32")
        per_expert_out, per_expert = self._new(lib, (E // N,), "int32")
        self.kernels.stage_counts(stream, targets.in_rank, targets.topk, forwarded, E // N, per_rank, per_expert)
        x_in, scales_in, topk_in, weights_in, in_rank_in = stage
        recv_x, recv_topk, recv_weights, _, inner, _ = self.intranode.dispatch(
            x_in if scales_in is None else (x_in, scales_in), num_tokens_per_rank=per_rank_out,
            is_token_in_rank=in_rank_in, num_tokens_per_expert=per_expert_out, topk_idx=topk_in,
            topk_weights=weights_in, expert_alignment=args.expert_alignment, num_worst_tokens=worst, config=config)
        recv_x, recv_scales = recv_x if scales_in is not None else (recv_x, None)
        order = self._new(lib, (worst,), "int64")[1]
        inverse = self._new(lib, (worst,), "int64")[1]
        prefix_out, prefix = self._new(lib, (R,), "int32")
        self.kernels.deepep_order(stream, self._view(inner[0], "rank_prefix_matrix"),
                                  self._view(inner[3], "recv_src_idx"), topo.local_rank, L, N, block_tokens, worst,
                                  order, inverse, prefix, block_prefix)
        outputs = [self._taken(lib, stream, a, order, worst) for a in (recv_x, recv_scales, recv_topk, recv_weights)]
        return outputs, prefix_out, inner, order, inverse

    def _taken(self, lib, stream: int, array, order, rows: int):
        """A new array like ``array`` whose row ``p`` is ``array``'s row ``order[p]``."""
        if array is None:
            return None
        info = describe(array, "output", self.device_id)
        source = device.device_view(array, info, self.device_id)  # refuses a dtype the kernels do not move
        dtype_name = str(info.dtype_name)
        out, view = self._new(lib, info.shape, dtype_name)
        self.kernels.take_rows(stream, view, source, order, rows, tensors.row_bytes(info.shape[1:], dtype_name))
        return out

    def cached_dispatch(self, lib, stream: int, handle: InternodeHandle, layout: RecordLayout, x_rows, x_scales, info,
                        scales_info, config) -> List[Any]:
        """A cached dispatch of a fixed-block handle: ``[recv_x, recv_scales]``."""
        B, N = handle.block_tokens, self.topology.num_nodes
        recv = self._send_and_receive(lib, stream, layout, B, PackSources(x_rows, x_scales),
                                      each_block=handle.num_tokens)
        worst = handle.num_worst_tokens
        if self.intranode is None:
            outputs, targets = device.dispatch_outputs(lib, worst, info, scales_info, 0, False, 0, self.device_id)
            self.records.unpack(stream, True, recv, layout, N * B, worst, targets, row_of=handle.row_of,
                                num_valid=handle.num_valid)
            return outputs[:2]
        stage, targets = device.dispatch_outputs(lib, N * B, info, scales_info, 0, False, 0, self.device_id)
        self.records.unpack(stream, False, recv, layout, N * B, N * B, targets)
        x_in, scales_in = stage[:2]
        recv_x = self.intranode.dispatch(x_in if scales_in is None else (x_in, scales_in), handle=handle.intranode,
                                         config=config)[0]
        recv_x, recv_scales = recv_x if scales_in is not None else (recv_x, None)
        return [self._taken(lib, stream, a, handle.order, worst) for a in (recv_x, recv_scales)]

    # -----------------------------------------------------------------------------------------
    # Combine

    def combine(self, lib, stream: int, x, info, weights, w_info, handle: InternodeHandle, layout: RecordLayout,
                out_view, out_weights_view, biases, config) -> None:
        """The combine of a fixed-block handle into ``out_view`` (and ``out_weights_view``)."""
        dev = self.device_id
        if self.intranode is None:
            rows = device.byte_rows(device.device_view(x, info, dev))
            w_rows = None if w_info is None else device.device_view(weights, w_info, dev)
            recv = self._send_and_receive(lib, stream, layout, handle.block_tokens, PackSources(rows, weights=w_rows),
                                          token_ids=handle.row_of)
        else:
            x_stage = self._taken(lib, stream, x, handle.inverse, handle.num_worst_tokens)
            w_stage = None if weights is None else \
                self._taken(lib, stream, weights, handle.inverse, handle.num_worst_tokens)
            partial, partial_w, _ = self.intranode.combine(x_stage, handle.intranode, topk_weights=w_stage,
                                                           config=config)
            rows = device.byte_rows(self._view(partial, "x"))
            w_rows = None if partial_w is None else self._view(partial_w, "topk_weights")
            recv = self._send_and_receive(lib, stream, layout, handle.block_tokens, PackSources(rows, weights=w_rows))
        self.records.sum_nodes(stream, self.intranode is None, info.dtype_name, out_view, out_weights_view, recv,
                               layout, handle.slots, biases)
