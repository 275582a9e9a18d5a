"""The Grafana dashboards, built with grafana-foundation-sdk (Grafana 11.6 schema).

``python -m mixin.dashboards`` writes ``grafana/dashboards/tqmon-resume.json`` (one run: health, the last
resume's numbers, the live window against its target) and ``grafana/dashboards/tqmon-fleet.json`` (every
run in one table). Both are committed, drift-checked and linted by ``mixin.dashlint`` in the tests.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Protocol, Self, TypeVar

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import (
    dashboard,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    ValueMap,
    ValueMapping,
    ValueMappingResult,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from mixin.repo import write
from tqmon.rules import (
    DOOMED_TOTAL,
    FILL_RATIO,
    FLEET_DASHBOARD_UID,
    RESTORED_TOTAL,
    RESUME_DASHBOARD_UID,
    USEFUL_AFTER_WARMUP,
    WINDOW_DEFICIT,
)

DASHBOARD_DIR = "grafana/dashboards"
DATASOURCE_UID = "${datasource}"  # every panel and target uses the dashboard's datasource variable
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
SEL = 'job=~"$job",instance=~"$instance"'
TAGS = ["tqmon", "verl", "transferqueue"]


class _Panel(Protocol):
    """What every panel builder of the SDK offers; the helpers below set it the same way on all of them."""

    def title(self, title: str) -> Self: ...
    def description(self, description: str) -> Self: ...
    def unit(self, unit: str) -> Self: ...
    def datasource(self, datasource: DataSourceRef) -> Self: ...
    def span(self, w: int) -> Self: ...
    def height(self, h: int) -> Self: ...
    def with_target(self, target: prometheus.Dataquery) -> Self: ...


P = TypeVar("P", bound=_Panel)


def query(expr: str, legend: str = "", *, instant: bool = False, table_format: bool = False) -> prometheus.Dataquery:
    target = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        target = target.legend_format(legend)
    if instant:
        target = target.instant()
    if table_format:
        target = target.format(PromQueryFormat.TABLE)
    return target


def panel(builder: P, title: str, description: str, unit: str, *targets: prometheus.Dataquery, span: int = 6) -> P:
    """Title, description, unit, the datasource variable and the queries (ref ids A, B, … in order)."""
    built = builder.title(title).description(description).unit(unit).datasource(DATASOURCE).span(span).height(6)
    for ref, target in zip("ABCDEFGHIJ", targets, strict=False):
        built = built.with_target(target.ref_id(ref))
    return built


def _stat(title: str, description: str, unit: str, *targets: prometheus.Dataquery, span: int = 4) -> stat.Panel:
    return panel(stat.Panel().graph_mode(common.BigValueGraphMode.NONE), title, description, unit, *targets, span=span)


def _state(title: str, description: str, *targets: prometheus.Dataquery, span: int = 6) -> stat.Panel:
    """The state whose 0/1 series is 1, shown by name (statesets export one series per state)."""
    builder = stat.Panel().graph_mode(common.BigValueGraphMode.NONE).text_mode(common.BigValueTextMode.NAME)
    return panel(builder, title, description, "none", *targets, span=span)


def _variable(name: str, label: str, expr: str, capture: str, *, multi: bool) -> dashboard.QueryVariable:
    """A query variable over the dashboard's time range, so ended runs stay selectable."""
    variable = (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"query_result({expr})")
        .regex(f'/{capture}="([^"]*)"/')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(multi)
        .include_all(multi)
    )
    return variable.all_value(".*")


def _variables(*, multi: bool) -> list[dashboard.DatasourceVariable | dashboard.QueryVariable]:
    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        _variable("job", "Job", "count by (job) (last_over_time(tqmon_build_info[$__range]))", "job", multi=multi),
        _variable(
            "instance",
            "Instance",
            'count by (instance) (last_over_time(tqmon_build_info{job=~"$job"}[$__range]))',
            "instance",
            multi=multi,
        ),
        _variable(
            "run",
            "Run",
            f"count by (run_id) (last_over_time(tqmon_run_info{{{SEL}}}[$__range]))",
            "run_id",
            multi=True,
        ),
    ]


