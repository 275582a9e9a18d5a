"""``tqmon serve --file-sd``: a real Prometheus whose only job is a ``file_sd_configs`` over a directory picks
up a tqmon it was never configured for, with the run's labels, and drops it once tqmon stops."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TqmonProcess, free_port
from tests.test_e2e import Prometheus
from tqmon.file_sd import FileSDError, FileSDTarget, parse_labels, target_address


def test_labels_are_checked_and_the_slurm_job_is_added(tmp_path: Path) -> None:
    assert parse_labels(["run=gsm8k-7b", "team=rl"]) == {"run": "gsm8k-7b", "team": "rl"}
    for bad in ("run", "1run=x", "__name__=x", "a-b=x"):
        with pytest.raises(FileSDError, match="NAME=VALUE"):
            parse_labels([bad])
    target = FileSDTarget(tmp_path / "t.json", "node-3:9842", {"run": "a"}, {"SLURM_JOB_ID": "4242"})
    target.register()
    assert json.loads((tmp_path / "t.json").read_text()) == [
        {"targets": ["node-3:9842"], "labels": {"slurm_job_id": "4242", "run": "a"}}
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # no temp file left behind
    target.deregister()
    assert list(tmp_path.iterdir()) == []


def test_wildcard_listen_announces_the_host_name() -> None:
    assert target_address("127.0.0.1", 9842) == "127.0.0.1:9842"
    assert target_address("::1", 9842) == "[::1]:9842"
    assert not target_address("0.0.0.0", 9842).startswith("0.0.0.0")


def test_a_missing_directory_is_a_usage_error(tqmon_factory: Callable[..., TqmonProcess], tmp_path: Path) -> None:
    proc = tqmon_factory(["--file-sd", str(tmp_path / "nowhere" / "t.json")])
    with pytest.raises(RuntimeError, match=r"directory .*nowhere does not exist"):
        proc.start()


def test_the_target_file_appears_only_once_tqmon_listens(tmp_path: Path) -> None:
    """The first scrape after the file appears is answered, never refused: the file comes after the bind."""
    port, target = free_port(), tmp_path / "t.json"
    command = [sys.executable, "-m", "tqmon.cli", "serve", "--listen", f"127.0.0.1:{port}"]
    command += ["--state-dir", str(tmp_path / "state"), "--file-sd", str(target)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not target.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "tqmon never wrote its target file"
            time.sleep(0.001)
        (address,) = json.loads(target.read_text())[0]["targets"]
        assert httpx.get(f"http://{address}/metrics", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    assert not target.exists()


def targets(prom: Prometheus) -> list[dict[str, Any]]:
    body = httpx.get(prom.url + "/api/v1/targets", params={"state": "active"}, timeout=5).json()
    active: list[dict[str, Any]] = body["data"]["activeTargets"]
    return active


def eventually(probe: Callable[[], Any], done: Callable[[Any], bool], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if done(value):
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last: {value}")


@pytest.mark.e2e
def test_prometheus_file_sd_picks_up_and_drops_tqmon(
    tqmon_factory: Callable[..., TqmonProcess], tmp_path: Path
) -> None:
    sd_dir = tmp_path / "file_sd"
    sd_dir.mkdir()
    job = (
        f"  - job_name: tqmon\n    file_sd_configs:\n      - files: ['{sd_dir}/*.json']\n        refresh_interval: 2s\n"
    )
    prom = Prometheus(tmp_path / "prometheus", None, job)
    try:
        prom.wait_ready()
        assert targets(prom) == []
        tqmon = tqmon_factory(
            ["--file-sd", str(sd_dir / "trainer-0.json"), "--file-sd-label", "run=gsm8k-7b"],
            env={"SLURM_JOB_ID": "4242"},
        ).start()
        found = eventually(
            lambda: targets(prom), lambda t: len(t) == 1 and t[0]["health"] == "up", "the target to be scraped"
        )
        assert found[0]["scrapeUrl"] == f"http://127.0.0.1:{tqmon.port}/metrics"
        labels = found[0]["labels"]
        assert {k: labels[k] for k in ("job", "instance", "run", "slurm_job_id")} == {
            "job": "tqmon",
            "instance": f"127.0.0.1:{tqmon.port}",
            "run": "gsm8k-7b",
            "slurm_job_id": "4242",
        }
        up = eventually(lambda: prom.query('up{job="tqmon",run="gsm8k-7b"}'), bool, "up from the file_sd target")
        assert up[0]["value"][1] == "1"

        tqmon.kill(signal.SIGTERM)
        assert not (sd_dir / "trainer-0.json").exists()
        eventually(lambda: targets(prom), lambda t: t == [], "the target to be dropped")
    finally:
        prom.stop()
