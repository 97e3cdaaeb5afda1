"""The host side of the decode calls across nodes (deepep_cupy/low_latency/across_nodes.py): the
handle it returns and how the rail's blocks are laid out. The calls themselves run on the GPU
(tests/test_gpu_low_latency.py, across simulated nodes)."""

import numpy as np

from deepep_cupy.low_latency.across_nodes import NodesHandle, _Blocks
from deepep_cupy.low_latency.handle import LowLatencyHandle, low_latency_handle


def test_a_handle_across_nodes_is_deepep_s_five_tuple_carrying_the_node_call_s_handle():
    node = LowLatencyHandle(np.zeros((2, 8), np.int32), np.zeros((2, 2), np.int64), 4, 128, 8)
    handle = NodesHandle(np.zeros((2, 8), np.int32), np.zeros((2, 4), np.int64), 2, 128, 16)
    handle.node = node
    low_latency_handle(handle)  # accepted where a one-node handle is
    assert len(handle) == 5 and handle[2:] == (2, 128, 16)
    assert handle.node is node


def test_each_part_of_a_rail_block_starts_on_16_bytes():
    # 3 tokens of top-3 ids (72 bytes), then their rows of 24 BF16 channels (144 bytes)
    blocks = _Blocks(4, (3 * 3 * 8, 3 * 24 * 2))
    assert blocks.offsets == (0, 80)
    assert blocks.block_bytes == 80 + 144
    assert blocks.total_bytes == 4 * blocks.block_bytes
    assert all(offset % 16 == 0 for offset in blocks.offsets) and blocks.block_bytes % 16 == 0


def test_a_combine_across_nodes_refuses_the_handle_of_a_one_node_dispatch():
    import pytest

    from deepep_cupy.groups.nodes import NodeTopology
    from deepep_cupy.low_latency.across_nodes import LowLatencyAcrossNodes

    class Node:  # what the path reads of its node's decode path when it is made
        device_id = 0

    path = LowLatencyAcrossNodes(Node(), transport=None, topology=NodeTopology(0, 4, 2), kernels=None)
    one_node = LowLatencyHandle(np.zeros((2, 8), np.int32), np.zeros((2, 4), np.int64), 2, 128, 16)
    with pytest.raises(ValueError, match="a dispatch across nodes"):
        path.combine(None, None, None, one_node)
    with pytest.raises(ValueError, match="this Buffer's low_latency_dispatch"):
        path.next_combine_buffer(one_node)


def test_a_low_latency_buffer_across_nodes_refuses_the_normal_calls_naming_the_way_out():
    import pytest

    from deepep_cupy.errors import BufferKindError
    from deepep_cupy.low_latency.engine import LowLatencyEngine

    class NodeEngine:  # the node's intranode engine: its normal calls would stay inside the node
        def dispatch(self, *args, **kwargs):
            raise AssertionError("a normal call reached the node's engine")

        combine = get_dispatch_layout = dispatch

    engine = LowLatencyEngine(NodeEngine(), path=None, group_barrier=lambda: None, across_nodes=True)
    for call in (engine.get_dispatch_layout, engine.dispatch, engine.combine):
        with pytest.raises(BufferKindError, match="low_latency_mode=False"):
            call()


def _path_with_recorded_exchanges(device_error_ptr):
    """A path across 2 nodes of 4 ranks (global rank 6) whose transport and relay kernels record what
    an exchange queues."""
    from deepep_cupy.groups.nodes import NodeTopology
    from deepep_cupy.low_latency.across_nodes import LowLatencyAcrossNodes

    queued = []

    class Node:
        device_id = 0
        shared_arguments = {"buffer_ptrs": 1, "num_ranks": 4, "rank": 2, "timeout_ns": 5, "error_record": 7}

    class Transport:
        size = 2

        def exchange_blocks(self, send_ptr, recv_ptr, block_bytes, stream, owners=()):
            queued.append(("exchange", stream))

    Transport.device_error_ptr = device_error_ptr

    class Kernels:
        def rail_failed(self, stream, rail_error, rail_size, ranks_per_node, node_arguments):
            queued.append(("rail_failed", stream, rail_error, rail_size, ranks_per_node, node_arguments["rank"]))

    class Memory:
        class data:
            ptr = 0

    path = LowLatencyAcrossNodes(Node(), transport=Transport(), topology=NodeTopology(6, 8, 4), kernels=Kernels())
    path._exchange(Memory(), Memory(), 64, stream=9)
    return queued


def test_an_exchange_whose_device_wait_can_time_out_is_followed_by_the_check_that_stops_the_node_call():
    # the local rail's mailboxes wait on the device: a timeout there must stop the node's decode call
    assert _path_with_recorded_exchanges(device_error_ptr=4096) == [
        ("exchange", 9), ("rail_failed", 9, 4096, 2, 4, 2)]


def test_an_exchange_with_no_device_wait_queues_nothing_after_it():
    assert _path_with_recorded_exchanges(device_error_ptr=0) == [("exchange", 9)]


def _path_agreeing_through(allgather, monkeypatch):
    """A path across 2 nodes of 2 ranks (global rank 0) whose call memory is a stand-in."""
    import deepep_cupy.low_latency.across_nodes as across_nodes
    from deepep_cupy.groups.nodes import NodeTopology

    class Node:
        device_id = 0

    monkeypatch.setattr(across_nodes, "_Scratch", lambda *shape: object())
    return across_nodes.LowLatencyAcrossNodes(Node(), transport=None, topology=NodeTopology(0, 4, 2), kernels=None,
                                              allgather=allgather)


def test_the_ranks_agree_on_a_new_call_shape_once_and_then_reuse_its_memory(monkeypatch):
    gathered = []

    def allgather(key):
        gathered.append(key)
        return [key] * 4

    path = _path_agreeing_through(allgather, monkeypatch)
    first = path._shape(128, 7168, 8)
    assert path._shape(128, 7168, 8) is first
    assert gathered == [(128, 7168, 8)]


def test_ranks_whose_decode_calls_disagree_on_sizes_raise_and_the_next_call_asks_again(monkeypatch):
    import pytest

    from deepep_cupy.errors import RankMismatchError

    gathered = []

    def allgather(key):
        gathered.append(key)
        return [key, key, (key[0], 2 * key[1], key[2]), key]

    path = _path_agreeing_through(allgather, monkeypatch)
    for _ in range(2):
        with pytest.raises(RankMismatchError, match=r"rank 2 has .*'hidden': 14336"):
            path._shape(128, 7168, 8)
    assert len(gathered) == 2
