"""Reading and checking array arguments (CPU only: ArrayInfo values and fake arrays stand in)."""

import threading
import time

import numpy as np
import pytest
from _harness import import_or_skip
from host_fakes import FakeArray, FakeLib, on_device

from deepep_cupy import tensors
from deepep_cupy.tensors import ArrayInfo, check_array


def info(dtype_name, shape, contiguous=True):
    return ArrayInfo(None, dtype_name, dtype_name, shape, contiguous, (0,) * len(shape))


def test_wrong_dtype_names_argument_expected_and_given():
    with pytest.raises(TypeError, match="topk_idx: expected dtype int64, got int32"):
        check_array(info("int32", (4, 8)), "topk_idx", ("int64",), 2)


def test_a_dtype_no_kernel_moves_is_named_as_the_library_calls_it():
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got float64$"):
        check_array(ArrayInfo(None, None, "torch.float64", (4, 8), True, (64, 8)), "x", ("bfloat16",), 2)


def test_wrong_number_of_dimensions():
    with pytest.raises(ValueError, match=r"x: expected 2 dimensions, got shape \(4,\)"):
        check_array(info("bfloat16", (4,)), "x", ("bfloat16",), 2)


def test_wrong_extent_names_the_axis():
    with pytest.raises(ValueError, match=r"is_token_in_rank: expected shape \(16, 2\), got \(16, 4\) \(axis 1\)"):
        check_array(info("bool", (16, 4)), "is_token_in_rank", ("bool",), 2, (16, 2))


def test_wildcard_extent_accepts_anything():
    check_array(info("float32", (16, 7)), "x_scales", ("float32",), 2, (16, None))


def test_non_contiguous_layout_is_refused():
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        check_array(info("bfloat16", (4, 8), contiguous=False), "x", ("bfloat16",), 2)


def test_storage_dtypes_of_the_named_types():
    assert tensors.STORAGE["bfloat16"] == np.uint16
    assert tensors.STORAGE["float8_e4m3fn"] == np.uint8
    assert tensors.ITEMSIZE["float32"] == 4


def test_a_numpy_array_is_refused_as_host_memory():
    with pytest.raises(TypeError, match=r"topk_idx: expected a device array .* NumPy array on the host"):
        tensors.describe(np.zeros((4, 2), np.int64), "topk_idx", 0)


def test_a_list_is_refused_with_its_type():
    with pytest.raises(TypeError, match="x: expected a CuPy array or a PyTorch CUDA tensor, got list"):
        tensors.describe([1, 2, 3], "x", 0)


def test_an_absent_argument_reads_as_no_array_with_no_rows():
    lib, ptr, rows, key = tensors.read(None)
    assert (lib, ptr, key) == (None, 0, None) and rows < -1


def test_something_that_is_no_array_gets_a_key_no_plan_has():
    assert tensors.read("abc")[3] == ("not an array", str)


def test_a_key_holds_everything_but_the_row_count(monkeypatch):
    lib = FakeLib()
    monkeypatch.setitem(tensors._LIBS, FakeArray, lib)
    a, b = on_device(np.zeros((8, 4), np.int64)), on_device(np.zeros((3, 4), np.int64))
    (_, ptr_a, rows_a, key_a), (_, _, rows_b, key_b) = tensors.read(a), tensors.read(b)
    assert ptr_a == a.ctypes.data and (rows_a, rows_b) == (8, 3) and key_a == key_b
    assert tensors.read(on_device(np.zeros((8, 5), np.int64)))[3] != key_a
    assert tensors.read(on_device(np.zeros((8, 4), np.int32)))[3] != key_a
    assert tensors.read(on_device(np.zeros((8, 4), np.int64), device_id=1))[3] != key_a
    assert tensors.read(on_device(np.zeros((8, 8), np.int64))[:, ::2])[3] != key_a


def test_any_non_negative_whole_element_strides_pass_where_allowed():
    strided = ArrayInfo(None, "float32", "float32", (16, 7), False, (4, 64))
    check_array(strided, "x[1]", ("float32",), 2, (16, None), any_strides=True)
    with pytest.raises(ValueError, match=r"x\[1\]: expected non-negative strides in whole elements, got \(4, -64\)"):
        check_array(strided._replace(strides=(4, -64)), "x[1]", ("float32",), 2, any_strides=True)
    with pytest.raises(ValueError, match="whole elements"):
        check_array(strided._replace(strides=(2, 64)), "x[1]", ("float32",), 2, any_strides=True)


# --- PyTorch tensors (CPU build: what can be read without a GPU) -------------------------------

def test_a_cpu_tensor_is_refused_as_host_memory():
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    with pytest.raises(TypeError, match="x: expected a CUDA tensor, got one on cpu"):
        tensors.describe(torch.zeros((4, 8), dtype=torch.bfloat16), "x", 0)


def test_a_tensor_is_read_natively():
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    t = torch.zeros((6, 8), dtype=torch.bfloat16)
    lib, ptr, rows, key = tensors.read(t)
    assert lib.name == "torch" and ptr == t.data_ptr() and rows == 6
    assert key[1:] == (torch.bfloat16, torch.Size([8]), True, -1)


def test_an_empty_tensor_is_read_at_its_place_in_its_storage():
    # data_ptr() of an empty tensor is 0: an empty view of rows in place must still be recognised.
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    t = torch.zeros((6, 8), dtype=torch.bfloat16)
    assert t[3:3].data_ptr() == 0
    assert tensors.read(t[3:3])[1] == t.data_ptr() + 3 * 8 * 2
    assert tensors.read(torch.empty((0, 8)))[1] == 0


def test_column_major_tensor_strides_are_read_in_elements():
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    scales = torch.ones((5, 3), dtype=torch.float32).T.contiguous().T
    assert tensors.library("torch").element_strides(scales) == (1, 5)


