"""``tqmon demo``: a preempted and resumed verl run on a real TransferQueue, watched live by tqmon.

It starts a local Ray cluster, the simulated trainer (``tqmon sim``) on a real TQ inside it, ``tqmon serve``
attached to the live TQ, the trainer log and the checkpoint dir and, when Debian's ``prometheus`` is on
PATH, a Prometheus on loopback scraping tqmon with the shipped alert rules, every ``for:`` shortened
``FOR_FACTOR`` times so that an alert fires while you watch. A one-screen summary refreshes in the terminal,
with each alert's pending, firing and resolved times; once the under-filled alert has fired for a while the
demo has the trainer refill its window (SIGUSR1), and the alert resolves. Ctrl-C (or SIGTERM) stops
everything it started, Ray included.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import click

from tqmon.cli import option
from tqmon.extras import require_extra
from tqmon.rules import RuleConfig, duration_seconds, rule_groups, shortened
from tqmon.rules import render as render_rules
from tqmon.service import LISTEN_DEFAULT, ConfigError, ServiceConfig
from tqmon.sim.scenarios import CHECKPOINT_DIR, LOG_FILE, SCENARIOS
from tqmon.warmup import PROMPT_STATUSES, TRAIN

CLEAR = "\x1b[H\x1b[2J"
STOP_SECONDS = 20.0  # per child, before SIGKILL
FOR_FACTOR = 30  # the demo's rules are the production rules with every for: divided by this: 10m -> 20s
REFILL_ALERT = "TQMonWindowUnderFilledAfterResume"  # once it has fired for REFILL_AFTER s, the trainer refills
REFILL_AFTER = 10.0


@dataclass
class Child:
    """A process the demo started; stopped with SIGTERM, then SIGKILL."""

    name: str
    proc: subprocess.Popen[bytes]
    output: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_SECONDS)


@dataclass
class AlertTimeline:
    """Each alert's states as the demo saw them in Prometheus's /api/v1/alerts, and when they changed.

    pending is Prometheus's own ``activeAt``; firing and resolved are the poll that first saw them, so they
    are late by at most one refresh. An alert that leaves the list before it fired went back to inactive.
    """

    changes: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # alert -> (state, unix time)

    def update(self, active: list[dict[str, Any]], now: float) -> None:
        seen = {alert_key(alert["labels"]): alert for alert in active}
        for key, alert in seen.items():
            states = self.changes.setdefault(key, [])
            if not states or states[-1][0] not in ("pending", "firing"):
                states.append(("pending", datetime.fromisoformat(alert["activeAt"]).timestamp()))
            if alert["state"] == "firing" and states[-1][0] != "firing":
                states.append(("firing", now))
        for key, states in self.changes.items():
            if key not in seen and states[-1][0] in ("pending", "firing"):
                states.append(("resolved" if states[-1][0] == "firing" else "inactive", now))

    def firing_since(self, alertname: str) -> float | None:
        states = self.changes.get(alertname)
        return states[-1][1] if states and states[-1][0] == "firing" else None

    def lines(self) -> list[str]:
        """One line per alert: its changes, each with its time and the seconds since the one before."""
        lines = []
        for key, states in sorted(self.changes.items(), key=lambda item: item[1][0][1]):
            parts = [f"{states[0][0]} {_clock(states[0][1])}"]
            parts += [
                f"{state} {_clock(at)} (+{at - before:.0f}s)" for (_, before), (state, at) in itertools.pairwise(states)
            ]
            lines.append(f"  {key}: {' → '.join(parts)}")
        return lines


def alert_key(labels: Mapping[str, str]) -> str:
    """The alert's name and the labels that tell its instances apart (job, instance and severity do not here)."""
    extra = ",".join(
        f'{k}="{v}"' for k, v in sorted(labels.items()) if k not in ("alertname", "job", "instance", "severity")
    )
    return labels["alertname"] + (f"{{{extra}}}" if extra else "")


def _clock(at: float) -> str:
    return datetime.fromtimestamp(at).strftime("%H:%M:%S")


