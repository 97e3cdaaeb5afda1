"""The numbers shared by the host and the kernels are defined once (CPU only)."""

import re

import pytest

from deepep_cupy import constants
from deepep_cupy.bench import own_kernels
from deepep_cupy.gpu import kernels, layout


def _sources():
    """Every CUDA source by name: the library's and the benchmark's own."""
    paths = [*kernels.kernel_dir().glob("*.cu*"), *own_kernels.KERNEL_DIR.glob("*.cu*")]
    return {path.name: path.read_text() for path in sorted(paths)}


def test_the_kernels_get_every_shared_constant_from_the_generated_header():
    header = constants.cuda_header()
    for name, value in constants.cuda_defines().items():
        assert f"#define {name} {value}\n" in header
    for file_name in kernels.SOURCES:
        source = kernels.read_source(file_name)
        assert header in source and f'#include "{kernels.GENERATED_HEADER}"' not in source


@pytest.mark.parametrize("file_name", sorted(_sources()))
def test_no_source_defines_a_shared_constant_itself(file_name):
    defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", _sources()[file_name], re.MULTILINE))
    assert not defined & set(constants.cuda_defines())


def test_every_shared_constant_is_used_by_a_kernel():
    text = "".join(_sources().values())
    unused = [name for name in constants.cuda_defines() if not re.search(rf"\b{name}\b", text)]
    assert not unused


def test_there_is_no_constants_file_to_drift():
    assert not (kernels.kernel_dir() / kernels.GENERATED_HEADER).exists()


def test_every_kernel_has_a_block_size_of_whole_warps():
    assert set(constants.BLOCK_THREADS) == set(kernels.SIGNATURES)
    assert all(n % 32 == 0 for n in constants.BLOCK_THREADS.values())


def test_error_codes_are_distinct_and_not_zero():
    codes = [constants.ERROR_TIMEOUT, constants.ERROR_MISMATCH, constants.ERROR_PEER_ABORTED]
    assert 0 not in codes and len(set(codes)) == len(codes)


def test_the_buffer_header_words_are_distinct_and_inside_the_header():
    words = [index for indices in layout.HEADER_WORDS.values() for index in indices]
    assert len(words) == len(set(words)), layout.HEADER_WORDS
    assert 0 <= min(words) and max(words) < layout.SIGNAL_BYTES // layout.INT_BYTES
    assert layout.HEADER_WORDS["abort mark"] == (constants.ABORT_INT,)