# --- views carved out of one allocation (what a dispatch allocating ahead returns) ------------

CARVED = [(16, (3, 4), "int64"), (112, (3, 4), "float32"), None, (160, (5,), "float32"), (180, (0, 2), "float32")]


def _check_carved(views, block_ptr, pointer):
    assert views[2] is None
    for view, (offset, shape, _) in zip([v for v in views if v is not None], [c for c in CARVED if c is not None]):
        assert tuple(view.shape) == shape
        assert pointer(view) == block_ptr + offset or 0 in shape  # PyTorch's empty views point nowhere


def test_cupy_carves_a_dispatchs_outputs_and_torch_allocates_them():
    # PyTorch's views of another dtype and offset measured slower on CUDA than allocations.
    assert tensors.library("cupy").carves_outputs
    import_or_skip("torch", "the PyTorch tests (the torch extra)")
    assert not tensors.library("torch").carves_outputs


def test_a_torch_block_is_reinterpreted_in_place():
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    block = torch.zeros(32, dtype=torch.int64)
    ints = tensors.library("torch").reinterpret(block, "int32")
    assert ints.shape == (64,) and ints.dtype == torch.int32 and ints.data_ptr() == block.data_ptr()


def test_a_cupy_block_is_carved_into_arrays_on_its_memory():
    cupy = import_or_skip("cupy")
    from cupy.cuda import memory

    host = np.zeros(32, np.int64)  # an address only: nothing is read or written without a GPU
    block = cupy.ndarray((32,), np.int64, memptr=memory.MemoryPointer(
        memory.UnownedMemory(host.ctypes.data, host.nbytes, host, device_id=0), 0))
    lib = tensors.library("cupy")
    views = lib.carve(block, CARVED)
    _check_carved(views, block.data.ptr, lambda a: a.data.ptr)
    assert [v.dtype for v in views if v is not None] == [np.int64, np.float32, np.float32, np.float32]
    assert all(v.flags.c_contiguous for v in views if v is not None)
    assert lib.reinterpret(block, "int32").shape == (64,)


def test_rows_of_a_cupy_window_are_one_array_on_its_memory():
    import_or_skip("cupy")
    host = np.zeros(256, np.uint8)  # an address only, as above
    lib = tensors.library("cupy")
    window = lib.window(host.ctypes.data, host.nbytes, 0, host)
    rows = lib.rows_in(window, 3, (4,), "int64")
    assert rows.shape == (3, 4) and rows.dtype == np.int64 and rows.flags.c_contiguous
    assert rows.data.ptr == window.data.ptr == host.ctypes.data
    assert lib.rows_in(window, 5, (), "float32").shape == (5,)


def test_a_torch_allocation_shrinks_to_its_first_rows_in_place_and_keeps_its_memory():
    torch = import_or_skip("torch", "the PyTorch tests (the torch extra)")
    t = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    address, first_rows = t.data_ptr(), t[:3].clone()
    shrunk = tensors.library("torch").shrink(t, 3)
    assert shrunk.shape == (3, 4) and shrunk.is_contiguous() and shrunk.data_ptr() == address
    assert torch.equal(shrunk, first_rows) and shrunk.untyped_storage().nbytes() == 8 * 4 * 4


def test_a_trimmed_cupy_array_is_its_first_rows_on_the_same_memory():
    import_or_skip("cupy")
    host = np.zeros(256, np.uint8)  # an address only, as above
    lib = tensors.library("cupy")
    rows = lib.rows_in(lib.window(host.ctypes.data, host.nbytes, 0, host), 8, (4,), "float32")
    trimmed = lib.trim(rows, 3)
    assert trimmed.shape == (3, 4) and trimmed.dtype == np.float32 and trimmed.flags.c_contiguous
    assert trimmed.data.ptr == host.ctypes.data and trimmed.data.mem is rows.data.mem


def test_the_legacy_default_stream_is_named_as_pytorchs_default_stream_not_a_new_one(monkeypatch):
    # torch.cuda.ExternalStream(0) reads the null pointer as "no stream given" and hands out a
    # stream of PyTorch's pool: work a call allocated "for" it ran there, unordered with the
    # caller's legacy default stream (the internode rows that landed on the wrong rank).
    import_or_skip("torch", "PyTorch tensors")
    from types import SimpleNamespace

    lib = tensors._TorchLib()
    made = []
    cuda = SimpleNamespace(default_stream=lambda device: made.append(("default", device)) or "default stream",
                           ExternalStream=lambda ptr, device: made.append(("external", ptr)) or f"stream {ptr}")
    monkeypatch.setattr(lib, "_torch", SimpleNamespace(cuda=cuda, device=lambda kind, index: (kind, index)))
    monkeypatch.setattr(lib, "_streams", {})
    monkeypatch.setattr(lib, "_devices", {})
    assert lib.stream(0, 0) == "default stream"
    assert lib.stream(0x5EED, 0) == f"stream {0x5EED}"
    assert made == [("default", ("cuda", 0)), ("external", 0x5EED)]


def test_threads_meeting_their_first_arrays_together_share_one_library_object(monkeypatch):
    # Rank threads of one process reach their first arrays at once; the argument checks compare
    # the library objects of x and topk_idx with ``is``.
    made = []

    class SlowLib:
        name = "slow"

        def __init__(self):
            made.append(self)
            time.sleep(0.05)  # as long as importing the library takes, the others arrive meanwhile

    monkeypatch.setattr(tensors, "_LIB_SINGLETONS", {})
    start = threading.Barrier(8)
    got = []

    def first_use():
        start.wait()
        got.append(tensors._singleton(SlowLib))

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1
    assert all(lib is made[0] for lib in got)
