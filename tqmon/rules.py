"""Prometheus recording and alerting rules for tqmon, built as data from the metric catalog.

``tqmon rules`` prints them; ``python -m mixin.rules`` (in a checkout) writes the defaults to
``deploy/prometheus/tqmon-rules.yml``, and a test fails when the committed file drifts. Every metric a rule
names is looked up in the catalog here, so a renamed metric breaks the build instead of silently blinding
an alert. Thresholds and selectors are fields of ``RuleConfig``.

Each alert is declared once, in :func:`alerts`: its PromQL and, beside it, the same condition in Python over
one snapshot (``check``), which the status page shows (:mod:`tqmon.conditions`); an alert no snapshot can
decide says why (``prometheus_only``). tests/test_alert_agreement.py feeds every simulator scenario's
exposition to promtool and proves both fire on the same snapshots.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import yaml

from tqmon.catalog import BY_NAME
from tqmon.report import describe_regression
from tqmon.snapshot import ResumeRecord, Snapshot
from tqmon.warmup import TRAIN, WarmupState

RESUME_DASHBOARD_UID = "tqmon-resume"
FLEET_DASHBOARD_UID = "tqmon-fleet"
GROUP = "tqmon"
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")
DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}

# Recording rules (level:metric:operations); the dashboards read them too.
WINDOW_TOTAL = "tqmon:window_prompt_groups:sum"
FILL_RATIO = "tqmon:window_fill_ratio:ratio"
WINDOW_DEFICIT = "tqmon:window_deficit_prompt_groups:clamp_min"
RESTORED_TOTAL = "tqmon:resume_restored_prompt_groups:sum"
DOOMED_TOTAL = "tqmon:resume_doomed_prompt_groups:sum"
USEFUL_AFTER_WARMUP = "tqmon:resume_useful_prompt_groups:sum"


def _param(default: Any, help: str) -> Any:
    """A RuleConfig field; its help is what `tqmon rules --help` and the README show."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class RuleConfig:
    """Every threshold and selector of the shipped rules; the defaults are what the runbooks describe."""

    selector: str = _param('job="tqmon"', "Label matchers of the tqmon scrape job, added to every selector.")
    runbook_base_url: str = _param(
        "https://github.com/tqmon/tqmon/blob/main/docs/runbooks/", "runbook_url is this + <Alert>.md."
    )
    grafana_url: str = _param("https://grafana.example.com", "dashboard_url links to its /d/<uid>.")
    fill_ratio_threshold: float = _param(0.9, "Live window below this share of T reads under-filled.")
    under_filled_for: str = _param("10m", "How long the window must stay under-filled after a resume.")
    resume_window_seconds: int = _param(7200, "Resume alerts look only this long after the last start.")
    progress_window: str = _param("10m", "The trainer progresses if a step moved its global step on this recently.")
    over_fill_ratio_threshold: float = _param(1.0, "Live window above this share of T reads over target.")
    over_target_for: str = _param("30m", "How long the window must stay over target.")
    decision_for: str = _param("1m", "for: of the alerts on the warmup decision (its numbers settle in seconds).")
    doomed_share_threshold: float = _param(0.25, "Doomed restored groups, as a share of T, that alert.")
    stale_groups_threshold: int = _param(0, "Stale restored groups tolerated.")
    orphan_threshold: int = _param(1000, "Orphan trajectory keys in the train partition that alert.")
    orphans_for: str = _param("30m", "How long orphans must stay above the threshold.")
    source_for: str = _param("5m", "for: of the source down and source stale alerts.")
    source_stale_seconds: int = _param(600, "A source is stale after this long without success.")
    push_sources: tuple[str, ...] = _param(("events",), "Sources that succeed only when pushed to: never stale.")
    down_for: str = _param("5m", "for: of TQMonDown (up == 0).")
    absent_for: str = _param("15m", "for: of TQMonAbsent (no tqmon target at all).")
    stall_window: str = _param("5m", "A global step standing this long while the trainer talks is a stall.")
    stall_for: str = _param("30m", "How long the trainer must stay stalled.")
    trainer_active_seconds: int = _param(600, "The trainer counts as alive if heard from this recently.")

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name.endswith(("_for", "_window")) and isinstance(value, str) and not DURATION.fullmatch(value):
                raise ValueError(f"{spec.name} must be a Prometheus duration like 10m or 1h30m, got {value!r}")
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"{spec.name} must not be negative, got {value}")


