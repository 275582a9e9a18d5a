"""The shipped alert rules' conditions, evaluated on one snapshot, for readers without Prometheus at hand.

Prometheus evaluates the real rules over time (``for:``, ``changes()``, scrape health); this module can only
say whether each rule's condition holds in this snapshot, with the default thresholds of
:class:`tqmon.rules.RuleConfig`. Every shipped alert appears: either evaluated here or marked as needing
Prometheus, so a new alert cannot be silently left off the status page.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

from tqmon.report import describe_regression
from tqmon.rules import Alert, RuleConfig, alerts
from tqmon.snapshot import ResumeRecord, Snapshot
from tqmon.warmup import WarmupState


class ConditionState(enum.StrEnum):
    TRUE = "true"  # the condition holds now; Prometheus fires once it has held for the rule's `for:`
    FALSE = "false"
    NEEDS_PROMETHEUS = "needs Prometheus"


@dataclass(frozen=True, slots=True)
class Condition:
    alert: str
    severity: str
    summary: str
    duration: str  # the rule's `for:`
    state: ConditionState
    detail: str  # the values behind the state


Check = tuple[bool, str]
Evaluator = Callable[[Snapshot, float, RuleConfig], Check]

# Alerts one snapshot cannot decide, and why.
NEEDS_PROMETHEUS = {
    "TQMonDown": "Prometheus's own scrape health (up == 0)",
    "TQMonAbsent": "Prometheus's own target list (absent(up))",
    "TQMonTrainerStalled": "the global step's history over 5m (changes())",
}
DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
PROGRESS_NOTE = "trainer progress approximated by a trainer event within the progress window"


def _recent(snapshot: Snapshot, now: float, config: RuleConfig) -> ResumeRecord | None:
    """The last start, if it is within the resume alerts' window."""
    record = snapshot.last_record
    if record is None or now - record.started_at >= config.resume_window_seconds:
        return None
    return record


def _fill(snapshot: Snapshot, now: float) -> tuple[float | None, str]:
    """The live train window over T (the recording rule ``tqmon:window_fill_ratio:ratio``)."""
    train = snapshot.train_window(now)
    if train is None:
        return None, "no fresh live window"
    if not snapshot.target_window:
        return None, "no target window T"
    ratio = train.total / snapshot.target_window
    return ratio, f"window {train.total} of T {snapshot.target_window} ({ratio:.0%})"


def _progressing(snapshot: Snapshot, now: float, config: RuleConfig) -> bool:
    seconds = _duration_seconds(config.progress_window)
    return snapshot.trainer_last_event is not None and now - snapshot.trainer_last_event <= seconds


