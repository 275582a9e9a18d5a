"""Benchmarks of a running tqmon: scrape latency against history size, event ingest, log tailing.

Run with ``make bench`` (or ``.venv/bin/python bench/bench_service.py``); it takes a minute or two and
writes only to a temporary directory. Every tqmon is a real ``tqmon serve`` subprocess on 127.0.0.1.

- ``/metrics`` latency over real HTTP with 1 and with 10,000 stored resume records. The 10k history
  is written straight into a state dir's SQLite store, so tqmon replays it at startup (also timed).
  Metrics render only the last record, so the 10k/1 ratio should stay close to 1.
- ``POST /api/v1/events`` throughput for single events and for batches of 100.
- Log tailing throughput: a ``LogSource``'s first poll (the ``serve`` path, on-disk store, a transaction per
  10k lines) and ``postmortem.analyze`` (the ``analyze`` path, in-memory store) over 200k generated lines.
- OTLP push: the cost of one export of the whole catalog (collect from the snapshot, encode, POST to a real
  protobuf receiver on loopback) with 1 and 10,000 stored resume records, and ``/metrics`` latency of a tqmon
  pushing every 100 ms against one that does not, side by side (target: p95 on <= 1.1x off).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tqmon.events import parse_event
from tqmon.exporters.otlp import OTLPExporter, base_resource, settings
from tqmon.postmortem import LogZone, analyze
from tqmon.snapshot import Snapshot, Tally
from tqmon.sources.logfile import LogSource
from tqmon.store import StateStore
from tqmon.tracker import Tracker

SCRAPES = 200
WARMUP_SCRAPES = 20
HISTORY = 10_000
SINGLE_EVENTS = 2_000
BATCH_SIZE = 100
BATCHES = 100
LOG_LINES = 200_000
OTLP_EXPORTS = 200
OTLP_BENCH_INTERVAL_MS = "50"  # far below the 60 s default, so that many pushes overlap the scrapes
OTLP_SCRAPES = 2_000
START_TIMEOUT = 120.0

RUN_STARTED: dict[str, Any] = {
    "type": "run_started",
    "id": "bench-run",
    "run_id": "bench",
    "trainer_mode": "colocate_async",
    "verl_version": "0.9.1",
    "config": {"train_batch_size": 4, "num_warmup_batches": 3},
}


def stop_process(proc: subprocess.Popen[Any], timeout: float) -> None:
    """Terminate a benchmarked process, killing it if it does not exit within ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def resume_events(prefix: str, index: int) -> list[dict[str, Any]]:
    """One resume from global_step_N as a trainer callback reports it: 5 events, one resume record."""
    step = 10 * (index + 1)
    eid = f"{prefix}-{index}"
    return [
        {
            "type": "training_started",
            "id": f"{eid}-start",
            "resumed_from_step": step,
            "checkpoint_path": f"/ckpt/global_step_{step}",
        },
        {
            "type": "checkpoint_restored",
            "id": f"{eid}-restored",
            "step": step,
            "restored_prompt_groups": 9,
            "by_status": {"pending": 2, "running": 1, "finished": 4, "failure": 2},
        },
        {"type": "inflight_reissued", "id": f"{eid}-reissued", "step": step + 1, "reissued_prompt_groups": 3},
        {
            "type": "warmup_decided",
            "id": f"{eid}-warmup",
            "target_prompt_groups": 12,
            "restored_prompt_groups": 9,
            "submitted_prompt_groups": 3,
        },
        {"type": "step_completed", "id": f"{eid}-step", "global_step": step + 1},
    ]


def event_stream(prefix: str, count: int) -> list[dict[str, Any]]:
    """``count`` events cut from consecutive resumes."""
    events: list[dict[str, Any]] = []
    index = 0
    while len(events) < count:
        events += resume_events(prefix, index)
        index += 1
    return events[:count]


def prefill(state_dir: Path, resumes: int) -> None:
    """Write a history of ``resumes`` resume records into a state dir, as if tqmon had applied them."""
    store = StateStore(state_dir)
    now = time.time()
    raw = [RUN_STARTED] + [e for i in range(resumes) for e in resume_events("history", i)]
    store.commit((parse_event(item), "events", now) for item in raw)
    store.close()


