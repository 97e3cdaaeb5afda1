"""A Buffer whose host path runs on the CPU: fake device arrays, a recording launcher.

Everything the Buffer does on the host is real (argument reads and checks, plans, kernel
parameter blocks with their completeness check, slots, allocate-ahead decisions, handles); only
what needs a GPU is replaced:

* :class:`FakeArray` (a NumPy array that claims to live on a GPU) and :class:`FakeLib` (its
  :class:`deepep_cupy.tensors.ArrayLib`), registered so that ``tensors.read`` knows it;
* kernels are "loaded" as null functions and launches are recorded by :class:`Launches`, which
  plays notify_dispatch's part in the slot protocol from a script;
* :class:`FakeOrder` stands for the stream order, or :func:`recording_order` makes a real
  :class:`deepep_cupy.gpu.streams.StreamOrder` whose CUDA calls go to a timeline shared with the launches.
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import numpy as np

from deepep_cupy import buffer as buffer_module
from deepep_cupy import tensors
from deepep_cupy.buffer import Buffer
from deepep_cupy.constants import (
    ERROR_DISPATCH_REFUSED,
    HOST_FAILURE_FLAG,
    KERNEL_STAGES,
    VERDICT_HOST_FAILED,
    VERDICT_OVER_CAPACITY,
)
from deepep_cupy.events import EventOverlap
from deepep_cupy.gpu import kernels, launch, slots
from deepep_cupy.gpu.slots import ERROR_RECORD, HostSlots
from deepep_cupy.gpu.streams import StreamOrder
from deepep_cupy.groups.group import Group
from deepep_cupy.intranode import engine as engine_module
from deepep_cupy.intranode.engine import IntranodeEngine

DEVICE = 0
#: The stream FakeLib's callers are on, and the communication stream of the fake orders.
CALLER_STREAM, COMM_STREAM = 0x5757, 0x0C0C


class FakeArray(np.ndarray):
    """A NumPy array standing for a device array on ``device_id`` (its host address as pointer)."""

    device_id = DEVICE

    def __array_finalize__(self, obj):
        self.device_id = getattr(obj, "device_id", DEVICE)


def on_device(data, device_id: int = DEVICE) -> FakeArray:
    array = np.ascontiguousarray(data).view(FakeArray)
    array.device_id = device_id
    return array


class FakeLib(tensors.ArrayLib):
    name = "fake"
    _NAMES = {dtype: name for name, dtype in tensors.STORAGE.items()}

    def __init__(self):
        self.allocations = []
        self.used_on_calls = []

    def read(self, a):
        return (self, a.ctypes.data, a.shape[0] if a.ndim else -1,
                (self, a.dtype, a.shape[1:], a.flags.c_contiguous, a.device_id))

    def describe(self, a, arg, device_id):
        if a.device_id != device_id:
            raise ValueError(f"{arg}: expected an array on GPU {device_id} (the Buffer's), got one on GPU "
                             f"{a.device_id}")
        return tensors.ArrayInfo(self, self._NAMES.get(a.dtype), a.dtype, a.shape, a.flags.c_contiguous, a.strides)

    def empty(self, shape, dtype_name, device_id):
        array = on_device(np.full(shape, 0x5A, dtype=tensors.STORAGE[dtype_name]), device_id)
        self.allocations.append((tuple(shape), dtype_name))
        return array

    def pointer(self, array):
        return array.ctypes.data

    carves_outputs = True  # as CuPy; a test sets False for PyTorch's way

    def reinterpret(self, array, dtype_name):
        return array.view(tensors.STORAGE[dtype_name])

    def carve(self, block, views):
        assert block.dtype == np.int64 and block.ndim == 1, "views are carved out of a handle's int64 words"
        raw = block.view(np.uint8)
        carved = []
        for view in views:
            if view is None:
                carved.append(None)
                continue
            offset, shape, dtype_name = view
            dtype = tensors.STORAGE[dtype_name]
            assert offset % dtype.itemsize == 0, f"{dtype_name} view at byte {offset}"
            size = dtype.itemsize * int(np.prod(shape))
            assert offset + size <= raw.nbytes, "a view past the end of its allocation"
            carved.append(raw[offset:offset + size].view(dtype).reshape(shape))
        return carved

    def current_stream(self, device_id):
        return CALLER_STREAM

    def element_strides(self, array):
        return tuple(s // array.itemsize for s in array.strides)

    def allocating_on(self, stream, device_id):
        return contextlib.nullcontext()

    def used_on(self, arrays, stream_ptr, device_id):
        self.used_on_calls.append((len([a for a in arrays if a is not None]), stream_ptr))

    def window(self, ptr, num_bytes, device_id, owner):
        begin = ptr - owner.local_ptr
        assert 0 <= begin and begin + num_bytes <= owner.num_bytes, "a window past the end of the NVLink buffer"
        return owner.memory[begin:begin + num_bytes]


class FakeNvlBuffer:
    """A rank's NVLink buffer in host memory (for outputs that are views of it)."""

    def __init__(self, num_bytes: int):
        self.memory = on_device(np.zeros(num_bytes, np.uint8))
        self.local_ptr, self.num_bytes = self.memory.ctypes.data, num_bytes

    def close(self):
        pass


