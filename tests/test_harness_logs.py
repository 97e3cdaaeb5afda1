"""The test harness keeps every worker run's output in ``DEEPEP_TEST_LOG_DIR`` as it ends, so that
a GPU session cut off by its time limit still has the failing workers' own reports."""

import sys

import _harness
import pytest


def test_each_run_leaves_a_numbered_log_with_its_command_exit_and_output(tmp_path, monkeypatch):
    monkeypatch.setattr(_harness, "LOG_DIR", str(tmp_path))
    script = tmp_path / "speaker.py"
    script.write_text("import sys\nprint('RESULT out')\nprint('why', file=sys.stderr)\nsys.exit(3)\n")
    _harness.run_command([sys.executable, script], timeout=60)
    _harness.run_command([sys.executable, script], timeout=60)
    logs = sorted(tmp_path.glob("*-speaker.log"))
    assert len(logs) == 2
    text = logs[0].read_text()
    assert "speaker.py" in text.splitlines()[0] and "exit 3" in text and "RESULT out" in text and "why" in text


def test_a_run_that_times_out_leaves_its_log_too(tmp_path, monkeypatch):
    monkeypatch.setattr(_harness, "LOG_DIR", str(tmp_path))
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(AssertionError, match="timed out"):
        _harness.run_command([sys.executable, script], timeout=2)
    (log,) = tmp_path.glob("*-sleeper.log")
    assert "timed out after 2 s" in log.read_text() and "started" in log.read_text()


def test_without_the_setting_no_log_is_written(monkeypatch):
    monkeypatch.setattr(_harness, "LOG_DIR", "")
    kept = _harness._logs_kept[0]
    _harness.run_command([sys.executable, "-c", "print(1)"], timeout=60)
    assert _harness._logs_kept[0] == kept
