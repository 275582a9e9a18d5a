"""``tqmon inspect``: what a resume from one checkpoint will do, predicted by the reconciler's own derivation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from tqmon.checkpoint.layout import CheckpointReading
from tqmon.checkpoint.storage import FilterVerdicts
from tqmon.derivation import predict_resumes
from tqmon.report import deficit
from tqmon.snapshot import ResumeRecord
from tqmon.versions import VerlVersion
from tqmon.warmup import (
    DOOM_REASONS,
    LATEST_FILE,
    LEGACY,
    STEP_DIR,
    TQ_DIR,
    LegacyWarmupFails,
    WarmupConfig,
    WarmupState,
    doomed_complete,
    is_stale,
    legacy_warmup_batches,
)

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Preflight:
    """What a resume from one checkpoint will do, as far as the checkpoint, the config and the verl version tell.

    ``records`` are what the tracker will derive once verl reports the resume: one under the warmup of the known
    ``version``, one per warmup (newest first) while it is unknown. R, K and the doomed groups are the same in
    each; without a config only they are known.
    """

    reading: CheckpointReading
    config: WarmupConfig | None
    records: tuple[ResumeRecord, ...]
    version: VerlVersion
    chosen_by: str | None = None  # how the user picked the step ("--step 6"); None: verl's latest
    latest: int | None = None  # the step latest_checkpointed_iteration.txt names, when the user chose another way

    @property
    def step_phrase(self) -> str:
        """ "step N", saying whose choice N is when it is not verl's latest."""
        step = self.reading.step
        if self.chosen_by is None:
            return f"step {step}"
        if self.latest is None:
            latest = f"there is no {LATEST_FILE}"
        elif self.latest == step:
            latest = f"{LATEST_FILE} also says {step}"
        else:
            latest = f"{LATEST_FILE} says {self.latest}: verl would resume from step {self.latest}"
        return f"step {step} (chosen with {self.chosen_by}; {latest})"

    @property
    def record(self) -> ResumeRecord:
        """The prediction R, K and the doomed groups are read from (every one agrees on them)."""
        return self.records[0]

    @property
    def restored(self) -> int:
        """R as verl will count it (0 in sync mode: verl restores no TQ state there)."""
        return self.record.restored or 0

    @property
    def doomed(self) -> Mapping[str, int]:
        return self.record.doomed or {}

    @property
    def reissued(self) -> int:
        return self.record.reissued or 0

    @property
    def cleared_trajectories(self) -> int:
        return self.record.cleared_trajectories or 0

    @property
    def predicted(self) -> tuple[ResumeRecord, ...]:
        """The records whose warmup is predicted: none without the config."""
        return () if self.config is None else self.records

    @property
    def warmup_state(self) -> WarmupState | None:
        """The warmup state every prediction agrees on, else None."""
        return _agreed([record.warmup_state for record in self.predicted])

    def useful(self, record: ResumeRecord) -> int | None:
        """R - doomed + M: the useful window right after the warmup ``record`` predicts."""
        if record.submitted is None:
            return None
        return self.restored - sum(self.doomed.values()) + record.submitted

    @property
    def sample_step(self) -> int:
        return self.reading.step + 1

    @property
    def doomed_complete(self) -> bool:
        return doomed_complete(self.record.doomed)

    @property
    def notes(self) -> tuple[str, ...]:
        if self.config is None:
            assumed = ", ".join(self.record.assumed_defaults)
            return (
                "T, M, O and the under-submission need the trainer config: --trainer-config "
                "<run dir>/.hydra/config.yaml, or --train-batch-size and --num-warmup-batches",
                # Without it, verl's eviction defaults decide stale and filtered (named), never silently.
                *((f"doomed assumes verl's defaults {assumed}",) if assumed else ()),
            )
        if self.warmup_state is WarmupState.SYNC_MODE:
            return ("sync mode: verl neither restores nor re-issues TransferQueue state; nothing of it comes back",)
        return (*self.version_notes, *self.dapo_notes)

    @property
    def version_notes(self) -> tuple[str, ...]:
        """What the verl version changes here: unknown, both warmups are predicted; 0.9.0's warmup may fail."""
        notes = []
        if self.version.semantics is None:
            notes.append(
                "the verl version is unknown, so both warmups are predicted: give the trainer's --log or "
                "--verl-version, or run tqmon next to the trainer's verl"
            )
        if self.config is not None and any(r.semantics == LEGACY and r.submitted is None for r in self.predicted):
            try:
                legacy_warmup_batches(self.config)
            except LegacyWarmupFails as err:  # why 0.9.0 decides nothing: its trainer stops at the warmup
                notes.append(str(err))
        return tuple(notes)

    def zero_variance(self, verdicts: FilterVerdicts) -> tuple[int, int]:
        """DAPO's zero-variance finished groups, and how many of them are also stale at the first sample:
        verl counts the latter under both evictions, doomed only as stale."""
        zero = sum(verdicts.filtered.values())
        if self.config is None:
            return zero, 0
        config, sample_step = self.config, self.sample_step
        return zero, sum(n for steps, n in verdicts.filtered.items() if is_stale(config, steps, sample_step))

    @property
    def dapo_notes(self) -> tuple[str, ...]:
        """What the storage units told about DAPO's filter, or why they could not."""
        if self.config is None or not self.config.filter_groups:
            return ()
        verdicts, error = self.reading.filter_verdicts, self.reading.filter_error
        if verdicts is None:
            if error is not None:
                return (f"filter_groups is on but the storage units could not be read ({error}): filtered is unknown",)
            if "filtered" in self.doomed:
                return ()  # nothing restored: nothing to filter
            return (
                "filter_groups is on: give --filter-groups-metric (algorithm.filter_groups.metric) to predict the "
                "groups DAPO filters from the storage units; until then the deficit is a minimum",
            )
        undecided: list[str] = []
        if verdicts.missing:
            undecided.append(
                f"{verdicts.missing} finished group(s) lack DAPO metric {verdicts.metric!r} on some trajectory: "
                "verl 0.9.1 raises RuntimeError ('Finished groups are missing DAPO metric') at the first sample"
            )
        if verdicts.refused:
            undecided.append(
                f"{verdicts.refused} finished group(s) hold a value of DAPO metric {verdicts.metric!r} tqmon cannot "
                f"decode, so filtered is unknown ({verdicts.refusal})"
            )
        if undecided:
            return tuple(undecided)
        zero, stale = self.zero_variance(verdicts)
        return (
            f"DAPO ({verdicts.metric}): {zero} of {verdicts.finished} finished groups have zero variance; verl "
            f"reports {zero} as filter_groups/evicted_samples, {stale} of them also as off_policy (doomed counts "
            "those as stale)",
        )

    def dapo_json(self) -> dict[str, Any] | None:
        """``tqmon inspect --json``'s ``dapo`` block: the verdicts as verl's first-step metrics will count them."""
        verdicts = self.reading.filter_verdicts
        if verdicts is None:
            return None if self.reading.filter_error is None else {"error": str(self.reading.filter_error)}
        zero, stale = self.zero_variance(verdicts)
        return {
            "metric": verdicts.metric,
            "finished_judged": verdicts.finished,
            "zero_variance": zero,  # verl's training/filter_groups/evicted_samples (it counts stale ones too)
            "zero_variance_stale": stale,  # also training/off_policy/evicted_samples: doomed counts them as stale
            "missing_metric": verdicts.missing,
            "refused_groups": verdicts.refused,  # their verdict unknown: a metric value tqmon cannot decode
            "refusal": verdicts.refusal,
            "trajectories_read": verdicts.trajectories,
            "storage_bytes": verdicts.storage_bytes,
        }

    def prediction_json(self, record: ResumeRecord) -> dict[str, Any]:
        """One warmup's prediction, keyed as ``tqmon inspect --json`` always named them."""
        return {
            "semantics": record.semantics,
            "target": record.target,
            "warmup_submitted": record.submitted,
            "warmup_state": record.warmup_state.value,
            "over_restored": record.over_restored,
            "over_filled": record.over_filled,
            "useful_after_warmup": self.useful(record),
            "under_submitted": record.under_submitted,
            "under_submitted_is_lower_bound": record.under_submitted is not None and record.under_submitted_lower_bound,
        }

    def to_json(self) -> dict[str, Any]:
        c = self.reading.composition
        predictions = [self.prediction_json(record) for record in self.predicted]
        # The prediction's keys at the top level: the known version's, or where every warmup agrees (else null).
        agreed = {key: _agreed([p[key] for p in predictions]) for key in PREDICTION_KEYS}
        return {
            "checkpoint_dir": str(self.reading.root),
            "step": self.reading.step,
            "step_chosen_by": self.chosen_by,
            "latest_step": self.latest if self.chosen_by is not None else self.reading.step,
            "path": None if self.reading.tq_dir is None else str(self.reading.tq_dir),
            "sample_step": self.sample_step,
            "restored": self.restored,
            "by_status": c.by_status,
            "by_age": {str(age): n for age, n in c.by_age(self.sample_step).items()},
            "groups": [g.model_dump() for g in c.group_counts()],
            "reissued": self.reissued,
            "cleared_trajectories": self.cleared_trajectories,
            "trajectories": c.trajectories,
            "orphan_trajectories": c.orphan_trajectories,
            "doomed": dict(self.doomed),
            "doomed_complete": self.doomed_complete,
            "config": None if self.config is None else self.config.model_dump(),
            "verl_version": {
                "version": self.version.version or None,
                "semantics": self.version.semantics,
                "source": self.version.source,
                "detail": self.version.detail or None,
            },
            **agreed,
            "under_submitted_is_lower_bound": bool(agreed["under_submitted_is_lower_bound"]),
            "predictions": predictions,
            "assumed_defaults": list(self.record.assumed_defaults),
            "controller_state_bytes": self.reading.size_bytes,
            "saved_at": self.reading.saved_at_ns / 1e9,
            "dapo": self.dapo_json(),
            "notes": list(self.notes),
        }


