"""`make demo` runs `tqmon demo`: Ray, a real TransferQueue, the simulated trainer, tqmon and Prometheus, live.

The test runs the default scenario, `miscounted-restore`: it watches the resume arrive through tqmon's /metrics
(from the log, the checkpoint dir and the live TQ) with the live window under-filled, then the under-filled
alert go pending, fire after the demo's shortened `for:` and resolve once the demo had the trainer refill the
window, on the demo's screen and in Prometheus's own ALERTS series; then it presses Ctrl-C and checks that
every process the demo started, Ray's included, is gone.
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
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mixin.repo import repo_root
from mixin.rules import RULES_FILE
from tests.conftest import free_port, sample_value
from tqmon.demo import FOR_FACTOR, REFILL_AFTER, REFILL_ALERT, AlertTimeline
from tqmon.rules import WINDOW_TOTAL, duration_seconds

# miscounted-restore (tqmon/sim/scenarios.py, numbers in tests/test_sim.py): T = 5 * 4 = 20 at the resume from
# global_step_2, whose checkpoint holds 8 prompt groups; the trainer counts their 22 trajectory keys too, logs
# R = 30 and skips the warmup. tqmon keeps the log's bare R (status "unknown"): nothing expected or submitted.
EXPECTED = {
    "tqmon_resumes_total": 1,
    "tqmon_last_resume_checkpoint_step": 2,
    "tqmon_resume_warmup_target_prompt_groups": 20,
    "tqmon_resume_warmup_expected_prompt_groups": 0,
    "tqmon_resume_warmup_submitted_prompt_groups": 0,
    'tqmon_resume_restored_prompt_groups{status="unknown"}': 30,
    'tqmon_resume_warmup_state{state="skipped_over_restored"}': 1,
    'tqmon_source_up{source="tq"}': 1,
    'tqmon_source_up{source="log"}': 1,
    'tqmon_source_up{source="checkpoint"}': 1,
    "tqmon_tq_controller_epochs_total": 2,  # the fresh start's controller, then the resumed trainer's
}
UNDER_FILLED = (8, 12)  # the live window after a sample, and between a step's submission and its sample
REFILLED = (20, 24)
DEMO_FOR = 20.0  # the under-filled alert's 10m, divided by FOR_FACTOR
FIRING_SLACK = 6.0  # an evaluation (2 s) and the demo's refresh (1 s), on a loaded machine
RESOLVE_WITHIN = 12.0  # a step (0.3 s), a TQ poll (<= 2 s), a scrape (2 s), an evaluation (2 s), a refresh (1 s)
TIMELINE = re.compile(
    rf"^  {REFILL_ALERT}: pending (\d\d:\d\d:\d\d) → firing (\d\d:\d\d:\d\d) \(\+(\d+)s\)"
    rf" → resolved (\d\d:\d\d:\d\d) \(\+(\d+)s\)$"
)
REFILL = re.compile(r"^refill: the trainer was asked at (\d\d:\d\d:\d\d) \(SIGUSR1\)")


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


def clock(stamp: str) -> int:
    """The demo screen's local ``HH:MM:SS`` as seconds of the day."""
    hours, minutes, seconds = (int(part) for part in stamp.split(":"))
    return hours * 3600 + minutes * 60 + seconds


def clock_of(at: float) -> int:
    return clock(datetime.fromtimestamp(at).strftime("%H:%M:%S"))


def since(earlier: int, later: int) -> int:
    """Seconds from one screen clock to a later one (across midnight too)."""
    return (later - earlier) % 86400


def last_match(pattern: re.Pattern[str], lines: list[str]) -> re.Match[str] | None:
    return next((m for m in map(pattern.match, reversed(lines)) if m), None)


def raw_samples(prometheus: str, expr: str) -> list[float]:
    """The timestamps of every raw sample of a one-series range query, oldest first ([] without a series)."""
    result = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=5).json()["data"]["result"]
    assert len(result) <= 1, result
    return [float(at) for at, _ in result[0]["values"]] if result else []


