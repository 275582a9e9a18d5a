"""Reconciles every source's events into run state and one resume record per trainer start.

Writers (sources, the API) call ``ingest``; each call persists, folds the new events in and publishes
a fresh immutable :class:`Snapshot`. Readers take ``tracker.snapshot`` and never block a writer.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqmon import __version__
from tqmon.events import (
    CheckpointRestored,
    CheckpointSaved,
    Event,
    GroupCount,
    InflightReissued,
    RunStarted,
    StepCompleted,
    TrainerConfig,
    TrainingStarted,
    WarmupDecided,
    WindowObserved,
    restored_groups,
    status_counts,
)
from tqmon.snapshot import (
    CheckpointView,
    Evidence,
    ResumeRecord,
    RunInfo,
    Snapshot,
    SourceHealth,
    WindowView,
)
from tqmon.store import StateStore
from tqmon.warmup import (
    DOOM_REASONS,
    PROMPT_STATUSES,
    WarmupConfig,
    WarmupState,
    decide_warmup,
    is_legacy_growth,
    is_legacy_unconditional,
    known_doomed,
    legacy_submitted,
    target_window,
)

_SKIP_STATES = {
    "sync_mode": WarmupState.SYNC_MODE,
    "skip_rollout_tq": WarmupState.DISABLED,
    "non_positive_warmup": WarmupState.DISABLED,
}


@dataclass
class _Observed:
    """What the sources said about one start; everything else in a record is derived from it."""

    index: int
    resumed: bool
    started_at: float
    run_id: str
    checkpoint_step: int | None = None
    restored: int | None = None
    by_status: dict[str, int] | None = None
    groups: list[GroupCount] | None = None
    reissued: int | None = None
    cleared: int | None = None
    target: int | None = None
    submitted: int | None = None
    skip_reason: str | None = None
    legacy_batches: int | None = None
    first_step_evictions: dict[str, int] | None = None
    first_step_wait: float | None = None
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        """The warmup already reported its decision."""
        return self.submitted is not None or self.skip_reason is not None or self.legacy_batches is not None

    @property
    def sealed(self) -> bool:
        """A start is over once its first step completed; later events belong to a new start."""
        return self.first_step_evictions is not None


@dataclass
class _Health:
    stale_after: float | None
    ok: bool = False
    last_success: float | None = None
    last_duration: float | None = None
    last_error: str | None = None


def derive_record(
    obs: _Observed,
    config: WarmupConfig | None,
    previous_restored: int | None,
) -> ResumeRecord:
    """Compute T, M expected, O, doomed, the deficit and the warmup state from what was observed."""
    restored = obs.restored
    if restored is None and config is not None and config.trainer_mode == "sync":
        restored = 0
    if restored is None and obs.resumed is False:
        restored = 0  # a fresh start restores nothing
    target = obs.target if obs.target is not None else (target_window(config) if config else None)

    predicted = decide_warmup(config, restored, resumed=obs.resumed) if config and restored is not None else None
    expected: int | None = None
    if predicted is not None:
        expected = predicted.submitted
    elif target is not None and restored is not None:
        expected = max(0, target - restored)

    submitted = obs.submitted
    semantics = "verl-0.9.1"
    if obs.legacy_batches is not None:
        semantics = "verl-0.9.0"
        submitted = legacy_submitted(config, obs.legacy_batches) if config else None

    state = _warmup_state(obs, restored, target, submitted, predicted.state if predicted else None, previous_restored)
    if state is WarmupState.LEGACY_UNCONDITIONAL:
        semantics = "verl-0.9.0"

    doomed = _doomed(obs, config, restored)
    under = None
    if target is not None and restored is not None and submitted is not None:
        # Unknown doom reasons count as 0, so with a bare log this is a lower bound of the deficit.
        known_doomed = sum((doomed or {}).values())
        under = max(0, target - (restored - known_doomed + submitted))
    reissued, cleared = obs.reissued, obs.cleared
    if reissued is None and (not obs.resumed or obs.decided or obs.sealed):
        # verl re-issues before the warmup and logs nothing when there was nothing in flight.
        reissued, cleared = 0, 0

    by_status: dict[str, int] | None = None
    if obs.by_status is not None:
        by_status = dict(obs.by_status)
    elif restored == 0:
        by_status = dict.fromkeys(PROMPT_STATUSES, 0)  # nothing restored: every status is known-empty
    elif restored is not None:
        by_status = {"unknown": restored}

    return ResumeRecord(
        index=obs.index,
        resumed=obs.resumed,
        started_at=obs.started_at,
        run_id=obs.run_id,
        checkpoint_step=obs.checkpoint_step if obs.resumed else 0,
        restored=restored,
        restored_by_status=by_status,
        reissued=reissued,
        cleared_trajectories=cleared,
        target=target,
        expected=expected,
        submitted=submitted,
        over_restored=max(0, restored - target) if restored is not None and target is not None else None,
        doomed=doomed,
        under_submitted=under,
        warmup_state=state,
        semantics=semantics,
        first_step_evictions=obs.first_step_evictions,
        first_step_generation_wait_seconds=obs.first_step_wait,
        evidence=tuple(obs.evidence),
    )


def _warmup_state(
    obs: _Observed,
    restored: int | None,
    target: int | None,
    submitted: int | None,
    predicted: WarmupState | None,
    previous_restored: int | None,
) -> WarmupState:
    if predicted is WarmupState.SYNC_MODE or obs.skip_reason == "sync_mode":
        return WarmupState.SYNC_MODE
    if obs.legacy_batches is not None:
        return WarmupState.LEGACY_UNCONDITIONAL
    if (
        restored is not None
        and target is not None
        and submitted is not None
        and is_legacy_unconditional(restored, target, submitted)
    ):
        return WarmupState.LEGACY_UNCONDITIONAL
    if obs.skip_reason in _SKIP_STATES:
        return _SKIP_STATES[obs.skip_reason]
    decided = obs.skip_reason is not None or submitted is not None
    if (
        not decided
        and restored is not None
        and target is not None
        and previous_restored is not None
        and is_legacy_growth(previous_restored, restored, target)
    ):
        return WarmupState.LEGACY_UNCONDITIONAL
    if decided and restored is not None:
        if submitted:
            return WarmupState.TOPPED_UP if obs.resumed else WarmupState.FRESH_START
        if target is not None:
            return WarmupState.SKIPPED_OVER_RESTORED if restored > target else WarmupState.SKIPPED_FULL
    if predicted in (WarmupState.DISABLED, WarmupState.SYNC_MODE):
        return predicted  # verl logs nothing for these: the config is the evidence
    return WarmupState.UNKNOWN


def _doomed(obs: _Observed, config: WarmupConfig | None, restored: int | None) -> dict[str, int] | None:
    """Doomed restored groups by the reasons that are known; None when none is."""
    if restored == 0:
        return dict.fromkeys(DOOM_REASONS, 0)
    groups = restored_groups(obs.groups) if obs.groups is not None and obs.checkpoint_step is not None else None
    return known_doomed(config, status_counts(obs.by_status, obs.groups), groups, obs.checkpoint_step or 0)


def checkpoint_doomed(event: CheckpointSaved, config: WarmupConfig | None) -> dict[str, int] | None:
    """Doomed groups of a resume from this checkpoint; None when the checkpoint's composition is unknown."""
    statuses = event.status_counts()
    if statuses is None:
        return None
    groups = restored_groups(event.groups) if event.groups is not None else None
    return known_doomed(config, statuses, groups, event.step)


