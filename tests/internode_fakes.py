"""The internode path on the CPU: ranks as threads, NumPy in CuPy's place, a rail transport that
copies between the threads' host buffers, and an intranode engine made of the intranode model.

Everything :class:`deepep_cupy.internode.InternodePath` does on the host and with its arrays is
real (checks, packing, the rail exchange's counts and byte offsets, node-local top-k, the
reduction and its roundings); only the GPU is replaced, so its results can be compared with
:mod:`deepep_cupy.internode_reference` on this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
from host_fakes import DEVICE, FakeArray, FakeLib, FakeOrder, on_device

from deepep_cupy import internode, tensors
from deepep_cupy import reference as ref

try:
    from deepep_cupy.nodes import NodeTopology
except ImportError:  # the transport helper's module, not merged yet: the same shape
    class NodeTopology(NamedTuple):
        rank: int
        num_ranks: int
        ranks_per_node: int

        @property
        def num_nodes(self):
            return self.num_ranks // self.ranks_per_node

        @property
        def node(self):
            return self.rank // self.ranks_per_node

        @property
        def local_rank(self):
            return self.rank % self.ranks_per_node


class NumpyAsCupy:
    """The part of CuPy's namespace the internode path uses, on NumPy."""

    cuda = SimpleNamespace(ExternalStream=lambda ptr, device_id: contextlib.nullcontext(),
                           Device=lambda device_id: contextlib.nullcontext())

    @staticmethod
    def asnumpy(a):
        return np.asarray(a)

    def __getattr__(self, name):
        return getattr(np, name)


def host_view(array, info, device_id):
    return np.asarray(array).view(tensors.STORAGE[info.dtype_name])


def use_host_arrays(monkeypatch) -> FakeLib:
    """Route the internode path's array work to NumPy; returns the fake array library."""
    lib = FakeLib()
    monkeypatch.setitem(tensors._LIBS, FakeArray, lib)
    numpy_as_cupy = NumpyAsCupy()
    monkeypatch.setattr(internode, "_cupy", lambda: numpy_as_cupy)
    monkeypatch.setattr(internode, "device_view", host_view)
    monkeypatch.setattr(internode, "device_pointer", lambda a: a.ctypes.data)
    return lib


class Hub:
    """A reusable exchange of one object per thread."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size

    def exchange(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        table = list(self.slots)
        self.barrier.wait()
        return table


class ThreadRail:
    """A RailTransport between threads: host pointers, byte offsets as the interface says."""

    name = "threads"

    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.calls = []

    def alltoall_ints(self, values):
        values = [int(v) for v in values]
        assert len(values) == self.size
        table = self.hub.exchange(self.rank, values)
        return [table[peer][self.rank] for peer in range(self.size)]

    def alltoallv(self, send_ptr, send_bytes, recv_ptr, recv_bytes, stream, owners=()):
        self.calls.append((list(send_bytes), list(recv_bytes)))
        table = self.hub.exchange(self.rank, (send_ptr, list(send_bytes)))
        offset = 0
        for peer in range(self.size):
            peer_ptr, peer_send = table[peer]
            assert peer_send[self.rank] == recv_bytes[peer], (peer, peer_send, recv_bytes)
            if recv_bytes[peer]:
                ctypes.memmove(recv_ptr + offset, peer_ptr + sum(peer_send[:self.rank]), recv_bytes[peer])
            offset += recv_bytes[peer]
        self.hub.barrier.wait()  # nobody's send buffer goes before every peer has copied from it

    def close(self):
        pass


def dtype_name_of(a) -> str:
    return {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16",
            np.dtype(np.float32): "float32"}[np.asarray(a).dtype]


class EngineHandle:
    def __init__(self, results, local, topks, weights, num_worst_tokens):
        self.results, self.local, self.topks, self.weights = results, local, topks, weights
        self.num_recv_tokens = len(results[local]["recv_src_idx"])
        self.num_worst_tokens = num_worst_tokens

    @property
    def rows(self):
        return self.num_worst_tokens or self.num_recv_tokens


class ModelEngine:
    """An intranode engine of the node's threads made of reference.dispatch/combine."""

    def __init__(self, hub: Hub, local: int, num_channels: int = 4):
        self.hub, self.local, self.num_channels = hub, local, num_channels
        self.destroyed = False

    def get_dispatch_layout(self, topk_idx, num_experts):
        topk = np.asarray(topk_idx)
        topk = np.where(topk < num_experts, topk, -1)  # the GPU layout does not count ids out of range
        per_rank, per_expert, in_rank = ref.get_dispatch_layout(topk, num_experts, self.hub.size)
        return on_device(per_rank), None, on_device(per_expert), on_device(in_rank), None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                 topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None):
        rows, scales = x if isinstance(x, tuple) else (x, None)
        posted = self.hub.exchange(self.local, (np.asarray(rows), None if scales is None else np.asarray(scales),
                                                None if topk_idx is None else np.asarray(topk_idx),
                                                None if topk_weights is None else np.asarray(topk_weights),
                                                None if num_tokens_per_expert is None else len(num_tokens_per_expert)))
        if handle is not None:
            topks, weights, num_experts = handle.topks, handle.weights, handle.results[0]["num_experts"]
        else:
            topks, weights, num_experts = [p[2] for p in posted], [p[3] for p in posted], posted[0][4]
            if weights[0] is None:
                weights = None
        results = ref.dispatch([p[0] for p in posted], topks, num_experts, self.num_channels, topk_weights=weights,
                               x_scales=None if scales is None else [p[1] for p in posted],
                               expert_alignment=expert_alignment)
        results[0]["num_experts"] = num_experts
        mine = results[self.local]
        worst = handle.num_worst_tokens if handle is not None else num_worst_tokens
        new_handle = handle or EngineHandle(results, self.local, topks, weights, num_worst_tokens)

        def pad(a, fill=None):
            if a is None:
                return None
            if worst:
                padded = np.full((worst, *a.shape[1:]), 0 if fill is None else fill, dtype=a.dtype)
                padded[:len(a)] = a
                a = padded
            return on_device(a)

        recv_x = pad(mine["recv_x"]) if mine["recv_x_scales"] is None else \
            (pad(mine["recv_x"]), pad(mine["recv_x_scales"]))
        if handle is not None:
            return recv_x, None, None, None, handle, None
        expert_list = [] if num_worst_tokens else mine["num_recv_tokens_per_expert_list"]
        return recv_x, pad(mine["recv_topk_idx"], -1), pad(mine["recv_topk_weights"]), expert_list, new_handle, None

    def combine(self, x, handle, topk_weights=None, config=None):
        n = handle.num_recv_tokens
        posted = self.hub.exchange(self.local, (np.asarray(x)[:n],
                                                None if topk_weights is None else np.asarray(topk_weights)[:n]))
        weights = None if posted[0][1] is None else [p[1] for p in posted]
        rows, w = ref.combine([p[0] for p in posted], handle.results, topk_weights=weights)[self.local]
        return on_device(ref.round_to_dtype(rows, dtype_name_of(x))), None if w is None else on_device(w), None

    def check_kernel_errors(self):
        pass

    def destroy(self):
        self.destroyed = True


