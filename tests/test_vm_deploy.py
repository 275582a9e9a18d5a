"""deploy/vm: the systemd unit passes ``systemd-analyze verify`` (its ExecStart pointed at this venv's tqmon,
since /opt/tqmon does not exist here), and every variable of the example environment file is an option of
``tqmon serve``, so a renamed flag cannot leave the example silently ignored. The Ray head script runs for
real in tests/test_ray_job_logs.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tqmon.cli import serve

VM = Path(__file__).resolve().parent.parent / "deploy" / "vm"


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is not installed: run `make test` (system-deps installs systemd)")
    unit = (VM / "tqmon.service").read_text()
    assert "ExecStart=/opt/tqmon/bin/tqmon serve" in unit
    unit = unit.replace("/opt/tqmon/bin/tqmon", str(Path(sys.executable).parent / "tqmon"))
    unit = unit.replace("/etc/tqmon/tqmon.env", str(VM / "tqmon.env"))
    (tmp_path / "tqmon.service").write_text(unit)
    result = subprocess.run(
        [analyze, "verify", str(tmp_path / "tqmon.service")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tqmon.service" not in result.stderr  # no warning about the unit itself


def test_example_environment_names_only_serve_options() -> None:
    known = {p.envvar for p in serve.params if isinstance(p, click.Option)}
    lines = [line for line in (VM / "tqmon.env").read_text().splitlines() if line and not line.startswith("#")]
    names = [line.partition("=")[0] for line in lines]
    assert names and set(names) <= known, set(names) - known
    assert "TQMON_STATE_DIR=/var/lib/tqmon" in (VM / "tqmon.service").read_text()