def duration_seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``) in seconds."""
    if not DURATION.fullmatch(duration):
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(int(n) * DURATION_UNITS[unit] for n, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def _duration(seconds: float) -> str:
    """Seconds as a Prometheus duration in the largest whole unit up to hours (``60`` → ``1m``)."""
    ms = round(seconds * 1000)
    for unit in ("h", "m", "s"):
        size = round(DURATION_UNITS[unit] * 1000)
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def shortened(config: RuleConfig, factor: int) -> RuleConfig:
    """``config`` with every ``for:`` divided by ``factor``: the demo's rules, whose alerts fire while you watch.

    Only the ``*_for`` durations change; ranges, lookbacks and thresholds stay, so every alert's condition is
    the production one and only the time it must hold is shorter.
    """
    if factor < 1:
        raise ValueError(f"factor must be at least 1, got {factor}")
    durations: dict[str, Any] = {
        spec.name: _duration(duration_seconds(getattr(config, spec.name)) / factor)
        for spec in fields(config)
        if spec.name.endswith("_for")
    }
    return replace(config, **durations)


Check = tuple[bool, str]  # whether an alert's condition holds in a snapshot, and the values behind that
Predicate = Callable[[Snapshot, float, RuleConfig], Check]


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert in monitoring-mixin form and its condition over one snapshot at a time (``check``), or why only
    Prometheus can tell (``prometheus_only``); ``fleet`` alerts have no instance and link the fleet dashboard."""

    name: str
    expr: str
    duration: str
    severity: str
    summary: str
    description: str
    check: Predicate | None
    prometheus_only: str = ""
    fleet: bool = False

    def __post_init__(self) -> None:
        if (self.check is None) == (not self.prometheus_only):
            raise ValueError(f"{self.name}: give either its condition in Python or why only Prometheus can tell")


class _Selectors:
    """Renders selectors of catalog metrics with the configured scrape-job matchers."""

    def __init__(self, config: RuleConfig) -> None:
        self._matchers = config.selector

    def __call__(self, name: str, extra: str = "") -> str:
        if name not in BY_NAME and name != "up":
            raise KeyError(f"{name} is not in the metric catalog")
        matchers = ",".join(m for m in (self._matchers, extra) if m)
        return f"{name}{{{matchers}}}"


def recording_rules(config: RuleConfig) -> list[dict[str, str]]:
    """Ratios and deficits the exporter does not pre-compute (see DESIGN §4), in evaluation order."""
    m = _Selectors(config)
    target = m("tqmon_window_target_prompt_groups")
    train = m("tqmon_window_prompt_groups", "partition=" + _q(TRAIN))
    rules = {
        WINDOW_TOTAL: f"sum without (partition, status) ({train})",
        FILL_RATIO: f"{WINDOW_TOTAL} / ({target} > 0)",
        WINDOW_DEFICIT: f"clamp_min({target} - {WINDOW_TOTAL}, 0)",
        RESTORED_TOTAL: f"sum without (status) ({m('tqmon_resume_restored_prompt_groups')})",
        DOOMED_TOTAL: f"sum without (reason) ({m('tqmon_resume_doomed_prompt_groups')})",
        # R - doomed + M; unknown doomed groups (log-only) count as 0, a lower bound like the exporter's.
        USEFUL_AFTER_WARMUP: (
            f"{RESTORED_TOTAL} - ({DOOMED_TOTAL} or {RESTORED_TOTAL} * 0)"
            f" + {m('tqmon_resume_warmup_submitted_prompt_groups')}"
        ),
    }
    return [{"record": name, "expr": expr} for name, expr in rules.items()]


