"""Launching a kernel through a parameter block that lives as long as the plan using it.

``cuLaunchKernel`` takes a kernel's parameters as a table of pointers to their values. A
:class:`KernelCall` keeps the values in one C struct laid out like the kernel's parameter list
(each field at its natural alignment, which is the CUDA ABI) and the pointer table next to it.
It is made once per kernel instance and operation plan, with every argument that does not change
between calls written then (the peer buffer table, rank, timeout, error record, shapes, buffer
offsets); a call writes only what changes (pointers, counts) and launches. The driver copies the
parameters when the launch is issued, so the block can be rewritten right after.

A call site names its changing parameters once (``per_call``), when it binds the kernel, and
passes their values in that order to :meth:`KernelCall.run`, which writes each run of
neighbouring ones into the struct with one ``struct.pack_into``: a tenth of the host time of
assigning them one by one by name.

One :class:`KernelCall` must not be used by two threads at once: each rank owns its plans.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
from typing import Any, Dict, List, Sequence, Tuple, Type

from . import kernels

#: Per parameter kind: its ctypes field type and its ``struct`` code (standard size, as ``=`` packs).
_FIELD_TYPES = {"ptr": (ctypes.c_uint64, "Q"), "i32": (ctypes.c_int32, "i"), "i64": (ctypes.c_int64, "q"),
                "f32": (ctypes.c_float, "f")}


@functools.lru_cache(maxsize=None)
def parameter_struct(kernel: str) -> Type[ctypes.Structure]:
    """A ``ctypes.Structure`` type with one field per parameter of ``kernel``, in order."""
    fields = [(name, _FIELD_TYPES[kind][0]) for name, kind in kernels.SIGNATURES[kernel]]
    return type(f"{kernel}_parameters", (ctypes.Structure,), {"_fields_": fields})


class ParameterBlock:
    """A kernel's parameters as one C struct, plus the pointer table ``cuLaunchKernel`` reads.

    Args:
        kernel: a name in :data:`deepep_cupy.gpu.kernels.SIGNATURES`.
        fixed: values for parameters that stay the same on every launch.

    Attributes:
        values: the struct; assign its fields by parameter name (pointers as ints, 0 for none).
    """

    def __init__(self, kernel: str, **fixed):
        struct_type = parameter_struct(kernel)
        self.kernel = kernel
        self.names = tuple(name for name, _ in kernels.SIGNATURES[kernel])
        unknown = sorted(set(fixed) - set(self.names))
        if unknown:
            raise TypeError(f"deepep_cupy: {kernel} has no parameters {unknown}")
        self.values = struct_type()
        base = ctypes.addressof(self.values)
        self._pointer_table = (ctypes.c_void_p * len(self.names))(
            *[base + getattr(struct_type, name).offset for name in self.names])
        self.table_address = ctypes.addressof(self._pointer_table)
        self.fixed = frozenset(fixed)
        self.assign(fixed)

    def assign(self, values: Dict[str, object]) -> None:
        """Set parameters by name; ``None`` is a null pointer."""
        for name, value in values.items():
            setattr(self.values, name, 0 if value is None else value)

    def missing(self, per_call: Dict[str, object]) -> List[str]:
        """Parameters neither fixed nor in ``per_call``, in declaration order."""
        return [name for name in self.names if name not in self.fixed and name not in per_call]

    def as_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self.values), ctypes.sizeof(self.values))

    def packers(self, names: Sequence[str]) -> Tuple[Tuple[struct.Struct, int, int, int], ...]:
        """``(packer, byte offset, first, end)`` per run of neighbouring parameters among ``names``
        (given in declaration order): ``packer.pack_into(struct bytes, offset, *values[first:end])``
        writes the run, padding between its fields left as it is."""
        kinds = dict(kernels.SIGNATURES[self.kernel])
        order = [self.names.index(name) for name in names]
        if order != sorted(order) or len(set(order)) != len(order):
            raise TypeError(f"deepep_cupy: {self.kernel}: per-call parameters must be named once each, in "
                            f"declaration order: {list(names)}")
        struct_type = type(self.values)
        runs: List[Dict[str, Any]] = []
        for i, (name, position) in enumerate(zip(names, order)):
            field = getattr(struct_type, name)
            if runs and position == runs[-1]["last"] + 1:
                run = runs[-1]
                gap = field.offset - run["end_offset"]
                run["format"] += f"{gap}x" if gap else ""
            else:
                run = {"offset": field.offset, "format": "=", "first": i}
                runs.append(run)
            run["format"] += _FIELD_TYPES[kinds[name]][1]
            run["last"], run["end"], run["end_offset"] = position, i + 1, field.offset + field.size
        return tuple((struct.Struct(run["format"]), run["offset"], run["first"], run["end"]) for run in runs)


class KernelCall:
    """One compiled kernel instance bound to a grid, a block size and its fixed arguments.

    Args:
        kernel: the kernel's name; ``template_args`` pick its instance.
        grid: blocks per launch.
        shared_mem: dynamic shared memory bytes.
        per_call: the parameters :meth:`run` takes, in declaration order; with ``fixed`` they must
            name every parameter.
        fixed: arguments that never change for this call site.
    """

    def __init__(self, kernel: str, template_args: Tuple[object, ...] = (), *, grid: int, shared_mem: int = 0,
                 per_call: Sequence[str] = (), **fixed):
        self.params = ParameterBlock(kernel, **fixed)
        missing = self.params.missing(dict.fromkeys(per_call))
        if missing or self.params.fixed & set(per_call):
            raise TypeError(f"deepep_cupy: {kernel}: per-call parameters {list(per_call)} leave {missing} unset "
                            f"or repeat fixed ones {sorted(self.params.fixed & set(per_call))}")
        self.per_call = tuple(per_call)
        self._packers = self.params.packers(self.per_call)
        self._bytes = memoryview(self.params.values).cast("B")
        self.name = kernels.name_expression(kernel, template_args)
        self.function_ptr = kernels.get_kernel(self.name).kernel.ptr
        self.grid = grid
        self.block = kernels.block_threads(kernel)
        self.shared_mem = shared_mem
        # cuLaunchKernel's arguments before the stream, and after it.
        self.geometry = (self.function_ptr, grid, 1, 1, self.block, 1, 1, shared_mem)
        self.parameters = (self.params.table_address, 0)

    def run(self, stream_ptr: int, *values: int) -> None:
        """Launch on ``stream_ptr`` with ``values`` for :attr:`per_call`, in its order (ints: 0 for a
        null pointer)."""
        view = self._bytes
        for packer, offset, first, end in self._packers:
            packer.pack_into(view, offset, *values[first:end])
        launch(self, stream_ptr)


def shared_arguments(peer_table_ptr: int, num_ranks: int, rank: int, timeout_s: float,
                     error_record_ptr: int) -> Dict[str, int]:
    """The arguments a Buffer's kernels share, by their parameter names: the table of the ranks'
    buffers, the group, the deadline of every wait, the error record."""
    return dict(buffer_ptrs=peer_table_ptr, num_ranks=num_ranks, rank=rank, timeout_ns=int(timeout_s * 1e9),
                error_record=error_record_ptr)


def every_argument_per_call(kernel: str, grid: int) -> KernelCall:
    """``kernel`` (a non-template instance) with all of its parameters passed to :meth:`KernelCall.run`, in
    declaration order: the small kernels whose launchers hold no fixed arguments."""
    return KernelCall(kernel, grid=grid, per_call=[name for name, _ in kernels.SIGNATURES[kernel]])


def bind(kernel: str, shared: Dict[str, int], template_args: Tuple[object, ...] = (), **call) -> KernelCall:
    """``KernelCall(kernel, template_args, **call)`` with the entries of ``shared``
    (:func:`shared_arguments`) that ``kernel`` names bound too."""
    names = {name for name, _ in kernels.SIGNATURES[kernel]}
    # Any: these join ``call``'s keywords, which hold grid (an int) and per_call (names) too.
    bound: Dict[str, Any] = {name: v for name, v in shared.items() if name in names}
    return KernelCall(kernel, template_args, **bound, **call)


class _Profile:
    """Opt-in per-kernel GPU times (``DEEPEP_CUPY_PROFILE=1``): events around every launch."""

    def __init__(self) -> None:
        self.enabled = os.environ.get("DEEPEP_CUPY_PROFILE", "") not in ("", "0")
        self.pending: List[Tuple[str, Any, Any]] = []     # (kernel, start, end): CuPy events

    def report(self) -> Dict[str, Tuple[int, float]]:
        """{kernel: (launches, mean milliseconds)} since the last report (synchronises)."""
        import cupy

        totals: Dict[str, List[float]] = {}
        for name, start, end in self.pending:
            end.synchronize()
            totals.setdefault(name, []).append(cupy.cuda.get_elapsed_time(start, end))
        self.pending = []
        return {name: (len(ts), sum(ts) / len(ts)) for name, ts in totals.items()}


profile = _Profile()


@functools.lru_cache(maxsize=None)
def _driver():
    from cupy.cuda import driver

    return driver


def fill_bytes(ptr: int, byte: int, num_bytes: int, stream_ptr: int) -> None:
    """Set ``num_bytes`` bytes at device address ``ptr`` to ``byte``, in order on ``stream_ptr``."""
    from cupy.cuda import runtime

    runtime.memsetAsync(ptr, byte, num_bytes, stream_ptr)


def launch(call: KernelCall, stream_ptr: int) -> None:
    """``cuLaunchKernel`` of ``call`` as its parameter block stands (with profiling events when enabled)."""
    if profile.enabled:
        import cupy

        stream = cupy.cuda.ExternalStream(stream_ptr)
        start = stream.record()
    _driver().launchKernel(*call.geometry, stream_ptr, *call.parameters)
    if profile.enabled:
        profile.pending.append((call.name.split("<")[0], start, stream.record()))