def _base(uid: str, title: str, description: str, *, multi: bool) -> dashboard.Dashboard:
    builder = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .readonly()
    )
    for variable in _variables(multi=multi):
        builder = builder.with_variable(variable)
    alerts = f'ALERTS{{alertname=~"TQMon.*",alertstate="firing",{SEL}}}'
    builder = builder.annotation(_lost_windows())
    return builder.annotation(
        dashboard.AnnotationQuery()
        .name("Resumes")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("blue")
        .expr(f"changes(tqmon_last_resume_timestamp_seconds{{{SEL}}}[2m]) > 0")
    ).annotation(
        dashboard.AnnotationQuery()
        .name("TQMon alerts")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("red")
        .expr(alerts)
    )


def _lost_windows() -> dashboard.AnnotationQuery:
    """Marks the starts whose checkpoint held no transfer_queue/ (see the TQMonResumeLostWindow runbook)."""
    lost = f'tqmon_resume_warmup_state{{state="lost_window",{SEL}}} == 1'
    started = f"changes(tqmon_last_resume_timestamp_seconds{{{SEL}}}[2m]) > 0"
    return (
        dashboard.AnnotationQuery()
        .name("Lost windows")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("orange")
        .expr(f"{lost} and ignoring (state) {started}")
    )


def _up_down() -> list[ValueMapping]:
    down, up = ValueMappingResult(text="down", color="red"), ValueMappingResult(text="up", color="green")
    return [ValueMap({"0": down, "1": up})]


def _health_row(builder: dashboard.Dashboard) -> dashboard.Dashboard:
    return (
        builder.with_row(dashboard.Row("Health"))
        .with_panel(
            _stat(
                "Scrape",
                "Prometheus's `up` for this tqmon: 0 means no other panel is current.",
                "none",
                query(f"up{{{SEL}}}", "{{instance}}"),
                span=3,
            ).mappings(_up_down())
        )
        .with_panel(
            _stat(
                "Sources up",
                "`tqmon_source_up` per source: a down source has its data series dropped, never served frozen.",
                "none",
                query(f"tqmon_source_up{{{SEL}}}", "{{source}}"),
                span=6,
            ).mappings(_up_down())
        )
        .with_panel(
            _stat(
                "Source last success",
                "How long ago each source last succeeded (push sources only succeed when the trainer posts).",
                "s",
                query(f"time() - tqmon_source_last_success_timestamp_seconds{{{SEL}}}", "{{source}}"),
                span=6,
            )
        )
        .with_panel(
            _state(
                "Run",
                "Identity of the monitored run from `tqmon_run_info`: run id, trainer mode and verl version.",
                query(f'tqmon_run_info{{{SEL},run_id=~"$run"}}', "{{run_id}} {{trainer_mode}} verl {{verl_version}}"),
                span=9,
            )
        )
    )


