"""Every alert's PromQL and its Python condition (what the status page shows) agree on the same snapshots, for
every simulator scenario.

Each scenario runs on a real TransferQueue in a local Ray while an in-process tqmon watches its log, its
checkpoint dir and the live TQ (``tests.test_sim.watched``, shared with tests/test_sim.py). The snapshots tqmon
published once a second, and its last one later on (when the window and the sources go stale, the trainer falls
silent and the start leaves the resume alerts' window), are rendered by the exporter as ``/metrics`` renders them
and fed to the real promtool, a test file per scenario, all in one run. One more timeline is folded from verl's
own log lines: a trainer that saved step 2 and then started from scratch (verl #7952), which no simulator
scenario does. The rules are rendered with every
``for:`` at 0s, so an alert fires at exactly the evaluations where its expression holds; at each point promtool
must find firing exactly the alerts whose Python condition holds on the same snapshot at the same ``now``: under
the shipped thresholds, and under thresholds a simulated run crosses (the seconds a restarting trainer pauses,
the 8 or 16 orphan trajectories a resume restores).

Point k is promtool's second k, with its wall-clock values (``*_timestamp_seconds``) counted from ``now - k``,
so that ``time()`` there is ``now``. That is faithful because the conditions read instants, never ranges (which
one snapshot could not evaluate): a test below keeps it so.
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from dataclasses import fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.test_rules import promtool
from tests.test_sim import Watched, cluster, watched  # noqa: F401  (cluster: the module's one Ray, a fixture)
from tqmon import rules
from tqmon.catalog import CATALOG
from tqmon.conditions import ConditionState, evaluate
from tqmon.exporters.prometheus import build_registry, render
from tqmon.sim.scenarios import SCENARIOS
from tqmon.snapshot import Snapshot, SourceName

# Every `for:` 0s: promtool fires what holds at each evaluation.
AT_ONCE: dict[str, Any] = {f.name: "0s" for f in fields(rules.RuleConfig) if f.name.endswith("_for")}
SHIPPED = replace(rules.RuleConfig(), **AT_ONCE)
CONFIGS = {
    "shipped": SHIPPED,
    # Between the live window's 8 restored orphan trajectories and the over-restored runs' 16, and shorter than
    # the pauses of a simulated trainer's restart.
    "tight": replace(SHIPPED, orphan_threshold=10, progress_window="5s", stall_window="5s"),
}
TARGET = {"job": "tqmon", "instance": "sim:9842"}  # the labels Prometheus adds to a scrape of tqmon
CLOCKS = tuple(spec.name for spec in CATALOG if spec.name.endswith("_timestamp_seconds"))  # wall-clock times
# After the run, its last snapshot again: the window still fresh, then the window and the polled sources stale
# with the trainer still counted as alive, then silent with the sources past source_stale_seconds, and last with
# the start out of the resume alerts' window.
LATER = (240, 360, 660, SHIPPED.resume_window_seconds + 60)
FIRING = 'group by (alertname) (ALERTS{alertstate="firing"})'


def restarted_behind(tmp_path: Path) -> list[tuple[Snapshot, float]]:
    """A trainer that saved global_step_2, then started from scratch: the log's own lines, folded as ``serve``
    folds them, seen while the start is recent and once it has left the resume alerts' window."""
    from tqmon.postmortem import LogZone, read_log
    from tqmon.store import StateStore
    from tqmon.tracker import Tracker

    now = time.time()
    at = [datetime.fromtimestamp(now + offset).strftime("%Y-%m-%d %H:%M:%S,000") for offset in (-600, -300, -60)]
    log = tmp_path / "behind.log"
    log.write_text(
        f"INFO:{at[0]}:Training from scratch\n"
        "step:1 - training/global_step:1 - timing_s/gen:2.5 - timing_s/step:10.0\n"
        "step:2 - training/global_step:2 - timing_s/gen:2.5 - timing_s/step:10.0\n"
        f"INFO:{at[1]}:Saving checkpoint to /ckpt/global_step_2\n"
        f"INFO:{at[2]}:Training from scratch\n"
    )
    tracker = Tracker(StateStore(None))
    tracker.register_source(SourceName.LOG, stale_after=None)
    events, _ = read_log(str(log), LogZone.of(None))
    tracker.ingest(events, SourceName.LOG)
    snapshot = tracker.snapshot
    assert [r.step_regressions for r in snapshot.records][-1], "the fold must flag the regression"
    return [(snapshot, now + later) for later in (0, 5, 60, SHIPPED.resume_window_seconds + 60)]