PREDICTION_KEYS = (
    "target",
    "warmup_submitted",
    "warmup_state",
    "over_restored",
    "over_filled",
    "useful_after_warmup",
    "under_submitted",
    "under_submitted_is_lower_bound",
)


def _agreed(values: list[V]) -> V | None:
    """The value every prediction gives; None when they differ, or there is none."""
    return values[0] if values and all(value == values[0] for value in values) else None


def preflight(
    reading: CheckpointReading,
    config: WarmupConfig | None,
    version: VerlVersion,
    *,
    chosen_by: str | None = None,
    latest: int | None = None,
) -> Preflight:
    """Predict the resume from ``reading``: R, K, doomed, and with the config T, M, O, the over-fill and the
    deficit under the warmup of ``version`` (each warmup while it is unknown).

    ``chosen_by`` says the user picked the step (and ``latest`` what verl would pick instead)."""
    composition = reading.composition
    event = reading.to_event()
    records = predict_resumes(event, composition.reissued, composition.inflight_trajectories, config, version)
    return Preflight(reading, config, records, version, chosen_by, latest)


def _warmup_phrase(result: Preflight, record: ResumeRecord, *, would: bool) -> str:
    """ "verl 0.9.1's warmup will submit M; useful window right after warmup U of T — verdict"."""
    release = record.semantics.removeprefix("verl-")
    if record.submitted is None:
        return f"verl {release}'s warmup fails (see note)"
    phrase = f"verl {release}'s warmup {'would' if would else 'will'} submit {record.submitted}"
    if record.target is None:
        return phrase + "; the warmup is off (skip.rollout_tq or num_warmup_batches <= 0): verl defines no T"
    bound = "" if result.doomed_complete else "at most "
    phrase += f"; useful window right after warmup {bound}{result.useful(record)} of {record.target}"
    if record.under_submitted:
        minimum = "" if result.doomed_complete else "at least "
        return phrase + f" — under-submitted by {minimum}{record.under_submitted}"
    if record.semantics == LEGACY and record.over_filled:
        return phrase + f" — over-filled by {record.over_filled} (R + M - T: the warmup ignores R; kept all run)"
    if record.over_restored:
        return phrase + f" — over-restored by {record.over_restored} (kept all run)"
    if record.warmup_state is WarmupState.LOST_WINDOW:
        return phrase + " — LOST WINDOW: no transfer_queue/ to restore, the warmup re-generates it all"
    return phrase + " — ok"