def instant(prometheus: str, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=5).json()[
        "data"
    ]["result"]
    return result


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus (make test installs it)")
def test_demo_alert_fires_and_resolves_on_the_real_stack_and_ctrl_c_leaves_nothing_running(tmp_path: Path) -> None:
    port = free_port()
    workdir = tmp_path / "demo"
    command = [sys.executable, "-m", "tqmon.cli", "demo", "--listen", f"127.0.0.1:{port}", "--step-seconds", "0.3"]
    command += ["--workdir", str(workdir), "--prometheus"]
    env = {k: v for k, v in os.environ.items() if k != "TQMON_DEMO_SCENARIO"}  # `make demo`'s scenario
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    started: set[int] = set()
    try:
        # The resume, with the live window under-filled: 8 or 12 of T = 20.
        deadline = time.monotonic() + 120
        text = ""
        while time.monotonic() < deadline:
            started |= descendants(proc.pid)
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                text = ""
            if (
                all(sample_value(text, s) == value for s, value in EXPECTED.items())
                and train_window(text) in UNDER_FILLED
            ):
                break
            assert proc.poll() is None, "\n".join(lines[-50:])
            time.sleep(0.5)
        assert {s: sample_value(text, s) for s in EXPECTED} == EXPECTED
        assert train_window(text) in UNDER_FILLED  # (a poll may see the new TQ before its restore)
        assert any(line.startswith("tqmon demo · scenario miscounted-restore:") for line in lines)
        prometheus = prometheus_url(lines)
        targets = httpx.get(prometheus + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        assert [(t["labels"]["job"], t["scrapeUrl"]) for t in targets] == [
            ("tqmon", f"http://127.0.0.1:{port}/metrics")
        ]

        # Prometheus evaluates the committed production rules, every for: divided by FOR_FACTOR, and the screen
        # says so.
        production = yaml.safe_load((repo_root() / RULES_FILE).read_text())["groups"][0]["rules"]
        loaded = yaml.safe_load((workdir / "tqmon-rules.yml").read_text())["groups"][0]["rules"]
        assert [rule["expr"] for rule in loaded] == [rule["expr"] for rule in production]
        groups = httpx.get(prometheus + "/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert [g["name"] for g in groups] == ["tqmon"]
        durations = {rule["name"]: rule["duration"] for rule in groups[0]["rules"] if rule["type"] == "alerting"}
        assert durations == {
            rule["alert"]: duration_seconds(rule["for"]) / FOR_FACTOR for rule in production if "alert" in rule
        }
        assert durations[REFILL_ALERT] == DEMO_FOR
        shown = [line for line in lines if line.startswith(f"alerts use for: shortened {FOR_FACTOR}× for the demo (")]
        assert shown and "10m → 20s" in shown[-1] and "production rules use the long ones" in shown[-1], shown

        # On the screen: pending, firing after the shortened for:, the refill REFILL_AFTER s later, resolved.
        deadline = time.monotonic() + DEMO_FOR + FIRING_SLACK + REFILL_AFTER + RESOLVE_WITHIN + 60
        while (timeline := last_match(TIMELINE, lines)) is None and time.monotonic() < deadline:
            started |= descendants(proc.pid)
            assert proc.poll() is None, "\n".join(lines[-50:])
            time.sleep(0.5)
        assert timeline is not None, "".join(lines[-40:])
        pending, firing, fired_after, resolved, resolved_after = timeline.groups()
        assert DEMO_FOR <= int(fired_after) <= DEMO_FOR + FIRING_SLACK, timeline.group(0)
        # the clocks are truncated to the second, the durations rounded
        assert abs(since(clock(pending), clock(firing)) - int(fired_after)) <= 1, timeline.group(0)
        assert abs(since(clock(firing), clock(resolved)) - int(resolved_after)) <= 1, timeline.group(0)
        refill = last_match(REFILL, lines)
        assert refill is not None, "".join(lines[-40:])
        assert REFILL_AFTER <= since(clock(firing), clock(refill.group(1))) <= REFILL_AFTER + 3, timeline.group(0)
        assert since(clock(refill.group(1)), clock(resolved)) <= RESOLVE_WITHIN, (refill.group(0), timeline.group(0))

        # In Prometheus's own record (ALERTS, one sample per evaluation): pending from the screen's pending time,
        # firing once the for: had elapsed, and no longer active since the screen said resolved.
        alerts = f'ALERTS{{alertname="{REFILL_ALERT}",alertstate="%s"}}[5m]'
        pending_at = raw_samples(prometheus, alerts % "pending")
        firing_at = raw_samples(prometheus, alerts % "firing")
        assert pending_at and firing_at, (pending_at, firing_at)
        assert DEMO_FOR <= firing_at[0] - pending_at[0] <= DEMO_FOR + 2.5  # an evaluation every 2 s
        assert clock_of(pending_at[0]) == clock(pending)  # the screen shows Prometheus's activeAt
        assert since(clock_of(firing_at[0]), clock(firing)) <= FIRING_SLACK
        assert 0 < since(clock_of(firing_at[-1]), clock(resolved)) <= FIRING_SLACK
        assert instant(prometheus, f'ALERTS{{alertname="{REFILL_ALERT}"}}') == []
        # Resolved by the refill, not by the trainer stopping: it still steps and its window is full.
        window = [float(w["value"][1]) for w in instant(prometheus, f'{WINDOW_TOTAL}{{job="tqmon"}}')]
        assert len(window) == 1 and window[0] in REFILLED, window
        assert instant(prometheus, 'changes(tqmon_trainer_global_step{job="tqmon"}[10s]) > 0'), "the trainer stopped"
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


def test_the_alert_timeline_keeps_each_change_with_its_time() -> None:
    """The screen's alert lines from /api/v1/alerts answers: pending at Prometheus's activeAt, firing and resolved
    when a poll first saw them, inactive for one that left before firing; a name fires again as a new line part."""

    def active(name: str, state: str, since: float, **labels: str) -> dict[str, Any]:
        at = datetime.fromtimestamp(since).astimezone().isoformat()
        return {"labels": {"alertname": name, "job": "tqmon", "severity": "warning", **labels}, "state": state,
                "activeAt": at}  # fmt: skip

    timeline = AlertTimeline()
    t0 = 1_700_000_000.0
    timeline.update([active("A", "pending", t0 - 0.5), active("B", "pending", t0, quantity="restored")], t0)
    timeline.update([active("A", "firing", t0 - 0.5)], t0 + 21)
    assert timeline.firing_since("A") == t0 + 21
    timeline.update([active("A", "firing", t0 - 0.5)], t0 + 25)
    timeline.update([], t0 + 33)
    assert timeline.firing_since("A") is None
    timeline.update([active("A", "pending", t0 + 40)], t0 + 41)

    def at(offset: float) -> str:
        return datetime.fromtimestamp(t0 + offset).strftime("%H:%M:%S")

    assert timeline.changes == {
        "A": [("pending", t0 - 0.5), ("firing", t0 + 21), ("resolved", t0 + 33), ("pending", t0 + 40)],
        'B{quantity="restored"}': [("pending", t0), ("inactive", t0 + 21)],
    }
    assert timeline.lines() == [
        f"  A: pending {at(-0.5)} → firing {at(21)} (+22s) → resolved {at(33)} (+12s) → pending {at(40)} (+7s)",
        f'  B{{quantity="restored"}}: pending {at(0)} → inactive {at(21)} (+21s)',
    ]


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