@dataclass
class Demo:
    scenario: str
    workdir: Path
    listen: tuple[str, int]
    step_seconds: float
    steps_after_resume: int
    prometheus_port: int | None  # None: no Prometheus
    children: list[Child] = field(default_factory=list)
    timeline: AlertTimeline = field(default_factory=AlertTimeline)
    refilled_at: float | None = None  # when the trainer was asked to refill its window

    @property
    def url(self) -> str:
        host, port = self.listen
        return f"http://{host}:{port}"

    @property
    def prometheus_url(self) -> str | None:
        return None if self.prometheus_port is None else f"http://127.0.0.1:{self.prometheus_port}"

    def spawn(self, name: str, command: list[str]) -> Child:
        output = self.workdir / f"{name}.out"
        with output.open("ab") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child = Child(name, proc, output)
        self.children.append(child)
        return child

    def start(self, gcs_address: str) -> None:
        run = self.workdir / "run"
        scenario = SCENARIOS[self.scenario]
        python = [sys.executable, "-m"]
        self.spawn(
            "trainer",
            [
                *python,
                "tqmon.sim",
                f"--scenario={self.scenario}",
                f"--workdir={run}",
                f"--ray-address={gcs_address}",
                f"--step-seconds={self.step_seconds}",
                f"--steps-after-resume={self.steps_after_resume}",
                "--hold",
            ],
        )
        host, port = self.listen
        self.spawn(
            "tqmon",
            [
                *python,
                "tqmon.cli",
                "serve",
                f"--listen={host}:{port}",
                f"--state-dir={self.workdir / 'state'}",
                f"--log={run / LOG_FILE}",
                f"--checkpoint-dir={run / CHECKPOINT_DIR}",
                f"--ray-address={gcs_address}",
                "--log-interval=0.5",
                "--checkpoint-interval=1",
                "--tq-min-interval=1",
                "--tq-max-interval=2",
                *scenario.after.tqmon_flags(),
            ],
        )
        if self.prometheus_port is not None:
            self.spawn("prometheus", prometheus_command(self.workdir, self.prometheus_port, self.listen))

    def refill_when_due(self, now: float) -> None:
        """Once REFILL_ALERT has fired for REFILL_AFTER s, have the trainer fill its window up to T (once)."""
        fired = self.timeline.firing_since(REFILL_ALERT)
        if self.refilled_at is None and fired is not None and now - fired >= REFILL_AFTER:
            trainer = next(c for c in self.children if c.name == "trainer")
            trainer.proc.send_signal(signal.SIGUSR1)
            self.refilled_at = now

    def stop(self) -> None:
        for child in reversed(self.children):  # Prometheus and tqmon first, the trainer (and its TQ) last
            child.stop()


def demo_rules() -> str:
    """The production rules, generated like deploy/prometheus/tqmon-rules.yml, with every for: shortened."""
    header = f"# tqmon demo: the production rules with every for: divided by {FOR_FACTOR}.\n"
    return header + render_rules(shortened(RuleConfig(), FOR_FACTOR))


@functools.cache
def for_line() -> str:
    """What the screen says of the demo's for: against production's, read from both rule files' data."""
    production = rule_groups(RuleConfig())["groups"][0]["rules"]
    demo = rule_groups(shortened(RuleConfig(), FOR_FACTOR))["groups"][0]["rules"]
    pairs = {(long["for"], short["for"]) for long, short in zip(production, demo, strict=True) if "alert" in long}
    shown = ", ".join(f"{long} → {short}" for long, short in sorted(pairs, key=lambda p: duration_seconds(p[0])))
    return f"alerts use for: shortened {FOR_FACTOR}× for the demo ({shown}); production rules use the long ones"


def prometheus_command(workdir: Path, port: int, target: tuple[str, int]) -> list[str]:
    """Prometheus on loopback scraping tqmon every 2 s with the demo's rules (:func:`demo_rules`)."""
    rules = workdir / "tqmon-rules.yml"
    rules.write_text(demo_rules())
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 2s\n  evaluation_interval: 2s\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n  - job_name: tqmon\n    static_configs:\n"
        f"      - targets: ['{target[0]}:{target[1]}']\n"
    )
    return [
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'prometheus'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]


# ---------------------------------------------------------------- the summary screen


def _count(value: Any) -> str:
    return "-" if value is None else str(value)


def window_line(status: Mapping[str, Any]) -> str:
    train = next((w for w in status.get("windows", []) if w["partition"] == TRAIN), None)
    target = status.get("target_window")
    if train is None:
        return f"live window (train): not seen yet · target {_count(target)}"
    counts = train["by_status"]
    parts = " · ".join(f"{s} {counts.get(s, 0)}" for s in PROMPT_STATUSES)
    total = sum(counts.values())
    extra = f" · orphan trajectories {train['orphan_trajectories']}" if train.get("orphan_trajectories") else ""
    return f"live window (train): {parts} = {total} of target {_count(target)} → {status['window_status']}{extra}"