def _resume_row(builder: dashboard.Dashboard) -> dashboard.Dashboard:
    groups = "short"
    return (
        builder.with_row(dashboard.Row("Last resume"))
        .with_panel(
            _stat(
                "Resumed at",
                "When the last start (resume or fresh start) was first observed.",
                "dateTimeFromNow",
                query(f"tqmon_last_resume_timestamp_seconds{{{SEL}}} * 1000"),
                span=4,
            )
        )
        .with_panel(
            _stat(
                "From checkpoint step",
                "Checkpoint step N the last start resumed from (0 for a fresh start).",
                "none",
                query(f"tqmon_last_resume_checkpoint_step{{{SEL}}}"),
                span=4,
            )
        )
        .with_panel(
            _stat(
                "Restored R / target T",
                "R: prompt groups restored from TransferQueue; T: the target window in force at the start.",
                groups,
                query(f"{RESTORED_TOTAL}{{{SEL}}}", "R restored"),
                query(f"tqmon_resume_warmup_target_prompt_groups{{{SEL}}}", "T target"),
                span=8,
            )
        )
        .with_panel(
            _state(
                "Warmup decision",
                "What the warmup did: topped_up, skipped_full, skipped_over_restored, disabled, legacy_unconditional,"
                " lost_window…",
                query(f"tqmon_resume_warmup_state{{{SEL}}} == 1", "{{state}}"),
                span=8,
            )
        )
        .with_panel(
            _stat(
                "Warmup M expected vs submitted",
                "Expected: max(0, T - R) as verl 0.9.1 computes it; submitted: what the trainer actually added.",
                groups,
                query(f"tqmon_resume_warmup_expected_prompt_groups{{{SEL}}}", "expected"),
                query(f"tqmon_resume_warmup_submitted_prompt_groups{{{SEL}}}", "submitted"),
                span=6,
            )
        )
        .with_panel(
            _stat(
                "Over-restored O",
                "max(0, R - T): restored prompt groups beyond the target, kept and never trimmed.",
                groups,
                query(f"tqmon_resume_over_restored_prompt_groups{{{SEL}}}"),
                span=3,
            )
        )
        .with_panel(
            _stat(
                "Doomed by reason",
                "Restored groups the first sample after the start evicts: failure, stale (off-policy) or filtered.",
                groups,
                query(f"tqmon_resume_doomed_prompt_groups{{{SEL}}}", "{{reason}}"),
                query(f"{DOOMED_TOTAL}{{{SEL}}}", "total"),
                span=7,
            )
        )
        .with_panel(
            _stat(
                "Useful after warmup / deficit",
                "R - doomed + M right after warmup, and the under-submission T - (R - doomed + M) when positive.",
                groups,
                query(f"{USEFUL_AFTER_WARMUP}{{{SEL}}}", "useful"),
                query(f"tqmon_resume_under_submitted_prompt_groups{{{SEL}}}", "deficit"),
                span=8,
            )
        )
        .with_panel(
            _stat(
                "Sources that disagree",
                "Quantities of the last start that two sources reported differently (log, plugin, checkpoint,"
                " config, live window); /api/v1/status names them. Total 0: every comparison agreed; no data:"
                " nothing compared yet. See the TQMonResumeSourcesDisagree runbook.",
                "none",
                query(f"tqmon_resume_source_disagreements{{{SEL}}} > 0", "{{quantity}}"),
                query(f"sum without (quantity) (tqmon_resume_source_disagreements{{{SEL}}})", "total"),
                span=16,
            )
        )
        .with_panel(
            _stat(
                "Lost window",
                "Prompt groups the last resume lost because its checkpoint held no transfer_queue/ (0: its restore"
                " was reported; absent: unknown, or a fresh start).",
                groups,
                query(f"tqmon_resume_lost_prompt_groups{{{SEL}}}", "lost"),
                span=8,
            )
        )
    )


