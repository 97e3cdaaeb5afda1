"""RowsInBuffer: which dispatch's rows lie in the NVLink buffer, and the inputs refused from there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepep_cupy.intranode.rows_in_buffer import RowsInBuffer

NVL = SimpleNamespace(local_ptr=1 << 20, num_bytes=4096)


def _plan(windows):
    return SimpleNamespace(windows=windows, spec=SimpleNamespace(layout="the layout"))


def test_a_dispatch_with_rows_in_place_leaves_its_handle_and_layout():
    rows, handle = RowsInBuffer(), SimpleNamespace()
    rows.note_dispatch(_plan(windows=("views",)), handle)
    assert rows.of is handle and handle.rows_in_buffer == "the layout"


def test_a_dispatch_that_allocates_its_outputs_overwrites_the_rows_in_place():
    rows, first = RowsInBuffer(), SimpleNamespace()
    rows.note_dispatch(_plan(windows=("views",)), first)
    rows.note_dispatch(_plan(windows=None), SimpleNamespace())
    assert rows.of is None


def test_nothing_is_in_place_before_a_dispatch_put_rows_there():
    rows = RowsInBuffer()
    assert rows.used is False and rows.of is None


def test_an_input_inside_the_buffer_is_refused_by_its_name():
    with pytest.raises(ValueError, match="topk_weights: lies in this Buffer's NVLink buffer"):
        RowsInBuffer().refuse_inputs(NVL, ("x", "topk_weights"), 0, NVL.local_ptr + 100)


@pytest.mark.parametrize("ptr", [0, NVL.local_ptr - 16, NVL.local_ptr + NVL.num_bytes])
def test_inputs_outside_the_buffer_pass(ptr):
    RowsInBuffer().refuse_inputs(NVL, ("x",), ptr)
