"""The internode path on the CPU: ranks as threads, NumPy in CuPy's place, a rail transport that
copies between the threads' host buffers, and an intranode engine made of the intranode model.

Everything :class:`deepep_cupy.internode.path.InternodePath` does on the host and with its arrays is
real (checks, packing, the rail exchange's counts and byte offsets, node-local top-k, the
reduction and its roundings); only the GPU is replaced, so its results can be compared with
:mod:`deepep_cupy.reference.internode` on this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
from types import SimpleNamespace

import numpy as np
from host_fakes import DEVICE, FakeArray, FakeLib, FakeOrder, on_device

from deepep_cupy import tensors
from deepep_cupy.gpu import call_span
from deepep_cupy.groups.nodes import NodeTopology
from deepep_cupy.internode import arrays as internode_arrays
from deepep_cupy.internode import path as internode
from deepep_cupy.reference import intranode as ref


class NumpyAsCupy:
    """The part of CuPy's namespace the internode path uses, on NumPy.

    Named one by one: a new use of CuPy in the path fails here (AttributeError) until it is added,
    instead of silently running on a NumPy function of the same name that CuPy may lack or treat
    otherwise.
    """

    cuda = SimpleNamespace(ExternalStream=lambda ptr, device_id: contextlib.nullcontext(),
                           Device=lambda device_id: contextlib.nullcontext())
    int32, int64, uint8 = np.int32, np.int64, np.uint8
    # staticmethod: NumPy's array functions bind as methods when set on a class.
    add = staticmethod(np.add)
    arange = staticmethod(np.arange)
    asarray = staticmethod(np.asarray)
    ascontiguousarray = staticmethod(np.ascontiguousarray)
    concatenate = staticmethod(np.concatenate)
    cumsum = staticmethod(np.cumsum)
    empty = staticmethod(np.empty)
    empty_like = staticmethod(np.empty_like)
    take = staticmethod(np.take)
    where = staticmethod(np.where)
    zeros = staticmethod(np.zeros)

    @staticmethod
    def asnumpy(a):
        return np.asarray(a)


def host_view(array, info, device_id):
    return np.asarray(array).view(tensors.STORAGE[info.dtype_name])


def use_host_arrays(monkeypatch) -> FakeLib:
    """Route the internode path's array work to NumPy; returns the fake array library."""
    lib = FakeLib()
    monkeypatch.setitem(tensors._LIBS, FakeArray, lib)
    numpy_as_cupy = NumpyAsCupy()
    monkeypatch.setattr(internode_arrays, "cupy_module", lambda: numpy_as_cupy)
    monkeypatch.setattr(call_span, "_cupy", lambda: numpy_as_cupy)
    monkeypatch.setattr(internode_arrays, "device_view", host_view)
    monkeypatch.setattr(internode_arrays, "device_pointer", lambda a: a.ctypes.data)
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
    capturable = True

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

    def exchange_blocks(self, send_ptr, recv_ptr, block_bytes, stream, owners=()):
        self.alltoallv(send_ptr, [block_bytes] * self.size, recv_ptr, [block_bytes] * self.size, stream, owners)

    def check(self):
        pass

    def close(self):
        pass


def dtype_name_of(a) -> str:
    return {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16",
            np.dtype(np.float32): "float32"}[np.asarray(a).dtype]


class EngineHandle:
    """The node model's handle: per source local rank, the rows of its tokens this rank got. As
    DeepEP's tuple it has the two fields the fixed-block path reads: ``rank_prefix_matrix``
    (this rank's column) and ``recv_src_idx``."""

    def __init__(self, picks, num_worst_tokens, num_tokens, local=0):
        self.picks, self.num_worst_tokens, self.num_tokens = picks, num_worst_tokens, num_tokens
        self.num_recv_tokens = sum(len(p) for p in picks)
        L = len(picks)
        prefix = np.zeros((L, L), np.int32)
        prefix[:, local] = np.cumsum([len(p) for p in picks])
        src_idx = np.zeros(self.rows, np.int32)
        src_idx[:self.num_recv_tokens] = np.concatenate([np.asarray(p, np.int64) for p in picks]) if picks else []
        self._fields = {0: on_device(prefix), 3: on_device(src_idx)}

    def __getitem__(self, index):
        return self._fields[index]

    @property
    def rows(self):
        return self.num_worst_tokens or self.num_recv_tokens


