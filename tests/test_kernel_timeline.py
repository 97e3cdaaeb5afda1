"""scripts/kernel_timeline.py still finds the places it stamps, and the stamped kernels compile.

The script profiles the transfer kernels on the GPU by patching a copy of their source; these
checks keep it usable as the kernels change (on any machine: NVRTC only).
"""

from __future__ import annotations

import numpy as np
import pytest
from _harness import load_script
from test_kernels_compile import _compile, _nvrtc

from deepep_cupy.gpu import kernels


def _timeline():
    return load_script("kernel_timeline")


@pytest.mark.parametrize("file_name", ["dispatch.cu", "combine.cu"])
def test_stamped_transfer_kernels_compile(file_name):
    timeline = _timeline()
    source = timeline.patch_source(file_name, kernels.read_source(file_name))
    assert source.count("timeline_stamp(timeline_call") == 4
    instances = [e for e in kernels.SOURCES[file_name] if e.endswith("2>") or e.endswith("2, true>")]
    lowered, _ = _compile(_nvrtc(), file_name, source, instances)
    assert set(lowered) == set(instances)


def test_a_missing_place_is_named():
    timeline = _timeline()
    with pytest.raises(RuntimeError, match="dispatch.cu has 0 places like"):
        timeline.patch_source("dispatch.cu", "__global__ void dispatch_kernel() {}\n")


def test_phases_are_read_per_call_in_call_order():
    timeline = _timeline()
    first = np.full((64, 4), 2.0**64 - 1)
    last = np.zeros((64, 4))
    # Call 5 then call 6 (table rows by barrier count), times in ns.
    for call, t0 in ((5, 1000.0), (6, 30000.0)):
        first[call] = [t0, t0 + 7000, t0 + 8000, t0 + 8000]
        last[call] = [t0 + 100, t0 + 7200, t0 + 20000, t0 + 25000]
    rows = timeline.phases(first, last)
    assert rows[0] == {"check": 7.0, "send_last": 13.0, "recv_last": 18.0, "gap": 4.0}
    assert rows[1] == {"check": 7.0, "send_last": 13.0, "recv_last": 18.0}
