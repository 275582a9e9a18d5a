"""OTLP push against a real protobuf receiver (tests/otlp_receiver.py): parity with ``/metrics``, the resource
and headers, resume verdicts as log records, a Collector down and back, a Collector that hangs on SIGTERM,
and bad settings refused at start. tqmon runs as a real ``tqmon serve`` subprocess except where one exact
snapshot is rendered both ways in process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.logs.v1.logs_pb2 import SeverityNumber
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mixin import docs
from tests.conftest import TqmonProcess, free_port
from tests.otlp_receiver import Labels, OTLPReceiver, attributes, points, wait_until
from tests.test_exposition import NOW, full_snapshot
from tqmon import __version__
from tqmon.catalog import CATALOG, MetricType
from tqmon.exporters.otlp import (
    ENV_VARS,
    LOG_QUEUE_MAX,
    RESUME_ATTRIBUTES,
    OTLPConfigError,
    OTLPExporter,
    base_resource,
    instruments,
    resume_attributes,
    settings,
)
from tqmon.exporters.prometheus import build_registry
from tqmon.warmup import WarmupState

INTERVAL_MS = "200"
EXPOSITION_ONLY = ("process_", "python_")  # prometheus-client's default collectors, not catalog metrics
Series = dict[tuple[str, Labels], float]

# T = floor(3 * 4 / 1) * 1 = 12 from the flags below.
TRAINER_FLAGS = ["--train-batch-size", "4", "--num-warmup-batches", "3", "--max-off-policy-threshold", "null"]
FRESH = [
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) INFO:2026-11-28 21:02:16,739:Training from scratch",
    "(TaskRunnerV1 pid=2314, ip=10.0.3.17) \x1b[36mINFO:2026-11-28 21:02:49,541:"
    "Added 12 warmup prompts after restoring 0 of 12 target prompt groups\x1b[0m",
    "INFO:2026-11-28 21:29:51,200:Saving checkpoint to /ckpt/global_step_40",
]
# A miscounted restore: 9 restored of 12, yet the trainer submits 1 instead of 3.
FLAGGED_RESUME = [
    "INFO:2026-11-28 22:14:03,123:Resuming from /ckpt/global_step_40, setting global step to 40",
    "INFO:2026-11-28 22:14:05,034:Loading TransferQueue state from /ckpt/global_step_40/transfer_queue",
    "INFO:2026-11-28 22:14:06,883:Restored 9 training prompt groups from TransferQueue",
    "INFO:2026-11-28 22:14:30,876:Re-issued 3 in-flight prompts for step 41; "
    "cleared 5 old trajectories from partition train",
    "INFO:2026-11-28 22:14:31,342:Added 1 warmup prompts after restoring 9 of 12 target prompt groups",
]


# ---------------------------------------------------------------- helpers


def prometheus_name(name: str, unit: str, kind: str) -> str:
    """OTel's OTLP-to-Prometheus name mapping (Prometheus' otlptranslator, escaping with suffixes)."""
    tokens = [t for t in re.split(r"[^a-zA-Z0-9:]", name) if t]
    words = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": ""}
    main = "" if not unit or "{" in unit else words.get(unit, unit)
    if main and main not in tokens:
        tokens.append(main)
    if kind == "counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if unit == "1" and kind == "gauge":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    return "_".join(tokens)


def exposition_series(text: str) -> Series:
    """Every catalog series of a text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.startswith(EXPOSITION_ONLY)
    }


def otlp_series(request: Any) -> Series:
    """Every data point of one metrics request, under the name Prometheus gives it."""
    series: Series = {}
    for name, unit, kind, labels, value in points(request):
        key = (prometheus_name(name, unit, kind), labels)
        assert key not in series, f"two OTLP points map to {key}"
        series[key] = value
    return series


def env(receiver: OTLPReceiver, **extra: str) -> dict[str, str]:
    return {"OTEL_METRIC_EXPORT_INTERVAL": INTERVAL_MS, "OTEL_EXPORTER_OTLP_TIMEOUT": "1000", **extra}


def metric_value(tqmon: TqmonProcess, name: str) -> float | None:
    return exposition_series(tqmon.metrics()).get((name, frozenset()))


def phases(receiver: OTLPReceiver, index: int) -> dict[str, Any]:
    """The log records of start ``index`` by phase."""
    return {
        attributes(r.attributes)["tqmon.resume.phase"]: r
        for _, r in receiver.log_records()
        if attributes(r.attributes).get("tqmon.resume.index") == index
    }


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    started = OTLPReceiver().start()
    yield started
    started.stop()


