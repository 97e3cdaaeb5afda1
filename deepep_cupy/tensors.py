"""CuPy arrays and PyTorch tensors behind one small interface, :class:`ArrayLib`.

CuPy has no bfloat16 or float8 dtype, so the library names element types itself:

    name              CuPy storage       PyTorch dtype
    "bfloat16"        uint16 (raw bits)  torch.bfloat16
    "float16"         float16            torch.float16
    "float32"         float32            torch.float32
    "float8_e4m3fn"   uint8 (raw bits)   torch.float8_e4m3fn
    "int64" "int32" "bool"

Each library's arrays are read natively: :func:`read` returns a device pointer, the row count
and a hashable *key* holding everything else an argument check looks at (library, dtype, the
extents after the first, contiguity, device). Operations cache their checked plans by those keys,
so a call with the same kinds of arguments as an earlier one pays a few attribute reads per array
and no checks, no ``__cuda_array_interface__`` and no DLPack. :func:`describe` is the slow,
complete reading that the checks use (and the source of every error message).

Outputs are allocated by the caller's library (CuPy's memory pool, or PyTorch's caching
allocator) on the stream the caller's library considers current, so they are returned as they are.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

#: Storage dtype of each element type name in CuPy (and NumPy) arrays.
STORAGE: Dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(np.uint8), "int64": np.dtype(np.int64), "int32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),
}
ITEMSIZE = {name: dtype.itemsize for name, dtype in STORAGE.items()}


def row_bytes(tail: Tuple[int, ...], dtype_name: str) -> int:
    """Bytes of ``tail``-shaped ``dtype_name`` elements: one row when ``tail`` is the extents
    after the first, the whole array when it is the shape."""
    size = ITEMSIZE[dtype_name]
    for extent in tail:
        size *= extent
    return size


class ArrayInfo(NamedTuple):
    """What the argument checks know of one array."""
    lib: "ArrayLib"
    dtype_name: Optional[str]  # None: a dtype this library cannot move
    dtype: Any                 # the library's own dtype object (for messages)
    shape: Tuple[int, ...]
    contiguous: bool
    strides: Tuple[int, ...]


class ArrayLib:
    """One array library: how to read, allocate, slice its arrays and find its current stream."""

    name = ""

    def read(self, x) -> Tuple["ArrayLib", int, int, tuple]:
        """``(self, device pointer, rows, key)`` of ``x`` (rows: extent of axis 0, -1 for 0-d)."""
        raise NotImplementedError

    def describe(self, x, arg: str, device_id: int) -> ArrayInfo:
        """The full reading used by the checks; raises on the wrong device or a CPU tensor."""
        raise NotImplementedError

    def empty(self, shape: Tuple[int, ...], dtype_name: str, device_id: int):
        raise NotImplementedError

    def pointer(self, array) -> int:
        raise NotImplementedError

    def current_stream(self, device_id: int) -> int:
        """The raw ``cudaStream_t`` the caller's work on ``device_id`` runs on."""
        raise NotImplementedError

    def stream(self, stream_ptr: int, device_id: int):
        """The library's stream object naming the raw stream ``stream_ptr`` (PyTorch only: CuPy's
        callers hold their ``cupy.cuda.Stream`` already)."""
        raise NotImplementedError

    def allocating_on(self, stream, device_id: int):
        """A context in which :meth:`empty` allocates for ``stream`` (a ``cupy.cuda.Stream``)."""
        raise NotImplementedError

    def used_on(self, arrays: Sequence[Any], stream_ptr: int, device_id: int) -> None:
        """Tell the allocator that ``arrays`` are used on ``stream_ptr`` too (PyTorch's
        ``record_stream``); CuPy has no such notion (the caller keeps the arrays alive instead)."""

    def element_strides(self, array) -> Tuple[int, ...]:
        """The strides of ``array`` in elements."""
        raise NotImplementedError

    def trim(self, array, rows: int):
        """The first ``rows`` rows of the C-contiguous ``array`` (a view)."""
        return array[:rows]

    def shrink(self, array, rows: int):
        """The first ``rows`` rows of ``array``, an allocation the running call made and has not
        handed out yet: :meth:`trim`, or ``array`` itself cut to them where that costs less."""
        return self.trim(array, rows)

    #: Whether a fresh dispatch allocated ahead returns its small outputs as views carved out of
    #: the handle's allocation (:meth:`carve`) instead of allocating and trimming each: fewer calls
    #: with CuPy; with PyTorch the views measured slower than the allocations (docs/PERFORMANCE.md).
    carves_outputs = False

    def reinterpret(self, array, dtype_name: str):
        """The 1-D contiguous ``array`` read as elements of ``dtype_name`` (a view of its memory)."""
        raise NotImplementedError

    def window(self, ptr: int, num_bytes: int, device_id: int, owner: Any):
        """A 1-D byte array of this library over ``num_bytes`` of device memory at ``ptr`` that it
        does not allocate (a Buffer's NVLink buffer); ``owner`` is kept alive with it."""
        raise NotImplementedError

    def rows_in(self, window, rows: int, tail: Tuple[int, ...], dtype_name: str):
        """The first ``rows`` rows of ``tail``-shaped ``dtype_name`` elements in ``window`` (a view;
        made once per plan, calls :meth:`trim` it)."""
        return self.reinterpret(window[:rows * row_bytes(tail, dtype_name)], dtype_name).reshape((rows, *tail))

    def carve(self, block, views: Sequence[Optional[Tuple[int, Tuple[int, ...], str]]]) -> list:
        """Arrays of exact size inside ``block``, a 1-D int64 allocation of this library: one
        contiguous view per ``(byte offset, shape, dtype name)`` of ``views`` (None for None); each
        offset is a multiple of its element size. Only for a library that :attr:`carves_outputs`:
        one call per output, where an allocation and a trim cost two."""
        raise NotImplementedError