NOTIFY_STAGE = next(i for i, name in KERNEL_STAGES.items() if name == "notify_dispatch")


class Launches:
    """Records every launch (kernel name, its parameters as a dict) and answers count exchanges.

    ``received``: what each call's count exchange reports as this rank's receive count, in order
    (the last one repeats; -1: it publishes none); a count above the capacity the host stated gives
    VERDICT_OVER_CAPACITY, and the exchange of the call redone after it reports the same count (the
    same inputs: a call, not an exchange, takes the next count). A negative capacity (a host that
    takes part only to refuse the call) gives VERDICT_HOST_FAILED for this rank and a count of 0.
    ``verdict``: a verdict to report instead (e.g. a settings mismatch).
    ``error``: an error record notify_dispatch writes after the count (a barrier that failed).
    ``timeline``: a list that also gets ``("launch", kernel name, stream)`` per launch.
    """

    def __init__(self, host_slots: HostSlots, received=(100,), expert_counts=(), verdict: int = 0, error=None,
                 timeline=None):
        self.slots = host_slots
        self.received = list(received)
        self.expert_counts = list(expert_counts)
        self.verdict = verdict
        self.error = error
        self.timeline = timeline
        self.log = []
        self._redo = None  # the count of a call refused for want of rows, which its redo gets again

    def __call__(self, call, stream_ptr):
        params = {name: getattr(call.params.values, name) for name in call.params.names}
        self.log.append((call.name, params))
        if self.timeline is not None:
            self.timeline.append(("launch", call.name, stream_ptr))
        if call.name == "notify_dispatch_kernel" or params.get("exchange"):
            if self._redo is not None:
                count, self._redo = self._redo, None
            else:
                count = self.received.pop(0) if len(self.received) > 1 else self.received[0]
            values = self.slots.values
            values[slots.EXPERT_COUNTS:slots.EXPERT_COUNTS + len(self.expert_counts)] = self.expert_counts
            capacity = params["recv_capacity"]
            if capacity < 0:
                verdict = VERDICT_HOST_FAILED + params["rank"] * HOST_FAILURE_FLAG - capacity
                count = 0 if count >= 0 else count
            else:
                verdict = self.verdict or (VERDICT_OVER_CAPACITY if count > capacity else 0)
            if verdict == VERDICT_OVER_CAPACITY:
                self._redo = count
            values[slots.VERDICT] = verdict
            values[slots.RECV_COUNT] = count
            if verdict and params.get("report_refusal") and not values[ERROR_RECORD]:
                # As count_exchange.cuh: a refused call is left in this rank's error record too.
                values[ERROR_RECORD:ERROR_RECORD + 6] = [ERROR_DISPATCH_REFUSED, NOTIFY_STAGE, params["rank"],
                                                         -1, -1, verdict]
            if self.error is not None:
                values[ERROR_RECORD:ERROR_RECORD + len(self.error)] = self.error

    def fill(self, ptr, byte, num_bytes, stream_ptr):
        """Stands for ``launch.fill_bytes``: recorded as a launch named ``fill``."""
        self.log.append(("fill", {"ptr": ptr, "byte": byte, "num_bytes": num_bytes, "stream": stream_ptr}))

    def names(self):
        return [name for name, _ in self.log]

    def last(self, name):
        return next(params for kernel, params in reversed(self.log) if kernel == name)


class FakeOrder:
    """The stream order, reduced to what the host path asks of it."""

    def __init__(self):
        self.stream = SimpleNamespace(ptr=COMM_STREAM)
        self.ptr = self.stream.ptr
        self.notify_done = None
        self.capturing = False
        self.begun = []
        self.finished = []
        self.side_work = []

    def begin(self, caller_ptr, previous_event, on_comm_stream, rank):
        self.begun.append(caller_ptr)
        return self.ptr if on_comm_stream else caller_ptr

    def record_notify_done(self, stream_ptr):
        pass

    def abandon(self, run_on):
        pass

    def note_side_work(self, stream_ptr):
        self.side_work.append(stream_ptr)

    def finish(self, caller_ptr, run_on, lib, async_finish, arrays, outputs=(), allocated_on_comm=False,
               check_errors=None):
        self.finished.append((async_finish, len(arrays)))
        if async_finish:
            lib.used_on(arrays, self.ptr, DEVICE)
            return EventOverlap(object(), tuple(arrays), lib, DEVICE)
        return EventOverlap(None, (), lib, DEVICE)

    def synchronize(self):
        pass


class _RecordingRuntime:
    """The CUDA runtime calls a StreamOrder makes, appended to a timeline; the streams in
    ``capturing`` are being captured into a CUDA graph."""

    def __init__(self, timeline, capturing=()):
        self.timeline = timeline
        self.capturing = set(capturing)

    def streamIsCapturing(self, stream):
        return stream in self.capturing

    def eventRecord(self, event, stream):
        self.timeline.append(("record", event, stream))

    def streamWaitEvent(self, stream, event, flags):
        self.timeline.append(("wait", stream, event))

    def streamSynchronize(self, stream):
        self.timeline.append(("stream sync", stream))


