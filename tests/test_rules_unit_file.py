"""``deploy/prometheus/tqmon-rules.test.yml``, the promtool unit tests shipped next to the rules, run as a user
who edited the rules would run them; a broken copy must fail, so the file cannot pass vacuously."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PROMETHEUS_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
TESTS_FILE = PROMETHEUS_DIR / "tqmon-rules.test.yml"


def promtool_test(path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run `make test`, which installs Debian's prometheus")
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, check=False)


def test_shipped_rule_unit_tests_pass() -> None:
    result = promtool_test(TESTS_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_shipped_rule_unit_tests_catch_a_changed_threshold(tmp_path: Path) -> None:
    rules = (PROMETHEUS_DIR / "tqmon-rules.yml").read_text()
    assert "tqmon:window_fill_ratio:ratio < 0.9" in rules
    (tmp_path / "tqmon-rules.yml").write_text(
        rules.replace("tqmon:window_fill_ratio:ratio < 0.9", "tqmon:window_fill_ratio:ratio < 0.4")
    )
    (tmp_path / TESTS_FILE.name).write_text(TESTS_FILE.read_text())
    result = promtool_test(tmp_path / TESTS_FILE.name)
    assert result.returncode != 0
    assert "TQMonWindowUnderFilledAfterResume" in result.stdout + result.stderr