def _window_row(builder: dashboard.Dashboard) -> dashboard.Dashboard:
    stacked = common_builders.StackingConfig().mode(common.StackingMode.NORMAL)
    target_line = [
        DynamicConfigValue("custom.stacking", {"mode": "none"}),
        DynamicConfigValue("custom.fillOpacity", 0),
        DynamicConfigValue("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
        DynamicConfigValue("color", {"mode": "fixed", "fixedColor": "red"}),
    ]
    return (
        builder.with_row(dashboard.Row("Live window"))
        .with_panel(
            panel(
                timeseries.Panel().stacking(stacked).fill_opacity(40),
                "Window by status vs target",
                "Live training prompt groups in TransferQueue stacked by status, against the target window T"
                " (dashed). A dip between a step's sample and its refill is normal.",
                "short",
                query(f'tqmon_window_prompt_groups{{{SEL},partition="train"}}', "{{status}}"),
                query(f"tqmon_window_target_prompt_groups{{{SEL}}}", "target"),
                span=12,
            ).override_by_name("target", target_line)
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Fill ratio and deficit",
                "Live window over T (recording rule); the under-filled alert fires below its threshold while the"
                " trainer steps. Deficit: T minus the live window, floored at 0.",
                "percentunit",
                query(f"{FILL_RATIO}{{{SEL}}}", "fill ratio"),
                query(f"{WINDOW_DEFICIT}{{{SEL}}}", "deficit (groups)"),
                span=12,
            ).override_by_name("deficit (groups)", [DynamicConfigValue("unit", "short")])
        )
        .with_panel(
            panel(
                statetimeline.Panel(),
                "Window verdict",
                "`tqmon_window_status`: ok, under_filled, over_filled or unknown over time.",
                "none",
                query(f"tqmon_window_status{{{SEL}}} == 1", "{{status}}"),
                span=12,
            )
        )
        .with_panel(
            panel(
                heatmap.Panel().calculate(False),
                "Prompt group age",
                "Trainer step minus the tag global_steps of live training prompt groups (gaugehistogram buckets):"
                " old groups risk the off-policy threshold.",
                "short",
                query(f"sum by (le) (tqmon_window_prompt_group_age_steps_bucket{{{SEL}}})", "{{le}}").format(
                    PromQueryFormat.HEATMAP
                ),
                span=12,
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Mean prompt group age",
                "Mean age in trainer steps of the live training prompt groups (gsum / gcount).",
                "short",
                query(
                    f"tqmon_window_prompt_group_age_steps_gsum{{{SEL}}}"
                    f" / (tqmon_window_prompt_group_age_steps_gcount{{{SEL}}} > 0)",
                    "mean age",
                ),
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Orphan trajectories",
                "Trajectory keys without a prompt key (live and in the latest checkpoint); nothing clears them.",
                "short",
                query(f"tqmon_window_orphan_trajectories{{{SEL}}}", "live {{partition}}"),
                query(f"tqmon_checkpoint_orphan_trajectories{{{SEL}}}", "latest checkpoint"),
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Trainer steps per minute",
                "Rate of `tqmon_trainer_global_step`: flat at 0 during warmup and when the trainer stalls.",
                "short",
                query(f"deriv(tqmon_trainer_global_step{{{SEL}}}[$__rate_interval]) * 60", "steps/min"),
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Source errors and rejected events",
                "Failed polls and bad records per source, and event API requests rejected, per second.",
                "cps",
                query(
                    f"sum by (source, reason) (rate(tqmon_source_errors_total{{{SEL}}}[$__rate_interval]))",
                    "{{source}} {{reason}}",
                ),
                query(
                    f"sum by (reason) (rate(tqmon_events_rejected_total{{{SEL}}}[$__rate_interval]))",
                    "rejected {{reason}}",
                ),
            )
        )
    )


def _cost_row(builder: dashboard.Dashboard) -> dashboard.Dashboard:
    """What each resume cost (ml-goodput-measurement's badput): each step of a line is one resume."""
    return (
        builder.with_row(dashboard.Row("Cost of the last resumes"))
        .with_panel(
            panel(
                timeseries.Panel(),
                "Steps lost",
                "Steps trained after the loaded checkpoint and lost at the stop (last step before it minus N); "
                "a gap where tqmon saw no step completions before the stop.",
                "short",
                query(f"tqmon_resume_lost_steps{{{SEL}}}", "steps lost"),
                span=8,
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Downtime and time to first step",
                "Downtime: last timestamped trainer line before the stop to the resume's first line. Time to first "
                "step: from that line until the first step completed (restore, re-issue, warmup, the step).",
                "s",
                query(f"tqmon_resume_downtime_seconds{{{SEL}}}", "downtime"),
                query(f"tqmon_resume_time_to_first_step_seconds{{{SEL}}}", "to first step"),
                span=8,
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Rollouts wasted",
                "Doomed restored prompt groups times actor_rollout_ref.rollout.n: rollouts evicted by the first "
                "sample and generated again.",
                "short",
                query(f"tqmon_resume_wasted_rollouts{{{SEL}}}", "rollouts"),
                span=8,
            )
        )
    )


def resume_dashboard() -> dashboard.Dashboard:
    """ "Resume & warmup" for one run (one tqmon instance)."""
    builder = _base(
        RESUME_DASHBOARD_UID,
        "tqmon / Resume & warmup",
        "Whether the TransferQueue prefetch window of one verl async run was refilled correctly after its last resume.",
        multi=False,
    )
    return _cost_row(_window_row(_resume_row(_health_row(builder))))


