"""End to end: ``tqmon serve`` in a subprocess, scraped every second by a real Prometheus (Debian's).

A fresh start and a resume from global_step_40 are replayed through the followed log and the event
API; Prometheus's HTTP API must then show the resume metrics with the right values. tqmon is then
killed with SIGKILL and restarted on the same state dir and port: the values come back, the resume
is not counted twice, no log line is read again, and the tail carries on from the persisted offset.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TqmonProcess, free_port
from tqmon import __version__
from tqmon.warmup import WarmupState

pytestmark = pytest.mark.e2e

TIMEOUT = 30.0
MAKE_HINT = "run `make test`, which installs Debian's prometheus (prometheus and promtool) when missing"

LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"
RESUME_AT = "2026-11-28 22:14:03,123"
FRESH_RUN = [
    "2026-11-28 21:02:03,118\tINFO worker.py:1888 -- Started a local Ray instance.",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) INFO:2026-11-28 21:02:11,416:data.gen_batch_size defaulted to 1.",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) INFO:2026-11-28 21:02:16,739:Training from scratch",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) \x1b[36mINFO:2026-11-28 21:02:49,541:"
    "Added 12 warmup prompts after restoring 0 of 12 target prompt groups\x1b[0m",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) step:1 - training/global_step:1 - timing_s/gen:6.215",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) INFO:2026-11-28 21:04:50,105:"
    "pending: 3, running: 5, finished: 4, failure: 0",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) step:40 - training/global_step:40 - timing_s/gen:3.891",
    "INFO:2026-11-28 21:29:51,200:Saving checkpoint to /ckpt/global_step_40",
    "*** SIGTERM received at time=1764367811 on cpu 3 ***",
]
RESUME_UNTIL_RESTORED = [
    "INFO:2026-11-28 22:13:51,547:data.gen_batch_size defaulted to 1.",
    f"INFO:{RESUME_AT}:Resuming from /ckpt/global_step_40, setting global step to 40",
    "INFO:2026-11-28 22:14:05,034:Loading TransferQueue state from /ckpt/global_step_40/transfer_queue",
    "INFO:2026-11-28 22:14:06,883:Restored 9 training prompt groups from TransferQueue",
]
RESUME_REST = [
    "INFO:2026-11-28 22:14:30,876:Re-issued 3 in-flight prompts for step 41; "
    "cleared 5 old trajectories from partition train",
    "INFO:2026-11-28 22:14:31,342:Added 3 warmup prompts after restoring 9 of 12 target prompt groups",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) step:41 - training/global_step:41 - timing_s/gen:3.515",
]
AFTER_RESTART = ["INFO:2026-11-28 22:20:11,000:Saving checkpoint to /ckpt/global_step_45"]
# Lines of the above that verl's parser turns into events (the rest is noise it must ignore).
LOG_EVENTS_BEFORE_KILL = 8

RUN_STARTED = {
    "type": "run_started",
    "id": "e2e-run-started",
    "run_id": "e2e-run",
    "trainer_mode": "colocate_async",
    "verl_version": "0.9.1",
    "config": {"train_batch_size": 4, "num_warmup_batches": 3},  # T = floor(3 * 4 / 1) * 1 = 12
}
BY_STATUS = {"pending": 2, "running": 1, "finished": 4, "failure": 2}
CHECKPOINT_RESTORED = {
    "type": "checkpoint_restored",
    "id": "e2e-checkpoint-restored",
    "step": 40,
    "restored_prompt_groups": 9,
    "by_status": BY_STATUS,
}

# T=12, R=9, K=3, M=3; doomed = the 2 failures; under-submitted = max(0, 12 - (9 - 2 + 3)) = 2.
EXPECTED_RESUME: dict[str, float] = {
    "tqmon_resumes_total": 1,
    "tqmon_last_resume_checkpoint_step": 40,
    # verl's asctime is local time; the record starts at the "Resuming from" line.
    "tqmon_last_resume_timestamp_seconds": datetime.strptime(RESUME_AT, LOG_TIME).astimezone().timestamp(),
    **{f'tqmon_resume_restored_prompt_groups{{status="{s}"}}': n for s, n in BY_STATUS.items()},
    "tqmon_resume_reissued_prompt_groups": 3,
    "tqmon_resume_warmup_target_prompt_groups": 12,
    "tqmon_resume_warmup_expected_prompt_groups": 3,
    "tqmon_resume_warmup_submitted_prompt_groups": 3,
    "tqmon_resume_over_restored_prompt_groups": 0,
    'tqmon_resume_doomed_prompt_groups{reason="failure"}': 2,
    'tqmon_resume_doomed_prompt_groups{reason="filtered"}': 0,  # DAPO filtering is off in the config
    "tqmon_resume_under_submitted_prompt_groups": 2,
    **{f'tqmon_resume_warmup_state{{state="{s}"}}': float(s is WarmupState.TOPPED_UP) for s in WarmupState},
    "tqmon_checkpoint_step": 40,
    'tqmon_events_total{outcome="applied",source="events"}': 2,
    'tqmon_events_total{outcome="applied",source="log"}': LOG_EVENTS_BEFORE_KILL,
    'tqmon_events_total{outcome="duplicate",source="log"}': 0,
    'tqmon_log_lines_total{outcome="event"}': LOG_EVENTS_BEFORE_KILL,
    'tqmon_log_lines_total{outcome="malformed"}': 0,
    'tqmon_run_info{run_id="e2e-run",trainer_mode="colocate_async",verl_version="0.9.1"}': 1,
    f'tqmon_build_info{{version="{__version__}"}}': 1,
    "up": 1,
}
# Stale groups need each finished group's submission step, which by_status does not give: unknown, so omitted.
ABSENT = ['tqmon_resume_doomed_prompt_groups{reason="stale"}']
WATCHED = (
    "up|tqmon_run_info|tqmon_build_info|tqmon_resumes_total|tqmon_last_resume_.*|tqmon_resume_.*|tqmon_checkpoint_step"
    "|tqmon_events_total|tqmon_log_lines_total|tqmon_trainer_global_step"
)


class Prometheus:
    """Debian's ``prometheus`` scraping one tqmon target every second, on loopback only (or running ``job``,
    the YAML of one scrape job)."""

    def __init__(self, workdir: Path, target_port: int | None, job: str | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = workdir / "prometheus.out"
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  scrape_timeout: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            + (job or f"  - job_name: tqmon\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
        )
        command = [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.out.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"prometheus did not become ready: {self.out.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=5)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def series(self, selector: str) -> dict[str, float]:
        """``name{label="value",…}`` (without job and instance) → value for each series ``selector`` matches."""
        values = {}
        for item in self.query(selector):
            metric = dict(item["metric"])
            name = metric.pop("__name__", "")
            metric.pop("job", None)
            metric.pop("instance", None)
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(metric.items()))
            values[f"{name}{{{labels}}}" if labels else name] = float(item["value"][1])
        return values

    def watched(self) -> dict[str, float]:
        return self.series(f'{{__name__=~"{WATCHED}", job="tqmon"}}')

    def oldest_sample(self) -> float | None:
        """Timestamp of the oldest current sample among the watched series (None if there is none)."""
        # timestamp() drops the metric name; keep a copy so the series stay distinct.
        named = f'label_replace({{__name__=~"{WATCHED}", job="tqmon"}}, "name", "$1", "__name__", "(.+)")'
        result = self.query(f"min(timestamp({named}))")
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], Prometheus]]:
    started: list[Prometheus] = []

    def start(target_port: int) -> Prometheus:
        # A missing Prometheus fails the test (in its body, not as a setup error): it must never skip.
        for tool in ("prometheus", "promtool"):
            if shutil.which(tool) is None:
                pytest.fail(f"`{tool}` is not on PATH: {MAKE_HINT}")
        prom = Prometheus(tmp_path / f"prometheus-{len(started)}", target_port)
        started.append(prom)
        prom.wait_ready()
        return prom

    yield start
    for prom in started:
        prom.stop()


def eventually(probe: Callable[[], Any], done: Callable[[Any], bool], what: str, timeout: float = TIMEOUT) -> Any:
    """Poll ``probe`` until ``done(value)``; fail with the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    value = None
    while True:
        try:
            value = probe()
        except httpx.HTTPError as err:
            value = err
        else:
            if done(value):
                return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {value!r}")
        time.sleep(0.2)


