"""Reconciles every source's events into run state and one resume record per trainer start.

Writers (sources, the API) call ``ingest``; each call persists, folds the new events in and publishes
a fresh immutable :class:`Snapshot`. Readers take ``tracker.snapshot`` and never block a writer.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import fmean
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
    TQPollView,
    WindowView,
)
from tqmon.store import PRUNED_RESUMES, StateStore
from tqmon.warmup import (
    DOOM_REASONS,
    PROMPT_STATUSES,
    WarmupConfig,
    WarmupState,
    decide_warmup,
    is_legacy_growth,
    is_legacy_unconditional,
    is_legacy_version,
    known_doomed,
    legacy_submitted,
    target_window,
)

EPOCH_CURSOR = "tq:controller"
STEP_RATE_WINDOW = 10  # steps averaged for the step duration
KEPT_COMPOSITIONS = 16  # checkpoint compositions kept for matching resumes to what they loaded
RESTART_CLAIM_SECONDS = 600.0  # a restart hint and a start reported this close together are one restart

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
    verl_version: str = "",
) -> ResumeRecord:
    """Compute T, M expected, O, doomed, the deficit and the warmup state from what was observed.

    ``verl_version`` (from ``run_started``) names the semantics when no log line or count betrays them.
    """
    restored = obs.restored
    if restored is None and config is not None and config.trainer_mode == "sync":
        restored = 0
    if restored is None and obs.resumed is False:
        restored = 0  # a fresh start restores nothing
    target = obs.target if obs.target is not None else window_target(config)

    predicted = decide_warmup(config, restored, resumed=obs.resumed) if config and restored is not None else None
    if predicted is not None and obs.target is not None and predicted.target != obs.target:
        predicted = None  # the trainer ran with another config than tqmon knows: what it logged wins
    expected: int | None = None
    if predicted is not None:
        expected = predicted.submitted
    elif target is not None and restored is not None:
        expected = max(0, target - restored)

    submitted = obs.submitted
    if submitted is None and predicted is not None and not predicted.logged and not obs.legacy_batches:
        submitted = predicted.submitted  # verl logs nothing when the warmup is off: the config is the evidence
    semantics = "verl-0.9.0" if is_legacy_version(verl_version) else "verl-0.9.1"
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


def window_target(config: WarmupConfig | None) -> int | None:
    """T, or None where no window is kept (``skip.rollout_tq`` replays cached rollouts instead)."""
    if config is None or config.skip_rollout_tq:
        return None
    return target_window(config)


def with_checkpoint(obs: _Observed, saved: tuple[CheckpointSaved, str, float] | None) -> _Observed:
    """A resume whose log gave only a total (or nothing: verl 0.9.0), completed from the checkpoint it loaded.

    ``tq.load_checkpoint(global_step_N)`` restores exactly that checkpoint's composition, so when the
    checkpoint source read it (and the totals agree), R's split by status and step is known too.
    """
    if saved is None or not obs.resumed or obs.by_status is not None or obs.groups is not None:
        return obs
    event, source, at = saved
    statuses = event.status_counts()
    if statuses is None or event.step != obs.checkpoint_step:
        return obs
    total = sum(statuses.values())
    if obs.restored not in (None, total):
        return obs  # the trainer restored something else: the log's total stands
    evidence = Evidence(source, event.type, event.id, at, f"composition of global_step_{event.step}: {statuses}")
    return replace(obs, restored=total, by_status=statuses, groups=event.groups, evidence=[*obs.evidence, evidence])


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
        flag_config: tuple[str, TrainerConfig, str] | None = None,
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
        self._tq: TQPollView | None = None
        self._restart_hint: Evidence | None = None  # a restart sign no start has claimed yet
        self._step_seconds: deque[float] = deque(maxlen=STEP_RATE_WINDOW)
        self._compositions: dict[int, tuple[CheckpointSaved, str, float]] = {}  # step -> a checkpoint's composition
        self._counters: dict[str, Counter[tuple[str, ...]]] = {
            name: Counter()
            for name in (
                "tqmon_events_total",
                "tqmon_events_rejected_total",
                "tqmon_log_lines_total",
                "tqmon_source_errors_total",
                "tqmon_checkpoint_pickle_refusals_total",
            )
        }
        if flag_config is not None:  # (trainer_mode, config, where it came from); run_started overrides it
            mode, cfg, origin = flag_config
            self._set_run(RunInfo("", mode, "", cfg.model_dump(), origin), cfg)
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
            self._resumes += self._store.meta(PRUNED_RESUMES)  # resumes of records retention dropped
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

    def count(self, name: str, labels: tuple[str, ...], n: int = 1) -> None:
        """Increment a persisted counter of the catalog that no event moves (a refused pickle)."""
        with self._lock:
            self._count(name, labels, n)
            self._publish()

    def refresh_state(self) -> None:
        """Republish when the state dir's health changed unprompted (a probe found the disk back)."""
        with self._lock:
            if self._store.health() != self._snapshot.state:
                self._publish()

    def reject(self, reason: str) -> None:
        with self._lock:
            self._count("tqmon_events_rejected_total", (reason,), 1)
            self._publish()

    def register_source(self, source: str, stale_after: float | None) -> None:
        """Declare a source; ``stale_after=None`` marks a push source (the API), up while tqmon serves."""
        with self._lock:
            self._health.setdefault(source, _Health(stale_after, ok=stale_after is None))
            self._publish()

    def source_succeeded(self, source: str, duration: float, *, stale_after: float | None = None) -> None:
        """``stale_after`` moves the source's staleness horizon (a poller whose interval adapts)."""
        with self._lock:
            health = self._health[source]
            if stale_after is not None:
                health.stale_after = stale_after
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

    def observe_windows(self, windows: Sequence[WindowView], poll: TQPollView) -> None:
        """Live windows from a poll; not persisted (the next poll supersedes them)."""
        with self._lock:
            for window in windows:
                self._windows[window.partition] = window
            self._tq = poll
            self._publish()

    def drop_windows(self, source: str, poll: TQPollView | None = None) -> None:
        """Forget a source's windows at once: a lost controller's last reply must not be served as fresh."""
        with self._lock:
            self._windows = {p: w for p, w in self._windows.items() if w.source != source}
            if poll is not None:
                self._tq = poll
            self._publish()

    def controller_epochs(self) -> int:
        seen = self._store.cursor(EPOCH_CURSOR)
        return int(seen["epochs"]) if isinstance(seen, dict) else 0

    def controller_epoch(self, controller_id: str, detail: str) -> int:
        """Record the TQ controller now watched; returns the epoch count (persisted across tqmon restarts).

        A controller with a new id means the trainer restarted: evidence for the start it belongs to.
        """
        with self._lock:
            seen = self._store.cursor(EPOCH_CURSOR)
            last_id, epochs = (seen["id"], int(seen["epochs"])) if isinstance(seen, dict) else (None, 0)
            if controller_id == last_id:
                return epochs
            epochs += 1
            self._store.commit((), cursors=[(EPOCH_CURSOR, {"id": controller_id, "epochs": epochs})])
            self.restart_hint(Evidence("tq", "controller_started", controller_id, self._clock(), detail))
            return epochs

    def restart_hint(self, evidence: Evidence) -> None:
        """A sign of a trainer restart that is not itself a verl event (a new TQ controller, a truncated JSONL).

        The open start gets it as evidence, or else the next one to open within
        :data:`RESTART_CLAIM_SECONDS`, next to what the log and events say.
        """
        with self._lock:
            obs = self._observed
            if obs is not None and not obs.sealed and abs(evidence.at - obs.started_at) <= RESTART_CLAIM_SECONDS:
                obs.evidence.append(evidence)
                self._rederive()
            else:
                self._restart_hint = evidence
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
        # Freshness is judged on tqmon's clock: a trainer clock running ahead must not make data look newer
        # than its arrival (docs/reliability.md, clock skew).
        seen = min(at, received_at)
        self._trainer_last_event = seen if self._trainer_last_event is None else max(self._trainer_last_event, seen)
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
                    event.resumed_from_step,
                    resumed,
                    at,
                    lambda o: o.resumed == resumed and (not o.decided or _corroborates(o, source, event.type)),
                )
                if event.resumed_from_step is not None:
                    self._trainer_step = event.resumed_from_step
            case CheckpointRestored():
                restored = event.restored_prompt_groups
                obs = self._attach(
                    event.step,
                    True,
                    at,
                    lambda o: (
                        o.restored in (None, restored) and (not o.decided or _corroborates(o, source, event.type))
                    ),
                )
                obs.restored = restored
                obs.by_status = event.status_counts() or obs.by_status
                obs.groups = event.groups or obs.groups
            case InflightReissued():
                step = None if event.step is None else max(0, event.step - 1)
                obs = self._attach(step, True, at, lambda o: o.reissued is None or _corroborates(o, source, event.type))
                obs.reissued, obs.cleared = event.reissued_prompt_groups, event.cleared_trajectories
            case WarmupDecided():
                obs = self._attach(
                    None,
                    bool(event.restored_prompt_groups),
                    at,
                    lambda o: not o.decided or _corroborates(o, source, event.type),
                )
                if event.target_prompt_groups is not None:
                    obs.target = event.target_prompt_groups
                if event.restored_prompt_groups is not None and obs.restored is None:
                    obs.restored = event.restored_prompt_groups
                # A second source's report of the same decision adds what it knows and keeps the rest.
                if event.submitted_prompt_groups is not None:
                    obs.submitted = event.submitted_prompt_groups
                if event.skip_reason is not None:
                    obs.skip_reason = event.skip_reason
                if event.legacy_warmup_batches is not None:
                    obs.legacy_batches = event.legacy_warmup_batches
            case StepCompleted():
                self._trainer_step = event.global_step
                if event.step_seconds is not None:
                    self._step_seconds.append(event.step_seconds)
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
                if not bare:
                    self._compositions[event.step] = (event, source, at)
                    while len(self._compositions) > KEPT_COMPOSITIONS:
                        del self._compositions[min(self._compositions)]
                # Never step back, and a bare log line never hides a composition read for the same step.
                older = current is not None and event.step < current.step
                if not older and not (
                    bare and current is not None and current.step == event.step and current.by_status
                ):
                    self._checkpoint_saved = (event, source)
                    self._derive_checkpoint()
                obs = self._observed if not bare and self._observed is not None else None
                if obs is not None:
                    self._rederive()  # the open start may have resumed from this very checkpoint
                    obs = None
            case WindowObserved():
                self._windows[event.partition] = WindowView(event.partition, source, seen, _str_keys(event.by_status))
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
        claim = self._restart_hint
        if claim is not None and abs(at - claim.at) <= RESTART_CLAIM_SECONDS:
            new.evidence.append(claim)
        self._restart_hint = None
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
        saved = self._compositions.get(obs.checkpoint_step) if obs.checkpoint_step is not None else None
        completed = with_checkpoint(obs, saved)
        return derive_record(completed, self._warmup_config, previous, self._run.verl_version if self._run else "")

    def _rederive(self) -> None:
        if self._observed is not None:
            self._records[self._observed.index] = self._derive(self._observed)

    def _publish(self) -> None:
        self._snapshot = self._build()

    def _build(self) -> Snapshot:
        last = self._records[-1] if self._records else None
        config = self._warmup_config
        state = self._store.health()
        failures: dict[tuple[str, ...], int] = {(reason,): n for reason, n in state.failures}
        target = last.target if last is not None and last.target is not None else window_target(config)
        return Snapshot(
            built_at=self._clock(),
            version=__version__,
            stale_after=self._stale_after,
            run=self._run,
            target_window=target,
            windows=tuple(self._windows.values()),
            trainer_step=self._trainer_step,
            trainer_last_event=self._trainer_last_event,
            trainer_step_seconds=fmean(self._step_seconds) if self._step_seconds else None,
            resumes_total=self._resumes,
            records_total=len(self._records),
            last_record=last,
            checkpoint=self._checkpoint,
            tq=self._tq,
            sources=tuple(
                SourceHealth(name, h.ok, h.last_success, h.last_duration, h.last_error, h.stale_after)
                for name, h in sorted(self._health.items())
            ),
            counters={name: dict(values) for name, values in self._counters.items()}
            | {"tqmon_state_write_failures_total": failures},
            state=state,
        )


def _corroborates(obs: _Observed, source: str, event_type: str) -> bool:
    """The same fact through a second door (the log and the verl plugin): another source already reported
    it for this start and this one has not, so it belongs to this start rather than opening a new one."""
    reporters = {evidence.source for evidence in obs.evidence if evidence.event_type == event_type}
    return bool(reporters) and source not in reporters


def _str_keys(counts: Mapping[Any, int]) -> dict[str, int]:
    return {str(key): value for key, value in counts.items()}


def _describe(event: Event) -> str:
    fields = event.model_dump(exclude={"id", "time", "type"}, exclude_none=True)
    return ", ".join(f"{key}={value}" for key, value in fields.items())