def fleet_dashboard() -> dashboard.Dashboard:
    """Every run in one table: fill ratio, last resume, verdict, warmup decision and firing alerts."""
    builder = _base(
        FLEET_DASHBOARD_UID,
        "tqmon / Fleet",
        "Every verl async run watched by tqmon: window fill, last resume and verdict, and firing TQMon alerts.",
        multi=True,
    )
    hidden = {"Time": True, "__name__": True, "Value #C": True, "Value #D": True, "Value #E": True}
    renamed = {"Value #A": "fill ratio", "Value #B": "last resume", "Value #F": "firing alerts"}
    runs = (
        panel(
            table.Panel(),
            "Runs",
            "One row per tqmon instance: live fill ratio, last resume time, window verdict, warmup decision and the"
            " number of firing TQMon alerts. Click an instance for its Resume & warmup dashboard.",
            "short",
            query(f"{FILL_RATIO}{{{SEL}}}", instant=True, table_format=True),
            query(f"tqmon_last_resume_timestamp_seconds{{{SEL}}} * 1000", instant=True, table_format=True),
            query(f"tqmon_window_status{{{SEL}}} == 1", instant=True, table_format=True),
            query(f"tqmon_resume_warmup_state{{{SEL}}} == 1", instant=True, table_format=True),
            query(f'tqmon_run_info{{{SEL},run_id=~"$run"}}', instant=True, table_format=True),
            query(
                f'count by (job, instance) (ALERTS{{alertname=~"TQMon.*",alertstate="firing",{SEL}}})',
                instant=True,
                table_format=True,
            ),
            span=24,
        )
        .with_transformation(DataTransformerConfig("merge", options={}))
        .with_transformation(
            DataTransformerConfig("organize", options={"excludeByName": hidden, "renameByName": renamed})
        )
        .override_by_name("fill ratio", [DynamicConfigValue("unit", "percentunit")])
        .override_by_name("last resume", [DynamicConfigValue("unit", "dateTimeFromNow")])
        .override_by_name(
            "instance",
            [
                DynamicConfigValue(
                    "links",
                    [
                        {
                            "title": "Resume & warmup",
                            "url": f"/d/{RESUME_DASHBOARD_UID}?var-job=${{__data.fields.job}}"
                            "&var-instance=${__data.fields.instance}&${__url_time_range}",
                        }
                    ],
                )
            ],
        )
    )
    return (
        builder.with_panel(runs)
        .with_panel(
            panel(
                table.Panel(),
                "Firing alerts",
                "TQMon alerts firing now, with their severity; each has a runbook under docs/runbooks/.",
                "none",
                query(f'ALERTS{{alertname=~"TQMon.*",alertstate="firing",{SEL}}}', instant=True, table_format=True),
                span=24,
            ).with_transformation(
                DataTransformerConfig(
                    "organize", options={"excludeByName": {"Time": True, "__name__": True, "Value": True}}
                )
            )
        )
        .with_panel(
            panel(
                timeseries.Panel(),
                "Fill ratio by run",
                "Live window over its target per instance; below the alert threshold after a resume means starving.",
                "percentunit",
                query(f"{FILL_RATIO}{{{SEL}}}", "{{instance}}"),
                span=24,
            )
        )
    )


def render(builder: dashboard.Dashboard) -> str:
    """Stable JSON; panel ids numbered in layout order (the SDK leaves them unset, Grafana wants them unique)."""
    model = load(json.dumps(builder.build(), cls=JSONEncoder))
    for number, item in enumerate(model["panels"], start=1):
        item["id"] = number
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


DASHBOARDS = {"tqmon-resume.json": resume_dashboard, "tqmon-fleet.json": fleet_dashboard}


def rendered() -> dict[str, str]:
    """File name -> JSON text of every shipped dashboard."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def load(text: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def main() -> int:
    for name, text in rendered().items():
        write(f"{DASHBOARD_DIR}/{name}", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