class _RecordingWaitable:
    """A stream or an event (``.ptr``) whose host waits go to a timeline."""

    def __init__(self, kind, ptr, timeline):
        self.kind, self.ptr, self.timeline = kind, ptr, timeline

    def synchronize(self):
        self.timeline.append((f"{self.kind} sync", self.ptr))


def recording_order(timeline, shares_gpu=False) -> StreamOrder:
    """A real StreamOrder on the communication stream COMM_STREAM whose CUDA calls (event records,
    stream waits, host waits) are appended to ``timeline``; events are numbered from 1. Its
    ``_runtime.capturing`` is the set of streams that are being captured (none at first)."""
    numbers = itertools.count(1)
    return StreamOrder(DEVICE, shares_gpu, _RecordingWaitable("stream", COMM_STREAM, timeline),
                       lambda: _RecordingWaitable("event", next(numbers), timeline), _RecordingRuntime(timeline))


class FakeMapped:
    def __init__(self):
        self.values = np.zeros(slots.SLOT_INTS, dtype=np.int32)

    def device_ptr(self, index):
        return 0x7000_0000 + 4 * index

    def free(self):
        pass


class FakeGroup(Group):
    """One rank's view of a group whose collectives are never needed on the host path."""

    in_process = False

    def __init__(self, rank=0, size=2):
        self._rank, self._size = rank, size

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    def allgather(self, obj):
        raise AssertionError("the host path makes no collective calls")

    def barrier(self):
        raise AssertionError("the host path makes no collective calls")


def fake_buffer(monkeypatch, *, rank=0, num_ranks=2, num_nvl_bytes=1 << 30, allocate_ahead=True, order=None,
                nvl_memory=False, nvl=None, **launch_script):
    """A Buffer of rank ``rank`` of ``num_ranks`` with fake hardware; returns ``(buffer, launches, lib)``.

    ``order``: the stream order (default a :class:`FakeOrder`); ``nvl_memory``: back the NVLink buffer
    with host memory (:class:`FakeNvlBuffer`; keep ``num_nvl_bytes`` small then); ``nvl``: another
    stand-in for the NVLink buffer; ``launch_script``: :class:`Launches`'s options.
    """
    lib = FakeLib()
    monkeypatch.setitem(tensors._LIBS, FakeArray, lib)
    null_kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=0))
    monkeypatch.setattr(kernels, "get_kernel", lambda name: null_kernel)
    monkeypatch.setattr(engine_module, "check_sm_budget", lambda ranks_per_device, num_sms: None)
    engine = IntranodeEngine(FakeGroup(rank, num_ranks), num_nvl_bytes, 5.0, DEVICE, allocate_ahead)
    engine.on_device = engine.ctx.on_device = engine.ctx.plans.scope = contextlib.nullcontext()
    if nvl_memory:
        engine.nvl = FakeNvlBuffer(num_nvl_bytes)
    elif nvl is not None:
        engine.nvl = nvl
    host_slots = HostSlots(rank, 5.0, in_process=False, mapped=FakeMapped())
    engine.attach(host_slots, FakeOrder() if order is None else order, 0xB0F)
    buf = buffer_over(monkeypatch, engine, num_nvl_bytes=num_nvl_bytes, allocate_ahead=allocate_ahead)
    launches = Launches(host_slots, **launch_script)
    router = launch.launch if isinstance(launch.launch, _Router) else _Router()
    router.add(buf, launches)
    monkeypatch.setattr(launch, "launch", router)
    monkeypatch.setattr(launch, "fill_bytes", launches.fill)
    return buf, launches, lib


def buffer_over(monkeypatch, engine, group=None, num_nvl_bytes=1 << 30, **settings):
    """A Buffer made by its public constructor whose engine is ``engine`` (fake hardware);
    ``group``: the Buffer's (default the engine's)."""
    monkeypatch.setattr(buffer_module, "make_engine", lambda group, chosen: engine)
    return Buffer(engine.group if group is None else group, num_nvl_bytes, timeout_s=5.0, device=DEVICE, **settings)


class _Router:
    """Sends each launch to the :class:`Launches` of the fake Buffer whose plan holds the call."""

    def __init__(self):
        self.routes = []

    def add(self, buf, launches):
        self.routes.append((buf, launches))

    def __call__(self, call, stream_ptr):
        for buf, launches in self.routes:
            planned = (c for p in buf._engine.ctx.plans.values()
                       for c in (getattr(p, name, None) for name in ("main", "notify", "main_with_exchange",
                                                                      "main_for_host", "refuse")))
            expand_calls = buf._engine.dispatch_path._expand_calls.values()
            if any(call is c for c in planned) or any(call is c for c in expand_calls):
                return launches(call, stream_ptr)
        raise AssertionError(f"a launch of {call.name} from no fake Buffer's plan")
