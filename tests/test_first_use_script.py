"""scripts/first_use_time.py, the measure of a first Buffer() with an empty kernel cache, runs.

Its GPU mode needs a GPU (without one it says so in one sentence, naming --nvrtc); its NVRTC mode
runs anywhere.
"""

from __future__ import annotations

import pytest
from _harness import REPO_ROOT, describe, gpu_count, run_python
from test_kernels_compile import _nvrtc

from deepep_cupy.gpu import kernels

SCRIPT = REPO_ROOT / "scripts" / "first_use_time.py"


def test_without_a_gpu_the_sentence_points_to_the_nvrtc_mode():
    if gpu_count():
        pytest.skip("a GPU is visible: the script measures instead")
    result = run_python([SCRIPT], timeout=120)
    # The sentence's form and exit status 2: tests/test_no_gpu_messages.py, as for every command.
    assert "without --nvrtc needs a CUDA GPU, but " in result.stderr, describe(result)


def test_the_nvrtc_mode_times_each_instance_of_the_warm_up_one_at_a_time_and_at_once():
    _nvrtc()
    result = run_python([SCRIPT, "--nvrtc", "--hot-path", "--ranks", "2", "--threads", "2"], timeout=300)
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    timed = [line[2:38].strip() for line in lines if line.startswith("  ")]
    assert timed == list(kernels.warm_up_instances(2)), describe(result)
    assert lines[-1].startswith("one at a time: ") and "in 2 threads at once: " in lines[-1], describe(result)