def resume_line(record: Mapping[str, Any] | None) -> str:
    if record is None:
        return "last start: none yet"
    start = f"resume from step {record['checkpoint_step']}" if record["resumed"] else "fresh start"
    split = record.get("restored_by_status") or {}
    detail = ", ".join(f"{s} {n}" for s, n in split.items() if n and s != "unknown")
    restored = _count(record["restored"]) + (f" ({detail})" if detail else "")
    doomed = record.get("doomed")
    bound = " (lower bound)" if record.get("under_submitted_lower_bound") else ""
    numbers = (
        f"R {restored} · K {_count(record['reissued'])} · T {_count(record['target'])} · "
        f"M expected {_count(record['expected'])} / submitted {_count(record['submitted'])} · "
        f"O {_count(record['over_restored'])} · doomed {_count(sum(doomed.values()) if doomed else None)} · "
        f"deficit {_count(record['under_submitted'])}{bound}"
    )
    return f"last start: {start} · {numbers} · {record['warmup_state']}\n  verdict: {record['verdict']}"


def refill_line(demo: Demo) -> str:
    if demo.refilled_at is None:
        return f"refill: once {REFILL_ALERT} has fired for {REFILL_AFTER:g} s, the trainer fills its window up to T"
    return f"refill: the trainer was asked at {_clock(demo.refilled_at)} (SIGUSR1) to fill its window up to T"


def summary(demo: Demo, status: Mapping[str, Any] | None, alerts_seen: bool, problem: str | None = None) -> str:
    """The one screen: where everything is, the live window against the target, the last start's verdict."""
    run = demo.workdir / "run"
    lines = [
        f"tqmon demo · scenario {demo.scenario}: {SCENARIOS[demo.scenario].summary}",
        f"  tqmon       {demo.url}/   metrics {demo.url}/metrics   status {demo.url}/api/v1/status",
    ]
    if demo.prometheus_url is not None:
        lines.append(f"  prometheus  {demo.prometheus_url}/   alerts {demo.prometheus_url}/alerts")
    lines.append(f"  trainer log {run / LOG_FILE}   checkpoints {run / CHECKPOINT_DIR}")
    lines.append("")
    if status is None:
        lines.append(f"waiting for tqmon… {problem or ''}".rstrip())
    else:
        sources = " · ".join(f"{s['source']} {'up' if s['up'] else 'down'}" for s in status["sources"])
        tq = status.get("tq") or {}
        lines += [
            f"sources: {sources}",
            f"trainer step {_count(status['trainer_step'])} · TQ controller epoch {tq.get('epochs', 0)}, "
            f"polled every {tq.get('interval', 0):.1f} s, {_count(tq.get('reply_keys'))} keys",
            window_line(status),
            resume_line(status["records"][-1] if status["records"] else None),
        ]
    if demo.prometheus_url is not None:
        state = "" if alerts_seen else " (Prometheus not answering)"
        lines += [
            for_line() + state,
            *(demo.timeline.lines() or ["  no alert pending or firing yet"]),
            refill_line(demo),
        ]
    lines += ["", "Ctrl-C stops everything the demo started."]
    return "\n".join(lines)


def get_json(url: str) -> Any:
    """GET a loopback JSON API with the standard library (the runtime carries no HTTP client library)."""
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.load(response)


def poll(demo: Demo) -> tuple[dict[str, Any] | None, bool, str | None]:
    """tqmon's status and, into the demo's timeline, Prometheus's alerts; (status, alerts read, problem)."""
    alerts_seen = False
    if demo.prometheus_url is not None:
        try:
            active = get_json(demo.prometheus_url + "/api/v1/alerts")["data"]["alerts"]
            demo.timeline.update(active, time.time())
            alerts_seen = True
        except (OSError, KeyError, ValueError):  # not up yet: the timeline keeps what it knew
            pass
    try:
        status = get_json(demo.url + "/api/v1/status")
    except (OSError, ValueError) as err:  # URLError and timeouts are OSErrors; a garbled body a ValueError
        return None, alerts_seen, str(err)
    return status, alerts_seen, None


# ---------------------------------------------------------------- lifecycle


