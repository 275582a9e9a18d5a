"""Human-readable verdicts and tables of resume records (``tqmon analyze``, the demo, the status page)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from tqmon.snapshot import RegressionReason, ResumeRecord, StepRegression
from tqmon.warmup import WarmupState, unknown_doom_reasons


def verdict(record: ResumeRecord) -> str:
    """One line an operator can act on; a deficit that is only a lower bound says so, and names the defaults
    it assumed."""
    problems = []
    if record.warmup_state is WarmupState.LOST_WINDOW:
        lost = "unknown" if record.cost.lost_prompt_groups is None else str(record.cost.lost_prompt_groups)
        problems.append(f"LOST WINDOW: resumed without transfer_queue/ ({lost} prompt groups lost, all re-generated)")
    problems += [f"STEP REGRESSION: {describe_regression(r)}" for r in record.step_regressions]
    if record.disagreements:
        problems.append("sources disagree: " + "; ".join(d.describe() for d in record.disagreements))
    if record.warmup_state is WarmupState.LEGACY_UNCONDITIONAL:
        problems.append("legacy verl 0.9.0 warmup stacked a full window on the restore")
    if record.submitted is not None and record.expected is not None and record.submitted != record.expected:
        problems.append(f"warmup submitted {record.submitted}, expected {record.expected}")
    if record.under_submitted:
        problems.append(f"UNDER-SUBMITTED by {deficit(record)}")
    if record.over_restored:
        problems.append(f"over-restored by {record.over_restored} (kept all run)")
    if record.under_submitted == 0 and record.under_submitted_lower_bound:
        problems.append(f"deficit {deficit(record)}: not known to be ok")
    caveat = ""
    if record.under_submitted is not None and record.assumed_defaults:
        caveat = f" (assuming verl defaults {', '.join(record.assumed_defaults)})"
    if problems:
        return "; ".join(problems) + caveat
    if record.warmup_state is WarmupState.UNKNOWN:
        return "incomplete: warmup decision not seen"
    return "ok" + caveat


def describe_regression(regression: StepRegression) -> str:
    """``began at step 0, step 45 was saved (latest_file_missing)`` or ``step 41 logged again after step 41``."""
    if regression.reason is RegressionReason.STEP_REPEATED:
        return f"step {regression.step} logged again after step {regression.newer_step} (counted twice)"
    return f"began at step {regression.step}, step {regression.newer_step} was saved ({regression.reason})"


def self_heal(record: ResumeRecord) -> str:
    """The plugin's self-heal decision with its inputs, or ``-`` when it was off."""
    heal = record.self_heal
    if heal is None:
        return "-"
    doomed = ", ".join(f"{reason} {n}" for reason, n in heal.doomed.items()) or "none known"
    done = f"submitted {heal.submitted}" if heal.mode == "on" else f"would submit {heal.planned}"
    exact = "" if heal.deficit_exact else " (lower bound)"
    return (
        f"{heal.mode}: {done} of deficit {heal.deficit}{exact} "
        f"(T {heal.target}, R {heal.restored}, doomed {doomed}, M {heal.warmup_submitted}, cap {heal.max_top_up})"
    )


def deficit(record: ResumeRecord) -> str:
    """The deficit as a number, or ``at least N (doomed stale not known)`` when it is a lower bound."""
    if record.under_submitted is None:
        return "-"
    if not record.under_submitted_lower_bound:
        return str(record.under_submitted)
    return f"at least {record.under_submitted} (doomed {', '.join(unknown_doom_reasons(record.doomed))} not known)"


def _fmt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _statuses(counts: Mapping[str, int] | None) -> str:
    """`` (pending 2, failure 1)`` for a known split; nothing for a bare total or an empty restore."""
    parts = [f"{status} {n}" for status, n in (counts or {}).items() if n and status != "unknown"]
    return f" ({', '.join(parts)})" if parts else ""


def _doomed(record: ResumeRecord) -> str:
    if record.doomed is None:
        return "-"
    total = sum(record.doomed.values())
    known = "" if len(record.doomed) == 3 else "≥"
    return f"{known}{total}"


def _cost(record: ResumeRecord, value: float | None, unit: str = "") -> str:
    """A resume's cost: ``unknown`` when not observed (never 0); ``-`` for a fresh start, which lost nothing."""
    if not record.resumed:
        return "-"
    if value is None:
        return "unknown"
    return f"{value:.1f}{unit}" if isinstance(value, float) else f"{value}{unit}"


COLUMNS = (
    "#",
    "started (UTC)",
    "from",
    "R",
    "K",
    "T",
    "M exp",
    "M sub",
    "O",
    "doomed",
    "deficit",
    "state",
    "steps lost",
    "downtime",
    "to 1st step",
    "wasted rollouts",
    "groups lost",
    "verdict",
)


def table(records: Sequence[ResumeRecord]) -> str:
    rows = [COLUMNS]
    for r in records:
        started = datetime.fromtimestamp(r.started_at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        rows.append(
            (
                str(r.index),
                started,
                f"step {r.checkpoint_step}" if r.resumed else "scratch",
                _fmt(r.restored) + _statuses(r.restored_by_status),
                _fmt(r.reissued),
                _fmt(r.target),
                _fmt(r.expected),
                _fmt(r.submitted),
                _fmt(r.over_restored),
                _doomed(r),
                f"≥{r.under_submitted}" if r.under_submitted_lower_bound else _fmt(r.under_submitted),
                str(r.warmup_state),
                _cost(r, r.cost.steps_lost),
                _cost(r, r.cost.downtime_seconds, "s"),
                _cost(r, r.cost.time_to_first_step_seconds, "s"),
                _cost(r, r.cost.wasted_rollouts),
                _cost(r, r.cost.lost_prompt_groups),
                verdict(r),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += [f"#{r.index} self-heal {self_heal(r)}" for r in records if r.self_heal is not None]
    return "\n".join(lines)