def _q(value: str) -> str:
    return f'"{value}"'


def _pct(share: float) -> str:
    return f"{share * 100:g}%"


# ---------------------------------------------------------------- the conditions over one snapshot
# Each reads the snapshot values the exporter turns into the series its alert's PromQL reads (the same
# comparison, the same absent-means-silent), so the page and Prometheus agree on every snapshot.


def _recent(snapshot: Snapshot, now: float, config: RuleConfig) -> ResumeRecord | None:
    """The last start, if it is within the resume alerts' window (``recent`` in :func:`alerts`)."""
    record = snapshot.last_record
    if record is None or now - record.started_at >= config.resume_window_seconds:
        return None
    return record


def _no_recent_start(snapshot: Snapshot) -> str:
    return "no start observed" if snapshot.last_record is None else "last start is older than the resume window"


def _progressing(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    """A step moved the global step on within the progress window (``progressing`` in :func:`alerts`)."""
    stepped = snapshot.trainer_stepped_at
    if stepped is None:
        return False, "no step seen"
    return now - stepped < duration_seconds(config.progress_window), f"last step {now - stepped:.0f}s ago"


def _fill(snapshot: Snapshot, now: float) -> tuple[float | None, str]:
    """The live train window over T (the recording rule ``tqmon:window_fill_ratio:ratio``)."""
    train = snapshot.train_window(now)
    if train is None:
        return None, "no fresh live window"
    if not snapshot.target_window:
        return None, "no target window T"
    ratio = train.total / snapshot.target_window
    return ratio, f"window {train.total} of T {snapshot.target_window} ({ratio:.0%})"


def _under_filled(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    ratio, detail = _fill(snapshot, now)
    if ratio is None:
        return False, detail
    progressing, progress = _progressing(snapshot, now, config)
    holds = ratio < config.fill_ratio_threshold and _recent(snapshot, now, config) is not None and progressing
    return holds, f"{detail}, threshold {config.fill_ratio_threshold:.0%}; {progress}"


def _over_target(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    ratio, detail = _fill(snapshot, now)
    if ratio is None:
        return False, detail
    progressing, progress = _progressing(snapshot, now, config)
    holds = ratio > config.over_fill_ratio_threshold and progressing
    return holds, f"{detail}, threshold {config.over_fill_ratio_threshold:.0%}; {progress}"


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
    return record.submitted - record.expected > 0, f"submitted {record.submitted}, expected {record.expected}"


def _step_regression(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if not record.step_regressions:
        return False, "no step regression"
    return True, "; ".join(describe_regression(r) for r in record.step_regressions)


def _in_state(state: WarmupState) -> Predicate:
    """The last start, if recent, ended its warmup decision in ``state``."""

    def check(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
        record = _recent(snapshot, now, config)
        if record is None:
            return False, _no_recent_start(snapshot)
        detail = f"warmup state {record.warmup_state}"
        if record.warmup_state is WarmupState.LOST_WINDOW:
            lost = record.cost.lost_prompt_groups
            detail += f", {'unknown' if lost is None else lost} prompt groups lost"
        return record.warmup_state is state, detail

    return check


def _doomed_high(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    if record.doomed is None or not record.target:
        return False, "doomed groups or T not known"
    doomed = sum(record.doomed.values())
    share = doomed / record.target
    detail = f"doomed {doomed} of T {record.target} ({share:.0%})"
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


def _stalled(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    """The global step stands while the trainer is heard from; Prometheus also wants it for ``stall_for``."""
    if snapshot.trainer_step is None:
        return False, "no global step observed"
    stepped, heard = snapshot.trainer_stepped_at, snapshot.trainer_last_event
    standing = stepped is None or now - stepped >= duration_seconds(config.stall_window)
    talking = heard is not None and now - heard < config.trainer_active_seconds
    since = "no step seen" if stepped is None else f"last step {now - stepped:.0f}s ago"
    heard_detail = "never heard from" if heard is None else f"heard from {now - heard:.0f}s ago"
    return standing and talking, f"global step {snapshot.trainer_step}, {since}; trainer {heard_detail}"


def _disagree(snapshot: Snapshot, now: float, config: RuleConfig) -> Check:
    record = _recent(snapshot, now, config)
    if record is None:
        return False, _no_recent_start(snapshot)
    counts = record.disagreement_counts()  # what tqmon_resume_source_disagreements exports
    if not any(counts.values()):
        return False, "the sources agree"
    return True, "; ".join(d.describe() for d in record.disagreements if counts.get(d.quantity))


def alerts(config: RuleConfig) -> list[Alert]:
    """The alerts, each silent on a healthy resume, during warmup and on an idle run (see tests/test_rules.py),
    each with its condition over one snapshot: ``recent`` is :func:`_recent`, ``progressing`` :func:`_progressing`."""
    m = _Selectors(config)
    recent = f"(time() - {m('tqmon_last_resume_timestamp_seconds')}) < {config.resume_window_seconds}"
    resume_hours = f"{config.resume_window_seconds / 3600:g}h"
    stepped = m("tqmon_trainer_last_step_timestamp_seconds")
    progressing = f"(time() - {stepped}) < {duration_seconds(config.progress_window):g}"
    step = m("tqmon_trainer_global_step")
    push = "|".join(config.push_sources)
    return [
        Alert(
            "TQMonWindowUnderFilledAfterResume",
            f"{FILL_RATIO} < {config.fill_ratio_threshold}\nand {recent}\nand {progressing}",
            config.under_filled_for,
            "critical",
            "The TransferQueue prefetch window stays under-filled after a resume.",
            "The live prefetch window of {{ $labels.instance }} has held {{ $value | humanizePercentage }} of its"
            f" target for more than {config.under_filled_for} within {resume_hours} of the last resume, below"
            f" {_pct(config.fill_ratio_threshold)}, while the trainer keeps stepping: rollouts starve the trainer.",
            _under_filled,
        ),
        Alert(
            "TQMonWarmupUnderSubmitted",
            f"{m('tqmon_resume_under_submitted_prompt_groups')} > 0\nand {recent}",
            config.decision_for,
            "warning",
            "The warmup after the last resume left the window short of useful work.",
            "The last start of {{ $labels.instance }} left {{ $value }} prompt groups of useful work missing right"
            " after warmup (T - (R - doomed + M)): the first steps after the resume wait for fresh rollouts.",
            _under_submitted,
        ),
        Alert(
            "TQMonWarmupOverSubmitted",
            f"({m('tqmon_resume_warmup_submitted_prompt_groups')} - {m('tqmon_resume_warmup_expected_prompt_groups')})"
            f" > 0\nand {recent}",
            config.decision_for,
            "warning",
            "The warmup after the last resume submitted more prompts than the window needed.",
            "The last warmup of {{ $labels.instance }} submitted {{ $value }} prompt groups more than"
            " max(0, T - R): the window is over-filled and its oldest prompts drift off-policy.",
            _over_submitted,
        ),
        Alert(
            "TQMonLegacyUnconditionalWarmup",
            f"{m('tqmon_resume_warmup_state', 'state=' + _q('legacy_unconditional'))} == 1"
            f"\nand ignoring (state) {recent}",
            config.decision_for,
            "warning",
            "The trainer resumed with verl 0.9.0's unconditional warmup.",
            "{{ $labels.instance }} resumed with the legacy verl 0.9.0 warmup, which submits num_warmup_batches"
            " whole batches on top of the restored prompt groups: the window grows by T on every resume.",
            _in_state(WarmupState.LEGACY_UNCONDITIONAL),
        ),
        Alert(
            "TQMonWindowOverTarget",
            f"{FILL_RATIO} > {config.over_fill_ratio_threshold}\nand {progressing}",
            config.over_target_for,
            "warning",
            "The TransferQueue prefetch window stays over its target.",
            "The live prefetch window of {{ $labels.instance }} has held {{ $value | humanizePercentage }} of its"
            f" target for more than {config.over_target_for} while the trainer keeps stepping: over-restored"
            " prompt groups are never trimmed and age off-policy.",
            _over_target,
        ),
        Alert(
            "TQMonDoomedRestoredGroupsHigh",
            f"{DOOMED_TOTAL} / ({m('tqmon_resume_warmup_target_prompt_groups')} > 0)"
            f" > {config.doomed_share_threshold}\nand {recent}",
            config.decision_for,
            "warning",
            "Many restored prompt groups are evicted by the first sample after the resume.",
            "The first sample after the last start of {{ $labels.instance }} evicts doomed restored prompt groups"
            " worth {{ $value | humanizePercentage }} of the target window (threshold"
            f" {_pct(config.doomed_share_threshold)}); their work is lost and they are refilled a step late.",
            _doomed_high,
        ),
        Alert(
            "TQMonStaleRestoredGroups",
            f"{m('tqmon_resume_doomed_prompt_groups', 'reason=' + _q('stale'))} > {config.stale_groups_threshold}"
            f"\nand ignoring (reason) {recent}",
            config.decision_for,
            "info",
            "Restored prompt groups are too old for the off-policy threshold.",
            "{{ $value }} finished prompt groups restored by {{ $labels.instance }} exceed max_off_policy_threshold"
            " at the first step after the resume and are evicted unused.",
            _stale,
        ),
        Alert(
            "TQMonOrphanTrajectoriesPilingUp",
            f"{m('tqmon_window_orphan_trajectories', 'partition=' + _q('train'))} > {config.orphan_threshold}",
            config.orphans_for,
            "warning",
            "Trajectory keys without a prompt key pile up in TransferQueue.",
            "{{ $labels.instance }} sees {{ $value }} trajectory keys without a prompt key in partition"
            f" {{{{ $labels.partition }}}} (threshold {config.orphan_threshold}): nothing clears them and every"
            " resume adds the last trained batch's.",
            _orphans,
        ),
        Alert(
            "TQMonSourceDown",
            f"{m('tqmon_source_up')} == 0",
            config.source_for,
            "warning",
            "A tqmon source is down.",
            "Source {{ $labels.source }} of {{ $labels.instance }} has been down for more than"
            f" {config.source_for}: its series are dropped and the verdicts rest on the other sources.",
            _source_down,
        ),
        Alert(
            "TQMonSourceStale",
            f"time() - {m('tqmon_source_last_success_timestamp_seconds', 'source!~' + _q(push))}"
            f" > {config.source_stale_seconds}",
            config.source_for,
            "warning",
            "A tqmon source has not succeeded for a long time.",
            "Source {{ $labels.source }} of {{ $labels.instance }} last succeeded {{ $value | humanizeDuration }}"
            f" ago (threshold {config.source_stale_seconds}s).",
            _source_stale,
        ),
        Alert(
            "TQMonDown",
            f"{m('up')} == 0",
            config.down_for,
            "warning",
            "Prometheus cannot scrape tqmon.",
            "Prometheus has failed to scrape tqmon at {{ $labels.instance }} (job {{ $labels.job }}) for more than"
            f" {config.down_for}: no window or resume alert can fire for this run.",
            None,
            "Prometheus's own scrape health (up == 0)",
        ),
        Alert(
            "TQMonAbsent",
            f"absent({m('up')})",
            config.absent_for,
            "warning",
            "No tqmon target is scraped.",
            "Prometheus has had no tqmon target of job {{ $labels.job }} for more than"
            f" {config.absent_for}: every other TQMon alert is blind.",
            None,
            "Prometheus's own target list (absent(up))",
            fleet=True,
        ),
        Alert(
            "TQMonTrainerStalled",
            f"{step}\nunless (time() - {stepped}) < {duration_seconds(config.stall_window):g}"
            f"\nand (time() - {m('tqmon_trainer_last_event_timestamp_seconds')}) < {config.trainer_active_seconds}",
            config.stall_for,
            "warning",
            "The trainer is alive but its global step does not advance.",
            "The trainer watched by {{ $labels.instance }} still reports but has been stuck at global step"
            f" {{{{ $value }}}} for more than {config.stall_for}: rollouts are not completing.",
            _stalled,
        ),
        Alert(
            "TQMonResumeSourcesDisagree",
            f"{m('tqmon_resume_source_disagreements')} > 0\nand ignoring (quantity) {recent}",
            config.decision_for,
            "warning",
            "tqmon's sources contradict each other about the last resume.",
            "{{ $labels.instance }} heard {{ $labels.quantity }} of the last start differently from its sources"
            " ({{ $value }} disagreement(s)), beyond a poll during mutation: one of them is wrong (a trainer bug,"
            " another checkpoint than tqmon thinks, or a config tqmon was not told).",
            _disagree,
        ),
        Alert(
            "TQMonResumeLostWindow",
            f"{m('tqmon_resume_warmup_state', 'state=' + _q('lost_window'))} == 1\nand ignoring (state) {recent}",
            config.decision_for,
            "warning",
            "The last resume lost its TransferQueue window.",
            "{{ $labels.instance }} resumed from a checkpoint without transfer_queue/: the saved prefetch window"
            " (tqmon_resume_lost_prompt_groups) was not restored and the warmup regenerated it from scratch.",
            _in_state(WarmupState.LOST_WINDOW),
        ),
        Alert(
            "TQMonResumeStepRegression",
            f"{m('tqmon_resume_step_regression_steps')} > 0\nand ignoring (reason) {recent}",
            config.decision_for,
            "warning",
            "The last start went back in steps, or counted a step twice.",
            "The last start of {{ $labels.instance }} went back {{ $value }} step(s) ({{ $labels.reason }}): it"
            " began older than a checkpoint already saved, or logged a step again; /api/v1/status names both steps.",
            _step_regression,
        ),
    ]


def _dashboard_url(config: RuleConfig, alert: Alert) -> str:
    if alert.fleet:
        return f"{config.grafana_url}/d/{FLEET_DASHBOARD_UID}?var-job={{{{ $labels.job | urlquery }}}}"
    return (
        f"{config.grafana_url}/d/{RESUME_DASHBOARD_UID}?var-job={{{{ $labels.job | urlquery }}}}"
        "&var-instance={{ $labels.instance | urlquery }}"
    )


def alert_rule(config: RuleConfig, alert: Alert) -> dict[str, Any]:
    return {
        "alert": alert.name,
        "expr": alert.expr,
        "for": alert.duration,
        "labels": {"severity": alert.severity},
        "annotations": {
            "summary": alert.summary,
            "description": alert.description,
            "runbook_url": f"{config.runbook_base_url}{alert.name}.md",
            "dashboard_url": _dashboard_url(config, alert),
        },
    }


def rule_groups(config: RuleConfig | None = None) -> dict[str, Any]:
    """The whole rules file as data: one group, recording rules first.

    Prometheus evaluates the rules of a group in order but groups concurrently, so alerts that read the
    recording rules sit in their group, after them, and see this evaluation's values, not the last one's.
    """
    config = config or RuleConfig()
    rules = [*recording_rules(config), *(alert_rule(config, alert) for alert in alerts(config))]
    return {"groups": [{"name": GROUP, "rules": rules}]}


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no type hints
    """Multi-line PromQL as literal blocks, so the committed file reads like a handwritten one."""


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_presenter)


def render(config: RuleConfig | None = None) -> str:
    body: str = yaml.dump(rule_groups(config), Dumper=_Dumper, sort_keys=False, width=10_000, allow_unicode=True)
    return "# Generated by `python -m mixin.rules` (make docs); do not edit by hand: a test fails on drift.\n" + body