class EventOrder(FakeOrder):
    """A FakeOrder whose asynchronous calls return events with an address (waitable by EventOverlap)."""

    def finish(self, caller_ptr, run_on, lib, async_finish, arrays, outputs=(), allocated_on_comm=False,
               check_errors=None):
        done = super().finish(caller_ptr, run_on, lib, async_finish, arrays, outputs, allocated_on_comm, check_errors)
        if done.event is not None:
            done.event = SimpleNamespace(ptr=0xE7, synchronize=lambda: None)
        return done


def fake_cupy_module():
    """A stand-in ``cupy`` module for the GPU workers run on the CPU: host arrays that claim a
    device, one stream, no events to wait for."""
    stream = SimpleNamespace(ptr=0, synchronize=lambda: None)
    module = types.ModuleType("cupy")
    module.cuda = SimpleNamespace(get_current_stream=lambda: stream, Device=lambda *a: SimpleNamespace(id=0),
                                  runtime=SimpleNamespace(streamWaitEvent=lambda *a: None))
    module.asarray = lambda a: on_device(np.asarray(a))
    module.asnumpy = np.asarray
    module.asfortranarray = lambda a: np.asfortranarray(a).view(type(a))
    return module


class FakeInternodeBuffer:
    """The internode Buffer's surface the GPU workers use, over one rank's InternodePath
    (``capture``: no event, as the fake order needs none)."""

    def __init__(self, path):
        self.path, self.rank, self.num_ranks = path, path.topology.rank, path.topology.num_ranks
        self.topology = path.topology
        self.get_dispatch_layout, self.dispatch, self.combine = path.get_dispatch_layout, path.dispatch, path.combine

    @staticmethod
    def capture(stream=None):
        return None


def make_paths(num_nodes: int, ranks_per_node: int):
    """Per rank, its InternodePath with thread collaborators (build and use them on one thread each)."""
    R = num_nodes * ranks_per_node
    rails = [Hub(num_nodes) for _ in range(ranks_per_node)]
    nodes = [Hub(ranks_per_node) for _ in range(num_nodes)]
    paths = []
    for rank in range(R):
        topo = NodeTopology(rank, R, ranks_per_node)
        engine = ModelEngine(nodes[topo.node], topo.local_rank) if ranks_per_node > 1 else None
        paths.append(internode.InternodePath(topo, ThreadRail(rails[topo.local_rank], topo.node), DEVICE, engine,
                                             EventOrder()))
    return paths


def run_ranks(paths, body):
    """``body(rank, path)`` on a thread per rank; their results, or the first exception raised."""
    results, errors = [None] * len(paths), []

    def run(rank):
        try:
            results[rank] = body(rank, paths[rank])
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)
            for hub in {id(h): h for h in _hubs(paths)}.values():
                hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _hubs(paths):
    for p in paths:
        yield p.transport.hub
        if p.intranode is not None:
            yield p.intranode.hub