class Tqmon:
    """``tqmon serve`` as a subprocess on a free loopback port."""

    def __init__(self, state_dir: Path, args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.args = list(args)
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = state_dir.parent / f"tqmon-{self.port}.out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds = 0.0

    def start(self) -> Tqmon:
        command = [sys.executable, "-m", "tqmon.cli", "serve", "--listen", f"127.0.0.1:{self.port}"]
        command += ["--state-dir", str(self.state_dir), "--log-level", "warning", *self.args]
        started = time.monotonic()
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        while time.monotonic() - started < START_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tqmon exited with {self.proc.returncode}: {self.out.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    self.startup_seconds = time.monotonic() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"tqmon did not come up in {START_TIMEOUT:.0f}s: {self.out.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=10)


@contextmanager
def running(state_dir: Path, args: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[Tqmon]:
    tqmon = Tqmon(state_dir, args, env)
    try:
        yield tqmon.start()
    finally:
        tqmon.stop()


def records_total(client: httpx.Client) -> int:
    response = client.get("/api/v1/status", params={"limit": 1})
    response.raise_for_status()
    return int(response.json()["records_total"])


def scrape_latencies(clients: Sequence[httpx.Client], scrapes: int = SCRAPES) -> list[list[float]]:
    """Seconds per ``GET /metrics`` (body read in full) for each client, after a few unmeasured warmup
    scrapes. The clients take turns, so background load on the machine hits every side alike."""
    samples: list[list[float]] = [[] for _ in clients]
    for i in range(WARMUP_SCRAPES + scrapes):
        for client, measured in zip(clients, samples, strict=True):
            started = time.perf_counter()
            response = client.get("/metrics")
            response.raise_for_status()
            elapsed = time.perf_counter() - started
            if i >= WARMUP_SCRAPES:
                measured.append(elapsed)
    return samples


def percentile(samples: Sequence[float], pct: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[pct - 1]


def post(client: httpx.Client, body: object) -> None:
    response = client.post("/api/v1/events", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"POST /api/v1/events: {response.status_code} {response.text}")


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(row) for row in rows), ""])


def bench_scrapes(tmp: Path) -> str:
    small, large = tmp / "state-1", tmp / "state-10k"
    prefill(small, 1)
    started = time.perf_counter()
    prefill(large, HISTORY)
    prefill_seconds = time.perf_counter() - started

    results: dict[str, tuple[list[float], int, int, float]] = {}
    with (
        running(small) as small_tqmon,
        running(large) as large_tqmon,
        httpx.Client(base_url=small_tqmon.url, timeout=10) as small_client,
        httpx.Client(base_url=large_tqmon.url, timeout=10) as large_client,
    ):
        small_samples, large_samples = scrape_latencies([small_client, large_client])
        for label, tqmon, client, samples in (
            ("1", small_tqmon, small_client, small_samples),
            (f"{HISTORY:,}", large_tqmon, large_client, large_samples),
        ):
            size = len(client.get("/metrics").content)
            results[label] = (samples, records_total(client), size, tqmon.startup_seconds)

    rows = []
    for label, (samples, records, size, startup) in results.items():
        rows.append(
            [
                label,
                f"{records:,}",
                f"{size:,}",
                f"{statistics.median(samples) * 1e3:.2f}",
                f"{percentile(samples, 95) * 1e3:.2f}",
                f"{startup:.2f}",
            ]
        )
    (one, *_), (many, *_) = results.values()
    ratio_median = statistics.median(many) / statistics.median(one)
    ratio_p95 = percentile(many, 95) / percentile(one, 95)
    rows.append(["10k / 1", "", "", f"{ratio_median:.2f}x", f"{ratio_p95:.2f}x", ""])
    return table(
        f"GET /metrics over HTTP ({SCRAPES} scrapes each, taking turns; startup = spawn until /healthz, incl. replay; "
        f"writing the 10k history took {prefill_seconds:.1f} s)",
        ["stored resumes", "records", "bytes", "median ms", "p95 ms", "startup s"],
        rows,
    )


def bench_ingest(tmp: Path) -> str:
    rows = []
    with running(tmp / "state-ingest") as tqmon, httpx.Client(base_url=tqmon.url, timeout=30) as client:
        post(client, RUN_STARTED)
        singles = event_stream("single", SINGLE_EVENTS)
        started = time.perf_counter()
        for event in singles:
            post(client, event)
        elapsed = time.perf_counter() - started
        rows.append(["single event", f"{len(singles):,}", f"{elapsed:.2f}", f"{len(singles) / elapsed:,.0f}"])

        batched = event_stream("batch", BATCH_SIZE * BATCHES)
        batches = [batched[i : i + BATCH_SIZE] for i in range(0, len(batched), BATCH_SIZE)]
        started = time.perf_counter()
        for batch in batches:
            post(client, batch)
        elapsed = time.perf_counter() - started
        rows.append([f"batch of {BATCH_SIZE}", f"{len(batched):,}", f"{elapsed:.2f}", f"{len(batched) / elapsed:,.0f}"])
        records = records_total(client)
    expected = (SINGLE_EVENTS + BATCH_SIZE * BATCHES) // 5
    if records != expected:
        raise RuntimeError(f"expected {expected} resume records after ingest, tqmon has {records}")
    return table(
        "POST /api/v1/events over HTTP (mixed resume events: started, restored, reissued, warmup, step)",
        ["request", "events", "seconds", "events/s"],
        rows,
    )


def write_log(path: Path, lines: int) -> int:
    """A verl-like trainer log: mostly step and progress noise, with replay-buffer counts, checkpoints
    and a resume every 500 steps, some behind Ray's prefix and ANSI colours. Returns the lines written."""
    ray = "(TaskRunnerV1 pid=2314, ip=10.0.3.17) "
    written = 0
    base = time.mktime((2026, 11, 28, 0, 0, 0, 0, 0, -1))
    with path.open("w", encoding="utf-8") as out:
        step = 0
        while written < lines:
            step += 1
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(base + step)) + f",{step % 1000:03d}"
            block = [
                f"{ray}step:{step} - training/global_step:{step} - timing_s/gen:6.215 - actor/pg_loss:-0.0134",
                f"Training Progress:  1%|##       | {step}/320000 [00:01<1:02:11, 41.2s/it]",
                f"{ray}[Rank 0] rollout worker {step % 8}: generated 256 responses",
            ]
            verl_lines = []
            if step % 3 == 0:
                verl_lines.append(f"{ray}INFO:{stamp}:pending: 11, running: 23, finished: 62, failure: {step % 4}")
            if step % 20 == 0:
                verl_lines.append(f"{ray}INFO:{stamp}:Saving checkpoint to /ckpt/run/global_step_{step}")
            if step % 500 == 0:
                verl_lines += [
                    f"{ray}\x1b[36mINFO:{stamp}:Resuming from /ckpt/run/global_step_{step}, "
                    f"setting global step to {step}\x1b[0m",
                    f"{ray}INFO:{stamp}:Loading TransferQueue state from /ckpt/run/global_step_{step}/transfer_queue",
                    f"{ray}INFO:{stamp}:Restored 9 training prompt groups from TransferQueue",
                    f"{ray}INFO:{stamp}:Re-issued 3 in-flight prompts for step {step + 1}; "
                    "cleared 5 old trajectories from partition train",
                    f"{ray}\x1b[36mINFO:{stamp}:Added 3 warmup prompts after restoring 9 of 12 target "
                    "prompt groups\x1b[0m",
                ]
            for line in block + verl_lines:
                out.write(line + "\n")
            written += len(block) + len(verl_lines)
    return written


