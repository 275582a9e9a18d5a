"""What to expose for one snapshot, independent of wire format (Prometheus pull and OTLP push share it).

Known-empty values are exported as 0; values no source has established are omitted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from tqmon.catalog import BY_NAME, OTLP_SIGNALS, STATE_WRITE_FAILURE_REASONS, MetricSpec
from tqmon.snapshot import TALLY_OWNERS, RegressionReason, ResumeRecord, SelfHeal, Snapshot, Tally
from tqmon.warmup import PROMPT_STATUSES

Labels = tuple[str, ...]
# The catalog counter each of the tracker's tallies becomes.
TALLIES: dict[str, Tally] = {
    "tqmon_events_total": Tally.EVENTS,
    "tqmon_events_rejected_total": Tally.EVENTS_REJECTED,
    "tqmon_log_lines_total": Tally.LOG_LINES,
    "tqmon_source_errors_total": Tally.SOURCE_ERRORS,
    "tqmon_checkpoint_pickle_refusals_total": Tally.PICKLE_REFUSALS,
}


@dataclass(frozen=True, slots=True)
class Series:
    labels: Labels
    value: float


@dataclass(frozen=True, slots=True)
class HistogramSeries:
    labels: Labels
    buckets: tuple[tuple[float, int], ...]  # cumulative (le, count), the last le is +Inf
    sum: float


def _by_status(counts: Mapping[str, int], prefix: Labels = ()) -> list[Series]:
    """A split by status exports every status (0 when absent: the source counted them all);
    a bare total exports only ``status="unknown"``."""
    statuses = ["unknown"] if set(counts) == {"unknown"} else PROMPT_STATUSES
    return [Series((*prefix, status), counts.get(status, 0)) for status in statuses]


def _stateset(spec: MetricSpec, current: str) -> list[Series]:
    values = spec.state_label.values or ()
    return [Series((value,), 1.0 if value == current else 0.0) for value in values]


def _opt(value: float | None) -> list[Series]:
    return [] if value is None else [Series((), value)]


def _regressions(record: ResumeRecord) -> list[Series]:
    """Every reason, 0 where none was found, so an alert sees a regression resolve rather than vanish."""
    steps = Counter[str]()
    for regression in record.step_regressions:
        steps[regression.reason] += regression.steps
    return [Series((reason,), steps[reason]) for reason in RegressionReason]


def _self_heal_groups(heal: SelfHeal) -> float:
    """What ``on`` submitted; what ``dry-run`` would have."""
    return heal.submitted if heal.mode == "on" else heal.planned


def _counter(spec: MetricSpec, snapshot: Snapshot, sources: tuple[str, ...]) -> list[Series]:
    """All label combinations of a closed-set counter, so an absent error reads 0 rather than no data."""
    observed = snapshot.counters.get(TALLIES[spec.name], {})
    first = spec.labels[0]
    firsts = sources if first.name == "source" else (first.values or ())
    rest = spec.labels[1].values or () if len(spec.labels) > 1 else None
    combos: list[Labels] = [(a, b) for a in firsts for b in rest] if rest is not None else [(a,) for a in firsts]
    return [Series(labels, observed.get(labels, 0)) for labels in combos]


def metric_values(snapshot: Snapshot, now: float) -> Iterator[tuple[MetricSpec, list[Series] | list[HistogramSeries]]]:
    """Yield (spec, series) for every catalog metric that has something to say; in catalog order."""
    windows = snapshot.fresh_windows(now)
    train = snapshot.train_window(now)
    record = snapshot.last_record
    checkpoint = snapshot.checkpoint
    sources = tuple(s.source for s in snapshot.sources)

    values: dict[str, list[Series] | list[HistogramSeries]] = {
        "tqmon_window_prompt_groups": [s for w in windows for s in _by_status(w.by_status, (w.partition,))],
        "tqmon_window_trajectories": [
            Series((w.partition,), w.trajectories) for w in windows if w.trajectories is not None
        ],
        "tqmon_window_orphan_trajectories": [
            Series((w.partition,), w.orphan_trajectories) for w in windows if w.orphan_trajectories is not None
        ],
        "tqmon_window_target_prompt_groups": _opt(snapshot.target_window),
        "tqmon_window_prompt_group_age_steps": (
            [HistogramSeries((), train.age_buckets, train.age_sum or 0.0)]
            if train is not None and train.age_buckets is not None
            else []
        ),
        "tqmon_window_status": _stateset(BY_NAME["tqmon_window_status"], snapshot.window_status(now)),
        "tqmon_plugin_window_state": _stateset(BY_NAME["tqmon_plugin_window_state"], snapshot.window_reader(now)),
        "tqmon_resumes_total": [Series((), snapshot.resumes_total)],
        "tqmon_trainer_global_step": _opt(snapshot.trainer_step),
        "tqmon_trainer_step_duration_seconds": _opt(snapshot.trainer_step_seconds),
        "tqmon_trainer_last_event_timestamp_seconds": _opt(snapshot.trainer_last_event),
        "tqmon_trainer_last_step_timestamp_seconds": _opt(snapshot.trainer_stepped_at),
        "tqmon_build_info": [Series((snapshot.version,), 1)],
        "tqmon_source_up": [Series((s.source,), float(s.up(now))) for s in snapshot.sources],
        "tqmon_source_last_success_timestamp_seconds": [
            Series((s.source,), s.last_success) for s in snapshot.sources if s.last_success is not None
        ],
        "tqmon_source_poll_duration_seconds": [
            Series((s.source,), s.last_duration) for s in snapshot.sources if s.last_duration is not None
        ],
    }
    if snapshot.run is not None:
        run = snapshot.run
        values["tqmon_run_info"] = [Series((run.run_id, run.trainer_mode, run.verl_version), 1)]
    told = snapshot.verl_version
    values["tqmon_verl_version_info"] = [
        Series((told.version, told.semantics or "unknown", told.source or "unknown"), 1)
    ]
    if record is not None:
        values |= {
            "tqmon_last_resume_timestamp_seconds": [Series((), record.started_at)],
            "tqmon_last_resume_checkpoint_step": _opt(record.checkpoint_step),
            "tqmon_resume_restored_prompt_groups": _by_status(record.restored_by_status or {})
            if record.restored_by_status is not None
            else [],
            "tqmon_resume_reissued_prompt_groups": _opt(record.reissued),
            "tqmon_resume_warmup_target_prompt_groups": _opt(record.target),
            "tqmon_resume_warmup_expected_prompt_groups": _opt(record.expected),
            "tqmon_resume_warmup_submitted_prompt_groups": _opt(record.submitted),
            "tqmon_resume_over_restored_prompt_groups": _opt(record.over_restored),
            "tqmon_resume_doomed_prompt_groups": [Series((r,), n) for r, n in (record.doomed or {}).items()],
            "tqmon_resume_under_submitted_prompt_groups": _opt(record.under_submitted),
            "tqmon_resume_under_submitted_lower_bound": []
            if record.under_submitted is None
            else [Series((), float(record.under_submitted_lower_bound))],
            "tqmon_resume_self_heal_prompt_groups": []
            if record.self_heal is None
            else [Series((record.self_heal.mode,), _self_heal_groups(record.self_heal))],
            "tqmon_resume_first_step_evicted_prompt_groups": [
                Series((r,), n) for r, n in (record.first_step_evictions or {}).items()
            ],
            "tqmon_resume_first_step_generation_wait_seconds": _opt(record.first_step_generation_wait_seconds),
            "tqmon_resume_warmup_state": _stateset(BY_NAME["tqmon_resume_warmup_state"], record.warmup_state),
            "tqmon_resume_source_disagreements": [Series((q,), n) for q, n in record.disagreement_counts().items()],
            "tqmon_resume_lost_steps": _opt(record.cost.steps_lost),
            "tqmon_resume_downtime_seconds": _opt(record.cost.downtime_seconds),
            "tqmon_resume_time_to_first_step_seconds": _opt(record.cost.time_to_first_step_seconds),
            "tqmon_resume_wasted_rollouts": _opt(record.cost.wasted_rollouts),
            "tqmon_resume_lost_prompt_groups": _opt(record.cost.lost_prompt_groups),
            "tqmon_resume_step_regression_steps": _regressions(record),
        }
    if checkpoint is not None:
        values |= {
            "tqmon_checkpoint_step": [Series((), checkpoint.step)],
            "tqmon_checkpoint_prompt_groups": _by_status(checkpoint.by_status) if checkpoint.by_status else [],
            "tqmon_checkpoint_doomed_prompt_groups": [Series((r,), n) for r, n in (checkpoint.doomed or {}).items()],
            "tqmon_checkpoint_orphan_trajectories": _opt(checkpoint.orphan_trajectories),
            "tqmon_checkpoint_warmup_submitted_prompt_groups": [
                Series((o.semantics,), o.submitted) for o in checkpoint.outcomes if o.submitted is not None
            ],
            "tqmon_checkpoint_over_filled_prompt_groups": [
                Series((o.semantics,), o.over_filled) for o in checkpoint.outcomes if o.over_filled is not None
            ],
            "tqmon_checkpoint_under_submitted_prompt_groups": [
                Series((o.semantics,), o.under_submitted) for o in checkpoint.outcomes if o.under_submitted is not None
            ],
        }
    if snapshot.tq is not None:
        tq = snapshot.tq
        values |= {
            "tqmon_tq_poll_interval_seconds": [Series((), tq.interval)],
            "tqmon_tq_controller_busy_ratio": _opt(tq.busy_ratio),
            "tqmon_tq_reply_keys": _opt(tq.reply_keys),
            "tqmon_tq_controller_epochs_total": [Series((), tq.epochs)],
        }
    for name, tally in TALLIES.items():
        owner = TALLY_OWNERS.get(tally)
        if owner is None or owner in sources:
            values[name] = _counter(BY_NAME[name], snapshot, sources)
    if snapshot.otlp is None:  # OTLP push is off
        values.pop("tqmon_otlp_export_failures_total", None)
    else:
        values |= {
            "tqmon_otlp_export_failures_total": [
                Series((s,), snapshot.otlp.export_failures.get(s, 0)) for s in OTLP_SIGNALS
            ],
            "tqmon_otlp_log_records_dropped_total": [Series((), snapshot.otlp.dropped_log_records)],
        }
    failures = dict(snapshot.state.failures)
    values |= {
        "tqmon_state_writable": [Series((), float(snapshot.state.writable))],
        "tqmon_state_write_failures_total": [Series((r,), failures.get(r, 0)) for r in STATE_WRITE_FAILURE_REASONS],
    }

    for spec in BY_NAME.values():
        series = values.get(spec.name)
        if series:
            yield spec, series
