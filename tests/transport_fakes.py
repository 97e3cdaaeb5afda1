"""Stand-ins for the rail transports' collaborators, so that their logic runs on the CPU.

* :class:`HostMemory`: the device operations of ``deepep_cupy.transports.memory.CudaMemory`` on
  host memory ("device pointers" are host addresses, copies are ``ctypes.memmove`` at once, events
  are numbers), recording every call.
* :class:`FakeNccl`: ``cupy.cuda.nccl`` recording group start/end, sends and receives.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading

import numpy as np


class HostMemory:
    """CudaMemory's methods on host memory; ``calls`` records them in order (thread-safe)."""

    _events = itertools.count(1)

    def __init__(self, device_id=0):
        self.device_id = device_id
        self.calls = []
        self._lock = threading.Lock()

    def _log(self, *call):
        with self._lock:
            self.calls.append(call)

    def device(self):
        return contextlib.nullcontext()

    def copy(self, dst, src, nbytes, stream):
        self._log("copy", dst, src, nbytes, stream)
        ctypes.memmove(dst, src, nbytes)

    def copy_peer(self, dst, dst_device, src, src_device, nbytes, stream):
        self._log("copy_peer", dst, dst_device, src, src_device, nbytes, stream)
        ctypes.memmove(dst, src, nbytes)

    def to_host(self, host, host_offset, src, nbytes, stream):
        self._log("to_host", host_offset, src, nbytes, stream)
        ctypes.memmove(host.ctypes.data + host_offset, src, nbytes)

    def to_device(self, dst, host, host_offset, nbytes, stream):
        self._log("to_device", dst, host_offset, nbytes, stream)
        ctypes.memmove(dst, host.ctypes.data + host_offset, nbytes)

    def synchronize(self, stream):
        self._log("synchronize", stream)

    def pinned(self, nbytes):
        self._log("pinned", nbytes)
        return np.zeros(nbytes, np.uint8)

    def device_view(self, ptr, nbytes):
        self._log("device_view", ptr, nbytes)
        if nbytes == 0:
            return np.empty(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def new_event(self):
        event = next(self._events)
        self._log("new_event", event)
        return event

    def record(self, event, stream):
        self._log("record", event, stream)

    def wait(self, stream, event):
        self._log("wait", stream, event)

    def event_synchronize(self, event):
        self._log("event_synchronize", event)

    def destroy_event(self, event):
        self._log("destroy_event", event)


class FakeNcclCommunicator:
    def __init__(self, nccl, size, unique_id, rank):
        self.nccl, self.size, self.unique_id, self.rank = nccl, size, unique_id, rank
        nccl.calls.append(("NcclCommunicator", size, unique_id, rank))

    def send(self, ptr, count, dtype, peer, stream):
        self.nccl.calls.append(("send", ptr, count, dtype, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        self.nccl.calls.append(("recv", ptr, count, dtype, peer, stream))

    def destroy(self):
        self.nccl.calls.append(("destroy",))


class FakeNccl:
    """``cupy.cuda.nccl`` as the NCCL transport uses it."""

    NCCL_INT8 = 0

    def __init__(self, unique_id=(7, 7, 7)):
        self.calls = []
        self._unique_id = unique_id

    def get_unique_id(self):
        self.calls.append(("get_unique_id",))
        return self._unique_id

    def NcclCommunicator(self, size, unique_id, rank):  # noqa: N802 - CuPy's name
        return FakeNcclCommunicator(self, size, unique_id, rank)

    def groupStart(self):  # noqa: N802
        self.calls.append(("groupStart",))

    def groupEnd(self):  # noqa: N802
        self.calls.append(("groupEnd",))


def random_counts(rng, size, max_bytes=300, zero_fraction=0.3):
    """A ``size x size`` matrix of byte counts, ``[p][q]`` from rail rank p to q, some of them 0."""
    counts = rng.integers(1, max_bytes, size=(size, size))
    counts[rng.random((size, size)) < zero_fraction] = 0
    return counts.tolist()


def packed_send(rank, counts, seed):
    """Rank ``rank``'s send buffer: for each peer q, ``counts[rank][q]`` bytes derived from (seed, rank, q)."""
    chunks = [np.random.default_rng([seed, rank, q]).integers(0, 256, counts[rank][q], dtype=np.uint8)
              for q in range(len(counts))]
    return np.concatenate(chunks) if chunks else np.empty(0, np.uint8)


def expected_recv(rank, counts, seed):
    """What rank ``rank`` must receive: from each peer p, p's chunk for it, packed in peer order."""
    chunks = [np.random.default_rng([seed, p, rank]).integers(0, 256, counts[p][rank], dtype=np.uint8)
              for p in range(len(counts))]
    return np.concatenate(chunks) if chunks else np.empty(0, np.uint8)

class FakeComm:
    """An mpi4py communicator of ``size`` ranks seen from rank ``rank``, whose allgather answers
    every rank's object with this rank's own."""

    def __init__(self, rank=0, size=2):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def allgather(self, obj):
        return [obj] * self.size

    def Barrier(self):
        pass