def bench_log(tmp: Path) -> str:
    path = tmp / "trainer.log"
    lines = write_log(path, LOG_LINES)
    size_mb = path.stat().st_size / 1e6
    rows = []

    # The serve path: the follower thread's first poll drains the file, 10k lines per transaction.
    tracker = Tracker(StateStore(tmp / "state-log"))
    source = LogSource([str(path)], tracker, interval=60.0)
    started = time.perf_counter()
    source.start()
    outcomes: dict[tuple[str, ...], int] = {}
    while sum(outcomes.values()) < lines and time.perf_counter() - started < START_TIMEOUT:
        time.sleep(0.005)
        outcomes = dict(tracker.snapshot.counters[Tally.LOG_LINES])
    elapsed = time.perf_counter() - started
    source.stop()
    if sum(outcomes.values()) != lines:
        raise RuntimeError(f"LogSource read {sum(outcomes.values())} of {lines} lines")
    events = outcomes.get(("event",), 0)
    rows.append(["LogSource (serve)", f"{lines:,}", f"{events:,}", f"{elapsed:.2f}", f"{lines / elapsed:,.0f}"])

    started = time.perf_counter()
    events = analyze([str(path)], zone=LogZone.of("UTC")).events
    elapsed = time.perf_counter() - started
    rows.append(["postmortem (analyze)", f"{lines:,}", f"{events:,}", f"{elapsed:.2f}", f"{lines / elapsed:,.0f}"])
    return table(
        f"Log tailing ({size_mb:.1f} MB generated verl-like log, cold start at offset 0)",
        ["path", "lines", "events", "seconds", "lines/s"],
        rows,
    )