def _duration_seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``) in seconds; RuleConfig has validated its shape."""
    return sum(int(n) * DURATION_UNITS[unit] for n, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def _under_filled(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    ratio, detail = _fill(snapshot, now)
    if ratio is None:
        return False, detail
    holds = ratio < config.fill_ratio_threshold
    holds = holds and _recent(snapshot, now, config) is not None and _progressing(snapshot, now, config)
    return holds, f"{detail}, threshold {config.fill_ratio_threshold:.0%}; {PROGRESS_NOTE}"


def _over_target(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    ratio, detail = _fill(snapshot, now)
    if ratio is None:
        return False, detail
    holds = ratio > config.over_fill_ratio_threshold and _progressing(snapshot, now, config)
    return holds, f"{detail}, threshold {config.over_fill_ratio_threshold:.0%}; {PROGRESS_NOTE}"


def _no_recent_start(snapshot: Snapshot) -> str:
    return "no start observed" if snapshot.last_record is None else "last start is older than the resume window"


def _under_submitted(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if record.under_submitted is None:
        return False, "deficit not known yet"
    return record.under_submitted > 0, f"deficit {record.under_submitted}"


def _over_submitted(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if record.submitted is None or record.expected is None:
        return False, "warmup submission not known yet"
    extra = record.submitted - record.expected
    return extra > 0, f"submitted {record.submitted}, expected {record.expected}"


def _legacy(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    return record.warmup_state is WarmupState.LEGACY_UNCONDITIONAL, f"warmup state {record.warmup_state}"


def _doomed_high(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if record.doomed is None or not record.target:
        return False, "doomed groups or T not known"
    share = sum(record.doomed.values()) / record.target
    detail = f"doomed {sum(record.doomed.values())} of T {record.target} ({share:.0%})"
    return share > config.doomed_share_threshold, f"{detail}, threshold {config.doomed_share_threshold:.0%}"


def _stale(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    stale = (record.doomed or {}).get("stale")
    if stale is None:
        return False, "stale groups not known (the series is absent)"
    return stale > config.stale_groups_threshold, f"stale {stale}, tolerated {config.stale_groups_threshold}"


def _orphans(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    train = snapshot.train_window(now)
    if train is None or train.orphan_trajectories is None:
        return False, "orphan trajectories not observed"
    orphans = train.orphan_trajectories
    return orphans > config.orphan_threshold, f"{orphans} orphans, threshold {config.orphan_threshold}"


def _source_down(snapshot: Snapshot, now: float, _config: RuleConfig) -> Check:
    down = [s.source for s in snapshot.sources if not s.up(now)]
    return bool(down), f"down: {', '.join(down)}" if down else "every source is up"


def _source_stale(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    stale = [
        f"{s.source} ({now - s.last_success:.0f}s)"
        for s in snapshot.sources
        if s.source not in config.push_sources
        and s.last_success is not None
        and now - s.last_success > config.source_stale_seconds
    ]
    detail = f"no success for over {config.source_stale_seconds}s: {', '.join(stale)}" if stale else "none stale"
    return bool(stale), detail


def _disagree(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if not record.disagreements:
        return False, "the sources agree"
    return True, "; ".join(d.describe() for d in record.disagreements)


def _lost_window(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    lost = "unknown" if record.cost.lost_prompt_groups is None else record.cost.lost_prompt_groups
    detail = f"warmup state {record.warmup_state}"
    if record.warmup_state is WarmupState.LOST_WINDOW:
        detail += f", {lost} prompt groups lost"
    return record.warmup_state is WarmupState.LOST_WINDOW, detail


def _step_regression(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if not record.step_regressions:
        return False, "no step regression"
    return True, "; ".join(describe_regression(r) for r in record.step_regressions)


EVALUATORS: dict[str, Evaluator] = {
    "TQMonWindowUnderFilledAfterResume": _under_filled,
    "TQMonWarmupUnderSubmitted": _under_submitted,
    "TQMonWarmupOverSubmitted": _over_submitted,
    "TQMonLegacyUnconditionalWarmup": _legacy,
    "TQMonWindowOverTarget": _over_target,
    "TQMonDoomedRestoredGroupsHigh": _doomed_high,
    "TQMonStaleRestoredGroups": _stale,
    "TQMonOrphanTrajectoriesPilingUp": _orphans,
    "TQMonSourceDown": _source_down,
    "TQMonSourceStale": _source_stale,
    "TQMonResumeSourcesDisagree": _disagree,
    "TQMonResumeLostWindow": _lost_window,
    "TQMonResumeStepRegression": _step_regression,
}


def _condition(alert: Alert, state: ConditionState, detail: str) -> Condition:
    return Condition(alert.name, alert.severity, alert.summary, alert.duration, state, detail)


def evaluate(snapshot: Snapshot, now: float, config: RuleConfig | None = None) -> list[Condition]:
    """Every shipped alert with its condition's state in this snapshot, in the rules file's order."""
    config = config or RuleConfig()
    result = []
    for alert in alerts(config):
        evaluator = EVALUATORS.get(alert.name)
        if evaluator is None:
            why = NEEDS_PROMETHEUS.get(alert.name, "not evaluated outside Prometheus")
            result.append(_condition(alert, ConditionState.NEEDS_PROMETHEUS, why))
            continue
        holds, detail = evaluator(snapshot, now, config)
        result.append(_condition(alert, ConditionState.TRUE if holds else ConditionState.FALSE, detail))
    return result