def write(path: Path, lines: list[str], mode: str = "a") -> None:
    with path.open(mode, encoding="utf-8") as out:
        out.write("".join(line + "\n" for line in lines))


# ---------------------------------------------------------------- the mapping, in process


def test_every_instrument_maps_back_to_its_exposition_name() -> None:
    for spec in CATALOG:
        made = instruments(spec)
        expected = (
            {spec.name + s for s in ("_bucket", "_gcount", "_gsum")}
            if spec.type is MetricType.GAUGEHISTOGRAM
            else {spec.name}
        )
        assert {prometheus_name(i.name, i.unit, i.kind) for i in made} == expected, spec.name
        kinds = {i.kind for i in made}
        if spec.type in (MetricType.STATESET, MetricType.INFO):
            assert kinds == {"updowncounter"}, spec.name
        elif spec.type is MetricType.COUNTER:
            assert kinds == {"counter"}, spec.name
        else:
            assert kinds == {"gauge"}, spec.name


def test_one_snapshot_pushed_and_scraped_gives_the_same_series(receiver: OTLPReceiver) -> None:
    """Every catalog entry (the full snapshot has them all, gaugehistogram included), over the wire."""
    snapshot = full_snapshot()
    exporter = OTLPExporter(settings(receiver.url, {}), lambda: snapshot, base_resource(9842, {}), clock=lambda: NOW)
    try:
        assert exporter.export_metrics()
        registry = build_registry(exporter.current, process_metrics=False, clock=lambda: NOW)
        scraped = exposition_series(generate_latest(registry).decode())
        (received,) = receiver.requests("/v1/metrics")
        pushed = otlp_series(received.request)
    finally:
        exporter.stop()
    assert pushed == scraped
    names = {name for name, _ in pushed}
    assert {spec.name for spec in CATALOG} <= names | {n.removesuffix("_bucket") for n in names}
    assert pushed[("tqmon_window_prompt_group_age_steps_bucket", frozenset({("le", "2.0")}))] == 9.0
    assert pushed[("tqmon_resume_warmup_state", frozenset({("state", "topped_up")}))] == 1.0


def test_every_emitted_log_attribute_is_documented() -> None:
    record = full_snapshot().last_record
    assert record is not None
    documented = [
        re.escape(key).replace(re.escape("<status>"), r"\w+").replace(re.escape("<reason>"), r"\w+")
        for key in RESUME_ATTRIBUTES
    ]
    for key in resume_attributes(record, "first_step"):
        assert any(re.fullmatch(pattern, key) for pattern in documented), key
    assert (
        "tqmon.resume.verdict" in docs.render()
        and "`tqmon_window_prompt_group_age_steps_gsum` (gauge)" in docs.render()
    )


# ---------------------------------------------------------------- settings


def test_flag_wins_over_the_generic_endpoint_and_a_signal_endpoint_wins_over_the_flag() -> None:
    config = settings(
        "http://collector:4318/otlp/",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4318",
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "https://loki:3100/otlp/v1/logs",
            "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20s3cret,x-scope-orgid=rl",
            "OTEL_EXPORTER_OTLP_LOGS_HEADERS": "x-scope-orgid=logs",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
            "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "gzip",
            "OTEL_METRIC_EXPORT_INTERVAL": "15000",
        },
    )
    assert config.metrics.endpoint == "http://collector:4318/otlp/v1/metrics"
    assert config.logs.endpoint == "https://loki:3100/otlp/v1/logs"
    assert config.metrics.headers == {"authorization": "Bearer s3cret", "x-scope-orgid": "rl"}
    assert config.logs.headers == {"x-scope-orgid": "logs"}
    assert (config.metrics.timeout, config.interval) == (2.5, 15.0)
    assert (config.metrics.compression, config.logs.compression) == ("gzip", "none")


@pytest.mark.parametrize(
    ("endpoint", "environ", "message"),
    [
        ("collector:4318", {}, "--otlp-endpoint: expected an http(s) URL"),
        ("http://collector:43a8", {}, "--otlp-endpoint: malformed port"),
        ("http://collector:4318?x=1", {}, "expected an http(s) URL"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_HEADERS": "Authorization"}, "OTEL_EXPORTER_OTLP_HEADERS: malformed"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_METRICS_HEADERS": "bad key=1"}, "_METRICS_HEADERS: malformed"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf only"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "expected one of none, gzip, deflate"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"}, "positive number of milliseconds"),
        ("http://c:4318", {"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, "OTEL_METRIC_EXPORT_INTERVAL"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "loki/v1/logs"}, "_LOGS_ENDPOINT: expected"),
    ],
)
def test_bad_settings_are_refused(endpoint: str, environ: dict[str, str], message: str) -> None:
    with pytest.raises(OTLPConfigError, match=re.escape(message)):
        settings(endpoint, environ)