def otlp_receiver() -> Any:
    """The test suite's OTLP/HTTP receiver (decodes every request with opentelemetry-proto, as a Collector does)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.otlp_receiver import OTLPReceiver

    return OTLPReceiver().start()


def snapshot_of(tracker: Tracker) -> Callable[[], Snapshot]:
    return lambda: tracker.snapshot


def bench_otlp_export(tmp: Path) -> str:
    """One push of the whole catalog, in process: collect (callbacks over one pinned snapshot), encode, POST."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    receiver = otlp_receiver()
    rows = []
    try:
        for resumes in (1, HISTORY):
            state = tmp / f"state-otlp-{resumes}"
            prefill(state, resumes)
            tracker = Tracker(StateStore(state))
            tracker.replay()
            exporter = OTLPExporter(settings(receiver.url, {}), snapshot_of(tracker), base_resource(0, {}))
            collect, encode, export = [], [], []
            size = points = 0
            for _ in range(WARMUP_SCRAPES + OTLP_EXPORTS):
                started = time.perf_counter()
                data = exporter.collect()
                collected = time.perf_counter()
                if data is None:
                    raise RuntimeError("the collection was empty")
                body = encode_metrics(data).SerializeToString()
                encoded = time.perf_counter()
                if not exporter.export_metrics():
                    raise RuntimeError("OTLP export to the local receiver failed")
                done = time.perf_counter()
                collect.append(collected - started)
                encode.append(encoded - collected)
                export.append(done - encoded)
                size = len(body)
                points = (
                    sum(
                        len(m.data.data_points)
                        for rm in data.resource_metrics
                        for sm in rm.scope_metrics
                        for m in sm.metrics
                    )
                    if data
                    else 0
                )
            exporter.stop()
            del collect[:WARMUP_SCRAPES], encode[:WARMUP_SCRAPES], export[:WARMUP_SCRAPES]
            rows.append(
                [
                    f"{tracker.snapshot.records_total:,}",
                    f"{points}",
                    f"{size:,}",
                    f"{statistics.median(collect) * 1e3:.2f}",
                    f"{statistics.median(encode) * 1e3:.2f}",
                    f"{statistics.median(export) * 1e3:.2f}",
                    f"{percentile(export, 95) * 1e3:.2f}",
                ]
            )
    finally:
        receiver.stop()
    return table(
        f"One OTLP metrics export of the whole catalog ({OTLP_EXPORTS} each; export = collect + encode + POST to a "
        "protobuf-decoding receiver on loopback, measured separately from the collect and encode columns)",
        ["resume records", "points", "bytes", "collect ms", "encode ms", "export median ms", "export p95 ms"],
        rows,
    )


def bench_otlp_scrapes(tmp: Path) -> str:
    """/metrics latency with OTLP push on (every 100 ms) and off, two tqmons scraped in turn."""
    receiver = otlp_receiver()
    off_state, on_state = tmp / "state-otlp-off", tmp / "state-otlp-on"
    prefill(off_state, HISTORY)
    prefill(on_state, HISTORY)
    push_env = {"OTEL_METRIC_EXPORT_INTERVAL": OTLP_BENCH_INTERVAL_MS}
    try:
        with (
            running(off_state) as off,
            running(on_state, ["--otlp-endpoint", receiver.url], push_env) as on,
            httpx.Client(base_url=off.url, timeout=10) as off_client,
            httpx.Client(base_url=on.url, timeout=10) as on_client,
        ):
            pushes_before = len(receiver.requests("/v1/metrics"))
            started = time.perf_counter()
            off_samples, on_samples = scrape_latencies([off_client, on_client], OTLP_SCRAPES)
            elapsed = time.perf_counter() - started
            pushes = len(receiver.requests("/v1/metrics")) - pushes_before
    finally:
        receiver.stop()
    if pushes == 0:
        raise RuntimeError("the OTLP tqmon pushed nothing during the scrapes")
    rows = [
        [label, f"{statistics.median(s) * 1e3:.2f}", f"{percentile(s, 95) * 1e3:.2f}"]
        for label, s in (("OTLP off", off_samples), ("OTLP on", on_samples))
    ]
    ratio_median = statistics.median(on_samples) / statistics.median(off_samples)
    ratio_p95 = percentile(on_samples, 95) / percentile(off_samples, 95)
    rows.append(["on / off", f"{ratio_median:.2f}x", f"{ratio_p95:.2f}x"])
    return table(
        f"GET /metrics with OTLP push on and off ({HISTORY:,} stored resumes each, {OTLP_SCRAPES:,} scrapes each, "
        f"taking turns; {pushes} pushes every {OTLP_BENCH_INTERVAL_MS} ms landed in the {elapsed:.1f} s of scrapes; "
        "target p95 on <= 1.1x off)",
        ["tqmon", "median ms", "p95 ms"],
        rows,
    )


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tqmon-bench-") as name:
        tmp = Path(name)
        for bench in (bench_scrapes, bench_ingest, bench_log, bench_otlp_export, bench_otlp_scrapes):
            print(bench(tmp), flush=True)


if __name__ == "__main__":
    main()
