"""The shipped alerts and dashboards against the real stack: the simulator (a subprocess) trains on a real
TransferQueue in a local Ray cluster, ``tqmon serve`` watches that live TQ, the log and the checkpoint dir,
and Debian's Prometheus scrapes tqmon and evaluates the rules from ``tqmon.rules`` every second, with the
durations shortened (``CONFIG``) so that a ``for:`` elapses within the test.

- miscounted-restore (numbers in tests/test_sim.py): after the resume the live window holds 8 prompt groups
  (12 between a step's submission and its sample) of T = 20 while the trainer steps, so the headline alert
  fires within its ``for:`` plus the detection slack, with the live numbers in its annotations. Before it,
  TQMonResumeSourcesDisagree fires for R (the log's 30 against the checkpoint's 8) and for the live window
  (8 or 12 against R + M = 30). While they fire every dashboard query returns data (the ALERTS queries have
  data because the alerts fire, and every other series exists once tqmon watches the log, the checkpoints
  and the live TQ), except the "Lost windows" annotation, which marks lost_window starts only, and the
  rollouts wasted, unknown here because the checkpoint contradicts the log's R. The test then tops the
  window up by the 12 missing prompt keys (what a correct warmup would have submitted) and the headline
  alert resolves while the trainer still steps.
- healthy-resume: the window holds 8 or 12 of T = 8 and nothing fires over longer than the shortened
  ``for:``. The headline alert never becomes pending once the restored window is seen (its expression never
  holds on a correct resume; only the new controller's polls before the trainer restored into it can make it
  pending, briefly, which its ``for:`` absorbs); other alerts may be pending but never fire:
  TQMonWindowOverTarget's expression holds whenever a poll lands between a step's submission and its sample,
  which its 30 m ``for:`` is there to absorb.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from mixin import dashboards, dashlint
from mixin.repo import repo_root
from tests.conftest import TqmonProcess
from tests.test_e2e import Prometheus, eventually
from tests.test_rules import check_rules
from tests.test_sim import LOGGED, cluster, serve_args  # noqa: F401  (cluster: the module's one Ray, a fixture)
from tqmon import rules
from tqmon.sim.rollout import PARTITION
from tqmon.sim.scenarios import SCENARIOS

pytestmark = pytest.mark.e2e

UNDER_FILLED_FOR = 15  # seconds
CONFIG = rules.RuleConfig(under_filled_for=f"{UNDER_FILLED_FOR}s", progress_window="30s", decision_for="5s")
HEADLINE = "TQMonWindowUnderFilledAfterResume"
DISAGREE = "TQMonResumeSourcesDisagree"
# From the resume to firing, beyond the for: a step within the progress window (the last before the preemption
# or the first after the resume) for "progressing", a TQ poll (<= 1 s), a scrape (1 s) and an evaluation (1 s).
FIRING_SLACK = 10.0
RESTART_LEAD = 10.0  # how long a new controller may be polled before the resume's first log line
RESOLVE_WITHIN = 6.0  # a TQ poll, a scrape, an evaluation, and the test's own polling
OBSERVE = UNDER_FILLED_FOR + 10  # how long the healthy run is watched, in seconds
STEP_SECONDS = 0.5
STEPS_AFTER_RESUME = 300  # more than the test needs: it stops the simulator (SIGTERM) when done
TQ_POLL = ["--tq-min-interval", "0.5", "--tq-max-interval", "1", "--tq-budget", "0.5"]
JOB = 'job="tqmon"'


class RulesPrometheus(Prometheus):
    """tests/test_e2e.py's Prometheus, with a rules file added to its config and loaded by a reload (SIGHUP)."""

    def load_rules(self, rules_file: Path) -> None:
        config = self.workdir / "prometheus.yml"
        config.write_text(config.read_text() + f"rule_files:\n  - {rules_file}\n")
        self.proc.send_signal(signal.SIGHUP)
        eventually(self.rule_groups, lambda names: list(names) == [rules.GROUP], "the rules")

    def rule_groups(self) -> list[str]:
        response = httpx.get(self.url + "/api/v1/rules", timeout=5)
        response.raise_for_status()
        return [group["name"] for group in response.json()["data"]["groups"]]

    def alerts(self) -> list[dict[str, Any]]:
        """The active (pending or firing) alerts; a resolved alert is no longer listed."""
        response = httpx.get(self.url + "/api/v1/alerts", timeout=5)
        response.raise_for_status()
        alerts: list[dict[str, Any]] = response.json()["data"]["alerts"]
        return alerts

    def value(self, expr: str) -> float | None:
        """The value of a query with at most one series (None: no series)."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None


@dataclass
class Stack:
    """One scenario's processes: the simulated trainer, the tqmon watching it and the Prometheus scraping tqmon."""

    sim: subprocess.Popen[bytes]
    tqmon: TqmonProcess
    prom: RulesPrometheus

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.tqmon.port}"


