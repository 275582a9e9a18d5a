"""`make demo` runs `tqmon demo`: Ray, a real TransferQueue, the simulated trainer, tqmon and Prometheus, live.

The test watches the resume of the `partial-restore` scenario arrive through tqmon's /metrics (from the log,
the checkpoint dir and the live TQ) and Prometheus, then presses Ctrl-C and checks that every process the
demo started, Ray's included, is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, sample_value

# partial-restore (tqmon/sim/scenarios.py): B 4, num_warmup_batches 2 -> 2.5 at the resume from global_step_2.
# T = floor(2.5 * 4) = 10; the checkpoint holds 8 groups (6 finished, 2 running): M = 10 - 8 = 2.
EXPECTED = {
    "tqmon_resumes_total": 1,
    "tqmon_last_resume_checkpoint_step": 2,
    "tqmon_resume_warmup_target_prompt_groups": 10,
    "tqmon_resume_warmup_expected_prompt_groups": 2,
    "tqmon_resume_warmup_submitted_prompt_groups": 2,
    'tqmon_resume_restored_prompt_groups{status="running"}': 2,
    'tqmon_resume_restored_prompt_groups{status="finished"}': 6,
    'tqmon_resume_warmup_state{state="topped_up"}': 1,
    'tqmon_source_up{source="tq"}': 1,
    'tqmon_source_up{source="log"}': 1,
    'tqmon_source_up{source="checkpoint"}': 1,
    "tqmon_tq_controller_epochs_total": 2,  # the fresh start's controller, then the resumed trainer's
}


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Ray's gcs_server, raylet and workers included)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def train_window(text: str) -> float:
    statuses = ("pending", "running", "finished", "failure")
    return sum(
        sample_value(text, f'tqmon_window_prompt_groups{{partition="train",status="{s}"}}') or 0 for s in statuses
    )


def prometheus_url(lines: list[str]) -> str:
    """The Prometheus URL from the demo's summary screen."""
    for line in lines:
        match = re.search(r"prometheus\s+(http://127\.0\.0\.1:\d+)/", line)
        if match:
            return match.group(1)
    raise AssertionError("the demo printed no Prometheus URL:\n" + "\n".join(lines[-30:]))


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (make test installs it)")
def test_demo_runs_the_real_stack_and_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    port = free_port()
    workdir = tmp_path / "demo"
    command = [sys.executable, "-m", "tqmon.cli", "demo", "--listen", f"127.0.0.1:{port}", "--step-seconds", "0.3"]
    command += ["--workdir", str(workdir), "--prometheus"]
    env = {**os.environ, "TQMON_DEMO_SCENARIO": "partial-restore"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline:
            started |= descendants(proc.pid)
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                text = ""
            if (
                all(sample_value(text, series) == value for series, value in EXPECTED.items())
                and train_window(text) == 10
            ):
                break
            assert proc.poll() is None, "\n".join(lines[-50:])
            time.sleep(0.5)
        assert {s: sample_value(text, s) for s in EXPECTED} == EXPECTED
        assert (
            train_window(text) == 10
        )  # the live window, topped up to T (a poll may see the new TQ before its restore)
        prometheus = prometheus_url(lines)
        targets = httpx.get(prometheus + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        assert [(t["labels"]["job"], t["scrapeUrl"]) for t in targets] == [
            ("tqmon", f"http://127.0.0.1:{port}/metrics")
        ]
        rules = httpx.get(prometheus + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert [g["name"] for g in rules] == ["tqmon"]
        started |= descendants(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        reader.join(timeout=10)
    output = "\n".join(lines)
    assert proc.returncode == 0, output[-3000:]
    assert f"http://127.0.0.1:{port}/metrics" in output
    assert "stopped: trainer, tqmon, prometheus and the Ray cluster" in output
    assert len(started) >= 5  # trainer, tqmon, prometheus, and Ray's own processes
    assert not [pid for pid in started if alive(pid)]


def test_the_demo_screen_marks_a_lower_bound_deficit() -> None:
    """The screen's resume line is built from /api/v1/status's record: a lower bound says so, an exact one not."""
    from dataclasses import replace

    from tqmon.demo import resume_line
    from tqmon.report import verdict
    from tqmon.snapshot import ResumeRecord

    exact = ResumeRecord(
        index=1, resumed=True, started_at=0.0, checkpoint_step=40, restored=20, reissued=5, target=24,
        expected=4, submitted=4, over_restored=0, doomed={"failure": 4, "stale": 2, "filtered": 0},
        under_submitted=6,
    )  # fmt: skip
    bound = replace(exact, doomed={"failure": 4}, under_submitted=4, under_submitted_lower_bound=True)
    for record, shown in ((exact, "deficit 6 ·"), (bound, "deficit 4 (lower bound) ·")):
        line = resume_line({**record.to_json(), "verdict": verdict(record)})
        assert shown in line
    assert "verdict: UNDER-SUBMITTED by at least 4 (doomed stale, filtered not known)" in resume_line(
        {**bound.to_json(), "verdict": verdict(bound)}
    )
