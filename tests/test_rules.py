"""The shipped Prometheus rules: drift, ``promtool check rules``, runbooks, and ``promtool test rules`` proving
that each alert fires on its fault with exact annotations, resolves, and stays silent on a healthy resume,
during warmup and on an idle run. Scenarios are one-minute series written to a temp dir per test."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from mixin import dashlint
from mixin.repo import repo_root
from mixin.rules import RULES_FILE
from tqmon import rules
from tqmon.catalog import BY_NAME, SOURCES
from tqmon.cli import main
from tqmon.snapshot import RegressionReason

RUNBOOKS = Path(__file__).resolve().parent.parent / "docs" / "runbooks"
INSTANCE = "trainer-0:9842"
RUNBOOK = "https://github.com/tqmon/tqmon/blob/main/docs/runbooks/"
DASHBOARD = "https://grafana.example.com/d/tqmon-resume?var-job=tqmon&var-instance=trainer-0%3A9842"
TARGET_LABELS = {"job": "tqmon", "instance": INSTANCE}
LIVE_SOURCES = ("tq", "log")  # polled sources: succeed on every poll
PUSH_SOURCE = "events"  # succeeds only when the trainer posts


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run `make test`, which installs Debian's prometheus")
    return path


def s(name: str, **labels: str) -> str:
    """A series of the scraped tqmon target."""
    assert name in BY_NAME or name == "up", name
    pairs = {**TARGET_LABELS, **labels}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs.items()) + "}"


def stateset(name: str, current: str, values: str = "1x240", others: str = "0x240") -> dict[str, str]:
    """Every state of a catalog stateset: ``current`` follows ``values``, the others ``others``."""
    states = BY_NAME[name].state_label.values or ()
    assert current in states
    label = BY_NAME[name].state_label.name
    return {s(name, **{label: state}): values if state == current else others for state in states}


# What a healthy resume watched through its log, checkpoint dir and TQ compares; the other quantities had one
# report at most, so they have no verdict and no series.
COMPARED = ("restored", "target", "submitted", "window_after_warmup", "checkpoint_window")


def healthy() -> dict[str, str]:
    """Resumed at t=0 from step 40 (its last step before the preemption completed at -2m): R=88 of T=96, warmup
    submits the expected 8, the trainer steps every minute from 5m with a full window; sources are fresh (the push
    source last posted at t=0)."""
    series = {
        s("up"): "1x240",
        s("tqmon_build_info", version="0.1.0"): "1x240",
        s("tqmon_last_resume_timestamp_seconds"): "0x240",
        s("tqmon_window_target_prompt_groups"): "96x240",
        s("tqmon_window_prompt_groups", partition="train", status="pending"): "64x240",
        s("tqmon_window_prompt_groups", partition="train", status="running"): "16x240",
        s("tqmon_window_prompt_groups", partition="train", status="finished"): "16x240",
        s("tqmon_window_prompt_groups", partition="train", status="failure"): "0x240",
        s("tqmon_window_orphan_trajectories", partition="train"): "40x240",
        s("tqmon_trainer_global_step"): "40x4 41+1x235",
        s("tqmon_trainer_last_step_timestamp_seconds"): "-120x4 300+60x235",
        s("tqmon_trainer_last_event_timestamp_seconds"): "0+60x240",
        s("tqmon_resume_restored_prompt_groups", status="pending"): "10x240",
        s("tqmon_resume_restored_prompt_groups", status="running"): "6x240",
        s("tqmon_resume_restored_prompt_groups", status="finished"): "72x240",
        s("tqmon_resume_restored_prompt_groups", status="failure"): "0x240",
        s("tqmon_resume_warmup_target_prompt_groups"): "96x240",
        s("tqmon_resume_warmup_expected_prompt_groups"): "8x240",
        s("tqmon_resume_warmup_submitted_prompt_groups"): "8x240",
        s("tqmon_resume_under_submitted_prompt_groups"): "0x240",
        **{
            s("tqmon_resume_doomed_prompt_groups", reason=r): "0x240"
            for r in BY_NAME["tqmon_resume_doomed_prompt_groups"].labels[0].values or ()
        },
        **stateset("tqmon_resume_warmup_state", "topped_up"),
        **{s("tqmon_resume_source_disagreements", quantity=q): "0x240" for q in COMPARED},
        **stateset("tqmon_window_status", "ok"),
        **{s("tqmon_source_up", source=src): "1x240" for src in (*LIVE_SOURCES, PUSH_SOURCE)},
        **{s("tqmon_source_last_success_timestamp_seconds", source=src): "0+60x240" for src in LIVE_SOURCES},
        s("tqmon_source_last_success_timestamp_seconds", source=PUSH_SOURCE): "0x240",
    }
    assert {PUSH_SOURCE, *LIVE_SOURCES} <= set(SOURCES)
    return series


def warmup() -> dict[str, str]:
    """A resume whose warmup takes 20m: the window fills slowly from 40 to 96 by 14m (under-filled longer than
    the alert's 10m, but the trainer's last step, 2m before the resume, counts as progress only until 8m), the
    warmup decision is known from 2m, and the first step lands at 21m (the step stands for 23m, under stall_for)."""
    return healthy() | {
        s("tqmon_window_prompt_groups", partition="train", status="pending"): "8+4x14 64x225",
        s("tqmon_trainer_global_step"): "40x20 41+1x219",
        s("tqmon_trainer_last_step_timestamp_seconds"): "-120x20 1260+60x219",
        s("tqmon_resume_under_submitted_prompt_groups"): "_x1 0x238",
        s("tqmon_resume_warmup_expected_prompt_groups"): "_x1 8x238",
        s("tqmon_resume_warmup_submitted_prompt_groups"): "_x1 8x238",
        **stateset("tqmon_resume_warmup_state", "unknown", "1x1 0x238", "0x240"),
        s("tqmon_resume_warmup_state", state="topped_up"): "0x1 1x238",
    }


def idle() -> dict[str, str]:
    """Resumed a day ago (with an under-submission then), trainer silent for an hour at step 120, window
    drained; tqmon and its polled sources are fine."""
    return healthy() | {
        s("tqmon_last_resume_timestamp_seconds"): "-86400x240",
        s("tqmon_resume_under_submitted_prompt_groups"): "12x240",
        s("tqmon_trainer_global_step"): "120x240",
        s("tqmon_trainer_last_step_timestamp_seconds"): "-3600x240",
        s("tqmon_trainer_last_event_timestamp_seconds"): "-3600x240",
        **{s("tqmon_window_prompt_groups", partition="train", status=st): "0x240" for st in ("pending", "running")},
        s("tqmon_window_prompt_groups", partition="train", status="finished"): "0x240",
        s("tqmon_window_orphan_trajectories", partition="train"): "500x240",
        **stateset("tqmon_window_status", "under_filled"),
    }


@dataclass(frozen=True)
class Case:
    """One alert's fault: it is quiet at ``quiet``, fires at ``fires`` with exactly these labels and
    annotations, and is resolved at ``resolved``."""

    alert: str
    faults: dict[str, str]
    quiet: str
    fires: str
    resolved: str
    severity: str
    summary: str
    description: str
    labels: dict[str, str] = field(default_factory=lambda: dict(TARGET_LABELS))
    dashboard: str = DASHBOARD


CASES = [
    Case(
        "TQMonWindowUnderFilledAfterResume",
        {s("tqmon_window_prompt_groups", partition="train", status="pending"): "64x9 10x30 64x200"},
        "19m",
        "25m",
        "45m",
        "critical",
        "The TransferQueue prefetch window stays under-filled after a resume.",
        "The live prefetch window of trainer-0:9842 has held 43.75% of its target for more than 10m within 2h of"
        " the last resume, below 90%, while the trainer keeps stepping: rollouts starve the trainer.",
    ),
    Case(
        "TQMonWarmupUnderSubmitted",
        {s("tqmon_resume_under_submitted_prompt_groups"): "12x240"},
        "0m",
        "5m",
        "130m",
        "warning",
        "The warmup after the last resume left the window short of useful work.",
        "The last start of trainer-0:9842 left 12 prompt groups of useful work missing right after warmup"
        " (T - (R - doomed + M)): the first steps after the resume wait for fresh rollouts.",
    ),
    Case(
        "TQMonWarmupOverSubmitted",
        {s("tqmon_resume_warmup_submitted_prompt_groups"): "104x240"},
        "0m",
        "5m",
        "130m",
        "warning",
        "The warmup after the last resume submitted more prompts than the window needed.",
        "The last warmup of trainer-0:9842 submitted 96 prompt groups more than max(0, T - R): the window is"
        " over-filled and its oldest prompts drift off-policy.",
    ),
    Case(
        "TQMonLegacyUnconditionalWarmup",
        stateset("tqmon_resume_warmup_state", "legacy_unconditional"),
        "0m",
        "5m",
        "130m",
        "warning",
        "The trainer resumed with verl 0.9.0's unconditional warmup.",
        "trainer-0:9842 resumed with the legacy verl 0.9.0 warmup, which submits num_warmup_batches whole batches"
        " on top of the restored prompt groups: the window grows by T on every resume.",
        {**TARGET_LABELS, "state": "legacy_unconditional"},
    ),
    Case(
        "TQMonWindowOverTarget",
        {s("tqmon_window_prompt_groups", partition="train", status="pending"): "64x9 160x60 64x170"},
        "39m",
        "40m",
        "75m",
        "warning",
        "The TransferQueue prefetch window stays over its target.",
        "The live prefetch window of trainer-0:9842 has held 200% of its target for more than 30m while the trainer"
        " keeps stepping: over-restored prompt groups are never trimmed and age off-policy.",
    ),
    Case(
        "TQMonDoomedRestoredGroupsHigh",
        {s("tqmon_resume_doomed_prompt_groups", reason="failure"): "30x240"},
        "0m",
        "5m",
        "130m",
        "warning",
        "Many restored prompt groups are evicted by the first sample after the resume.",
        "The first sample after the last start of trainer-0:9842 evicts doomed restored prompt groups worth"
        " 31.25% of the target window (threshold 25%); their work is lost and they are refilled a step late.",
    ),
    Case(
        "TQMonStaleRestoredGroups",
        {s("tqmon_resume_doomed_prompt_groups", reason="stale"): "3x240"},
        "0m",
        "5m",
        "130m",
        "info",
        "Restored prompt groups are too old for the off-policy threshold.",
        "3 finished prompt groups restored by trainer-0:9842 exceed max_off_policy_threshold at the first step"
        " after the resume and are evicted unused.",
        {**TARGET_LABELS, "reason": "stale"},
    ),
    Case(
        "TQMonOrphanTrajectoriesPilingUp",
        {s("tqmon_window_orphan_trajectories", partition="train"): "40x9 2400x50 40x180"},
        "39m",
        "40m",
        "65m",
        "warning",
        "Trajectory keys without a prompt key pile up in TransferQueue.",
        "trainer-0:9842 sees 2400 trajectory keys without a prompt key in partition train (threshold 1000):"
        " nothing clears them and every resume adds the last trained batch's.",
        {**TARGET_LABELS, "partition": "train"},
    ),
    Case(
        "TQMonSourceDown",
        {s("tqmon_source_up", source="tq"): "1x9 0x20 1x210"},
        "14m",
        "15m",
        "35m",
        "warning",
        "A tqmon source is down.",
        "Source tq of trainer-0:9842 has been down for more than 5m: its series are dropped and the verdicts rest"
        " on the other sources.",
        {**TARGET_LABELS, "source": "tq"},
    ),
    Case(
        "TQMonSourceStale",
        {s("tqmon_source_last_success_timestamp_seconds", source="tq"): "0+60x10 600x30 2520+60x200"},
        "25m",
        "30m",
        "45m",
        "warning",
        "A tqmon source has not succeeded for a long time.",
        "Source tq of trainer-0:9842 last succeeded 20m 0s ago (threshold 600s).",
        {**TARGET_LABELS, "source": "tq"},
    ),
    Case(
        "TQMonDown",
        {s("up"): "1x9 0x20 1x210"},
        "14m",
        "15m",
        "35m",
        "warning",
        "Prometheus cannot scrape tqmon.",
        "Prometheus has failed to scrape tqmon at trainer-0:9842 (job tqmon) for more than 5m: no window or resume"
        " alert can fire for this run.",
    ),
    Case(
        "TQMonAbsent",
        {s("up"): "1x9 stale _x29 1x200"},
        "24m",
        "25m",
        "45m",
        "warning",
        "No tqmon target is scraped.",
        "Prometheus has had no tqmon target of job tqmon for more than 15m: every other TQMon alert is blind.",
        {"job": "tqmon"},
        "https://grafana.example.com/d/tqmon-fleet?var-job=tqmon",
    ),
    Case(
        "TQMonTrainerStalled",
        {
            s("tqmon_trainer_global_step"): "40x4 41+1x15 56x40 57+1x180",
            s("tqmon_trainer_last_step_timestamp_seconds"): "-120x4 300+60x15 1200x40 3720+60x180",
        },
        "54m",
        "55m",
        "65m",
        "warning",
        "The trainer is alive but its global step does not advance.",
        "The trainer watched by trainer-0:9842 still reports but has been stuck at global step 56 for more than"
        " 30m: rollouts are not completing.",
    ),
    Case(
        "TQMonResumeSourcesDisagree",
        {s("tqmon_resume_source_disagreements", quantity="restored"): "0x2 1x238"},
        "2m",
        "5m",
        "130m",
        "warning",
        "tqmon's sources contradict each other about the last resume.",
        "trainer-0:9842 heard restored of the last start differently from its sources (1 disagreement(s)), beyond"
        " a poll during mutation: one of them is wrong (a trainer bug, another checkpoint than tqmon thinks, or a"
        " config tqmon was not told).",
        {**TARGET_LABELS, "quantity": "restored"},
    ),
    Case(
        "TQMonResumeLostWindow",
        stateset("tqmon_resume_warmup_state", "lost_window"),
        "0m",
        "5m",
        "130m",
        "warning",
        "The last resume lost its TransferQueue window.",
        "trainer-0:9842 resumed from a checkpoint without transfer_queue/: the saved prefetch window"
        " (tqmon_resume_lost_prompt_groups) was not restored and the warmup regenerated it from scratch.",
        {**TARGET_LABELS, "state": "lost_window"},
    ),
    Case(
        "TQMonResumeStepRegression",
        {
            **{s("tqmon_resume_step_regression_steps", reason=r): "0x240" for r in RegressionReason},
            s("tqmon_resume_step_regression_steps", reason="latest_file_missing"): "0x2 45x238",
        },
        "2m",
        "5m",
        "130m",
        "warning",
        "The last start went back in steps, or counted a step twice.",
        "The last start of trainer-0:9842 went back 45 step(s) (latest_file_missing): it began older than a"
        " checkpoint already saved, or logged a step again; /api/v1/status names both steps.",
        {**TARGET_LABELS, "reason": "latest_file_missing"},
    ),
]


def run_promtool_test(tmp_path: Path, name: str, series: dict[str, str], **tests: list[dict[str, Any]]) -> None:
    document = {
        "rule_files": [str(repo_root() / RULES_FILE)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                **tests,
            }
        ],
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    result = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def alert_names() -> list[str]:
    return [alert.name for alert in rules.alerts(rules.RuleConfig())]


def test_rules_file_matches_the_code() -> None:
    assert (repo_root() / RULES_FILE).read_text() == rules.render(), (
        "deploy/prometheus/tqmon-rules.yml drifted: run `make docs`"
    )


def check_rules(path: Path) -> str:
    """``promtool check rules`` on a rules file, which must pass; its report."""
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_promtool_check_rules_is_clean() -> None:
    recording = len(rules.recording_rules(rules.RuleConfig()))
    assert f"SUCCESS: {recording + len(alert_names())} rules found" in check_rules(repo_root() / RULES_FILE)


def test_rules_name_only_catalog_metrics_and_keep_counters_in_rate() -> None:
    config = rules.RuleConfig()
    recorded = [rule["record"] for rule in rules.recording_rules(config)]
    known = dashlint.known_metrics(recorded)
    exprs = [rule["expr"] for rule in rules.recording_rules(config)] + [a.expr for a in rules.alerts(config)]
    findings = [f for expr in exprs for f in dashlint.query_findings("rules", expr, known, rate_interval=False)]
    assert findings == []
    named = {sel.metric for expr in exprs for sel in dashlint.scan(expr).selectors}
    assert {"up", "tqmon_window_prompt_groups", "tqmon_trainer_global_step", rules.FILL_RATIO} <= named


def test_alerts_follow_mixin_conventions() -> None:
    for rule in (r for r in rules.rule_groups()["groups"][0]["rules"] if "alert" in r):
        assert rule["alert"].startswith("TQMon") and rule["alert"].isalnum()
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        annotations = rule["annotations"]
        assert "{{" not in annotations["summary"], "summary must be static"
        assert "{{ $labels." in annotations["description"]
        assert annotations["runbook_url"] == f"{RUNBOOK}{rule['alert']}.md"
        assert annotations["dashboard_url"].startswith("https://grafana.example.com/d/")
    group = rules.rule_groups()["groups"][0]["rules"]
    recorded = [rule for rule in group if "record" in rule]
    assert recorded and all(rule["record"].count(":") == 2 for rule in recorded)
    assert group[: len(recorded)] == recorded  # before the alerts that read them, in the same group


def test_config_parameters_reach_the_rules() -> None:
    config = rules.RuleConfig(
        selector='job="trainer-sidecar"', fill_ratio_threshold=0.5, under_filled_for="3m", grafana_url="http://g"
    )
    text = rules.render(config)
    assert 'job="tqmon"' not in text
    assert text.count('job="trainer-sidecar"') > len(alert_names())
    under = next(a for a in rules.alerts(config) if a.name == "TQMonWindowUnderFilledAfterResume")
    assert under.expr.startswith(f"{rules.FILL_RATIO} < 0.5\n") and under.duration == "3m"
    assert "below 50%" in under.description
    assert "http://g/d/tqmon-resume?" in text


def test_shortened_rules_are_the_committed_rules_with_every_for_divided(tmp_path: Path) -> None:
    """The demo's rules (``tqmon demo``): the committed production file with every ``for:`` divided by the factor,
    the descriptions naming the shorter one, and nothing else changed."""
    production = yaml.safe_load((repo_root() / RULES_FILE).read_text())["groups"][0]["rules"]
    demo = rules.rule_groups(rules.shortened(rules.RuleConfig(), 30))["groups"][0]["rules"]
    assert len(demo) == len(production)
    for long, short in zip(production, demo, strict=True):
        if "alert" not in long:
            assert short == long
            continue
        assert rules.duration_seconds(short["for"]) * 30 == rules.duration_seconds(long["for"]), long["alert"]
        assert {k: v for k, v in short.items() if k not in ("for", "annotations")} == {
            k: v for k, v in long.items() if k not in ("for", "annotations")
        }
        description = long["annotations"]["description"].replace(long["for"], short["for"])
        assert short["annotations"] == {**long["annotations"], "description": description}
    durations = {rule["alert"]: rule["for"] for rule in demo if "alert" in rule}
    assert durations["TQMonWindowUnderFilledAfterResume"] == "20s"  # 10m
    assert durations["TQMonWarmupUnderSubmitted"] == "2s"  # 1m
    assert durations["TQMonWindowOverTarget"] == "1m"  # 30m
    demo_file = tmp_path / "demo-rules.yml"
    demo_file.write_text(rules.render(rules.shortened(rules.RuleConfig(), 30)))
    check_rules(demo_file)
    assert rules.shortened(rules.RuleConfig(), 1) == rules.RuleConfig()
    with pytest.raises(ValueError, match="factor must be at least 1"):
        rules.shortened(rules.RuleConfig(), 0)


@pytest.mark.parametrize(
    ("duration", "seconds"), [("10m", 600), ("1h30m", 5400), ("250ms", 0.25), ("1d", 86400), ("90s", 90)]
)
def test_duration_seconds(duration: str, seconds: float) -> None:
    assert rules.duration_seconds(duration) == seconds


def test_duration_seconds_refuses_what_prometheus_would() -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration: '10 minutes'"):
        rules.duration_seconds("10 minutes")


def test_each_alert_declares_its_condition_over_a_snapshot_or_why_only_prometheus_can_tell() -> None:
    """The status page evaluates every alert but the two on Prometheus's own scrape health; a declaration without
    either, or with both, is refused."""
    declared = rules.alerts(rules.RuleConfig())
    assert {a.name: a.prometheus_only for a in declared if a.check is None} == {
        "TQMonDown": "Prometheus's own scrape health (up == 0)",
        "TQMonAbsent": "Prometheus's own target list (absent(up))",
    }
    for check, why in ((None, ""), (declared[0].check, "both")):
        with pytest.raises(ValueError, match="TQMonX: give either its condition in Python or why only Prometheus"):
            rules.Alert("TQMonX", "up == 0", "5m", "warning", "summary", "description", check, why)


def test_a_metric_missing_from_the_catalog_is_refused() -> None:
    with pytest.raises(KeyError, match="tqmon_no_such_metric"):
        rules._Selectors(rules.RuleConfig())("tqmon_no_such_metric")


def test_every_alert_has_a_case_and_a_runbook() -> None:
    assert sorted(case.alert for case in CASES) == sorted(alert_names())
    assert sorted(path.stem for path in RUNBOOKS.glob("*.md")) == sorted(alert_names())
    for name in alert_names():
        text = (RUNBOOKS / f"{name}.md").read_text()
        assert text.startswith(f"# {name}\n")
        for section in ("## Meaning", "## First queries", "## Likely causes", "## What to do"):
            assert section in text, f"{name}.md lacks {section}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.alert)
def test_alert_fires_on_its_fault_and_resolves(tmp_path: Path, case: Case) -> None:
    fired = {
        "exp_labels": {"alertname": case.alert, "severity": case.severity, **case.labels},
        "exp_annotations": {
            "summary": case.summary,
            "description": case.description,
            "runbook_url": f"{RUNBOOK}{case.alert}.md",
            "dashboard_url": case.dashboard,
        },
    }
    run_promtool_test(
        tmp_path,
        case.alert,
        healthy() | case.faults,
        alert_rule_test=[
            {"eval_time": case.quiet, "alertname": case.alert, "exp_alerts": []},
            {"eval_time": case.fires, "alertname": case.alert, "exp_alerts": [fired]},
            {"eval_time": case.resolved, "alertname": case.alert, "exp_alerts": []},
        ],
        # ALERTS is what the silent scenarios below read: show it carries a firing alert.
        promql_expr_test=[
            {
                "expr": f'count(ALERTS{{alertname="{case.alert}",alertstate="firing"}})',
                "eval_time": case.fires,
                "exp_samples": [{"labels": "{}", "value": 1}],
            }
        ],
    )


def test_a_quantity_is_silent_until_compared_and_its_alert_resolves_when_it_falls_back(tmp_path: Path) -> None:
    """K is absent (one report, no verdict) until a second source reports it at 3m and contradicts the first;
    the contradiction is gone at 14m, and the series falls back to 0 rather than vanishing: the alert fires
    on the count and resolves on a value. A quantity never compared stays absent and silent."""
    case = next(case for case in CASES if case.alert == "TQMonResumeSourcesDisagree")
    reissued = s("tqmon_resume_source_disagreements", quantity="reissued")
    fired = {
        "exp_labels": {"alertname": case.alert, "severity": case.severity, **TARGET_LABELS, "quantity": "reissued"},
        "exp_annotations": {
            "summary": case.summary,
            "description": case.description.replace("heard restored", "heard reissued"),
            "runbook_url": f"{RUNBOOK}{case.alert}.md",
            "dashboard_url": case.dashboard,
        },
    }
    run_promtool_test(
        tmp_path,
        "absent-until-compared",
        healthy() | {reissued: "_x3 1x10 0x226"},
        alert_rule_test=[
            {"eval_time": "2m", "alertname": case.alert, "exp_alerts": []},
            {"eval_time": "5m", "alertname": case.alert, "exp_alerts": [fired]},
            {"eval_time": "13m", "alertname": case.alert, "exp_alerts": [fired]},
            {"eval_time": "14m", "alertname": case.alert, "exp_alerts": []},
        ],
        promql_expr_test=[
            {"expr": reissued, "eval_time": "2m", "exp_samples": []},
            {"expr": reissued, "eval_time": "20m", "exp_samples": [{"labels": reissued, "value": 0}]},
            {
                "expr": s("tqmon_resume_source_disagreements", quantity="restored_pending"),
                "eval_time": "20m",
                "exp_samples": [],
            },
        ],
    )


@pytest.mark.parametrize(
    ("scenario", "minutes"),
    [(healthy, 240), (warmup, 60), (idle, 240)],
    ids=["healthy-resume", "during-warmup", "idle-run"],
)
def test_no_alert_fires(tmp_path: Path, scenario: Any, minutes: int) -> None:
    run_promtool_test(
        tmp_path,
        scenario.__name__,
        scenario(),
        promql_expr_test=[
            {"expr": 'ALERTS{alertstate="firing"}', "eval_time": f"{t}m", "exp_samples": []}
            for t in range(0, minutes, 5)
        ],
    )


def test_tqmon_rules_command_takes_every_parameter_as_a_flag_or_variable(tmp_path: Path) -> None:
    runner = CliRunner()
    default = runner.invoke(main, ["rules"], catch_exceptions=False)
    assert default.exit_code == 0 and default.output == (repo_root() / RULES_FILE).read_text()

    out = tmp_path / "rules.yml"
    args = ["rules", "--selector", 'job="grpo-7b"', "--under-filled-for", "20m", "-o", str(out)]
    custom = runner.invoke(main, args, env={"TQMON_RULES_FILL_RATIO_THRESHOLD": "0.75"}, catch_exceptions=False)
    assert custom.exit_code == 0, custom.output
    groups = yaml.safe_load(out.read_text())["groups"]
    headline = next(r for r in groups[0]["rules"] if r.get("alert") == "TQMonWindowUnderFilledAfterResume")
    assert headline["for"] == "20m"
    assert '{job="grpo-7b"}' in headline["expr"] and "< 0.75" in headline["expr"]
    assert 'job="tqmon"' not in out.read_text()
    recording = len(rules.recording_rules(rules.RuleConfig()))
    assert f"SUCCESS: {recording + len(alert_names())} rules found" in check_rules(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--under-filled-for", "15x"], "under_filled_for must be a Prometheus duration like 10m or 1h30m"),
        (["--orphan-threshold", "-1"], "orphan_threshold must not be negative"),
    ],
)
def test_tqmon_rules_refuses_a_parameter_that_cannot_work(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["rules", *args])
    assert result.exit_code == 2 and message in result.output