def render(result: Preflight) -> str:
    """The human preflight: a headline sentence, then the details (a column per warmup while the verl version
    is unknown)."""
    reading, c = result.reading, result.reading.composition
    statuses = c.by_status
    finished_doom = [f"{result.doomed[r]} {r}" for r in ("stale", "filtered") if result.doomed.get(r)]
    finished = f"{statuses['finished']} finished" + (f" ({', '.join(finished_doom)})" if finished_doom else "")
    head = (
        f"resuming from {result.step_phrase} will restore {result.restored} prompt groups: "
        f"{statuses['pending']} pending, {statuses['running']} running, {finished}, {statuses['failure']} failed"
    )
    predicted = result.predicted
    if result.warmup_state is WarmupState.SYNC_MODE:
        head = (
            f"resuming from {result.step_phrase} in sync mode restores no TransferQueue state "
            f"(the checkpoint holds {c.restored} prompt groups); sync mode has no warmup"
        )
    elif len(predicted) == 1:
        head += "; " + _warmup_phrase(result, predicted[0], would=False)
    elif predicted:
        outcomes = "; ".join(_warmup_phrase(result, record, would=True) for record in predicted)
        head += f"; the warmup depends on the verl version, which is unknown: {outcomes}"
    else:
        head += "; warmup and under-submission: need the trainer config (see note)"

    rows: list[tuple[str, str]] = []
    if reading.tq_dir is None:
        rows.append(("checkpoint", f"{reading.root / STEP_DIR.format(reading.step)} (no {TQ_DIR}/: nothing restored)"))
    else:
        saved = datetime.fromtimestamp(reading.saved_at_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        rows.append(("checkpoint", f"{reading.tq_dir} ({_size(reading.size_bytes)}, saved {saved})"))
    held = "" if result.restored == c.restored else f" (the checkpoint holds {c.restored}, by status and age below)"
    rows.append(("restored R", f"{result.restored} prompt groups{held}"))
    rows.append(("  by status", " · ".join(f"{s} {n}" for s, n in statuses.items())))
    ages = c.by_age(result.sample_step)
    if ages:
        rows.append((f"  by age at {result.sample_step}", " · ".join(f"{age}: {n}" for age, n in ages.items())))
    rows.append(
        (
            "re-issued K",
            f"{result.reissued} (pending + running, re-stamped step {result.sample_step}); "
            f"clears {result.cleared_trajectories} old trajectories",
        )
    )
    doomed = " · ".join(f"{r} {result.doomed[r]}" if r in result.doomed else f"{r} ?" for r in DOOM_REASONS)
    rule = ""
    if result.config is not None:
        threshold = result.config.max_off_policy_threshold
        rule = f"; off-policy threshold {'null' if threshold is None else threshold}, "
        rule += result.config.max_off_policy_strategy
    rows.append(("doomed", f"{doomed} (first sample at step {result.sample_step}{rule})"))
    orphans = f"{c.orphan_trajectories} orphaned: no prompt key, nothing clears them"
    rows.append(("trajectories", f"{c.trajectories} ({orphans})"))
    rows.append(("verl", result.version.describe()))
    if result.config is not None and result.record.target is not None:
        cfg = result.config
        rows.append(
            (
                "target T",
                f"{result.record.target} ({cfg.trainer_mode}, train_batch_size {cfg.train_batch_size}, "
                f"num_warmup_batches {cfg.num_warmup_batches:g}, gen_batch_size {cfg.effective_gen_batch_size})",
            )
        )
        rows.append(("over-restored O", str(result.record.over_restored)))
        rows += _prediction_rows(result)
    width = max(len(label) for label, _ in rows)
    lines = [head, ""] + [f"{label.ljust(width)}  {value}".rstrip() for label, value in rows]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def _prediction_rows(result: Preflight) -> list[tuple[str, str]]:
    """The rows that depend on the warmup: one value each, or a column per warmup while the version is unknown."""
    predicted = result.predicted
    table: list[tuple[str, list[str]]] = [
        ("warmup M", [_value(r.submitted) + f" ({r.warmup_state.value})" for r in predicted]),
        ("over-filled", [_value(r.over_filled) + (" (R + M - T)" if r.over_filled else "") for r in predicted]),
        (
            "useful window",
            [
                "-"
                if result.useful(r) is None
                else f"{result.useful(r)} of {r.target} (R {result.restored} - doomed "
                f"{sum(result.doomed.values())} + M {r.submitted})"
                for r in predicted
            ],
        ),
        ("under-submitted", [deficit(r) for r in predicted]),
    ]
    if len(predicted) == 1:
        return [(label, values[0]) for label, values in table]
    table.insert(0, ("warmup of", [r.semantics for r in predicted]))
    widths = [max(len(values[i]) for _, values in table) for i in range(len(predicted))]
    return [(label, "   ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))) for label, values in table]


def _value(value: int | None) -> str:
    return "-" if value is None else str(value)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