class ModelEngine:
    """An intranode engine of the node's threads: the intranode contract (routing by
    is_token_in_rank, receive order by source rank then token, top-k ids made rank-local, expert
    counts summed from the senders', combine summed in float32 over the ranks in ascending order
    and rounded to x's dtype), on NumPy."""

    def __init__(self, hub: Hub, local: int):
        self.hub, self.local = hub, local
        self.destroyed = False
        self.calls = []

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                 topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None):
        self.calls.append("cached dispatch" if handle is not None else "dispatch")
        rows, scales = x if isinstance(x, tuple) else (x, None)
        host = [None if a is None else np.asarray(a) for a in (rows, scales, topk_idx, topk_weights, is_token_in_rank,
                                                                num_tokens_per_expert)]
        posted = self.hub.exchange(self.local, host)
        me, L = self.local, self.hub.size
        picks = handle.picks if handle is not None else [np.nonzero(p[4][:, me])[0] for p in posted]
        worst = handle.num_worst_tokens if handle is not None else num_worst_tokens
        if worst and sum(len(p) for p in picks) > worst:
            raise ValueError("num_worst_tokens: too many tokens")

        def gather(part, fill=0):
            if posted[0][part] is None:
                return None
            got = np.concatenate([posted[j][part][picks[j]] for j in range(L)])
            if worst:
                padded = np.full((worst, *got.shape[1:]), fill, dtype=got.dtype)
                padded[:len(got)] = got
                got = padded
            return got

        recv_x = on_device(gather(0)) if scales is None else (on_device(gather(0)), on_device(gather(1)))
        new_handle = handle or EngineHandle(picks, num_worst_tokens, len(host[0]), me)
        if handle is not None:
            return recv_x, None, None, None, handle, None
        recv_topk = recv_w = None
        per_expert = np.sum([p[5] for p in posted], axis=0)
        epr = len(per_expert) // L
        if posted[0][2] is not None:
            topk = gather(2, -1)
            mine = (topk >= me * epr) & (topk < (me + 1) * epr)
            recv_topk = on_device(np.where(mine, topk - me * epr, -1).astype(np.int64))
            if posted[0][3] is not None:
                recv_w = on_device(np.where(mine, gather(3), np.float32(0)).astype(np.float32))
        counts = per_expert[me * epr:(me + 1) * epr]
        expert_list = [] if num_worst_tokens else [int(-(-int(c) // expert_alignment) * expert_alignment)
                                                   for c in counts]
        return recv_x, recv_topk, recv_w, expert_list, new_handle, None

    def combine(self, x, handle, topk_weights=None, config=None):
        self.calls.append("combine")
        posted = self.hub.exchange(self.local, (handle, np.asarray(x),
                                                None if topk_weights is None else np.asarray(topk_weights)))
        me = self.local
        dtype = dtype_name_of(x)
        out = np.zeros((handle.num_tokens, np.asarray(x).shape[1]), np.float32)
        out_w = None if posted[0][2] is None else np.zeros((out.shape[0], posted[0][2].shape[1]), np.float32)
        for h, rows, weights in posted:  # the node's ranks, ascending
            start = sum(len(p) for p in h.picks[:me])
            tokens = h.picks[me]
            out[tokens] += ref._as_float32(rows[start:start + len(tokens)])
            if out_w is not None:
                out_w[tokens] += weights[start:start + len(tokens)]
        return on_device(ref.round_to_dtype(out, dtype)), None if out_w is None else on_device(out_w), None

    def check_kernel_errors(self):
        pass

    def destroy(self):
        self.destroyed = True


class NumpyRecords:
    """The record kernels (deepep_cupy.internode.records.RecordKernels) on NumPy arrays, with the
    kernel each call stands for."""

    def __init__(self):
        self.launched = []

    def pack(self, stream, records, layout, token_ids, count, sources):
        self.launched.append("notify")
        ids = np.arange(count) if token_ids is None else np.asarray(token_ids)[:count]
        written = ids >= 0  # -1: no token for the record (a fixed-size block's gap)
        rec = np.asarray(records)[:count][written]
        ids = ids[written]
        rows, scales, topk, weights, in_rank = (None if a is None else np.asarray(a) for a in sources)
        rec[:, :layout.row_bytes] = rows[ids]
        for offset, part, dtype in ((layout.scales_off, scales, np.float32), (layout.topk_off, topk, np.int64),
                                    (layout.weights_off, weights, np.float32), (layout.in_rank_off, in_rank, np.bool_)):
            if part is not None:
                width = np.dtype(dtype).itemsize * (part.shape[1] if part.ndim > 1 else 1)
                values = np.ascontiguousarray(part[ids].astype(dtype)).view(np.uint8).reshape(len(ids), width)
                rec[:, offset:offset + values.shape[1]] = values
        np.asarray(records)[:count][written] = rec

    def unpack(self, stream, writes_outputs, records, layout, count, out_rows, targets, first_expert=0,
               num_local_experts=0, in_rank_from=0, row_of=None, num_valid=None):
        self.launched.append("dispatch" if writes_outputs else "forward")
        rec = np.asarray(records)[:count]
        if row_of is not None:  # the records in their rows' order, then the unwritten rows as padding
            rows_of = np.asarray(row_of)[:count]
            rec = rec[np.argsort(np.where(rows_of < 0, count, rows_of), kind="stable")][:int(np.asarray(num_valid)[0])]
            count = len(rec)
        rows, scales, topk, weights, in_rank = targets
        np.asarray(rows)[:count] = rec[:, :layout.row_bytes]
        if scales is not None:
            np.asarray(scales)[:count] = _part(rec, layout.scales_off, layout.scale_bytes, np.float32)
        if topk is not None:
            ids = _part(rec, layout.topk_off, 8 * layout.num_topk, np.int64)
            mine = (ids >= first_expert) & (ids < first_expert + num_local_experts)
            np.asarray(topk)[:count] = np.where(mine, ids - first_expert, -1)
            np.asarray(topk)[count:out_rows] = -1
            if weights is not None:
                w = _part(rec, layout.weights_off, 4 * layout.num_topk, np.float32)
                np.asarray(weights)[:count] = np.where(mine, w, np.float32(0))
        if in_rank is not None:
            width = np.asarray(in_rank).shape[1]
            np.asarray(in_rank)[:count] = rec[:, layout.in_rank_off + in_rank_from:
                                              layout.in_rank_off + in_rank_from + width].view(np.bool_)

    def sum_nodes(self, stream, writes_outputs, dtype_name, out, out_weights, records, layout, slots, biases):
        self.launched.append("combine" if writes_outputs else "sum_nodes")
        rec, slots = np.asarray(records), np.asarray(slots)
        num_tokens = slots.shape[1]
        acc = np.zeros((num_tokens, layout.row_bytes // tensors.ITEMSIZE[dtype_name]), np.float32)
        for b in biases:
            if b is not None:
                acc = acc + ref._as_float32(np.asarray(b))
        acc_w = np.zeros((num_tokens, layout.num_weights), np.float32)
        storage = tensors.STORAGE[dtype_name]
        for n in range(slots.shape[0]):
            sent = slots[n] >= 0
            rows = np.ascontiguousarray(rec[slots[n][sent], :layout.row_bytes]).view(storage)
            acc[sent] = acc[sent] + ref._as_float32(rows)
            if layout.num_weights:
                acc_w[sent] = acc_w[sent] + _part(rec[slots[n][sent]], layout.weights_off, 4 * layout.num_weights,
                                                  np.float32)
        np.asarray(out)[...] = ref.round_to_dtype(acc, dtype_name).view(np.asarray(out).dtype)
        if out_weights is not None:
            np.asarray(out_weights)[...] = acc_w


class NumpyBlockKernels:
    """The block kernels (deepep_cupy.internode.block_kernels.BlockKernels) on NumPy arrays: each
    written from its docstring's contract, with NumPy's own means (a stable sort where the kernel
    counts places)."""

    def __init__(self):
        self.launched = []
        self.overflow = None
        self.closed = False

    def zero(self, stream, array):
        np.asarray(array)[...] = 0

    def route(self, stream, topk, in_rank_in, num_tokens, num_experts, num_ranks, ranks_per_node, block_tokens, *,
              in_rank_out=None, per_rank=None, per_node=None, per_expert=None, slots=None):
        self.launched.append("route")
        T, R, E = num_tokens, num_ranks, num_experts
        N = R // ranks_per_node
        ids = np.zeros((T, 0), np.int64) if topk is None else np.asarray(topk)
        valid = (ids >= 0) & (ids < E)
        if in_rank_in is not None:
            in_rank = np.asarray(in_rank_in).astype(bool)
        else:
            in_rank = (np.where(valid, ids // (E // R), -1)[:, :, None] == np.arange(R)).any(axis=1)
        in_node = in_rank.reshape(T, N, ranks_per_node).any(axis=2)
        for out, values in ((in_rank_out, in_rank), (per_rank, in_rank.sum(axis=0)), (per_node, in_node.sum(axis=0)),
                            (per_expert, np.bincount(ids[valid], minlength=E)),
                            (slots, np.where(in_node.T, np.arange(N)[:, None] * block_tokens + np.arange(T), -1))):
            if out is not None:
                np.asarray(out)[...] = values

    def number_rows(self, stream, records, record_bytes, in_rank_off, rank, num_blocks, block_tokens, num_rows,
                    row_of, counts, block_prefix):
        mine = np.asarray(records)[:, in_rank_off + rank] != 0
        inclusive = np.cumsum(mine)
        np.asarray(row_of)[...] = np.where(mine & (inclusive - 1 < num_rows), inclusive - 1, -1)
        np.asarray(counts)[:num_blocks] = np.minimum(inclusive.reshape(num_blocks, block_tokens)[:, -1], num_rows)
        np.asarray(counts)[num_blocks] = inclusive[-1]
        np.asarray(block_prefix)[...] = block_tokens * np.arange(1, num_blocks + 1)
        if inclusive[-1] > num_rows:
            self.overflow = (int(inclusive[-1]), num_rows)

    def take_overflow(self):
        found, self.overflow = self.overflow, None
        return found

    def close(self):
        self.closed = True

    def stage_counts(self, stream, in_rank, topk, num_rows, num_node_experts, per_rank, per_expert):
        in_rank = np.asarray(in_rank)[:num_rows]
        np.asarray(per_rank)[...] = in_rank.sum(axis=0)
        ids = np.zeros((num_rows, 0), np.int64) if topk is None else np.asarray(topk)[:num_rows]
        ids = ids[in_rank.any(axis=1)]
        np.asarray(per_expert)[...] = np.bincount(ids[(ids >= 0) & (ids < num_node_experts)],
                                                  minlength=num_node_experts)

    def deepep_order(self, stream, rank_prefix, recv_src_idx, local_rank, ranks_per_node, num_nodes, block_tokens,
                     num_rows, order, inverse, gbl_prefix, block_prefix):
        L = ranks_per_node
        column = np.asarray(rank_prefix).reshape(L, L)[:, local_rank]
        received = min(int(column[-1]), num_rows)
        rows = np.arange(received)
        source = (np.asarray(recv_src_idx)[:received] // block_tokens) * L + np.searchsorted(column, rows, "right")
        taken = np.concatenate([np.argsort(source, kind="stable"), np.arange(received, num_rows)])
        np.asarray(order)[...] = taken
        np.asarray(inverse)[taken] = np.arange(num_rows)
        np.asarray(gbl_prefix)[...] = np.cumsum(np.bincount(source, minlength=L * num_nodes))
        np.asarray(block_prefix)[...] = block_tokens * np.arange(1, num_nodes + 1)

    def take_rows(self, stream, dst, src, order, num_rows, row_bytes):
        np.asarray(dst)[:num_rows] = np.asarray(src)[np.asarray(order)[:num_rows]]


def _part(records, offset, width, dtype):
    return np.ascontiguousarray(records[:, offset:offset + width]).view(dtype)


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
                                  runtime=SimpleNamespace(streamWaitEvent=lambda *a: None),
                                  Stream=SimpleNamespace(null=contextlib.nullcontext()))
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


def make_paths(num_nodes: int, ranks_per_node: int, in_blocks: bool = False):
    """Per rank, its InternodePath with thread collaborators (build and use them on one thread each);
    ``in_blocks``: a rail that a graph could hold, so that the calls with num_worst_tokens go in
    fixed-size blocks (otherwise the host learns their counts, as over MPI)."""
    R = num_nodes * ranks_per_node
    rails = [Hub(num_nodes) for _ in range(ranks_per_node)]
    nodes = [Hub(ranks_per_node) for _ in range(num_nodes)]
    everyone = Hub(R)
    paths = []
    for rank in range(R):
        topo = NodeTopology(rank, R, ranks_per_node)
        engine = ModelEngine(nodes[topo.node], topo.local_rank) if ranks_per_node > 1 else None
        rail = ThreadRail(rails[topo.local_rank], topo.node)
        rail.capturable = in_blocks
        path = internode.InternodePath(topo, rail, DEVICE, engine, EventOrder(), records=NumpyRecords(),
                                       vote=lambda obj, rank=rank: everyone.exchange(rank, obj),
                                       block_kernels=NumpyBlockKernels())
        path.everyone = everyone
        paths.append(path)
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
        yield p.everyone
        yield p.transport.hub
        if p.intranode is not None:
            yield p.intranode.hub