def timeline(run: Watched) -> list[tuple[Snapshot, float]]:
    """Each snapshot at the time it was taken, then the last one LATER."""
    taken, last = run.snapshots[-1]
    return [(snapshot, now) for now, snapshot in run.snapshots] + [(last, taken + later) for later in LATER]


def scrape(snapshot: Snapshot, now: float, second: int) -> dict[str, float]:
    """The exposition of ``snapshot`` at ``now`` as Prometheus stores a scrape of it (series -> value), its
    wall-clock values counted from ``now - second``, promtool's second 0 for this point."""
    body, _ = render(build_registry(lambda: snapshot, process_metrics=False, clock=lambda: now), None)
    scraped = {_series("up", {}): 1.0}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            value = sample.value - (now - second) if sample.name in CLOCKS else sample.value
            scraped[_series(sample.name, sample.labels)] = value
    return scraped


def _series(name: str, labels: dict[str, str]) -> str:
    """A series of the scraped target, as promtool reads it."""
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted({**escaped, **TARGET}.items())) + "}"


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    return ("+Inf" if value > 0 else "-Inf") if math.isinf(value) else repr(value)


def input_series(points: list[tuple[Snapshot, float]]) -> list[dict[str, str]]:
    """promtool's values of each series, one a second: a sample where the scrape has it, else a staleness marker
    once it was seen (no earlier sample may stand in for it) or nothing before."""
    scrapes = [scrape(snapshot, now, second) for second, (snapshot, now) in enumerate(points)]
    series = []
    for name in sorted({name for scraped in scrapes for name in scraped}):
        values, seen = [], False
        for scraped in scrapes:
            seen = seen or name in scraped
            values.append(_number(scraped[name]) if name in scraped else "stale" if seen else "_")
        series.append({"series": name, "values": " ".join(values)})
    return series


def python_firing(snapshot: Snapshot, now: float, config: rules.RuleConfig) -> list[str]:
    """The alerts whose condition the status page says holds."""
    return sorted(c.alert for c in evaluate(snapshot, now, config) if c.state is ConditionState.TRUE)


def promtool_checks(expected: list[list[str]]) -> list[dict[str, Any]]:
    """At each point's second, exactly the alerts expected there are firing."""
    return [
        {
            "expr": FIRING,
            "eval_time": f"{second}s",
            "exp_samples": [{"labels": f'{{alertname="{alert}"}}', "value": 1} for alert in firing],
        }
        for second, firing in enumerate(expected)
    ]


def test_the_conditions_read_instants_only() -> None:
    """One snapshot has no history: an alert whose condition the page evaluates reads no range."""
    ranged = [a.name for a in rules.alerts(SHIPPED) if a.check is not None and re.search(r"\[[^\]]*\]", a.expr)]
    assert ranged == []


def test_every_alert_fires_in_promtool_exactly_when_its_python_condition_holds(
    cluster: str,  # noqa: F811  (the imported fixture)
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    runs = {name: watched(name, tmp_path_factory, cluster) for name in SCENARIOS}
    assert [name for name, run in runs.items() if run.snapshots[-1][1].resumes_total != 1] == []  # all resumed
    points = {name: timeline(run) for name, run in runs.items()} | {"restarted-behind": restarted_behind(tmp_path)}
    series = {name: input_series(moments) for name, moments in points.items()}
    files, verdicts = [], {}
    for label, config in CONFIGS.items():
        (tmp_path / f"{label}-rules.yml").write_text(rules.render(config))
        for name, moments in points.items():  # a file each, so that promtool's report names the scenario
            verdicts[label, name] = [python_firing(snapshot, now, config) for snapshot, now in moments]
            group = {
                "interval": "1s",
                "input_series": series[name],
                "promql_expr_test": promtool_checks(verdicts[label, name]),
            }
            document = {"rule_files": [f"{label}-rules.yml"], "evaluation_interval": "1s", "tests": [group]}
            files.append(tmp_path / f"{label}-{name}.yml")
            files[-1].write_text(yaml.safe_dump(document, sort_keys=False, width=10_000))
    result = subprocess.run(
        [promtool(), "test", "rules", *map(str, files)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout[-20_000:] + result.stderr[-5_000:]
    assert result.stdout.count("SUCCESS") == len(files)

    # Not vacuous: every alert the page evaluates held somewhere and failed somewhere, and the two on Prometheus's
    # own scrape health fired nowhere (promtool saw up == 1 throughout).
    held = [alert for firing in verdicts.values() for point in firing for alert in point]
    total = sum(len(firing) for firing in verdicts.values())
    evaluated = [alert.name for alert in rules.alerts(SHIPPED) if alert.check is not None]
    counts = {alert: held.count(alert) for alert in evaluated}
    assert [a for a, n in counts.items() if not 0 < n < total] == [], (counts, total)