@contextmanager
def ray_cluster() -> Iterator[str]:
    """A local Ray (4 logical CPUs: TQ's controller and storage unit need them), on loopback; yields its address."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # Ctrl-C/SIGTERM must clean up, not dump
    import ray

    context: Any = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    def handle(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(
    scenario: str,
    listen: tuple[str, int],
    *,
    step_seconds: float,
    steps_after_resume: int,
    prometheus: bool | None,
    workdir: Path | None,
    out: TextIO = sys.stdout,
    refresh: float = 1.0,
) -> None:
    """Run until Ctrl-C; ``prometheus=None`` starts one if it is installed."""
    if prometheus is None:
        prometheus = shutil.which("prometheus") is not None
    elif prometheus and shutil.which("prometheus") is None:
        raise click.UsageError("--prometheus needs Debian's prometheus on PATH (apt-get install prometheus)")
    keep = workdir is not None
    root = workdir or Path(tempfile.mkdtemp(prefix="tqmon-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    demo = Demo(scenario, root, listen, step_seconds, steps_after_resume, _free_port() if prometheus else None)
    draw: Callable[[str], None] = _screen(out)
    try:
        with ray_cluster() as gcs, interrupt_on_sigterm():  # after ray.init, which sets its own handler
            demo.start(gcs)
            try:
                while True:
                    status, alerts_seen, problem = poll(demo)
                    demo.refill_when_due(time.time())
                    draw(summary(demo, status, alerts_seen, problem))
                    dead = [c for c in demo.children if not c.alive()]
                    if dead:
                        tail = dead[0].output.read_text(errors="replace")[-2000:]
                        raise click.ClickException(f"{dead[0].name} exited with {dead[0].proc.returncode}:\n{tail}")
                    time.sleep(refresh)
            except KeyboardInterrupt:
                out.write("\nstopping the demo…\n")
            finally:
                demo.stop()
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    out.write(f"stopped: {', '.join(c.name for c in demo.children)} and the Ray cluster\n")
    out.flush()


def _screen(out: TextIO) -> Callable[[str], None]:
    """Redraw in place on a terminal; elsewhere (a pipe, CI) print each new screen once."""
    last: list[str] = [""]

    def draw(text: str) -> None:
        if out.isatty():
            out.write(CLEAR + text + "\n")
        elif text != last[0]:
            out.write(text + "\n\n")
        last[0] = text
        out.flush()

    return draw


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- the command


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``."""
    try:
        return ServiceConfig(listen=value).address
    except ConfigError as err:
        raise click.BadParameter(str(err)) from None


@click.command()
@option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    default="miscounted-restore",
    show_default=True,
    help="What the simulated trainer does before the preemption and at the resume (see `tqmon sim --help`); "
    "the default leaves the window under-filled, so the under-filled alert fires and, once refilled, resolves.",
    env="DEMO_SCENARIO",
)
@option("--listen", default=LISTEN_DEFAULT, show_default=True, help="HOST:PORT tqmon serves on.", env="LISTEN")
@option(
    "--step-seconds",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Wall time of one simulated training step.",
    env="DEMO_STEP_SECONDS",
)
@option(
    "--steps-after-resume",
    type=click.IntRange(min=1),
    default=600,
    show_default=True,
    help="Steps the trainer runs after resuming (then it holds its TransferQueue until you stop the demo).",
    env="DEMO_STEPS_AFTER_RESUME",
)
@option(
    "--prometheus/--no-prometheus",
    default=None,
    help="Also run Prometheus on loopback with the alert rules, their for: shortened "
    "[default: when `prometheus` is on PATH].",
    env="DEMO_PROMETHEUS",
)
@option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the run (log, checkpoints, tqmon state, outputs) here; default: a temp dir removed on exit.",
    env="DEMO_WORKDIR",
)
def demo(
    scenario: str,
    listen: str,
    step_seconds: float,
    steps_after_resume: int,
    prometheus: bool | None,
    workdir: Path | None,
) -> None:
    """Watch a preempted and resumed verl run on a real TransferQueue, live.

    Starts a local Ray cluster, the simulated verl 0.9.1 trainer on a real TransferQueue in it, tqmon
    attached to the live TQ, the trainer log and the checkpoint dir, and Prometheus with the alert rules
    (their for: shortened, so an alert fires while you watch) when it is installed; prints the URLs and a
    live summary with each alert's pending, firing and resolved times. Once the under-filled alert has fired
    a while the trainer refills its window and the alert resolves. Ctrl-C stops everything it started.
    """
    require_extra("tq", "tqmon demo")
    if workdir is not None and workdir.exists() and any(workdir.iterdir()):
        raise click.UsageError(f"--workdir {workdir} is not empty; give a fresh directory")
    run_demo(
        scenario,
        parse_listen(listen),
        step_seconds=step_seconds,
        steps_after_resume=steps_after_resume,
        prometheus=prometheus,
        workdir=workdir,
    )