def stop(sim: subprocess.Popen[bytes]) -> None:
    """SIGTERM: the simulator stops at its next pause and closes its TQ (which kills the controller)."""
    if sim.poll() is None:
        sim.send_signal(signal.SIGTERM)
        try:
            sim.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait()


@contextmanager
def stack(name: str, tmp_path: Path, gcs: str, tqmon_factory: Callable[..., TqmonProcess]) -> Iterator[Stack]:
    """tqmon and Prometheus first, so they see the fresh start and the resume; then the simulator."""
    workdir = tmp_path / "run"
    tqmon = tqmon_factory([*serve_args(workdir, SCENARIOS[name]), "--ray-address", gcs, *TQ_POLL]).start()
    rules_file = tmp_path / "tqmon-rules.yml"
    rules_file.write_text(rules.render(CONFIG))
    check_rules(rules_file)
    prom = RulesPrometheus(tmp_path / "prometheus", tqmon.port)
    sim: subprocess.Popen[bytes] | None = None
    try:
        prom.wait_ready()
        prom.load_rules(rules_file)
        command = [sys.executable, "-m", "tqmon.sim", "--scenario", name, "--workdir", str(workdir)]
        command += ["--ray-address", gcs, "--hold", "--step-seconds", str(STEP_SECONDS)]
        command += ["--steps-after-resume", str(STEPS_AFTER_RESUME)]
        with (tmp_path / "sim.out").open("wb") as out:
            sim = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        yield Stack(sim, tqmon, prom)
    finally:
        if sim is not None:
            stop(sim)
        prom.stop()


def resumed_at(prom: RulesPrometheus, windows: tuple[int, int]) -> float:
    """Once Prometheus has scraped the resume and the restored live window (one of ``windows``, which the new
    controller reaches when the trainer loaded its checkpoint): when the resume started (its log line)."""
    eventually(lambda: prom.value(f"tqmon_resumes_total{{{JOB}}}"), lambda n: n == 1, "the resume", timeout=120)
    eventually(lambda: prom.value(f"{rules.WINDOW_TOTAL}{{{JOB}}}"), lambda n: n in windows, f"a window in {windows}")
    started = prom.value(f"tqmon_last_resume_timestamp_seconds{{{JOB}}}")
    assert started is not None
    return started


def rfc3339(stamp: str) -> float:
    """Prometheus's RFC 3339 time (nanoseconds, ``Z``) as unix seconds."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp() + float(f"0.{fraction or 0}")


def headline(prom: RulesPrometheus) -> dict[str, Any] | None:
    return next((a for a in prom.alerts() if a["labels"]["alertname"] == HEADLINE), None)


def humanize_percentage(value: float) -> str:
    """Prometheus's ``humanizePercentage``: ``%.4g`` of the value times 100."""
    return f"{value * 100:.4g}%"


@pytest.fixture
def trainer_tq(cluster: str) -> Iterator[Callable[[], Any]]:  # noqa: F811  (the imported fixture)
    """This process as one more client of the simulator's TQ controller, like a second trainer process.

    ``tq.init()`` finds the existing controller and only connects a client (``_init_from_existing``). The
    teardown runs after the test stopped the simulator, whose ``tq.close()`` already killed the controller:
    this process's ``tq.close()`` then only closes its client.
    """
    import transfer_queue as tq

    attached: list[Any] = []

    def attach() -> Any:
        if not attached:
            tq.init()
            attached.append(tq)
        return tq

    yield attach
    if attached:
        tq.close()


