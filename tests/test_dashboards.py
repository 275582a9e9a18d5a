"""The shipped Grafana dashboards: drift, schema-ish shape, the Python lint (clean on what ships, and each
rule catching a deliberately broken panel) and the provisioning files."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from mixin import dashboards, dashlint
from mixin.repo import repo_root
from tqmon import rules
from tqmon.catalog import CATALOG, MetricType

GRAFANA = Path(__file__).resolve().parent.parent / "grafana"


def known() -> frozenset[str]:
    return dashlint.known_metrics(rule["record"] for rule in rules.recording_rules(rules.RuleConfig()))


def shipped(name: str) -> dict[str, Any]:
    return dashboards.load((repo_root() / dashboards.DASHBOARD_DIR / name).read_text())


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [expr for _, expr in dashlint.queries(dashboard)]


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_dashboard_file_matches_the_code(name: str) -> None:
    assert (repo_root() / dashboards.DASHBOARD_DIR / name).read_text() == dashboards.rendered()[name], (
        f"{name} drifted: make docs"
    )


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_shipped_dashboard_passes_the_lint(name: str) -> None:
    assert [str(f) for f in dashlint.lint(shipped(name), known())] == []


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_dashboard_shape(name: str) -> None:
    dashboard = shipped(name)
    assert dashboard["uid"] in {rules.RESUME_DASHBOARD_UID, rules.FLEET_DASHBOARD_UID}
    assert dashboard["title"] and dashboard["schemaVersion"] >= 39 and dashboard["panels"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "run"]
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name_ in ("job", "instance", "run"):
        variable = variables[name_]
        assert variable["refresh"] == 2, "refresh on time range change"
        assert variable["query"].startswith("query_result(") and "last_over_time(" in variable["query"]
        assert "[$__range]" in variable["query"], "ended runs stay selectable over the dashboard's range"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0


def test_resume_dashboard_shows_the_resume_numbers_and_annotations() -> None:
    dashboard = shipped("tqmon-resume.json")
    named = {sel.metric for expr in exprs(dashboard) for sel in dashlint.scan(expr).selectors}
    assert {
        rules.RESTORED_TOTAL,
        "tqmon_resume_warmup_target_prompt_groups",
        "tqmon_resume_warmup_expected_prompt_groups",
        "tqmon_resume_warmup_submitted_prompt_groups",
        "tqmon_resume_over_restored_prompt_groups",
        "tqmon_resume_doomed_prompt_groups",
        "tqmon_resume_under_submitted_prompt_groups",
        "tqmon_resume_warmup_state",
        "tqmon_window_prompt_groups",
        "tqmon_window_target_prompt_groups",
        "tqmon_window_prompt_group_age_steps_bucket",
        "tqmon_window_orphan_trajectories",
        "tqmon_trainer_global_step",
        "tqmon_source_up",
        "tqmon_source_last_success_timestamp_seconds",
    } <= named
    annotations = {a["name"]: a["expr"] for a in dashboard["annotations"]["list"]}
    assert annotations["Resumes"].startswith("changes(tqmon_last_resume_timestamp_seconds{")
    window = next(p for p in dashboard["panels"] if p["title"] == "Window by status vs target")
    assert window["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    target_override = window["fieldConfig"]["overrides"][0]
    assert target_override["matcher"] == {"id": "byName", "options": "target"}
    assert {"id": "custom.stacking", "value": {"mode": "none"}} in target_override["properties"]


def test_fleet_dashboard_lists_runs_and_firing_alerts() -> None:
    dashboard = shipped("tqmon-fleet.json")
    runs = next(p for p in dashboard["panels"] if p["title"] == "Runs")
    assert runs["type"] == "table" and all(t["instant"] and t["format"] == "table" for t in runs["targets"])
    queries = [t["expr"] for t in runs["targets"]]
    assert queries[0].startswith(rules.FILL_RATIO + "{")
    assert any(q.startswith("tqmon_last_resume_timestamp_seconds{") for q in queries)
    assert any(q.startswith("tqmon_window_status{") for q in queries)
    assert any('ALERTS{alertname=~"TQMon.*",alertstate="firing"' in q for q in queries)
    assert [t["id"] for t in runs["transformations"]] == ["merge", "organize"]
    assert not any(t.get("disabled") for t in runs["transformations"])
    assert runs["transformations"][1]["options"]["renameByName"]["Value #A"] == "fill ratio"


def test_gaugehistograms_are_known_by_their_series_names_only() -> None:
    names = known()
    for spec in CATALOG:
        if spec.type is MetricType.GAUGEHISTOGRAM:
            assert spec.name not in names
            assert {spec.name + suffix for suffix in dashlint.GAUGEHISTOGRAM_SUFFIXES} <= names
        else:
            assert spec.name in names
    assert {"up", "ALERTS", rules.FILL_RATIO} <= names


def _first_stat(dashboard: dict[str, Any]) -> dict[str, Any]:
    panel: dict[str, Any] = next(p for p in dashboard["panels"] if p["type"] == "stat")
    return panel


def _set_expr(expr: str) -> Callable[[dict[str, Any]], None]:
    def mutate(dashboard: dict[str, Any]) -> None:
        _first_stat(dashboard)["targets"][0]["expr"] = expr

    return mutate


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(dashboard: dict[str, Any]) -> None:
        _first_stat(dashboard)[key] = value

    return mutate


def _drop_unit(dashboard: dict[str, Any]) -> None:
    del _first_stat(dashboard)["fieldConfig"]["defaults"]["unit"]


def _hardcode_target_datasource(dashboard: dict[str, Any]) -> None:
    _first_stat(dashboard)["targets"][0]["datasource"] = {"type": "prometheus", "uid": "prometheus"}


def _hardcode_annotation_datasource(dashboard: dict[str, Any]) -> None:
    dashboard["annotations"]["list"][0]["datasource"] = {"type": "prometheus", "uid": "prometheus"}


def _duplicate_id(dashboard: dict[str, Any]) -> None:
    dashboard["panels"][2]["id"] = dashboard["panels"][1]["id"]


BROKEN = {
    "panel-title": _set("title", ""),
    "panel-description": _set("description", ""),
    "panel-unit": _drop_unit,
    "panel-datasource": _set("datasource", {"type": "prometheus", "uid": "prometheus"}),
    "target-datasource": _hardcode_target_datasource,
    "annotation-datasource": _hardcode_annotation_datasource,
    "panel-id": _duplicate_id,
    "rate-interval": _set_expr('sum(rate(tqmon_source_errors_total{job=~"$job"}[5m]))'),
    "counter-outside-rate": _set_expr('sum(tqmon_source_errors_total{job=~"$job"})'),
    "unknown-metric": _set_expr('tqmon_no_such_metric{job=~"$job"}'),
    "promql-parse": _set_expr('sum(tqmon_source_up{job=~"$job"}'),
}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_lint_catches_a_broken_panel(rule: str) -> None:
    dashboard = copy.deepcopy(shipped("tqmon-resume.json"))
    BROKEN[rule](dashboard)
    findings = dashlint.lint(dashboard, known())
    assert [f.rule for f in findings] == [rule], [str(f) for f in findings]


def test_lint_reads_variable_queries_and_grafana_variables() -> None:
    assert dashlint.promql_of_variable('query_result(count by (job) (up{a="b"}))') == 'count by (job) (up{a="b"})'
    assert dashlint.promql_of_variable('label_values(tqmon_build_info{job="x"}, instance)') == (
        'tqmon_build_info{job="x"}'
    )
    assert dashlint.promql_of_variable("label_values(job)") is None
    assert dashlint.for_promtool('rate(x{a=~"$job",b="${run}"}[$__rate_interval])') == 'rate(x{a=~"x",b="x"}[5m])'
    # A variable outside a string is left unparsable, as Grafana would send it.
    assert dashlint.promtool_findings({"q": "x[$window]"})[0].rule == "promql-parse"


def test_provisioning_files() -> None:
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tqmon.yml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]
    assert (
        json.loads((repo_root() / dashboards.DASHBOARD_DIR / "tqmon-fleet.json").read_text())["uid"]
        == rules.FLEET_DASHBOARD_UID
    )
