"""Argument checks on arrays that need no GPU: what is refused, and that the message says why."""

from types import SimpleNamespace

import numpy as np
import pytest

from deepep_cupy import arrays


def fake(dtype, shape, contiguous=True):
    """Stands in for a CuPy array in check_array, which reads only these attributes."""
    return SimpleNamespace(dtype=np.dtype(dtype), ndim=len(shape), shape=shape, _c_contiguous=contiguous,
                           strides=(0,) * len(shape))


def test_a_numpy_array_is_refused_as_host_memory():
    with pytest.raises(TypeError, match=r"topk_idx: expected a device array .* NumPy array on the host"):
        arrays.as_cupy(np.zeros((4, 2), np.int64), "topk_idx", 0)


def test_a_list_is_refused_with_its_type():
    with pytest.raises(TypeError, match="x: expected a CuPy array or a PyTorch CUDA tensor, got list"):
        arrays.as_cupy([1, 2, 3], "x", 0)


def test_wrong_dtype_names_argument_expected_and_given():
    with pytest.raises(TypeError, match="topk_idx: expected dtype int64, got int32"):
        arrays.check_array(fake(np.int32, (4, 8)), "topk_idx", ("int64",), 2)


def test_uint16_counts_as_bfloat16():
    arrays.check_array(fake(np.uint16, (4, 8)), "x", ("bfloat16", "float16", "float32"), 2)


def test_wrong_number_of_dimensions():
    with pytest.raises(ValueError, match=r"x: expected 2 dimensions, got shape \(4,\)"):
        arrays.check_array(fake(np.uint16, (4,)), "x", ("bfloat16",), 2)


def test_wrong_extent_names_the_axis():
    with pytest.raises(ValueError, match=r"is_token_in_rank: expected shape \(16, 2\), got \(16, 4\) \(axis 1\)"):
        arrays.check_array(fake(np.bool_, (16, 4)), "is_token_in_rank", ("bool",), 2, (16, 2))


def test_wildcard_extent_accepts_anything():
    arrays.check_array(fake(np.float32, (16, 7)), "x_scales", ("float32",), 2, (16, None))


def test_non_contiguous_layout_is_refused():
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        arrays.check_array(fake(np.uint16, (4, 8), contiguous=False), "x", ("bfloat16",), 2)


def test_storage_dtypes_of_the_named_types():
    assert arrays.STORAGE["bfloat16"] == np.uint16
    assert arrays.STORAGE["float8_e4m3fn"] == np.uint8
    assert arrays.ITEMSIZE["float32"] == 4