def dashboard_queries(instance: str) -> dict[str, str]:
    """Every query of the shipped dashboards (panels, variables, annotations), with the Grafana variables set."""
    values = {
        "job": "tqmon",
        "instance": instance,  # as Grafana sends a single value (its dots match themselves too)
        "run": ".*",  # the simulator runs without a run id: tqmon_run_info has run_id=""
        "__rate_interval": "30s",
        "__interval": "30s",
        "__range": "5m",
    }
    found = {}
    for name in sorted(dashboards.DASHBOARDS):
        model = dashboards.load((repo_root() / dashboards.DASHBOARD_DIR / name).read_text())
        for where, expr in dashlint.queries(model):
            found[f"{name} {where}"] = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)
    return found


def test_under_filled_window_fires_every_panel_has_data_and_recovery_resolves(
    cluster: str,  # noqa: F811  (the imported fixture)
    tmp_path: Path,
    tqmon_factory: Callable[..., TqmonProcess],
    trainer_tq: Callable[[], Any],
) -> None:
    with stack("miscounted-restore", tmp_path, cluster, tqmon_factory) as s:
        prom = s.prom
        # The numbers of the scenario: the live window 8 or 12 (tests/test_sim.py) of T 20.
        resume = resumed_at(prom, (8, 12))
        assert prom.value(f"tqmon_window_target_prompt_groups{{{JOB}}}") == 20

        firing = eventually(
            lambda: headline(prom),
            lambda alert: alert is not None and alert["state"] == "firing",
            f"{HEADLINE} firing",
            timeout=UNDER_FILLED_FOR + FIRING_SLACK + 30,
        )
        fired = time.time()
        # The condition holds from the new controller's first poll, which can come a few seconds before the
        # resume's log line (the trainer builds its controller, then loads the checkpoint): it starts at the
        # restart, never earlier, and the alert fires no sooner than `for` after it and within the slack.
        active_at = rfc3339(firing["activeAt"])
        assert resume - RESTART_LEAD <= active_at <= resume + FIRING_SLACK, (active_at, resume)
        assert fired - active_at >= UNDER_FILLED_FOR, (fired, active_at)
        elapsed = fired - resume
        assert elapsed <= UNDER_FILLED_FOR + FIRING_SLACK, elapsed
        print(f"{HEADLINE} firing {elapsed:.1f}s after the resume")

        # The annotations carry the live numbers: the fill ratio at that evaluation, 8 or 12 of 20.
        value = float(firing["value"])
        assert value in (8 / 20, 12 / 20), firing
        template = next(a for a in rules.alerts(CONFIG) if a.name == HEADLINE).description
        description = template.replace("{{ $labels.instance }}", s.instance)
        description = description.replace("{{ $value | humanizePercentage }}", humanize_percentage(value))
        assert "{{" not in description
        assert firing["labels"] == {
            "alertname": HEADLINE,
            "severity": "critical",
            "job": "tqmon",
            "instance": s.instance,
        }
        assert firing["annotations"] == {
            "summary": "The TransferQueue prefetch window stays under-filled after a resume.",
            "description": description,
            "runbook_url": f"{CONFIG.runbook_base_url}{HEADLINE}.md",
            "dashboard_url": f"{CONFIG.grafana_url}/d/{rules.RESUME_DASHBOARD_UID}?var-job=tqmon"
            f"&var-instance={quote(s.instance, safe='')}",
        }
        # tqmon keeps the log's inflated R (30 of 20: nothing under-submitted), but the judge flags that the
        # checkpoint and the live window contradict it: those two alerts fire, and nothing else.
        names = sorted(
            (a["labels"]["alertname"], a["labels"].get("quantity", "")) for a in prom.alerts() if a["state"] == "firing"
        )
        assert names == [(DISAGREE, "restored"), (DISAGREE, "window_after_warmup"), (HEADLINE, "")], names

        # Every dashboard query returns data from this Prometheus while the alert fires.
        queries = dashboard_queries(s.instance)
        assert len(queries) >= 40  # every panel target, variable and annotation of both dashboards
        empty = [where for where, expr in queries.items() if not prom.query(expr)]
        lost_windows = [where for where in queries if where.endswith("annotation 'Lost windows'")]
        assert len(lost_windows) == len(dashboards.DASHBOARDS)  # the exemption names a real query
        # Unknown here by design, so absent rather than 0: the checkpoint's composition contradicts the log's R,
        # so the doomed groups, and with them the rollouts wasted, are not known.
        unknown = [where for where in queries if "panel 'Rollouts wasted'" in where]
        assert len(unknown) == 1  # the exemption names a real query
        assert sorted(empty) == sorted(lost_windows + unknown), {where: queries[where] for where in empty}

        # Recovery: the 12 prompt groups a correct warmup would have added (T 20 - the 8 held after a sample),
        # pending at the trainer's current step. The window then holds 20 or 24.
        step = prom.value(f"tqmon_trainer_global_step{{{JOB}}}")
        assert step is not None
        tq = trainer_tq()
        keys = [uuid.uuid4().hex for _ in range(12)]
        tags = [{"is_prompt": True, "status": "pending", "global_steps": int(step)} for _ in keys]
        tq.kv_batch_put(keys=keys, partition_id=PARTITION, tags=tags)
        topped_up = time.time()
        eventually(lambda: headline(prom), lambda alert: alert is None, f"{HEADLINE} resolved", timeout=30)
        took = time.time() - topped_up
        assert took <= RESOLVE_WITHIN, took
        print(f"{HEADLINE} resolved {took:.1f}s after the top-up")
        # Resolved by the refill, not by the trainer stopping: it still steps and the window is full.
        assert s.sim.poll() is None
        since_step = prom.value(f"time() - tqmon_trainer_last_step_timestamp_seconds{{{JOB}}}")
        assert since_step is not None and since_step < rules.duration_seconds(CONFIG.progress_window)
        assert prom.value(f"{rules.WINDOW_TOTAL}{{{JOB}}}") in (20, 24)


