"""scripts/decode_timeline.py: the stamped low-latency kernels compile, and its phases read the stamps.

The script profiles the decode kernels on the GPU with ``LL_STAMP`` defined; these checks keep it
usable as the kernels change (NVRTC and NumPy only).
"""

from __future__ import annotations

import numpy as np
import pytest
from _harness import load_script
from test_kernels_compile import _compile, _nvrtc

from deepep_cupy.gpu import kernels


def _timeline():
    return load_script("decode_timeline")


def test_stamped_low_latency_kernels_compile():
    timeline = _timeline()
    source = timeline.patch_source("low_latency.cu", kernels.read_source("low_latency.cu"))
    instances = kernels.SOURCES["low_latency.cu"]
    lowered, _ = _compile(_nvrtc(), "low_latency.cu", source, instances)
    assert set(lowered) == set(instances)


@pytest.mark.parametrize("knob", ["LL_POLL_SLEEP_NS=100"])
def test_a_knob_set_with_define_reaches_the_kernels_and_compiles(knob):
    timeline = _timeline()
    source = timeline.patch_source("low_latency.cu", kernels.read_source("low_latency.cu"), [knob])
    assert source.startswith(f"#define {knob.replace('=', ' ')}\n")
    lowered, _ = _compile(_nvrtc(), "low_latency.cu", source, kernels.SOURCES["low_latency.cu"])
    assert set(lowered) == set(kernels.SOURCES["low_latency.cu"])


def test_other_kernels_are_not_stamped():
    timeline = _timeline()
    assert timeline.patch_source("dispatch.cu", "text") == "text"


def test_phases_are_measured_from_the_first_entry_and_against_the_peer():
    timeline = _timeline()
    shape = (timeline.MAX_RANKS_STAMPED, 2, timeline.CALLS_KEPT, timeline.SLOTS)
    first, last = np.zeros(shape, np.uint64), np.zeros(shape, np.uint64)
    # slots: 0 entry, 1 released, 2 sent, 3 seen, 4 done, 5 placed, 6 written
    for call, base in ((0, 10_000), (1, 50_000)):
        for rank, late in ((0, 0), (1, 2_000)):
            first[rank, 0, call] = [base + late] * timeline.SLOTS
            last[rank, 0, call] = [base + late + d for d in (0, 1_000, 4_000, 6_000, 9_000, 2_000, 3_000)]
    out = timeline.phases(first.ravel(), last.ravel(), num_ranks=2, op=0)
    assert out[0] == {"entry": -2.0, "released": 1.0, "placed": 2.0, "written": 3.0, "sent": 4.0, "seen": 6.0,
                      "done": 9.0, "gap": 31.0}
    assert out[1]["entry"] == 2.0


def test_a_point_no_warp_reached_is_not_a_number():
    timeline = _timeline()
    shape = (timeline.MAX_RANKS_STAMPED, 2, timeline.CALLS_KEPT, timeline.SLOTS)
    first, last = np.zeros(shape, np.uint64), np.zeros(shape, np.uint64)
    first[0, 1, 0] = [1_000] * timeline.SLOTS
    last[0, 1, 0] = [1_000, 2_000, 3_000, 4_000, 5_000, 0, 0]  # a combine: no dispatch places
    out = timeline.phases(first.ravel(), last.ravel(), num_ranks=1, op=1)
    assert np.isnan(out[0]["placed"]) and out[0]["done"] == 4.0
