"""Rail transports on the CPU: which transport a group gets, and each transport's calls.

Host memory stands in for device memory (tests/transport_fakes.py): the local transport runs
between threads, the MPI transport under mpiexec (tests/workers/transport_worker.py) and on a
fake communicator, the NCCL transports on fakes that record their calls. The same moves on GPUs:
tests/test_gpu_transports.py.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
from _harness import WORKERS, describe, run_mpi, worker_records
from transport_fakes import FakeComm, FakeNccl, HostMemory, expected_recv, packed_send, random_counts

from deepep_cupy.errors import DeepEPTimeoutError, RankFailed, RankMismatchError
from deepep_cupy.groups.group import Group, MPIGroup, TorchGroup
from deepep_cupy.groups.local import run_local_group
from deepep_cupy.transports import factory
from deepep_cupy.transports.base import offsets
from deepep_cupy.transports.factory import TRANSPORT_ENV, choose_kind, make_transport
from deepep_cupy.transports.local import LocalRailTransport
from deepep_cupy.transports.mpi import MPI_CUDA_AWARE_ENV, MpiRailTransport, mpi_is_cuda_aware
from deepep_cupy.transports.nccl import NcclRailTransport, TorchNcclRailTransport

STREAM = 0x5157


def run(fn, n, **kwargs):
    kwargs.setdefault("use_devices", False)
    kwargs.setdefault("timeout_s", 20.0)
    return run_local_group(fn, n, **kwargs)


# ---------------------------------------------------------------------------------------------
# Which transport



def _torch_group(backend, monkeypatch):
    group = object.__new__(TorchGroup)   # no torch.distributed job on the CPU runner
    monkeypatch.setattr(factory, "_torch_backend", lambda g: backend)
    return group


class ThreadLike(Group):
    in_process = True
    rank = 0
    size = 1

    def allgather(self, obj):
        return [obj]

    def barrier(self):
        pass


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)


def test_an_in_process_group_gets_the_local_transport(no_env):
    assert choose_kind(None, ThreadLike()) == "local"


def test_a_torch_nccl_group_gets_nccl(no_env, monkeypatch):
    assert choose_kind(None, _torch_group("nccl", monkeypatch)) == "nccl"


def test_a_torch_gloo_group_gets_the_staged_torch_transport_and_not_nccl(no_env, monkeypatch):
    assert choose_kind(None, _torch_group("gloo", monkeypatch)) == "torch"
    assert choose_kind("torch", _torch_group("nccl", monkeypatch)) == "torch"
    with pytest.raises(ValueError, match="'nccl' over a torch.distributed group needs the NCCL backend"):
        choose_kind("nccl", _torch_group("gloo", monkeypatch))


def test_an_mpi_communicator_gets_nccl_where_cupy_loads_it(no_env, monkeypatch):
    monkeypatch.setattr(factory, "nccl_module", lambda: FakeNccl())
    assert choose_kind(None, MPIGroup(FakeComm())) == "nccl"


def test_an_mpi_communicator_gets_mpi_without_nccl(no_env, monkeypatch):
    monkeypatch.setattr(factory, "nccl_module", lambda: None)
    assert choose_kind(None, MPIGroup(FakeComm())) == "mpi"
    with pytest.raises(ValueError, match="'nccl' over an mpi4py communicator needs NCCL: .*DEEPEP_CUPY_NCCL_LIB"):
        choose_kind("nccl", MPIGroup(FakeComm()))


def test_the_environment_variable_chooses_when_kind_is_none(monkeypatch):
    monkeypatch.setattr(factory, "nccl_module", lambda: FakeNccl())
    monkeypatch.setenv(TRANSPORT_ENV, "MPI")
    assert choose_kind(None, MPIGroup(FakeComm())) == "mpi"
    assert choose_kind("nccl", MPIGroup(FakeComm())) == "nccl"


@pytest.mark.parametrize("kind, group, needs", [
    ("mpi", ThreadLike, "an mpi4py communicator"),
    ("local", lambda: MPIGroup(FakeComm()), "an in-process group"),
    ("nccl", ThreadLike, "a torch.distributed NCCL group or an mpi4py communicator"),
])
def test_a_kind_the_group_cannot_use_is_refused(no_env, kind, group, needs):
    with pytest.raises(ValueError, match=f"transport: '{kind}' needs {needs}"):
        choose_kind(kind, group())


def test_an_unknown_kind_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"kind: expected one of \['nccl', 'mpi', 'torch', 'local'\], got 'ucx'"):
        choose_kind("ucx", ThreadLike())
    monkeypatch.setenv(TRANSPORT_ENV, "rdma")
    with pytest.raises(ValueError, match=f"{TRANSPORT_ENV}: expected one of"):
        choose_kind(None, ThreadLike())


def test_offsets_are_exclusive_prefix_sums():
    assert offsets([3, 0, 5, 1]) == [0, 3, 3, 8]


# ---------------------------------------------------------------------------------------------
# make_transport on an in-process group: rails found from every rank's rail


def test_make_transport_splits_the_group_into_the_rails(no_env):
    def body(group):
        rail = list(range(group.rank % 2, 6, 2))
        t = make_transport(None, group, rail, device_id=0, timeout_s=5, memory=HostMemory())
        out = (t.name, t.rank, t.size, t.rail, t.alltoall_ints([10 * group.rank + p for p in range(3)]))
        t.close()
        return out

    results = run(body, 6)
    for r, (name, rank, size, rail, ints) in enumerate(results):
        assert (name, rank, size, rail) == ("local", r // 2, 3, list(range(r % 2, 6, 2)))
        assert ints == [10 * g + r // 2 for g in rail]


def test_make_transport_refuses_a_rail_without_this_rank(no_env):
    with pytest.raises(RankFailed) as info:
        run(lambda g: make_transport("local", g, [0], 0, 5), 2)
    assert sorted(info.value.failures) == [0, 1]
    assert str(info.value.failures[0]) == "rank 1: rail: expected a list of ranks holding this rank (1), got [0]"


def test_make_transport_refuses_rails_that_do_not_partition_the_group(no_env):
    with pytest.raises(RankFailed) as info:
        run(lambda g: make_transport("local", g, [0, 1] if g.rank < 2 else [1, 2], 0, 5), 3)
    assert isinstance(info.value.exception, ValueError)
    assert "partition: expected non-empty, disjoint lists" in str(info.value.exception)


class ThreadsAsMpi(MPIGroup):
    """A rank of a thread group that looks like an mpi4py communicator to the transport choice."""

    def __init__(self, group):
        self._group = group

    rank = property(lambda self: self._group.rank)
    size = property(lambda self: self._group.size)

    def allgather(self, obj):
        return self._group.allgather(obj)


def _rank():
    return int(threading.current_thread().name.rsplit("-", 1)[1])


def _agree_on(n, monkeypatch, kind=None, nccl_on=lambda r: True, gpu_of=lambda r: f"0000:{r:02x}:00.0",
              rails=None):
    monkeypatch.setattr(factory, "nccl_module", lambda: FakeNccl() if nccl_on(_rank()) else None)
    monkeypatch.setattr(factory, "gpu_address", lambda device_id: gpu_of(_rank()))
    rails = rails or [list(range(n))] * n
    return run(lambda g: factory._agree(ThreadsAsMpi(g), kind, rails[g.rank], 0), n)


def test_every_rank_takes_nccl_when_every_rank_can(no_env, monkeypatch):
    assert _agree_on(4, monkeypatch, rails=[[0, 2], [1, 3], [0, 2], [1, 3]]) == [
        ("nccl", [[0, 2], [1, 3]])] * 4


def test_every_rank_takes_mpi_when_one_rank_cannot_load_nccl(no_env, monkeypatch):
    assert [k for k, _ in _agree_on(3, monkeypatch, nccl_on=lambda r: r != 1)] == ["mpi"] * 3


def test_ranks_of_a_rail_sharing_a_gpu_take_mpi(no_env, monkeypatch):
    assert [k for k, _ in _agree_on(2, monkeypatch, gpu_of=lambda r: "0000:01:00.0")] == ["mpi"] * 2


def test_nccl_asked_for_ranks_sharing_a_gpu_is_refused_on_every_rank(no_env, monkeypatch):
    with pytest.raises(RankFailed) as info:
        _agree_on(2, monkeypatch, kind="nccl", gpu_of=lambda r: "0000:01:00.0")
    assert all(isinstance(e, ValueError) and "NCCL refuses two ranks on one GPU" in str(e)
               for e in info.value.failures.values())
    assert sorted(info.value.failures) == [0, 1]


def test_nccl_asked_on_one_rank_only_for_ranks_sharing_a_gpu_is_refused_on_every_rank(no_env, monkeypatch):
    # Rank 1 chooses automatically (nccl too): none may go on into the split while another raises.
    monkeypatch.setattr(factory, "nccl_module", lambda: FakeNccl())
    monkeypatch.setattr(factory, "gpu_address", lambda device_id: "0000:01:00.0")
    with pytest.raises(RankFailed) as info:
        run(lambda g: factory._agree(ThreadsAsMpi(g), None if g.rank else "nccl", [0, 1], 0), 2)
    assert sorted(info.value.failures) == [0, 1]
    assert all(isinstance(e, ValueError) and "NCCL refuses two ranks on one GPU" in str(e)
               for e in info.value.failures.values())


def test_a_kind_one_rank_cannot_use_is_refused_on_every_rank(no_env, monkeypatch):
    with pytest.raises(RankFailed) as info:
        _agree_on(3, monkeypatch, kind="nccl", nccl_on=lambda r: r != 2)
    failures = info.value.failures
    assert sorted(failures) == [0, 1, 2] and all(isinstance(e, ValueError) for e in failures.values())
    assert str(failures[0]).startswith("rank 2: transport: 'nccl' over an mpi4py communicator needs")


def test_ranks_asking_for_different_kinds_are_refused(monkeypatch):
    monkeypatch.setattr(factory, "nccl_module", lambda: FakeNccl())
    monkeypatch.setattr(factory, "gpu_address", lambda device_id: f"gpu{_rank()}")
    with pytest.raises(RankFailed) as info:
        run(lambda g: factory._agree(ThreadsAsMpi(g), "mpi" if g.rank else "nccl", [0, 1], 0), 2)
    assert all(isinstance(e, RankMismatchError) for e in info.value.failures.values())
    assert "ranks chose different transports, got ['nccl', 'mpi']" in str(info.value.exception)


# ---------------------------------------------------------------------------------------------
# The local transport (threads, host memory)


def _local_alltoallv(group, counts, seed, memory, timeout_s=10.0):
    rank = group.rank
    t = LocalRailTransport(group, list(range(group.size)), device_id=rank, timeout_s=timeout_s, memory=memory)
    send = packed_send(rank, counts, seed)
    recv_bytes = [counts[p][rank] for p in range(group.size)]
    recv = np.full(sum(recv_bytes) + 1, 0xEE, np.uint8)   # one byte more: nothing writes past the end
    t.alltoallv(send.ctypes.data, counts[rank], recv.ctypes.data, recv_bytes, STREAM)
    t.close()
    return send, recv


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_local_alltoallv_delivers_every_chunk(size):
    rng = np.random.default_rng(size)
    for trial in range(3):
        counts = random_counts(rng, size)
        results = run(lambda g, c=counts, s=trial: _local_alltoallv(g, c, s, HostMemory(g.rank)), size)
        for rank, (_, recv) in enumerate(results):
            np.testing.assert_array_equal(recv[:-1], expected_recv(rank, counts, trial))
            assert recv[-1] == 0xEE


def test_local_exchange_blocks_on_host_memory_delivers_block_p_to_peer_p_and_is_not_capturable():
    block = 8

    def exchange(g):
        t = LocalRailTransport(g, list(range(g.size)), device_id=g.rank, timeout_s=10.0, memory=HostMemory(g.rank))
        send = np.array([[16 * g.rank + p] * block for p in range(g.size)], np.uint8)
        recv = np.zeros((g.size, block), np.uint8)
        t.exchange_blocks(send.ctypes.data, recv.ctypes.data, block, STREAM)
        capturable = t.capturable
        t.close()
        return recv, capturable

    for rank, (recv, capturable) in enumerate(run(exchange, 3)):
        assert recv.tolist() == [[16 * p + rank] * block for p in range(3)]
        assert not capturable  # host memory has no mailboxes: the event-ordered copies stand in


def test_local_alltoallv_moves_nothing_when_every_count_is_zero():
    results = run(lambda g: _local_alltoallv(g, [[0] * 3] * 3, 0, HostMemory(g.rank)), 3)
    assert all(recv.tolist() == [0xEE] for _, recv in results)


def test_local_alltoallv_orders_each_copy_after_the_peers_ready_event():
    counts = [[0, 5, 7], [3, 0, 0], [2, 4, 1]]
    memories = [HostMemory(r) for r in range(3)]
    run(lambda g: _local_alltoallv(g, counts, 1, memories[g.rank]), 3)
    ready = {r: memories[r].calls[0][1] for r in range(3)}     # each made its ready event first
    done = {r: memories[r].calls[1][1] for r in range(3)}
    for r, memory in enumerate(memories):
        calls = [c for c in memory.calls if c[0] in ("record", "wait", "copy_peer")]
        assert calls[0] == ("record", ready[r], STREAM)
        copies = [i for i, c in enumerate(calls) if c[0] == "copy_peer"]
        for i in copies:
            dst_device = calls[i][2]
            assert calls[i][-1] == STREAM and calls[i][4] == r
            if dst_device != r:
                assert ("wait", STREAM, ready[dst_device]) in calls[:i]
        record_done = calls.index(("record", done[r], STREAM))
        assert record_done > max(copies)
        waited = [c[2] for c in calls[record_done:] if c[0] == "wait"]
        assert waited == [done[p] for p in range(3) if p != r and counts[p][r]]


def test_local_alltoallv_refuses_counts_that_disagree_on_every_rank():
    def body(group):
        t = LocalRailTransport(group, [0, 1], group.rank, 5.0, memory=HostMemory())
        buf = np.zeros(16, np.uint8)
        send = [0, 4] if group.rank == 0 else [3, 0]
        t.alltoallv(buf.ctypes.data, send, buf.ctypes.data, [0, 4] if group.rank == 0 else [5, 0], STREAM)

    with pytest.raises(RankFailed) as info:
        run(body, 2)
    assert all(isinstance(e, RankMismatchError) for e in info.value.failures.values())
    assert "rail rank 0 sends 4 bytes to rail rank 1, which expects 5" in str(info.value.exception)


def test_local_alltoallv_names_the_peer_that_never_comes():
    def body(group):
        t = LocalRailTransport(group, [4, 7], group.rank, 0.3, memory=HostMemory())
        if group.rank == 0:
            buf = np.zeros(4, np.uint8)
            t.alltoallv(buf.ctypes.data, [0, 2], buf.ctypes.data, [0, 2], STREAM)

    with pytest.raises(RankFailed) as info:
        run(body, 2)
    assert isinstance(info.value.exception, DeepEPTimeoutError)
    message = str(info.value.exception)
    assert message.startswith("rank 4: local rail alltoallv timed out (rail ranks 0..1 are global ranks [4, 7])")
    assert "for ranks [1]" in message


def test_local_alltoallv_checks_its_counts_before_anything_moves():
    def body(group):
        t = LocalRailTransport(group, [0, 1], group.rank, 5.0, memory=HostMemory())
        with pytest.raises(ValueError, match=r"send_bytes: expected 2 non-negative byte counts"):
            t.alltoallv(0, [1, -1], 0, [0, 0], STREAM)
        with pytest.raises(ValueError, match=r"recv_bytes: expected 2 non-negative byte counts"):
            t.alltoallv(0, [0, 0], 0, [0, 0, 0], STREAM)
        with pytest.raises(TypeError, match=r"values: expected 2 ints"):
            t.alltoall_ints(["x", 1])
        return t.alltoall_ints([group.rank, 100 + group.rank])

    assert run(body, 2) == [[0, 1], [100, 101]]


# ---------------------------------------------------------------------------------------------
# The NCCL transport over a CuPy communicator: the calls it makes


def _nccl_transports(size, nccl):
    memories = [HostMemory(r) for r in range(size)]

    def body(group):
        return NcclRailTransport(group, list(range(size)), group.rank, 5.0, nccl=nccl, memory=memories[group.rank])

    return run(body, size), memories


def test_nccl_every_rank_joins_the_communicator_of_rank_0s_unique_id():
    nccl = FakeNccl(unique_id=(1, 2, 3))
    transports_, _ = _nccl_transports(3, nccl)
    assert nccl.calls.count(("get_unique_id",)) == 1
    assert sorted(c for c in nccl.calls if c[0] == "NcclCommunicator") == [
        ("NcclCommunicator", 3, (1, 2, 3), r) for r in range(3)]


def test_nccl_alltoallv_is_one_group_of_sends_and_receives_at_the_packed_offsets():
    nccl = FakeNccl()
    (t, *_), memories = _nccl_transports(3, nccl)
    nccl.calls.clear()
    send, recv = np.arange(10, dtype=np.uint8), np.zeros(11, np.uint8)
    s, r = send.ctypes.data, recv.ctypes.data
    t.alltoallv(s, [4, 0, 6], r, [4, 7, 0], STREAM)
    assert nccl.calls == [
        ("groupStart",),
        ("recv", r + 4, 7, FakeNccl.NCCL_INT8, 1, STREAM),
        ("send", s + 4, 6, FakeNccl.NCCL_INT8, 2, STREAM),
        ("groupEnd",),
    ]
    # The self entry is a device-to-device copy on the stream, queued before the group.
    assert memories[0].calls == [("copy", r, s, 4, STREAM)]
    assert recv[:4].tolist() == [0, 1, 2, 3]


def test_nccl_exchange_blocks_is_one_group_of_equal_sends_and_receives_that_a_graph_can_hold():
    nccl = FakeNccl()
    (t, *_), memories = _nccl_transports(3, nccl)
    nccl.calls.clear()
    send, recv = np.arange(12, dtype=np.uint8), np.zeros(12, np.uint8)
    s, r = send.ctypes.data, recv.ctypes.data
    t.exchange_blocks(s, r, 4, STREAM)
    assert t.capturable
    assert nccl.calls == [
        ("groupStart",),
        ("send", s + 4, 4, FakeNccl.NCCL_INT8, 1, STREAM), ("recv", r + 4, 4, FakeNccl.NCCL_INT8, 1, STREAM),
        ("send", s + 8, 4, FakeNccl.NCCL_INT8, 2, STREAM), ("recv", r + 8, 4, FakeNccl.NCCL_INT8, 2, STREAM),
        ("groupEnd",),
    ]
    assert memories[0].calls == [("copy", r, s, 4, STREAM)]


def test_nccl_alltoallv_with_nothing_to_move_makes_no_nccl_call():
    nccl = FakeNccl()
    (_, t, _), memories = _nccl_transports(3, nccl)
    nccl.calls.clear()
    t.alltoallv(1000, [0, 0, 0], 5000, [0, 0, 0], STREAM)
    assert nccl.calls == [] and memories[1].calls == []


def test_nccl_alltoallv_ends_the_group_when_a_call_fails():
    nccl = FakeNccl()
    (t, *_), _ = _nccl_transports(2, nccl)

    def refuse(*args):
        raise RuntimeError("ncclInvalidUsage")

    t._comm.send = refuse
    nccl.calls.clear()
    with pytest.raises(RuntimeError, match="ncclInvalidUsage"):
        t.alltoallv(0, [0, 5], 0, [0, 5], STREAM)
    assert nccl.calls == [("groupStart",), ("groupEnd",)]


@pytest.mark.parametrize("make", [
    lambda g: LocalRailTransport(g, [0, 1], g.rank, 5.0, memory=HostMemory(g.rank)),
    lambda g: NcclRailTransport(g, [0, 1], g.rank, 5.0, nccl=FakeNccl(), memory=HostMemory(g.rank)),
], ids=["local", "nccl"])
def test_a_closed_transport_refuses_every_call(make):
    def body(group):
        t = make(group)
        t.close()
        t.close()
        for call in (lambda: t.alltoallv(0, [0, 0], 0, [0, 0], STREAM), lambda: t.alltoall_ints([0, 0])):
            with pytest.raises(ValueError, match=f"rank {group.rank}: the {t.name} rail transport was closed"):
                call()

    run(body, 2)   # a rank whose call was not refused fails the run


def test_nccl_host_alltoall_and_close():
    nccl = FakeNccl()
    memories = [HostMemory(r) for r in range(2)]

    def body(group):
        t = NcclRailTransport(group, [4, 9], group.rank, 5.0, nccl=nccl, memory=memories[group.rank])
        ints = t.alltoall_ints([group.rank * 10, group.rank * 10 + 1])
        t.close()
        t.close()
        return ints

    assert run(body, 2) == [[0, 10], [1, 11]]
    assert nccl.calls.count(("destroy",)) == 2


def test_nccl_refuses_a_self_entry_that_does_not_match():
    (t, _), _ = _nccl_transports(2, FakeNccl())
    with pytest.raises(ValueError, match="this rank sends itself 3 bytes but receives 2"):
        t.alltoallv(0, [3, 0], 0, [2, 0], STREAM)


# ---------------------------------------------------------------------------------------------
# The NCCL transport over a torch.distributed group: the calls it makes


class FakeTorch:
    """The parts of ``torch`` the torch NCCL transport uses, recording what it asks."""

    uint8 = "uint8"

    def __init__(self):
        self.calls = []
        self.current_stream = None
        outer = self

        class Cuda:
            @staticmethod
            def ExternalStream(ptr, device):  # noqa: N802
                return ("ExternalStream", ptr, device)

            @staticmethod
            def default_stream(device):
                return ("default_stream", device)

            @staticmethod
            def stream(s):
                class Ctx:
                    def __enter__(self):
                        outer.current_stream = s

                    def __exit__(self, *exc):
                        outer.current_stream = None

                return Ctx()

            @staticmethod
            def device(d):
                import contextlib
                return contextlib.nullcontext()

        class Dist:
            @staticmethod
            def all_to_all_single(output, input, output_split_sizes, input_split_sizes, group):
                outer.calls.append(("all_to_all_single", output, input, output_split_sizes, input_split_sizes,
                                    group, outer.current_stream))

        self.cuda, self.distributed = Cuda(), Dist()

    @staticmethod
    def device(kind, index):
        return (kind, index)

    @staticmethod
    def as_tensor(obj, device):
        cai = obj.__cuda_array_interface__
        assert cai["typestr"] == "|u1" and cai["version"] == 3 and "stream" not in cai
        return ("tensor", cai["data"][0], cai["shape"], device)

    def empty(self, n, dtype, device):
        return ("empty", n, dtype, device)


class RailOfTorch:
    """What the torch transport needs of its rail group."""

    def __init__(self, rank, size):
        self.rank, self.size, self.process_group, self.freed = rank, size, "rail-pg", 0

    def allgather(self, obj):
        return [obj] * self.size

    def free(self):
        self.freed += 1


def test_torch_alltoallv_is_all_to_all_single_on_views_of_the_buffers_on_the_callers_stream():
    torch = FakeTorch()
    t = TorchNcclRailTransport(RailOfTorch(1, 3), [1, 3, 5], device_id=2, timeout_s=5, torch=torch)
    t.alltoallv(1000, [4, 3, 0], 5000, [0, 3, 9], STREAM)
    assert torch.calls == [(
        "all_to_all_single",
        ("tensor", 5000, (12,), ("cuda", 2)), ("tensor", 1000, (7,), ("cuda", 2)),
        [0, 3, 9], [4, 3, 0], "rail-pg", ("ExternalStream", STREAM, ("cuda", 2)))]


def test_torch_alltoallv_on_the_legacy_default_stream_runs_on_pytorchs_default_stream():
    # torch.cuda.ExternalStream(0) would be a new stream of PyTorch's pool, unordered with the caller's.
    torch = FakeTorch()
    t = TorchNcclRailTransport(RailOfTorch(1, 3), [1, 3, 5], device_id=2, timeout_s=5, torch=torch)
    t.alltoallv(1000, [4, 3, 0], 5000, [0, 3, 9], 0)
    assert torch.calls[0][-1] == ("default_stream", ("cuda", 2))


def test_torch_alltoallv_takes_part_even_with_nothing_to_move():
    torch = FakeTorch()
    t = TorchNcclRailTransport(RailOfTorch(0, 2), [0, 1], device_id=0, timeout_s=5, torch=torch)
    t.alltoallv(1000, [0, 0], 5000, [0, 0], STREAM)
    (_, output, input, *_), = torch.calls
    assert output == input == ("empty", 0, "uint8", ("cuda", 0))


def test_torch_close_frees_the_rail_group_once():
    rail = RailOfTorch(0, 2)
    t = TorchNcclRailTransport(rail, [0, 1], device_id=0, timeout_s=5, torch=FakeTorch())
    t.close()
    t.close()
    assert rail.freed == 1
    with pytest.raises(ValueError, match="closed"):
        t.alltoallv(0, [0, 0], 0, [0, 0], STREAM)


# ---------------------------------------------------------------------------------------------
# The MPI transport on a fake communicator: Ialltoallv's arguments, the arrival stamps, the deadline


class FakeRequest:
    def __init__(self, done=True, on_done=None):
        self.done, self.on_done = done, on_done

    def Test(self):
        if self.done and self.on_done is not None:
            self.on_done()
            self.on_done = None
        return self.done


class FakeMpiComm(FakeComm):
    """Point-to-point and Ialltoallv that complete at once, except from the peers in ``silent``."""

    def __init__(self, rank, size, silent=(), stalled=False, stamps=None):
        super().__init__(rank, size)
        self.silent, self.stalled, self.calls, self.stamps = set(silent), stalled, [], stamps or {}
        self.call = 0

    def Irecv(self, buf, source, tag):
        array, stamp = buf[0], self.stamps.get(source, self.call)

        def arrive():
            array[0] = stamp

        return FakeRequest(source not in self.silent, arrive)

    def Isend(self, buf, dest, tag):
        return FakeRequest()

    def Ialltoallv(self, sendbuf, recvbuf):
        self.calls.append(("Ialltoallv", sendbuf[1], sendbuf[2], recvbuf[1], recvbuf[2],
                           type(sendbuf[0]).__name__, len(sendbuf[0]), len(recvbuf[0])))
        self.call += 1
        return FakeRequest(not self.stalled)


def _mpi_on_fake(comm, cuda_aware, timeout_s=5.0):
    memory = HostMemory()
    return MpiRailTransport(MPIGroup(comm), [10 * r for r in range(comm.size)], 0, timeout_s,
                            cuda_aware=cuda_aware, memory=memory), memory


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_mpi_ialltoallv_gets_the_counts_and_displacements_with_the_self_entry_zeroed(cuda_aware):
    from mpi4py import MPI

    comm = FakeMpiComm(rank=1, size=3)
    t, memory = _mpi_on_fake(comm, cuda_aware)
    send, recv = np.zeros(20, np.uint8), np.zeros(20, np.uint8)
    t.alltoallv(send.ctypes.data, [4, 5, 6], recv.ctypes.data, [7, 5, 0], STREAM)
    (name, send_spec, send_type, recv_spec, recv_type, buf_type, send_len, recv_len), = comm.calls
    assert send_spec == ([4, 0, 6], [0, 4, 9]) and recv_spec == ([7, 0, 0], [0, 7, 12])
    assert send_type == recv_type == MPI.BYTE
    assert (send_len, recv_len) == ((15, 12) if cuda_aware else (1 << 20, 1 << 20))
    assert buf_type == "ndarray"
    assert ("copy", recv.ctypes.data + 7, send.ctypes.data + 4, 5, STREAM) in memory.calls


def test_mpi_staging_copies_out_all_but_the_self_chunk_then_back_after_the_exchange():
    comm = FakeMpiComm(rank=1, size=3)
    t, memory = _mpi_on_fake(comm, cuda_aware=False)
    send, recv = np.arange(20, dtype=np.uint8), np.zeros(20, np.uint8)
    t.alltoallv(send.ctypes.data, [4, 5, 6], recv.ctypes.data, [7, 5, 2], STREAM)
    moves = [c[:4] if c[0] != "to_device" else c[:4] for c in memory.calls
             if c[0] in ("to_host", "to_device", "synchronize", "copy")]
    s, r = send.ctypes.data, recv.ctypes.data
    assert moves == [("copy", r + 7, s + 4, 5),
                     ("to_host", 0, s, 4), ("to_host", 9, s + 9, 6), ("synchronize", STREAM),
                     ("to_device", r, 0, 7), ("to_device", r + 12, 12, 2)]
    assert memory.calls[-1][0] == "record"


def test_mpi_reuses_its_pinned_buffers_and_waits_for_the_last_copy_back():
    comm = FakeMpiComm(rank=0, size=2)
    t, memory = _mpi_on_fake(comm, cuda_aware=False)
    buf = np.zeros(64, np.uint8)
    for _ in range(3):
        t.alltoallv(buf.ctypes.data, [1, 8], buf.ctypes.data, [1, 8], STREAM)
    assert [c for c in memory.calls if c[0] == "pinned"] == [("pinned", 1 << 20)] * 2
    assert len([c for c in memory.calls if c[0] == "event_synchronize"]) == 2


def test_mpi_names_the_rail_peers_that_never_arrive():
    comm = FakeMpiComm(rank=0, size=4, silent={2, 3}, stalled=True)
    t, _ = _mpi_on_fake(comm, cuda_aware=True, timeout_s=0.2)
    buf = np.zeros(8, np.uint8)
    with pytest.raises(DeepEPTimeoutError, match=r"rail peers \[2, 3\] \(global ranks \[20, 30\]\) never reached it") \
            as info:
        t.alltoallv(buf.ctypes.data, [0, 1, 1, 1], buf.ctypes.data, [0, 1, 1, 1], STREAM)
    assert (info.value.rank, info.value.peer, info.value.kernel) == (0, 20, "mpi rail alltoallv")
    with pytest.raises(Exception, match="the MPI rail transport is unusable: a alltoallv timed out"):
        t.alltoall_ints([0, 0, 0, 0])


def test_mpi_says_when_every_peer_arrived_but_the_transfer_did_not_end():
    comm = FakeMpiComm(rank=1, size=2, stalled=True)
    t, _ = _mpi_on_fake(comm, cuda_aware=True, timeout_s=0.2)
    with pytest.raises(DeepEPTimeoutError, match="every rail peer reached it, but the transfer did not complete"):
        t.alltoallv(0, [0, 0], 0, [0, 0], STREAM)


def test_mpi_refuses_peers_at_another_call():
    comm = FakeMpiComm(rank=0, size=3, stamps={2: 5})
    t, _ = _mpi_on_fake(comm, cuda_aware=True)
    with pytest.raises(RankMismatchError, match=r"rail alltoallv call 0, but rail peers are at calls \{20: 5\}"):
        t.alltoallv(0, [0, 0, 0], 0, [0, 0, 0], STREAM)


def test_mpi_host_alltoall_names_the_silent_peer():
    comm = FakeMpiComm(rank=1, size=3, silent={0})
    t, _ = _mpi_on_fake(comm, cuda_aware=True, timeout_s=0.2)
    with pytest.raises(DeepEPTimeoutError, match=r"alltoall_ints timed out after 0.2 s: rail peers \[0\]"):
        t.alltoall_ints([1, 2, 3])


class StalledMpiComm(FakeMpiComm):
    """A FakeMpiComm whose requests never complete; ``received`` has weak references to the
    arrays its receives and Ialltoallv write to."""

    def __init__(self, rank, size):
        super().__init__(rank, size, silent=range(size), stalled=True)
        self.received = []

    def Irecv(self, buf, source, tag):
        self.received.append(weakref.ref(buf[0].base))
        return FakeRequest(done=False)

    def Ialltoallv(self, sendbuf, recvbuf):
        self.received.append(weakref.ref(recvbuf[0]))
        return FakeRequest(done=False)


@pytest.mark.parametrize("call", ["alltoallv", "alltoall_ints"])
def test_mpi_keeps_what_a_timed_out_call_left_posted_past_close(call):
    # MPI cannot cancel the requests: a late peer may still write into their arrays.
    comm = StalledMpiComm(rank=0, size=2)
    t, _ = _mpi_on_fake(comm, cuda_aware=False, timeout_s=0.05)
    buf = np.zeros(16, np.uint8)
    try:
        if call == "alltoallv":
            t.alltoallv(buf.ctypes.data, [0, 8], buf.ctypes.data, [0, 8], STREAM)
        else:
            t.alltoall_ints([1, 2])
    except DeepEPTimeoutError:
        pass
    else:
        raise AssertionError("expected a timeout")
    t.close()
    del t
    gc.collect()
    assert comm.received and all(ref() is not None for ref in comm.received)


class _DeviceMemoryOwner:
    """Stands for the CuPy array that owns device memory handed to the transport by pointer."""


def test_mpi_keeps_the_owners_of_device_memory_that_a_timed_out_call_left_posted_past_close():
    # CUDA-aware MPI writes straight into the caller's device memory: it must outlive the request.
    comm = StalledMpiComm(rank=0, size=2)
    t, _ = _mpi_on_fake(comm, cuda_aware=True, timeout_s=0.05)
    owners = [_DeviceMemoryOwner(), _DeviceMemoryOwner()]
    kept = [weakref.ref(o) for o in owners]
    buf = np.zeros(16, np.uint8)
    with pytest.raises(DeepEPTimeoutError):
        t.alltoallv(buf.ctypes.data, [0, 8], buf.ctypes.data, [0, 8], STREAM, owners=tuple(owners))
    del owners
    t.close()
    del t
    gc.collect()
    assert all(ref() is not None for ref in kept)


def test_mpi_close_waits_for_the_last_copy_back_before_it_lets_the_staging_buffers_go():
    comm = FakeMpiComm(rank=0, size=2)
    t, memory = _mpi_on_fake(comm, cuda_aware=False)
    buf = np.zeros(16, np.uint8)
    t.alltoallv(buf.ctypes.data, [0, 8], buf.ctypes.data, [0, 8], STREAM)
    event = [c for c in memory.calls if c[0] == "record"][-1][1]
    t.close()
    assert memory.calls[-2:] == [("event_synchronize", event), ("destroy_event", event)]


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False)])
def test_the_environment_variable_says_whether_mpi_is_cuda_aware(monkeypatch, value, expected):
    monkeypatch.setenv(MPI_CUDA_AWARE_ENV, value)
    assert mpi_is_cuda_aware(None) is expected


def test_cuda_awareness_is_asked_of_the_communicator_without_the_variable(monkeypatch):
    monkeypatch.delenv(MPI_CUDA_AWARE_ENV, raising=False)

    class Info:
        def __init__(self, kinds):
            self.kinds = kinds

        def Get(self, key):
            return self.kinds if key == "mpi_memory_alloc_kinds" else None

    class Comm:
        def __init__(self, kinds):
            self.kinds = kinds

        def Get_info(self):
            return Info(self.kinds)

    from mpi4py import MPI

    if hasattr(MPI, "Query_cuda_support"):
        pytest.skip("this mpi4py answers Query_cuda_support itself")
    assert mpi_is_cuda_aware(Comm("mpi,system,cuda:device")) is True
    assert mpi_is_cuda_aware(Comm("mpi,system")) is False
    monkeypatch.setenv(MPI_CUDA_AWARE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{MPI_CUDA_AWARE_ENV}: expected 0 or 1"):
        mpi_is_cuda_aware(Comm("x"))


# ---------------------------------------------------------------------------------------------
# The MPI transport under mpiexec, host memory standing in for device memory


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_alltoallv_delivers_every_chunk_staged_and_direct(n):
    proc = run_mpi(n, [str(WORKERS / "transport_worker.py"), "host"], timeout=240)
    assert proc.returncode == 0, describe(proc)
    records = sorted(worker_records(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == list(range(n)), describe(proc)
    rails = [[0, 2], [1, 3]] if n == 4 else [list(range(n))]
    for r in records:
        rail = rails[r["rank"] % len(rails)]
        assert (r["rail"], r["rail_size"], r["rail_rank"]) == (rail, len(rail), rail.index(r["rank"])), r
        assert r["mismatches"] == [], r
        assert r["cases"] >= 10
        assert r["ints"] == [100 * p + r["rail_rank"] for p in range(len(rail))]


@pytest.mark.mpi
def test_mpi_alltoallv_times_out_naming_the_rank_that_never_calls():
    proc = run_mpi(3, [str(WORKERS / "transport_worker.py"), "timeout"], timeout=120)
    assert proc.returncode == 0, describe(proc)
    records = {r["rank"]: r for r in worker_records(proc.stdout)}
    assert "rail peers [2] (global ranks [2]) never reached it" in records[0]["error"], records
    assert records[0]["type"] == "DeepEPTimeoutError"
    assert records[2]["error"] is None


def test_threads_of_this_module_leave_nothing_running():
    assert not [t for t in threading.enumerate() if t.name.startswith("deepep-rank-")]