def test_healthy_resume_fires_nothing(
    cluster: str,  # noqa: F811  (the imported fixture)
    tmp_path: Path,
    tqmon_factory: Callable[..., TqmonProcess],
) -> None:
    with stack("healthy-resume", tmp_path, cluster, tqmon_factory) as s:
        prom = s.prom
        resumed_at(prom, (8, 12))  # of T 8
        restored_seen = time.time()
        step = prom.value(f"tqmon_trainer_global_step{{{JOB}}}")
        deadline = time.monotonic() + OBSERVE
        samples = 0
        while time.monotonic() < deadline:
            active = prom.alerts()
            assert not [a for a in active if a["state"] == "firing"], active
            assert HEADLINE not in {a["labels"]["alertname"] for a in active}, active
            samples += 1
            time.sleep(0.5)
        assert samples >= OBSERVE
        # Not vacuous: the live window was scraped all along, never under T, while the trainer stepped.
        window = f"{rules.FILL_RATIO}{{{JOB}}}[{OBSERVE}s]"
        assert (prom.value(f"count_over_time({window})") or 0) >= OBSERVE - 5
        assert prom.value(f"min_over_time({window})") == 1.0
        assert (prom.value(f"tqmon_trainer_global_step{{{JOB}}}") or 0) > (step or 0)
        assert s.sim.poll() is None
        # The sources agree on every quantity of the resume they were compared on: what the log states (the live
        # windows too when a TQ poll landed before the first step, a race), each exported at 0, and only those
        # (K is logged once, R's split given by the checkpoint alone). No window was lost.
        record = httpx.get(s.tqmon.url + "/api/v1/status", timeout=5).json()["records"][-1]
        assert set(LOGGED) <= set(record["compared"]) and record["disagreements"] == [], record
        assert prom.value(f"count(tqmon_resume_source_disagreements{{{JOB}}} == 0)") == len(record["compared"])
        assert prom.value(f"count(tqmon_resume_source_disagreements{{{JOB}}})") == len(record["compared"])
        assert prom.value(f"tqmon_resume_lost_prompt_groups{{{JOB}}}") == 0
        # And over the whole run, fresh start and preemption included, as Prometheus recorded it in ALERTS.
        assert prom.query('count_over_time(ALERTS{alertname=~"TQMon.*",alertstate="firing"}[10m])') == []
        # The one exception: the new controller's first polls, before the trainer restored its checkpoint into
        # it, see an empty window; the headline may be pending then (its `for:` absorbs that), never after.
        alerts = f'ALERTS{{alertname="{HEADLINE}"}}'
        last_pending = prom.value(f"max_over_time(timestamp({alerts})[10m:1s])")
        assert last_pending is None or last_pending < restored_seen, (last_pending, restored_seen)
        assert (prom.value(f"count_over_time({alerts}[10m])") or 0) < UNDER_FILLED_FOR