def test_serve_refuses_a_malformed_header_at_start_with_one_line(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tqmon.cli", "serve", "--state-dir", str(tmp_path), "--listen", "127.0.0.1:1"]
    result = subprocess.run(
        [*command, "--otlp-endpoint", "http://127.0.0.1:4318"],
        env={**os.environ, "OTEL_EXPORTER_OTLP_HEADERS": "api-key"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: OTEL_EXPORTER_OTLP_HEADERS: malformed header 'api-key'; expected key=value (URL-encoded)"]


def test_without_the_otel_extra_only_otlp_fails_with_one_line(tmp_path: Path) -> None:
    """The base install: no SDK and no OTLP exporter (fastapi brings only opentelemetry-api). Plain serving
    imports neither; --otlp-endpoint says what to install."""
    block = "import sys; sys.modules['opentelemetry.sdk'] = sys.modules['opentelemetry.exporter.otlp'] = None; "
    plain = (
        block
        + "import tqmon.cli, tqmon.server, tqmon.service; "
        + "print([m for m, v in sys.modules.items() if v and m.startswith(('opentelemetry.sdk', 'opentelemetry.exp'))])"
    )
    assert subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True).stdout == "[]\n"
    serve = block + (
        "from tqmon.cli import main; main(['serve', '--state-dir', sys.argv[1], '--listen', '127.0.0.1:1', "
        "'--otlp-endpoint', 'http://127.0.0.1:4318'])"
    )
    result = subprocess.run([sys.executable, "-c", serve, str(tmp_path)], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "pip install 'tqmon[otel]'" in errors[0], result.stderr


def test_serve_help_lists_the_otel_variables() -> None:
    from click.testing import CliRunner

    from tqmon.cli import main

    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output.split())
    for names, _ in ENV_VARS:
        for name in names.split(", "):
            assert name in text, name
    assert "TQMON_OTLP_ENDPOINT" in text


# ---------------------------------------------------------------- a real tqmon


def test_a_real_resume_pushes_what_metrics_serves(
    tqmon_factory: Callable[..., TqmonProcess], receiver: OTLPReceiver, tmp_path: Path
) -> None:
    log = tmp_path / "trainer.log"
    write(log, FRESH + FLAGGED_RESUME, "w")
    args = ["--log", str(log), "--log-interval", "600", *TRAINER_FLAGS]
    tqmon = tqmon_factory([*args, "--otlp-endpoint", receiver.url], env=env(receiver)).start()
    wait_until(lambda: metric_value(tqmon, "tqmon_resume_warmup_submitted_prompt_groups") == 1, what="the resume")
    # Its first step, as verl's plugin posts it (a --jsonl line would do the same, but needs a second poll).
    step = {
        "type": "step_completed",
        "id": "s41",
        "global_step": 41,
        "evicted_prompt_groups": {"failure": 2, "stale": 1},
        "generation_wait_seconds": 31.5,
    }
    assert httpx.post(tqmon.url + "/api/v1/events", json=step, timeout=5).status_code == 200

    # The log is read once (--log-interval 600): the snapshot stands still. A push that arrives between
    # two identical scrapes was collected from that same snapshot.
    for _ in range(20):
        before = exposition_series(tqmon.metrics())
        target = len(receiver.requests("/v1/metrics")) + 2  # the next push may have been collected before
        receiver.wait_for(lambda: len(receiver.requests("/v1/metrics")) >= target, what="a push")  # noqa: B023
        pushed = otlp_series(receiver.requests("/v1/metrics")[-1].request)
        if exposition_series(tqmon.metrics()) == before:
            break
    else:
        pytest.fail("the snapshot never stood still")
    assert pushed == before
    assert before[("tqmon_resume_under_submitted_prompt_groups", frozenset())] == 2.0  # 12 - (9 + 1)
    assert before[("tqmon_resume_restored_prompt_groups", frozenset({("status", "unknown")}))] == 9.0
    assert before[("tqmon_checkpoint_step", frozenset())] == 40.0
    assert before[("tqmon_otlp_export_failures_total", frozenset({("signal", "metrics")}))] == 0.0

    # The flagged resume as a WARN log record with its numbers, and again when its first step landed.
    by_phase = receiver.wait_for(lambda: len(phases(receiver, 1)) == 2 and phases(receiver, 1), what="both phases")
    decided, first = attributes(by_phase["decided"].attributes), attributes(by_phase["first_step"].attributes)
    assert by_phase["decided"].severity_number == SeverityNumber.SEVERITY_NUMBER_WARN
    assert by_phase["decided"].severity_text == "WARN" and by_phase["decided"].event_name == "tqmon.resume"
    assert {k: decided[k] for k in ("tqmon.resume.restored", "tqmon.resume.target", "tqmon.resume.expected")} == {
        "tqmon.resume.restored": 9,
        "tqmon.resume.target": 12,
        "tqmon.resume.expected": 3,
    }
    assert (decided["tqmon.resume.submitted"], decided["tqmon.resume.under_submitted"]) == (1, 2)
    assert (decided["tqmon.resume.reissued"], decided["tqmon.resume.checkpoint_step"]) == (3, 40)
    # The config tqmon was given predicts M = 3, the log says 1: the judge names both sources. Restored 9 by
    # "unknown" status: the failed groups are not known, so 2 is a lower bound and says so.
    assert decided["tqmon.resume.verdict"] == (
        "sources disagree: submitted: log said 1; config said 3 (exact); warmup submitted 1, expected 3;"
        " UNDER-SUBMITTED by at least 2 (doomed failure not known)"
    )
    assert decided["tqmon.resume.under_submitted_lower_bound"] is True
    assert decided["tqmon.resume.warmup_state"] == "topped_up" and decided["tqmon.resume.resumed"] is True
    assert "tqmon.resume.first_step.evicted.failure" not in decided
    assert (first["tqmon.resume.first_step.evicted.failure"], first["tqmon.resume.first_step.evicted.stale"]) == (2, 1)
    assert first["tqmon.resume.first_step.generation_wait_seconds"] == 31.5


def test_a_healthy_start_is_info_and_the_resource_says_who_sent_it(
    tqmon_factory: Callable[..., TqmonProcess], receiver: OTLPReceiver, tmp_path: Path
) -> None:
    log = tmp_path / "trainer.log"
    write(log, FRESH[:2], "w")
    extra = {
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=staging,team=rl%20infra",
        "OTEL_SERVICE_NAME": "grpo-7b-sidecar",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret,x-scope-orgid=rl",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nobody there: the flag must win
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "POD_NAME": "verl-trainer-0",
        "POD_NAMESPACE": "rl",
    }
    args = ["--log", str(log), *TRAINER_FLAGS, "--otlp-endpoint", receiver.url]
    tqmon = tqmon_factory(args, env=env(receiver, **extra)).start()
    (resource, record) = receiver.wait_for(receiver.log_records, what="the fresh start's log record")[0]
    receiver.wait_for(lambda: receiver.requests("/v1/metrics"), what="a metrics push")
    assert record.severity_number == SeverityNumber.SEVERITY_NUMBER_INFO and record.severity_text == "INFO"
    assert attributes(record.attributes)["tqmon.resume.verdict"] == "ok"
    assert attributes(record.attributes)["tqmon.resume.warmup_state"] == "fresh_start"
    expected = {
        "service.name": "grpo-7b-sidecar",
        "service.version": __version__,
        "deployment.environment": "staging",
        "team": "rl infra",
        "k8s.pod.name": "verl-trainer-0",
        "k8s.namespace.name": "rl",
    }
    assert {k: resource.get(k) for k in expected} == expected
    assert resource["service.instance.id"].endswith(f":{tqmon.port}")
    for path in ("/v1/metrics", "/v1/logs"):
        request = receiver.requests(path)[0]
        assert request.headers["authorization"] == "Bearer s3cret" and request.headers["x-scope-orgid"] == "rl"
        assert request.headers["content-encoding"] == "gzip"

    # The run's identity joins the resource once a source tells it.
    event = {
        "type": "run_started",
        "id": "rs-1",
        "run_id": "grpo-7b",
        "trainer_mode": "colocate_async",
        "verl_version": "0.9.1",
        "config": {"train_batch_size": 4, "num_warmup_batches": 3},
    }
    assert httpx.post(tqmon.url + "/api/v1/events", json=event, timeout=5).status_code == 200
    resources = receiver.wait_for(
        lambda: [
            attributes(rm.resource.attributes)
            for r in receiver.requests("/v1/metrics")
            for rm in r.request.resource_metrics
            if any(kv.key == "tqmon.run.id" for kv in rm.resource.attributes)
        ],
        what="a push with the run id",
    )
    assert resources[-1]["tqmon.run.id"] == "grpo-7b" and resources[-1]["tqmon.run.verl_version"] == "0.9.1"
    assert resources[-1]["service.name"] == "grpo-7b-sidecar"


def test_a_collector_down_then_back(
    tqmon_factory: Callable[..., TqmonProcess], receiver: OTLPReceiver, tmp_path: Path
) -> None:
    """Down (port closed) for ~20 export intervals, then answering 500 for a while, then back: tqmon keeps
    serving, its memory stays flat, failures are counted, and the queued resume record arrives afterwards."""
    log = tmp_path / "trainer.log"
    write(log, FRESH[:2], "w")
    args = ["--log", str(log), "--log-interval", "0.2", *TRAINER_FLAGS, "--otlp-endpoint", receiver.url]
    tqmon = tqmon_factory(args, env=env(receiver, OTEL_EXPORTER_OTLP_TIMEOUT="300")).start()
    assert tqmon.proc is not None
    receiver.wait_for(lambda: len(receiver.requests("/v1/metrics")) >= 3 and receiver.log_records(), what="pushes")
    receiver.stop()
    rss_down = rss_kib(tqmon.proc.pid)
    write(log, FLAGGED_RESUME)  # decided while the Collector is unreachable
    worst = 0.0
    with httpx.Client(base_url=tqmon.url, timeout=5) as client:
        deadline = time.monotonic() + 4.0  # 20 intervals of 200 ms
        while time.monotonic() < deadline:
            for path in ("/metrics", "/healthz"):
                started = time.perf_counter()
                assert client.get(path).status_code == 200
                worst = max(worst, time.perf_counter() - started)
            time.sleep(0.05)
        failures = exposition_series(client.get("/metrics").text)
    assert worst < 1.0, f"a request took {worst:.2f} s while the Collector was down"
    assert failures[("tqmon_otlp_export_failures_total", frozenset({("signal", "metrics")}))] >= 3
    assert failures[("tqmon_otlp_export_failures_total", frozenset({("signal", "logs")}))] >= 1
    assert failures[("tqmon_otlp_log_records_dropped_total", frozenset())] == 0
    assert rss_kib(tqmon.proc.pid) - rss_down < 10_000, "RSS grew by more than 10 MB while the Collector was down"

    receiver.mode = "error"
    answered = receiver.attempts
    receiver.start()
    receiver.wait_for(lambda: receiver.attempts >= answered + 2, what="requests answered with 500")
    receiver.mode = "ok"
    records = receiver.wait_for(
        lambda: [r for _, r in receiver.log_records() if attributes(r.attributes).get("tqmon.resume.index") == 1],
        what="the resume decided during the outage",
    )
    assert records[0].severity_number == SeverityNumber.SEVERITY_NUMBER_WARN
    metric_failures = ("tqmon_otlp_export_failures_total", frozenset({("signal", "metrics")}))

    def pushed_after_the_outage() -> Series | None:
        """The newest push once it reports the outage's failures (pushes from before it report none)."""
        series = otlp_series(receiver.requests("/v1/metrics")[-1].request)
        return series if series.get(metric_failures, 0) >= 4 else None

    pushed = receiver.wait_for(pushed_after_the_outage, what="metrics after the outage counting its failures")
    assert pushed[("tqmon_resume_under_submitted_prompt_groups", frozenset())] == 2.0


def test_sigterm_while_the_collector_hangs(tqmon_factory: Callable[..., TqmonProcess], receiver: OTLPReceiver) -> None:
    """A Collector that accepts and never answers (and an export timeout of a minute): tqmon still serves,
    and SIGTERM stops it within the shutdown bound."""
    receiver.mode = "hang"
    tqmon = tqmon_factory(
        ["--otlp-endpoint", receiver.url],
        env={"OTEL_METRIC_EXPORT_INTERVAL": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "60000"},
    ).start()
    assert tqmon.proc is not None
    receiver.wait_for(lambda: receiver.attempts >= 1, what="a hanging export")
    started = time.perf_counter()
    assert httpx.get(tqmon.url + "/metrics", timeout=5).status_code == 200
    assert time.perf_counter() - started < 1.0
    started = time.monotonic()
    tqmon.proc.send_signal(signal.SIGTERM)
    tqmon.proc.wait(timeout=30)
    took = time.monotonic() - started
    assert tqmon.proc.returncode == -signal.SIGTERM  # uvicorn re-raises SIGTERM after a graceful shutdown
    assert took < 9.0, f"SIGTERM took {took:.1f} s (bound: 5 s flush + shutdown)"
    output = tqmon.log_path.read_text()
    assert "final flush abandoned" in output and "Application shutdown complete" in output


def test_metrics_threads_do_not_share_state_with_scrapes(receiver: OTLPReceiver) -> None:
    """Scrapes render while the exporter collects: each sees whole snapshots (no torn or pinned values)."""
    snapshots = [full_snapshot()]
    exporter = OTLPExporter(settings(receiver.url, {}), lambda: snapshots[-1], base_resource(1, {}), clock=lambda: NOW)
    registry = build_registry(exporter.current, process_metrics=False, clock=lambda: NOW)
    stop = threading.Event()

    def push() -> None:
        while not stop.is_set():
            exporter.export_metrics()

    pusher = threading.Thread(target=push)
    pusher.start()
    try:
        for step in range(30):
            snapshots.append(replace(snapshots[-1], trainer_step=100 + step))
            text = generate_latest(registry).decode()
            assert f"tqmon_trainer_global_step {100 + step}.0" in text
    finally:
        stop.set()
        pusher.join()
        exporter.stop()
    pushed = [
        [p[4] for p in points(r.request) if p[0] == "tqmon_trainer_global_step"]
        for r in receiver.requests("/v1/metrics")
    ]
    assert pushed and all(len(values) == 1 and values[0] in {43.0, *map(float, range(100, 130))} for values in pushed)


def test_log_records_follow_a_start_through_both_phases_once(receiver: OTLPReceiver) -> None:
    """The log thread's view in process: decided, then first step, each once; a new start starts over."""
    snapshot = full_snapshot()
    record = snapshot.last_record
    assert record is not None
    exporter = OTLPExporter(settings(receiver.url, {}), lambda: snapshot, base_resource(1, {}), clock=lambda: NOW)
    undecided = replace(record, first_step_evictions=None, warmup_state=WarmupState.UNKNOWN)
    exporter.watch(replace(snapshot, last_record=undecided))
    assert exporter.export_logs() and receiver.log_records() == []
    exporter.watch(replace(snapshot, last_record=replace(record, first_step_evictions=None)))
    exporter.watch(replace(snapshot, last_record=replace(record, first_step_evictions=None)))
    exporter.watch(snapshot)
    exporter.watch(snapshot)
    exporter.watch(replace(snapshot, last_record=replace(record, index=record.index + 1, first_step_evictions=None)))
    assert exporter.export_logs()
    exporter.stop()
    seen = [
        (attributes(r.attributes)["tqmon.resume.index"], attributes(r.attributes)["tqmon.resume.phase"])
        for _, r in receiver.log_records()
    ]
    assert seen == [(1, "decided"), (1, "first_step"), (2, "decided")]


def test_the_log_queue_is_bounded_and_counts_what_it_drops(receiver: OTLPReceiver) -> None:
    """A Collector away for longer than LOG_QUEUE_MAX resume decisions: the oldest go, counted."""
    snapshot = full_snapshot()
    record = snapshot.last_record
    assert record is not None
    exporter = OTLPExporter(settings(receiver.url, {}), lambda: snapshot, base_resource(1, {}), clock=lambda: NOW)
    decided_only = replace(record, first_step_evictions=None)
    for index in range(LOG_QUEUE_MAX + 6):
        exporter.watch(replace(snapshot, last_record=replace(decided_only, index=index)))
    view = exporter.current().otlp
    assert view is not None and view.dropped_log_records == 6
    assert exporter.export_logs()
    indexes = [attributes(r.attributes)["tqmon.resume.index"] for _, r in receiver.log_records()]
    assert indexes == list(range(6, LOG_QUEUE_MAX + 6))
    exporter.stop()


def test_the_resume_log_record_carries_the_self_heal_decision() -> None:
    record = full_snapshot().last_record
    assert record is not None and record.self_heal is not None
    attributes = resume_attributes(record, "decided")
    heal = {key.removeprefix("tqmon.resume.self_heal."): v for key, v in attributes.items() if "self_heal" in key}
    assert heal == {
        "mode": "dry-run",
        "deficit": 3,
        "deficit_exact": True,
        "planned": 3,
        "submitted": 0,
        "reason": "would submit 3",
    }
    assert not any("self_heal" in key for key in resume_attributes(replace(record, self_heal=None), "decided"))
