"""The kernels around the node's decode calls across nodes (kernels/low_latency_nodes.cu), and the
strided copies that take the node calls' inputs out of the rail's blocks.

:class:`RelayKernels` launches on raw pointers and a raw ``cudaStream_t``; it knows no operation.
"""

from __future__ import annotations

from typing import Dict, Mapping

from ..gpu import kernels
from ..gpu.launch import KernelCall, bind, every_argument_per_call

#: Blocks of the kernels that loop over tokens or rows in steps of the grid.
GRID_BLOCKS = 132


class RelayKernels:
    """Launches the relay kernels; every instance is loaded when the object is made (a kernel
    loaded lazily by a rank sharing a GPU could wait for a peer's running kernel)."""

    def __init__(self) -> None:
        kernels.load(kernels.SOURCES["low_latency_nodes.cu"])
        self._calls: Dict[str, KernelCall] = {}

    def _run(self, kernel: str, stream: int, *values) -> None:
        call = self._calls.get(kernel)
        if call is None:
            call = self._calls[kernel] = every_argument_per_call(f"deepep_cupy::ll_nodes::{kernel}", GRID_BLOCKS)
        call.run(stream, *values)

    def relay_tokens(self, stream: int, x: int, topk: int, num_tokens: int, num_max: int, num_topk: int, hidden: int,
                     num_experts: int, num_nodes: int, own_node: int, send: int, block_bytes: int,
                     x_off: int) -> None:
        """This rank's tokens into one block per node of ``send`` (kernels/low_latency_nodes.cu)."""
        self._run("relay_tokens", stream, x, topk, num_tokens, num_max, num_topk, hidden // 8, num_experts, num_nodes,
                  own_node, send, block_bytes, x_off)

    def relay_routing(self, stream: int, topk: int, weights: int, num_tokens: int, num_max: int, num_topk: int,
                      num_experts: int, num_nodes: int, own_node: int, send: int, block_bytes: int,
                      weights_off: int) -> None:
        """The combine's top-k ids and weights into one block per node of ``send``."""
        self._run("relay_routing", stream, topk, weights, num_tokens, num_max, num_topk, num_experts, num_nodes,
                  own_node, send, block_bytes, weights_off)

    def global_handle(self, stream: int, node_src_info: int, node_layout_range: int, src_info: int,
                      layout_range: int, num_local_experts: int, ranks_per_node: int, num_nodes: int,
                      num_max: int) -> None:
        """The node call's handle arrays as DeepEP's."""
        self._run("global_handle", stream, node_src_info, node_layout_range, src_info, layout_range,
                  num_local_experts, ranks_per_node, num_nodes, num_max)

    def sum_partials(self, stream: int, out: int, partials: int, num_tokens: int, num_max: int, num_nodes: int,
                     hidden: int) -> None:
        """``out`` (BF16 ``[num_tokens, hidden]``): the sum of every node's partial rows."""
        if num_tokens:
            self._run("sum_partials", stream, out, partials, num_tokens, num_max, num_nodes, hidden // 8)

    def rail_failed(self, stream: int, rail_error: int, rail_size: int, ranks_per_node: int,
                    node_arguments: Mapping[str, int]) -> None:
        """After a block exchange of the rail: give up on the node's decode buffer when the exchange's
        device wait timed out (its error word ``rail_error`` set), so that the node call that reads the
        blocks stops instead of moving stale ones. ``node_arguments``: the node path's
        :attr:`~deepep_cupy.low_latency.path.LowLatencyPath.shared_arguments` (bound at the first call:
        an instance serves one path)."""
        call = self._calls.get("rail_failed")
        if call is None:
            call = self._calls["rail_failed"] = bind("deepep_cupy::ll_nodes::rail_failed", dict(node_arguments),
                                                     grid=1, per_call=("rail_error", "rail_size", "ranks_per_node"))
        call.run(stream, rail_error, rail_size, ranks_per_node)

    @staticmethod
    def gather_blocks(stream: int, dst: int, src: int, part_bytes: int, block_bytes: int, num_blocks: int) -> None:
        """``part_bytes`` from the start of each of ``num_blocks`` blocks of ``block_bytes`` at ``src``,
        packed at ``dst`` (one strided copy; a CUDA graph holds it)."""
        from cupy.cuda import runtime

        runtime.memcpy2DAsync(dst, part_bytes, src, block_bytes, part_bytes, num_blocks,
                              runtime.memcpyDeviceToDevice, stream)