class Tracker:
    """Owns run state; the only writer of the store and the snapshot."""

    def __init__(
        self,
        store: StateStore,
        *,
        stale_after: float = 300.0,
        flag_config: tuple[str, TrainerConfig] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._stale_after = stale_after
        self._clock = clock
        self._lock = threading.RLock()
        self._run: RunInfo | None = None
        self._warmup_config: WarmupConfig | None = None
        self._observed: _Observed | None = None
        self._records: list[ResumeRecord] = []
        self._resumes = 0
        self._trainer_step: int | None = None
        self._trainer_last_event: float | None = None
        self._windows: dict[str, WindowView] = {}
        self._checkpoint: CheckpointView | None = None
        self._checkpoint_saved: tuple[CheckpointSaved, str] | None = None  # the event behind it
        self._health: dict[str, _Health] = {}
        self._counters: dict[str, Counter[tuple[str, ...]]] = {
            name: Counter()
            for name in (
                "tqmon_events_total",
                "tqmon_events_rejected_total",
                "tqmon_log_lines_total",
                "tqmon_source_errors_total",
            )
        }
        if flag_config is not None:
            mode, cfg = flag_config
            self._set_run(RunInfo("", mode, "", cfg.model_dump(), "flags"), cfg)
        self._snapshot = self._build()

    # ---------------------------------------------------------------- reading

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def records(self, offset: int = 0, limit: int | None = None) -> list[ResumeRecord]:
        with self._lock:
            end = None if limit is None else offset + limit
            return self._records[offset:end]

    def cursor(self, key: str) -> object | None:
        return self._store.cursor(key)

    # ---------------------------------------------------------------- writing

    def replay(self) -> int:
        """Rebuild state from the store after a restart; returns the number of events replayed."""
        with self._lock:
            count = 0
            for stored in self._store.events():
                self._apply(stored.event, stored.source, stored.received_at)
                count += 1
            for (name, labels), value in self._store.counters().items():
                self._counters[name][tuple(labels.split("|"))] = value
            self._publish()
            return count

    def ingest(
        self,
        events: Sequence[Event],
        source: str,
        *,
        cursors: Iterable[tuple[str, object]] = (),
        log_lines: Mapping[str, int] | None = None,
    ) -> tuple[int, int]:
        """Persist and apply events from one source; returns (applied, duplicates)."""
        received_at = self._clock()
        counters = [("tqmon_log_lines_total", outcome, n) for outcome, n in (log_lines or {}).items() if n]
        with self._lock:
            # The events, their cursor and every counter they move commit in one transaction.
            fresh = self._store.commit(
                ((e, source, received_at) for e in events),
                counters=counters,
                cursors=cursors,
                count_events_as="tqmon_events_total",
            )
            applied = 0
            for event, is_new in zip(events, fresh, strict=True):
                if is_new:
                    self._apply(event, source, received_at)
                    applied += 1
            duplicates = len(events) - applied
            for outcome, n in (("applied", applied), ("duplicate", duplicates)):
                if n:
                    self._counters["tqmon_events_total"][(source, outcome)] += n
            for _name, outcome, n in counters:
                self._counters["tqmon_log_lines_total"][(outcome,)] += n
            self._publish()
            return applied, duplicates

    def reject(self, reason: str) -> None:
        with self._lock:
            self._count("tqmon_events_rejected_total", (reason,), 1)
            self._publish()

    def register_source(self, source: str, stale_after: float | None) -> None:
        """Declare a source; ``stale_after=None`` marks a push source (the API), up while tqmon serves."""
        with self._lock:
            self._health.setdefault(source, _Health(stale_after, ok=stale_after is None))
            self._publish()

    def source_succeeded(self, source: str, duration: float) -> None:
        with self._lock:
            health = self._health[source]
            health.ok, health.last_success, health.last_duration, health.last_error = (
                True,
                self._clock(),
                duration,
                None,
            )
            self._publish()

    def source_failed(self, source: str, reason: str, message: str, *, duration: float | None = None) -> None:
        with self._lock:
            health = self._health[source]
            health.ok, health.last_error = False, message
            if duration is not None:
                health.last_duration = duration
            self._count("tqmon_source_errors_total", (source, reason), 1)
            self._publish()

    def source_error(self, source: str, reason: str, count: int = 1) -> None:
        """Count bad records (a malformed line) without marking the source down."""
        with self._lock:
            self._count("tqmon_source_errors_total", (source, reason), count)
            self._publish()

    # ---------------------------------------------------------------- folding

    def _count(self, name: str, labels: tuple[str, ...], n: int) -> None:
        """Increment a persisted counter (the store first, so a crash never inflates it)."""
        if n:
            self._store.commit((), counters=[(name, "|".join(labels), n)])
            self._counters[name][labels] += n

    def _set_run(self, run: RunInfo, config: TrainerConfig) -> None:
        self._run = run
        self._warmup_config = config.warmup_config(run.trainer_mode)

    def _apply(self, event: Event, source: str, received_at: float) -> None:
        at = event.timestamp(received_at)
        obs: _Observed | None
        self._trainer_last_event = at if self._trainer_last_event is None else max(self._trainer_last_event, at)
        match event:
            case RunStarted():
                run = RunInfo(event.run_id, event.trainer_mode, event.verl_version, event.config.model_dump(), "events")
                self._set_run(run, event.config)
                self._derive_checkpoint()  # its doomed groups depend on the config
                obs = None  # run-level, not evidence of one start
                if self._observed is not None and not self._observed.sealed:
                    self._observed.run_id = event.run_id
                    self._rederive()  # the open start now derives from this config
            case TrainingStarted():
                resumed = event.resumed_from_step is not None
                obs = self._attach(
                    event.resumed_from_step, resumed, at, lambda o: o.resumed == resumed and not o.decided
                )
                if event.resumed_from_step is not None:
                    self._trainer_step = event.resumed_from_step
            case CheckpointRestored():
                restored = event.restored_prompt_groups
                obs = self._attach(event.step, True, at, lambda o: not o.decided and o.restored in (None, restored))
                obs.restored = restored
                obs.by_status = event.status_counts() or obs.by_status
                obs.groups = event.groups or obs.groups
            case InflightReissued():
                step = None if event.step is None else max(0, event.step - 1)
                obs = self._attach(step, True, at, lambda o: o.reissued is None)
                obs.reissued, obs.cleared = event.reissued_prompt_groups, event.cleared_trajectories
            case WarmupDecided():
                obs = self._attach(None, bool(event.restored_prompt_groups), at, lambda o: not o.decided)
                if event.target_prompt_groups is not None:
                    obs.target = event.target_prompt_groups
                if event.restored_prompt_groups is not None and obs.restored is None:
                    obs.restored = event.restored_prompt_groups
                obs.submitted = event.submitted_prompt_groups
                obs.skip_reason = event.skip_reason
                obs.legacy_batches = event.legacy_warmup_batches
            case StepCompleted():
                self._trainer_step = event.global_step
                obs = self._observed
                if obs is not None and not obs.sealed:
                    evicted = _str_keys(event.evicted_prompt_groups)
                    obs.first_step_evictions = {r: evicted.get(r, 0) for r in DOOM_REASONS}
                    obs.first_step_wait = event.generation_wait_seconds
                else:
                    obs = None
            case CheckpointSaved():
                if source != "checkpoint":  # the checkpoint dir may hold an older run's checkpoint
                    self._trainer_step = event.step
                current = self._checkpoint
                bare = event.status_counts() is None
                if not (bare and current is not None and current.step == event.step and current.by_status):
                    self._checkpoint_saved = (event, source)  # a bare log line never hides a read composition
                    self._derive_checkpoint()
                obs = None
            case WindowObserved():
                self._windows[event.partition] = WindowView(event.partition, source, at, _str_keys(event.by_status))
                obs = None
        if obs is not None:
            obs.evidence.append(Evidence(source, event.type, event.id, at, _describe(event)))
            self._rederive()

    def _attach(
        self, checkpoint_step: int | None, resumed: bool, at: float, accepts: Callable[[_Observed], bool]
    ) -> _Observed:
        """The start an event belongs to: the open one if it is compatible, else a new one."""
        obs = self._observed
        if (
            obs is not None
            and not obs.sealed
            and (checkpoint_step is None or obs.checkpoint_step in (None, checkpoint_step))
            and accepts(obs)
        ):
            if obs.checkpoint_step is None:
                obs.checkpoint_step = checkpoint_step
            return obs
        new = _Observed(
            index=len(self._records),
            resumed=resumed,
            started_at=at,
            run_id=self._run.run_id if self._run else "",
            checkpoint_step=checkpoint_step,
        )
        self._observed = new
        self._records.append(self._derive(new))
        self._resumes += resumed
        return new

    def _derive_checkpoint(self) -> None:
        if self._checkpoint_saved is None:
            return
        event, source = self._checkpoint_saved
        self._checkpoint = CheckpointView(
            event.step,
            source,
            event.status_counts(),
            checkpoint_doomed(event, self._warmup_config),
            event.orphan_trajectories,
        )

    def _derive(self, obs: _Observed) -> ResumeRecord:
        previous = self._records[obs.index - 1].restored if obs.index > 0 else None
        return derive_record(obs, self._warmup_config, previous)

    def _rederive(self) -> None:
        if self._observed is not None:
            self._records[self._observed.index] = self._derive(self._observed)

    def _publish(self) -> None:
        self._snapshot = self._build()

    def _build(self) -> Snapshot:
        last = self._records[-1] if self._records else None
        config = self._warmup_config
        target = last.target if last is not None and last.target is not None else None
        if target is None and config is not None:
            target = target_window(config)
        return Snapshot(
            built_at=self._clock(),
            version=__version__,
            stale_after=self._stale_after,
            run=self._run,
            target_window=target,
            windows=tuple(self._windows.values()),
            trainer_step=self._trainer_step,
            trainer_last_event=self._trainer_last_event,
            resumes_total=self._resumes,
            records_total=len(self._records),
            last_record=last,
            checkpoint=self._checkpoint,
            sources=tuple(
                SourceHealth(name, h.ok, h.last_success, h.last_duration, h.last_error, h.stale_after)
                for name, h in sorted(self._health.items())
            ),
            counters={name: dict(values) for name, values in self._counters.items()},
        )


def _str_keys(counts: Mapping[Any, int]) -> dict[str, int]:
    return {str(key): value for key, value in counts.items()}


def _describe(event: Event) -> str:
    fields = event.model_dump(exclude={"id", "time", "type"}, exclude_none=True)
    return ", ".join(f"{key}={value}" for key, value in fields.items())