def mismatches(observed: dict[str, float], expected: dict[str, float]) -> dict[str, tuple[float | None, float]]:
    """Series whose value differs from ``expected`` (observed None: missing), plus ones that must be absent."""
    wrong: dict[str, tuple[float | None, float]] = {
        key: (observed.get(key), value) for key, value in expected.items() if observed.get(key) != value
    }
    for key in ABSENT:
        if key in observed:
            wrong[key] = (observed[key], float("nan"))
    return wrong


def assert_eventually_matches(prom: Prometheus, expected: dict[str, float], what: str) -> dict[str, float]:
    observed: dict[str, float] = eventually(
        prom.watched, lambda seen: isinstance(seen, dict) and not mismatches(seen, expected), what
    )
    return observed


def append(path: Path, lines: list[str]) -> None:
    with path.open("a", encoding="utf-8") as out:
        out.writelines(line + "\n" for line in lines)


def post(url: str, event: dict[str, Any]) -> None:
    response = httpx.post(url + "/api/v1/events", json=event, timeout=5)
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 1, "applied": 1, "duplicates": 0}


def status(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/api/v1/status", timeout=5)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def last_record(body: dict[str, Any]) -> dict[str, Any]:
    records: list[dict[str, Any]] = body["records"]
    return records[-1] if records else {}


def test_resume_metrics_survive_kill_9(
    tmp_path: Path, tqmon_factory: Callable[..., TqmonProcess], prometheus: Callable[[int], Prometheus]
) -> None:
    log_path = tmp_path / "trainer.log"
    log_path.touch()
    args = ["--log", str(log_path), "--log-interval", "0.2"]
    first = tqmon_factory(args).start()
    prom = prometheus(first.port)

    # The trainer's config first, so every record is derived with T known; then the log up to the restore.
    post(first.url, RUN_STARTED)
    append(log_path, FRESH_RUN + RESUME_UNTIL_RESTORED)
    eventually(
        lambda: last_record(status(first.url)),
        lambda rec: rec.get("resumed") is True and rec.get("checkpoint_step") == 40 and rec.get("restored") == 9,
        "the log's resume from step 40 with R=9 in /api/v1/status",
    )
    # The trainer callback's view of the same restore, with the split by status the log cannot give.
    post(first.url, CHECKPOINT_RESTORED)
    append(log_path, RESUME_REST)
    body = eventually(
        lambda: status(first.url),
        lambda b: last_record(b).get("warmup_state") == "topped_up",
        "the warmup decision in /api/v1/status",
    )

    # One record per start: the fresh start and ONE resume, which both sources contributed to.
    assert body["resumes_total"] == 1
    assert body["records_total"] == 2
    fresh, resume = body["records"]
    assert (fresh["resumed"], fresh["warmup_state"], fresh["submitted"]) == (False, "fresh_start", 12)
    assert resume["resumed"] is True
    assert resume["run_id"] == "e2e-run"
    assert resume["restored_by_status"] == BY_STATUS
    said = {(e["source"], e["event_type"]) for e in resume["evidence"]}
    assert said == {
        ("log", "training_started"),
        ("log", "checkpoint_restored"),
        ("events", "checkpoint_restored"),
        ("log", "inflight_reissued"),
        ("log", "warmup_decided"),
    }

    # What Prometheus scraped.
    before = assert_eventually_matches(prom, EXPECTED_RESUME, "the resume metrics in Prometheus")
    assert before["tqmon_trainer_global_step"] == 40

    # The real exposition passes promtool's parser and linter without a single warning.
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=first.metrics().encode(), capture_output=True, timeout=30, check=False
    )
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()
    assert lint.stdout.decode().strip() == "" and lint.stderr.decode().strip() == "", lint.stdout + lint.stderr

    # kill -9: Prometheus sees the target down.
    first.kill()
    eventually(lambda: prom.series('up{job="tqmon"}'), lambda seen: seen == {"up": 0.0}, "up == 0 after kill -9")

    # Restart on the same state dir and the same port, so Prometheus keeps scraping the same target.
    second = tqmon_factory(args)
    second.port, second.url = first.port, first.url
    restarted_at = time.time()
    second.start()
    eventually(
        prom.oldest_sample,
        lambda oldest: isinstance(oldest, float) and oldest > restarted_at,
        "every watched series to be scraped again after the restart",
    )
    after = assert_eventually_matches(prom, EXPECTED_RESUME, "the resume metrics after the restart")
    # Nothing doubled or re-read: same resume count, applied events and log lines (by outcome) as before.
    assert after == before

    # The tail resumed at the persisted offset: only the new line is read.
    append(log_path, AFTER_RESTART)
    expected_after = EXPECTED_RESUME | {
        "tqmon_checkpoint_step": 45,
        'tqmon_events_total{outcome="applied",source="log"}': LOG_EVENTS_BEFORE_KILL + 1,
        'tqmon_log_lines_total{outcome="event"}': LOG_EVENTS_BEFORE_KILL + 1,
    }
    final = assert_eventually_matches(prom, expected_after, "tqmon_checkpoint_step == 45 after the restart")
    assert final['tqmon_log_lines_total{outcome="ignored"}'] == before['tqmon_log_lines_total{outcome="ignored"}']
    assert final['tqmon_events_total{outcome="duplicate",source="log"}'] == 0
    assert final["tqmon_trainer_global_step"] == 45
