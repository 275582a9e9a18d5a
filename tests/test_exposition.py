"""Exposition from a fixed snapshot: golden output, catalog consistency, docs drift, promtool."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from mixin import docs
from mixin.repo import repo_root
from tqmon.catalog import BY_NAME, CATALOG, MetricType, Stability
from tqmon.cost import ResumeCost
from tqmon.exporters.prometheus import build_registry, render
from tqmon.snapshot import (
    CheckpointView,
    Claim,
    Disagreement,
    Evidence,
    OTLPView,
    RegressionReason,
    ResumeRecord,
    RunInfo,
    SelfHeal,
    Snapshot,
    SourceHealth,
    StateHealth,
    StepRegression,
    Tally,
    TQPollView,
    WarmupOutcome,
    WindowView,
)
from tqmon.warmup import WarmupState

GOLDEN = Path(__file__).parent / "golden"
NOW = 1_800_000_000.0
UPDATE = os.environ.get("TQMON_UPDATE_GOLDEN") == "1"


def full_snapshot(now: float = NOW) -> Snapshot:
    """Every catalog metric has something to say: a resume from step 40 with doomed groups."""
    record = ResumeRecord(
        index=1,
        resumed=True,
        started_at=now - 120,
        run_id="run-7",
        checkpoint_step=40,
        restored=9,
        restored_by_status={"pending": 2, "running": 1, "finished": 4, "failure": 2},
        reissued=3,
        cleared_trajectories=5,
        target=12,
        expected=3,
        submitted=3,
        over_restored=0,
        doomed={"failure": 2, "stale": 1, "filtered": 0},
        under_submitted=3,
        warmup_state=WarmupState.TOPPED_UP,
        first_step_evictions={"failure": 2, "stale": 0, "filtered": 0},
        first_step_generation_wait_seconds=31.5,
        evidence=(Evidence("log", "checkpoint_restored", "log:1", now - 119, "restored_prompt_groups=9"),),
        disagreements=(Disagreement("reissued", (Claim("log", 3, now - 118), Claim("events", 2, now - 117)), "exact"),),
        compared=("restored", "reissued", "target", "submitted"),
        cost=ResumeCost(
            steps_lost=3,
            downtime_seconds=95.0,
            time_to_first_step_seconds=180.5,
            wasted_rollouts=24,
            lost_prompt_groups=0,
        ),
        step_regressions=(StepRegression(40, 45, RegressionReason.LATEST_FILE_STALE),),
        self_heal=SelfHeal(
            "dry-run", 12, 9, {"failure": 2, "stale": 1, "filtered": 0}, 3, 3, True, 12, 3, 0, "would submit 3", "e:1"
        ),
    )
    return Snapshot(
        built_at=now,
        version="0.1.0",
        stale_after=300.0,
        run=RunInfo("run-7", "colocate_async", "", {"train_batch_size": 4}, "events"),  # verl's version unreadable
        target_window=12,
        windows=(
            WindowView(
                "train",
                "tq",
                now - 1,
                {"pending": 3, "running": 2, "finished": 5, "failure": 0},
                trajectories=40,
                orphan_trajectories=4,
                age_buckets=((0.0, 3), (1.0, 6), (2.0, 9), (4.0, 10), (float("inf"), 10)),
                age_sum=11.0,
            ),
            WindowView("val", "tq", now - 1, {"pending": 0, "running": 0, "finished": 0, "failure": 0}, 0, 0),
            WindowView("train", "log", now - 1000, {"pending": 99}),  # stale: must not be exposed
        ),
        trainer_step=43,
        trainer_last_event=now - 5,
        trainer_stepped_at=now - 65,
        trainer_step_seconds=42.5,
        resumes_total=1,
        records_total=2,
        last_record=record,
        tq=TQPollView("ctrl-1", 2, 1.0, 0.004, 1234, now + 60),
        checkpoint=CheckpointView(
            45,
            "checkpoint",
            {"pending": 1, "running": 1, "finished": 9, "failure": 1},
            {"failure": 1},
            7,
            # the verl version is unknown: both warmups of R = 12, T = 12 (the stale reason unknown: a lower bound)
            outcomes=(
                WarmupOutcome("verl-0.9.1", 12, 0, WarmupState.SKIPPED_FULL, 0, 0, 1, True),
                WarmupOutcome("verl-0.9.0", 12, 12, WarmupState.LEGACY_UNCONDITIONAL, 0, 12, 0, True),
            ),
        ),
        sources=(
            SourceHealth("checkpoint", False, now - 20, 0.003, "controller_state.pkl: refused", 100.0),
            SourceHealth("events", True, now - 10, 0.001, None, None),
            SourceHealth("log", True, now - 1, 0.0002, None, 30.0),
            SourceHealth("tq", True, now - 400, 0.05, None, 60.0),  # stale: reads down
        ),
        counters={
            Tally.EVENTS: {("log", "applied"): 12, ("events", "duplicate"): 1},
            Tally.EVENTS_REJECTED: {("malformed_json",): 2},
            Tally.LOG_LINES: {("event",): 12, ("ignored",): 30, ("malformed",): 1},
            Tally.SOURCE_ERRORS: {("log", "malformed_line"): 1, ("tq", "timeout"): 3},
            Tally.PICKLE_REFUSALS: {("too_deep",): 1},
        },
        otlp=OTLPView({"metrics": 3, "logs": 1}, 2),
        state=StateHealth(False, "state dir /var/lib/tqmon not writable (no_space)", (("no_space", 3),)),
    )


def registry_for(snapshot: Snapshot) -> CollectorRegistry:
    return build_registry(lambda: snapshot, process_metrics=False, clock=lambda: NOW)


def _golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(actual)
    assert actual == path.read_text(), f"{name} drifted; rerun with TQMON_UPDATE_GOLDEN=1 and review the diff"


def test_golden_text_exposition() -> None:
    _golden("full.prom", generate_latest(registry_for(full_snapshot())).decode())


def test_golden_openmetrics_exposition() -> None:
    _golden("full.om", generate_openmetrics(registry_for(full_snapshot())).decode())


def test_every_catalog_entry_is_exposed_and_nothing_else() -> None:
    text = generate_latest(registry_for(full_snapshot())).decode()
    # The text format has no gaugehistogram type: its _gcount/_gsum parse as families of their own.
    families = {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith(("_gcount", "_gsum"))}
    exposed = {name + ("_total" if f.type == "counter" else "") for name, f in families.items()}
    assert exposed == set(BY_NAME)
    for name, family in families.items():
        spec = BY_NAME.get(name) or BY_NAME[name + "_total"]
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            assert set(labels) == set(spec.label_names), sample
            for label in spec.labels:
                if label.values is not None:
                    assert labels[label.name] in label.values, sample


def test_values_reflect_the_snapshot() -> None:
    text = generate_latest(registry_for(full_snapshot())).decode()
    assert "tqmon_resume_under_submitted_prompt_groups 3.0" in text
    assert 'tqmon_resume_warmup_state{state="topped_up"} 1.0' in text
    assert 'tqmon_resume_warmup_state{state="skipped_full"} 0.0' in text
    # The stale log window (pending=99) is dropped; the fresh TQ window is served.
    assert 'tqmon_window_prompt_groups{partition="train",status="pending"} 3.0' in text
    assert "99.0" not in text
    assert 'tqmon_window_status{status="under_filled"} 1.0' in text  # 10 live < 12 target
    assert 'tqmon_source_up{source="tq"} 0.0' in text  # last success 400 s ago, stale after 60
    assert 'tqmon_source_up{source="log"} 1.0' in text
    assert 'tqmon_events_rejected_total{reason="too_large"} 0.0' in text  # known-empty is 0
    # The verl version is unknown: it says so, and the checkpoint's warmup is predicted under both semantics.
    assert 'tqmon_verl_version_info{semantics="unknown",source="unknown",verl_version=""} 1.0' in text
    assert 'tqmon_checkpoint_warmup_submitted_prompt_groups{semantics="verl-0.9.1"} 0.0' in text
    assert 'tqmon_checkpoint_warmup_submitted_prompt_groups{semantics="verl-0.9.0"} 12.0' in text
    assert 'tqmon_checkpoint_over_filled_prompt_groups{semantics="verl-0.9.0"} 12.0' in text
    assert 'tqmon_checkpoint_under_submitted_prompt_groups{semantics="verl-0.9.1"} 1.0' in text


def test_unknown_values_are_omitted_not_zero() -> None:
    empty = Snapshot(
        built_at=NOW,
        version="0.1.0",
        stale_after=300.0,
        run=None,
        target_window=None,
        windows=(),
        trainer_step=None,
        trainer_last_event=None,
        trainer_stepped_at=None,
        trainer_step_seconds=None,
        resumes_total=0,
        records_total=0,
        last_record=None,
        checkpoint=None,
        tq=None,
        sources=(),
        counters={},
    )
    names = {f.name for f in text_string_to_metric_families(generate_latest(registry_for(empty)).decode())}
    assert names == {
        "tqmon_window_status",
        "tqmon_plugin_window_state",  # unobserved: no plugin and no --ray-address is a known state
        "tqmon_resumes",
        "tqmon_build_info",
        "tqmon_verl_version_info",  # unknown, and says so
        "tqmon_events_rejected",
        "tqmon_state_writable",
        "tqmon_state_write_failures",
    }


def test_a_bare_total_is_exported_as_status_unknown_only() -> None:
    snapshot = full_snapshot()
    assert snapshot.last_record is not None
    bare = replace(snapshot, last_record=replace(snapshot.last_record, restored_by_status={"unknown": 9}))
    text = generate_latest(registry_for(bare)).decode()
    lines = [line for line in text.splitlines() if line.startswith("tqmon_resume_restored_prompt_groups{")]
    assert lines == ['tqmon_resume_restored_prompt_groups{status="unknown"} 9.0']


def test_a_disagreement_series_exists_only_for_a_quantity_that_was_compared() -> None:
    """0 says two claims agreed; a quantity fewer than two claims were given for has no verdict, and no series."""
    snapshot = full_snapshot()
    assert snapshot.last_record is not None
    texts = {}
    for compared in (("target", "checkpoint_window"), ()):
        record = replace(snapshot.last_record, compared=compared, disagreements=())
        texts[compared] = generate_latest(registry_for(replace(snapshot, last_record=record))).decode()
    samples = [
        line
        for line in texts[("target", "checkpoint_window")].splitlines()
        if line.startswith("tqmon_resume_source_disagreements")
    ]
    assert samples == [
        'tqmon_resume_source_disagreements{quantity="target"} 0.0',
        'tqmon_resume_source_disagreements{quantity="checkpoint_window"} 0.0',
    ]
    assert "tqmon_resume_source_disagreements" not in texts[()]  # nothing compared: not even the family


def test_content_negotiation() -> None:
    registry = registry_for(full_snapshot())
    body, content_type = render(registry, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    body, content_type = render(registry, "text/plain")
    assert content_type.startswith("text/plain; version=0.0.4") and b"# EOF" not in body


def test_collect_reads_the_current_snapshot_on_every_scrape() -> None:
    current = [full_snapshot()]
    registry = build_registry(lambda: current[0], process_metrics=False, clock=lambda: NOW)
    assert b"tqmon_trainer_global_step 43.0" in generate_latest(registry)
    current[0] = replace(current[0], trainer_step=44)
    assert b"tqmon_trainer_global_step 44.0" in generate_latest(registry)


def test_metrics_doc_matches_the_catalog() -> None:
    assert (repo_root() / docs.METRICS_DOC).read_text() == docs.render(), "docs/metrics.md drifted: run `make docs`"
    catalog_table = docs.render().split("\n## ")[0]  # the OTLP mapping's tables follow
    rows = {line.split(" | ")[0].strip("| `"): line for line in catalog_table.splitlines() if line.startswith("| `")}
    assert set(rows) == {spec.name for spec in CATALOG}
    for spec in CATALOG:
        assert f" | {spec.stability.value} | " in rows[spec.name], spec.name
    assert BY_NAME["tqmon_tq_controller_busy_ratio"].stability is Stability.EXPERIMENTAL
    assert BY_NAME["tqmon_resume_under_submitted_prompt_groups"].stability is Stability.STABLE


def test_the_collector_describes_the_catalog_so_a_colliding_metric_is_refused() -> None:
    registry = build_registry(full_snapshot, process_metrics=False, clock=lambda: NOW)
    for name in ("tqmon_window_prompt_groups", "tqmon_resumes"):  # a counter's family name is without _total
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            Gauge(name, "a second metric of the same name", registry=registry)
    Gauge("tqmon_something_else", "no collision", registry=registry)


def test_catalog_names_follow_conventions() -> None:
    for spec in CATALOG:
        assert spec.name.startswith("tqmon_")
        assert (spec.type is MetricType.COUNTER) == spec.name.endswith("_total"), spec.name
        assert (spec.type is MetricType.INFO) == spec.name.endswith("_info"), spec.name
        if spec.unit:
            assert spec.name.removesuffix("_total").endswith("_" + spec.unit), spec.name
        assert spec.help.endswith("."), spec.name
        assert "run_id" not in spec.label_names or spec.type is MetricType.INFO


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run `make test`, which installs Debian's prometheus")
    return path


def test_promtool_check_metrics_is_clean() -> None:
    text = generate_latest(registry_for(full_snapshot()))
    result = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == b"" and result.stderr.strip() == b"", result.stdout + result.stderr