class _CupyLib(ArrayLib):
    name = "cupy"
    carves_outputs = True

    def __init__(self):
        import cupy

        self._cupy = cupy
        self._names = {dtype: name for name, dtype in STORAGE.items()}

    def read(self, a) -> Tuple[ArrayLib, int, int, tuple]:
        shape = a.shape
        memory = a.data
        return (self, memory.ptr, shape[0] if shape else -1,
                (self, a.dtype, shape[1:], a._c_contiguous, memory.device_id))

    def describe(self, a, arg: str, device_id: int) -> ArrayInfo:
        if a.data.device_id != device_id:
            raise ValueError(f"{arg}: expected an array on GPU {device_id} (the Buffer's), got one on GPU "
                             f"{a.data.device_id}")
        return ArrayInfo(self, self._names.get(a.dtype), a.dtype, tuple(a.shape), bool(a._c_contiguous),
                         tuple(a.strides))

    def empty(self, shape, dtype_name, device_id):
        # The pool's memory, then an array on it: about 1 us less per call than cupy.empty.
        return self._cupy.ndarray(shape, STORAGE[dtype_name], self._cupy.cuda.alloc(row_bytes(shape, dtype_name)))

    def pointer(self, array) -> int:
        return array.data.ptr

    def current_stream(self, device_id: int) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def element_strides(self, array) -> Tuple[int, ...]:
        itemsize = array.itemsize
        return tuple(s // itemsize for s in array.strides)

    def allocating_on(self, stream, device_id: int):
        return stream

    def reinterpret(self, array, dtype_name: str):
        return array.view(STORAGE[dtype_name])

    def window(self, ptr: int, num_bytes: int, device_id: int, owner: Any):
        cuda = self._cupy.cuda
        memory = cuda.MemoryPointer(cuda.UnownedMemory(ptr, num_bytes, owner, device_id), 0)
        return self._cupy.ndarray((num_bytes,), np.uint8, memory)

    def rows_in(self, window, rows: int, tail: Tuple[int, ...], dtype_name: str):
        # One call, as in carve: an array made on the window's memory (no slice, view, reshape).
        return self._cupy.ndarray((rows, *tail), STORAGE[dtype_name], window.data)

    def trim(self, array, rows: int):
        # An array made on the same memory: one call, where a slice costs about twice as much.
        return self._cupy.ndarray((rows, *array.shape[1:]), array.dtype, array.data)

    def carve(self, block, views) -> list:
        # An array made on the block's memory takes any dtype and offset in one call (no base
        # array: the memory pointer keeps the pool's allocation alive).
        ndarray, memory = self._cupy.ndarray, block.data
        return [None if view is None else ndarray(view[1], STORAGE[view[2]], memory + view[0]) for view in views]


class _TorchLib(ArrayLib):
    name = "torch"

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._dtypes = {name: getattr(torch, name) for name in STORAGE}
        self._names = {dtype: name for name, dtype in self._dtypes.items()}
        self._devices: Dict[int, Any] = {}
        self._streams: Dict[Tuple[int, int], Any] = {}
        self._raw_stream: Callable[[int], int]  # the device's current stream (cudaStream_t)
        try:
            self._raw_stream = torch._C._cuda_getCurrentRawStream
        except AttributeError:  # pragma: no cover - a PyTorch without the raw accessor
            self._raw_stream = lambda device_id: torch.cuda.current_stream(device_id).cuda_stream

    def read(self, t) -> Tuple[ArrayLib, int, int, tuple]:
        shape = t.shape
        return (self, t.data_ptr() or self._address_in_storage(t), shape[0] if shape else -1,
                (self, t.dtype, shape[1:], t.is_contiguous(), t.get_device()))

    @staticmethod
    def _address_in_storage(t) -> int:
        """Where ``t`` starts in its storage: an empty tensor's ``data_ptr()`` is 0, and an empty
        view of rows in place (a rank that received no tokens) must still be known by its address."""
        return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()

    def describe(self, t, arg: str, device_id: int) -> ArrayInfo:
        if not t.is_cuda:
            raise TypeError(f"{arg}: expected a CUDA tensor, got one on {t.device}")
        if t.get_device() != device_id:
            raise ValueError(f"{arg}: expected a tensor on GPU {device_id} (the Buffer's), got one on {t.device}")
        return ArrayInfo(self, self._names.get(t.dtype), t.dtype, tuple(t.shape), t.is_contiguous(),
                         tuple(s * t.element_size() for s in t.stride()))

    def device(self, device_id: int):
        device = self._devices.get(device_id)
        if device is None:
            device = self._devices[device_id] = self._torch.device("cuda", device_id)
        return device

    def empty(self, shape, dtype_name, device_id):
        # Sizes as separate arguments: measurably faster to parse than one tuple.
        return self._torch.empty(*shape, dtype=self._dtypes[dtype_name], device=self.device(device_id))

    def pointer(self, tensor) -> int:
        return tensor.data_ptr()

    def current_stream(self, device_id: int) -> int:
        return self._raw_stream(device_id)

    def element_strides(self, tensor) -> Tuple[int, ...]:
        return tensor.stride()

    def reinterpret(self, tensor, dtype_name: str):
        return tensor.view(self._dtypes[dtype_name])

    def shrink(self, tensor, rows: int):
        # Cut in place (a third of a slice's cost); the storage stays whole, as a slice's would.
        return tensor.resize_(rows, *tensor.shape[1:])

    def window(self, ptr: int, num_bytes: int, device_id: int, owner: Any):
        # Once per plan: through CuPy's view of the memory, which the tensor keeps alive.
        return self._torch.as_tensor(library("cupy").window(ptr, num_bytes, device_id, owner),
                                     device=self.device(device_id))

    def stream(self, stream_ptr: int, device_id: int):
        """A ``torch.cuda.Stream`` naming the raw stream ``stream_ptr`` (made once per stream)."""
        key = (stream_ptr, device_id)
        stream = self._streams.get(key)
        if stream is None:
            device = self.device(device_id)
            # PyTorch reads ExternalStream(0) as "no stream given" and hands out a stream of its
            # pool: the legacy default stream must be named as PyTorch's default stream.
            stream = self._torch.cuda.default_stream(device) if stream_ptr == 0 else \
                self._torch.cuda.ExternalStream(stream_ptr, device=device)
            self._streams[key] = stream
        return stream

    def allocating_on(self, stream, device_id: int):
        return self._torch.cuda.stream(self.stream(stream.ptr, device_id))

    def used_on(self, arrays, stream_ptr: int, device_id: int) -> None:
        stream = self.stream(stream_ptr, device_id)
        for t in arrays:
            if isinstance(t, self._torch.Tensor):  # a caller may mix in CuPy arrays
                t.record_stream(stream)


_LIBS: Dict[type, Optional[ArrayLib]] = {}
_LIB_SINGLETONS: Dict[str, ArrayLib] = {}
#: Held while a library object is made: rank threads of one process meet their first arrays
#: together, and two objects for one library would fail the checks that compare them with ``is``.
_MAKING = threading.Lock()


def _singleton(cls) -> ArrayLib:
    lib = _LIB_SINGLETONS.get(cls.name)
    if lib is None:
        with _MAKING:
            lib = _LIB_SINGLETONS.get(cls.name)
            if lib is None:
                lib = _LIB_SINGLETONS[cls.name] = cls()
    return lib


def library(name: str) -> ArrayLib:
    """The :class:`ArrayLib` named ``"cupy"`` or ``"torch"``."""
    return _singleton({"cupy": _CupyLib, "torch": _TorchLib}[name])


def _lib_for_type(cls: type) -> Optional[ArrayLib]:
    """The library of arrays of type ``cls`` (remembered per type), or None for anything else."""
    lib = None
    module = cls.__module__ or ""
    if module.startswith("cupy"):
        import cupy

        if issubclass(cls, cupy.ndarray):
            lib = _singleton(_CupyLib)
    elif module.startswith("torch") or any(base.__module__.startswith("torch") for base in cls.__mro__):
        import torch

        if issubclass(cls, torch.Tensor):
            lib = _singleton(_TorchLib)
    _LIBS[cls] = lib
    return lib


def lib_of(x) -> Optional[ArrayLib]:
    """The :class:`ArrayLib` of ``x``, or None when ``x`` is no CuPy array or PyTorch tensor."""
    cls = type(x)
    try:
        return _LIBS[cls]
    except KeyError:
        return _lib_for_type(cls)


#: What :func:`read` returns for an argument that was not given (its row count matches no array's).
ABSENT = (None, 0, -2, None)


def read(x) -> Tuple[Optional[ArrayLib], int, int, Optional[tuple]]:
    """``(lib, pointer, rows, key)`` of an array argument; :data:`ABSENT` for None.

    Anything that is no array gets a key no checked plan has: the checks then explain what is
    wrong with it.
    """
    if x is None:
        return ABSENT
    cls = type(x)
    try:
        lib = _LIBS[cls]
    except KeyError:
        lib = _lib_for_type(cls)
    if lib is None:
        return (None, 0, 0, ("not an array", cls))
    return lib.read(x)


def describe(x, arg: str, device_id: int) -> ArrayInfo:
    """Read ``x`` completely for the checks.

    Raises:
        TypeError: ``x`` is not a device array (NumPy arrays and CPU tensors included).
        ValueError: ``x`` lives on another GPU than the Buffer's.
    """
    lib = lib_of(x)
    if lib is None:
        if isinstance(x, np.ndarray):
            raise TypeError(f"{arg}: expected a device array (CuPy array or CUDA tensor), got a NumPy array "
                            "on the host")
        raise TypeError(f"{arg}: expected a CuPy array or a PyTorch CUDA tensor, got {type(x).__name__}")
    return lib.describe(x, arg, device_id)


def check_array(info: ArrayInfo, arg: str, dtype_names: Tuple[str, ...], ndim: int,
                shape: Optional[Tuple[Optional[int], ...]] = None, any_strides: bool = False) -> str:
    """Raise a clear error unless ``info`` has one of ``dtype_names``, ``ndim``, ``shape`` and
    a row-major contiguous layout (``any_strides``: any whole, non-negative element strides).
    ``None`` in ``shape`` accepts any extent. Returns ``info``'s dtype name (one of ``dtype_names``)."""
    dtype_name = info.dtype_name
    if dtype_name is None or dtype_name not in dtype_names:
        shown = dtype_name or str(info.dtype).replace("torch.", "")
        raise TypeError(f"{arg}: expected dtype {' or '.join(dtype_names)}, got {shown}")
    if len(info.shape) != ndim:
        raise ValueError(f"{arg}: expected {ndim} dimensions, got shape {info.shape}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, info.shape)):
            if want is not None and want != got:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{arg}: expected shape {expected}, got {info.shape} (axis {axis})")
    if any_strides:
        itemsize = ITEMSIZE[dtype_name]
        if any(stride < 0 or stride % itemsize for stride in info.strides):
            raise ValueError(f"{arg}: expected non-negative strides in whole elements, got {info.strides} bytes")
    elif not info.contiguous:
        raise ValueError(f"{arg}: expected a contiguous (row-major) array, got strides {info.strides}")
    return dtype_name


def check_int(value: Any, arg: str, minimum: int = 1) -> int:
    """``value`` (a Python or NumPy integer, not a bool) as an int; a ``ValueError`` naming ``arg``
    if it is none or below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{arg}: expected {expected}, got {value!r}")
    return int(value)
