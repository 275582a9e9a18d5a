"""Folds every source's events into observations of trainer starts, one :class:`Observed` per start.

The middle of the pipeline: sources produce events, this module folds them, :mod:`tqmon.derivation` turns
each start's observations into its resume record, the tracker keeps the result and publishes it. Nothing
here does I/O, reads a clock or takes a lock: given the same events (with their receive times) it reaches
the same state, which is why the tracker can rebuild it by replaying the store.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from statistics import fmean
from typing import Any

from tqmon.composition import from_group_counts, window_view
from tqmon.derivation import (
    Observed,
    SavedCheckpoint,
    checkpoint_doomed,
    derive_record,
    predict_resumes,
    with_checkpoint,
)
from tqmon.events import (
    CheckpointRestored,
    CheckpointSaved,
    Event,
    InflightReissued,
    PluginStateChanged,
    RunStarted,
    SelfHealDecided,
    StepCompleted,
    TrainingStarted,
    WarmupDecided,
    WindowObserved,
)
from tqmon.judge import has_tq_dir, in_order
from tqmon.snapshot import (
    PUSHED_SOURCE,
    UNTIMED_SOURCE,
    CheckpointListing,
    CheckpointView,
    Claim,
    Evidence,
    PluginView,
    ResumeRecord,
    RunInfo,
    SelfHeal,
    SourceName,
    WarmupOutcome,
    WindowView,
)
from tqmon.versions import VerlVersion, VersionSource, betrayed_by, choose, named
from tqmon.warmup import (
    DOOM_REASONS,
    INFLIGHT_STATUSES,
    TRAIN,
    GivenConfig,
    TrainerConfig,
    WarmupConfig,
    eviction_rules,
    window_target,
)

STEP_RATE_WINDOW = 10  # steps averaged for the step duration
KEPT_COMPOSITIONS = 16  # checkpoint compositions kept for matching resumes to what they loaded
RECENT_TRAIN_WINDOWS = 64  # train windows kept for a start whose reports arrive after them (a minute of polls)
RESTART_CLAIM_SECONDS = 600.0  # a restart hint and a start reported this close together are one restart


def corroborates(obs: Observed, source: str, event_type: str) -> bool:
    """The same fact through a second door (the log and the verl plugin): another source already reported
    it for this start and this one has not, so it belongs to this start rather than opening a new one."""
    reporters = {evidence.source for evidence in obs.evidence if evidence.event_type == event_type}
    return bool(reporters) and source not in reporters


# ---------------------------------------------------------------- folding events


class Reconciler:
    """The fold of every applied event: run info, the open start, the records, the checkpoint, the windows.

    Deterministic in its inputs (each event comes with the time it was received); the tracker owns one and
    serialises the calls.
    """

    def __init__(self, given: GivenConfig | None = None, versions: Iterable[VerlVersion] = ()) -> None:
        """``versions``: what tqmon was told of the verl release before any event (``--verl-version``, the verl
        installed next to it); the plugin's ``run_started`` and the log's own lines come as events."""
        self.run: RunInfo | None = None
        self.warmup_config: WarmupConfig | None = None
        self.records: list[ResumeRecord] = []
        self.resumes = 0
        self.trainer_step: int | None = None
        self.trainer_last_event: float | None = None
        self.trainer_stepped_at: float | None = None  # when a completed or saved step last moved trainer_step on
        self.windows: dict[tuple[str, str], WindowView] = {}  # (source, partition) -> the newest seen
        self.plugin: PluginView | None = None  # the verl plugin's last reported state; None: it never said
        self.checkpoint: CheckpointView | None = None
        self._observed: Observed | None = None
        self._checkpoint_saved: tuple[CheckpointSaved, str] | None = None  # the event behind ``checkpoint``
        # The checkpoint dir as the checkpoint source last read it (None: nothing readable there); once read,
        # it, not the trainer's "saved" events, is what ``checkpoint`` shows, rollbacks and deletions included.
        self._directory: tuple[CheckpointSaved | None] | None = None
        self._restart_hint: Evidence | None = None  # a restart sign no start has claimed yet
        self.listing: CheckpointListing | None = None  # the checkpoint dir's folders and latest file, last listed
        self._step_seconds: deque[float] = deque(maxlen=STEP_RATE_WINDOW)
        self._compositions: dict[int, SavedCheckpoint] = {}  # step -> a checkpoint's composition
        self._last_train_window: Claim | None = None  # never dropped: a lost window's size after a restart
        self._train_windows: deque[Claim] = deque(maxlen=RECENT_TRAIN_WINDOWS)  # for a start heard after them
        # Since the open start began: the last step the trainer completed and saved, and its last timed event.
        self._step_completed: int | None = None
        self._step_saved: int | None = None
        self._saved_claim: Claim | None = None  # the newest of those saves, as its source reported it
        self._logged: dict[str, int] = {}  # source -> the newest step it logged since the open start began
        self._last_activity: float | None = None
        self._event_time: float | None = None  # trainer_time of the event being applied
        self._versions: dict[VersionSource, VerlVersion] = {v.source: v for v in versions if v.source is not None}
        self.verl_version = choose(self._versions.values())  # what the predictions and records assume
        if given is not None:  # run_started overrides it
            run = RunInfo(given.run_id, given.trainer_mode, "", given.config.model_dump(), given.origin)
            self._set_run(run, given.config)

    @property
    def step_seconds(self) -> float | None:
        return fmean(self._step_seconds) if self._step_seconds else None

    @property
    def target_window(self) -> int | None:
        """T of the newest start, or the config's while there is none (or it did not say)."""
        last = self.records[-1] if self.records else None
        return last.target if last is not None and last.target is not None else window_target(self.warmup_config)

    def wanted_checkpoint(self) -> tuple[int, str | None] | None:
        """The checkpoint the newest start resumed from while its composition is not known: its step and the
        folder verl named (None: not named)."""
        obs = self._observed
        if obs is None or not obs.resumed or obs.checkpoint_step is None or obs.checkpoint_step in self._compositions:
            return None
        return obs.checkpoint_step, obs.checkpoint_path

    def observe_windows(self, windows: Iterable[WindowView]) -> None:
        """Live windows from a poller, each superseding its source's last view of the partition."""
        for window in windows:
            self._keep_window(window)

    def drop_windows(self, source: str) -> None:
        """Forget a source's windows: a lost controller's last reply must not be served as fresh."""
        self.windows = {key: w for key, w in self.windows.items() if w.source != source}

    def hint(self, evidence: Evidence) -> None:
        """A sign of a trainer restart that is not itself a verl event (a new TQ controller, a truncated JSONL).

        The open start gets it as evidence, or else the next one to open within
        :data:`RESTART_CLAIM_SECONDS`, next to what the log and events say.
        """
        obs = self._observed
        if obs is not None and not obs.sealed and abs(evidence.at - obs.started_at) <= RESTART_CLAIM_SECONDS:
            obs.evidence.append(evidence)
            self._rederive()
        else:
            self._restart_hint = evidence

    def apply(self, event: Event, source: str, received_at: float) -> None:
        at = event.timestamp(received_at)
        # Freshness is judged on the arrival time: a trainer clock running ahead of tqmon's must not make data
        # look newer than its arrival (docs/reliability.md, clock skew). Evidence keeps the trainer's time.
        seen = min(at, received_at)
        self.trainer_last_event = seen if self.trainer_last_event is None else max(self.trainer_last_event, seen)
        self._event_time = trainer_time(event, source, received_at)
        step_before = self.trainer_step
        evidence_of: Observed | None = None  # the start this event is evidence of
        if source == SourceName.LOG and (told := betrayed_by(event)) is not None:
            self._hear_version("log", told)
        match event:
            case RunStarted():
                run = RunInfo(
                    event.run_id, event.trainer_mode, event.verl_version, event.config.model_dump(), SourceName.EVENTS
                )
                self._set_run(run, event.config)
                self._hear_version("run_started", named(event.verl_version, "run_started", "the verl plugin"))
                self._derive_checkpoint()  # its doomed groups depend on the config
                if self._observed is not None and not self._observed.sealed:
                    self._observed.run_id = event.run_id
                    self._rederive()  # the open start now derives from this config
            case TrainingStarted():
                resumed = event.resumed_from_step is not None
                evidence_of = self._attach(
                    event.resumed_from_step,
                    resumed,
                    at,
                    lambda o: o.resumed == resumed and (not o.decided or corroborates(o, source, event.type)),
                )
                evidence_of.checkpoint_path = evidence_of.checkpoint_path or event.checkpoint_path
                if event.resumed_from_step is not None:
                    self.trainer_step = event.resumed_from_step
            case CheckpointRestored():
                restored = event.restored_prompt_groups
                evidence_of = self._attach(
                    event.step,
                    True,
                    at,
                    lambda o: (
                        (o.restored in (None, restored) or corroborates(o, source, event.type))
                        and (not o.decided or corroborates(o, source, event.type))
                    ),
                )
                if evidence_of.restored in (None, restored):  # a contradiction is judged, the first report kept
                    evidence_of.restored = restored
                    evidence_of.by_status = event.status_counts() or evidence_of.by_status
                    evidence_of.groups = event.groups or evidence_of.groups
                evidence_of.restored_at = at if evidence_of.restored_at is None else min(evidence_of.restored_at, at)
                evidence_of.claim("restored", source, restored, at, event.id)
                for status, count in (event.status_counts() or {}).items():
                    evidence_of.claim(f"restored_{status}", source, count, at, event.id)
            case InflightReissued():
                step = None if event.step is None else max(0, event.step - 1)
                evidence_of = self._attach(
                    step, True, at, lambda o: o.reissued is None or corroborates(o, source, event.type)
                )
                evidence_of.reissued, evidence_of.cleared = event.reissued_prompt_groups, event.cleared_trajectories
                evidence_of.claim("reissued", source, event.reissued_prompt_groups, at, event.id)
                evidence_of.loop_started_at = _latest(evidence_of.loop_started_at, self._event_time)
            case WarmupDecided():
                evidence_of = self._attach(
                    None,
                    bool(event.restored_prompt_groups),
                    at,
                    lambda o: not o.decided or corroborates(o, source, event.type),
                )
                _take_decision(evidence_of, event)
                _claim_decision(evidence_of, event, source, at)
                evidence_of.loop_started_at = _latest(evidence_of.loop_started_at, self._event_time)
            case SelfHealDecided():
                evidence_of = self._attach(None, True, at, lambda o: o.self_heal is None)
                evidence_of.self_heal = SelfHeal(
                    mode=event.mode,
                    target=event.target_prompt_groups,
                    restored=event.restored_prompt_groups,
                    doomed=_str_keys(event.doomed_prompt_groups),
                    warmup_submitted=event.warmup_prompt_groups,
                    deficit=event.deficit_prompt_groups,
                    deficit_exact=event.deficit_exact,
                    max_top_up=event.max_top_up,
                    planned=event.planned_prompt_groups,
                    submitted=event.submitted_prompt_groups,
                    reason=event.reason,
                    event_id=event.id,
                )
            case StepCompleted():
                self.trainer_step = event.global_step
                self._check_repeat(event, source, at)
                # The log's console line and the JSONL report the same step: its duration counts once.
                repeated = self._step_completed is not None and event.global_step <= self._step_completed
                self._step_completed = max(event.global_step, self._step_completed or 0)
                if event.step_seconds is not None and not repeated:
                    self._step_seconds.append(event.step_seconds)
                obs = self._observed
                if obs is not None and not obs.sealed:
                    evicted = _str_keys(event.evicted_prompt_groups)
                    obs.seal(at, {r: evicted.get(r, 0) for r in DOOM_REASONS})
                    obs.first_step_wait = event.generation_wait_seconds
                    obs.first_step_seconds = event.step_seconds
                    evidence_of = obs
            case CheckpointSaved():
                self._saved(event, source, at)
            case WindowObserved():
                self._observe_window(event, event.source_name(source), seen)
            case PluginStateChanged():
                self.plugin = PluginView(event.window, event.reason, at)
                if not self.plugin_reports:
                    self.drop_windows(SourceName.REPLAY_BUFFER)
        if isinstance(event, StepCompleted | CheckpointSaved) and self.trainer_step != step_before:
            # The trainer progresses (what the alerts and the status page read); a resume going back is not a step.
            self.trainer_stepped_at = _latest(self.trainer_stepped_at, seen)
        if evidence_of is not None:
            evidence_of.evidence.append(Evidence(source, event.type, event.id, at, _describe(event)))
            for window in self._train_windows:  # seen before this report made them count (the log lagged)
                evidence_of.saw_window(window)
            self._rederive()
        if not isinstance(event, RunStarted):  # a new process announcing itself is not activity before a stop
            self._last_activity = _latest(self._last_activity, self._event_time)

    @property
    def plugin_reports(self) -> bool:
        """The verl plugin's windows count: it reports, or never said otherwise (an older plugin)."""
        return self.plugin is None or self.plugin.window == "reporting"

    def accepts_window(self, source: str) -> bool:
        """A pushed window of ``source`` is taken: not the plugin's once it said it stopped (a view it had
        queued may still arrive after its ``failed``)."""
        return source != SourceName.REPLAY_BUFFER or self.plugin_reports

    def _observe_window(self, event: WindowObserved, source: str, at: float) -> None:
        """A pushed window; one with a composition gets ages like a polled one."""
        if not self.accepts_window(source):
            return
        key = (source, event.partition)
        if key in self.windows and self.windows[key].observed_at > at:
            return  # a retried older post must not replace a newer window
        if event.groups is None:
            self._keep_window(WindowView(event.partition, source, at, _str_keys(event.by_status)), event.id)
        else:
            composition = from_group_counts(event.groups, event.trajectories or 0, event.orphan_trajectories or 0)
            view = window_view(event.partition, source, composition, self.trainer_step, at)
            view = replace(view, trajectories=event.trajectories, orphan_trajectories=event.orphan_trajectories)
            self._keep_window(view, event.id)

    def _keep_window(self, window: WindowView, event_id: str = "") -> None:
        """The newest view of its (source, partition); the open start also keeps the train windows the judge
        compares with what was reported, and the last one stays for a lost window's size after a restart."""
        self.windows[(window.source, window.partition)] = window
        if window.partition != TRAIN:
            return
        seen = Claim(window.source, window.total, window.observed_at, event_id)
        self._last_train_window = seen
        self._train_windows.append(seen)
        obs = self._observed
        if obs is not None and obs.saw_window(seen):  # by when it was seen, not when it arrived
            self._rederive()

    def _saved(self, event: CheckpointSaved, source: str, at: float) -> None:
        if source != UNTIMED_SOURCE:  # the checkpoint dir may hold an older run's checkpoint
            self.trainer_step = event.step
            self._step_saved = max(event.step, self._step_saved or 0)
            if self._saved_claim is None or event.step > self._saved_claim.value:
                self._saved_claim = Claim(source, event.step, at, event.id)
        current = self.checkpoint
        bare = event.status_counts() is None
        if not bare:
            self._compositions[event.step] = (event, source, at)
            self._trim_compositions()
        # Never step back, and a bare log line never hides a composition read for the same step.
        older = current is not None and event.step < current.step
        if not older and not (bare and current is not None and current.step == event.step and current.by_status):
            self._checkpoint_saved = (event, source)
            self._derive_checkpoint()
        if not bare:
            self._rederive()  # the open start may have resumed from this very checkpoint

    def _trim_compositions(self) -> None:
        """Keep the newest :data:`KEPT_COMPOSITIONS`, and always the ones the open start is judged against (the
        checkpoint it loaded, the newest before it): the trainer saves on after a resume, and dropping them
        would withdraw the verdicts they gave (the composition's R, the live window's bounds) mid-run."""
        obs = self._observed
        step = obs.checkpoint_step if obs is not None and obs.resumed else None
        before = self._before(step)
        pinned = {step, None if before is None else before[0].step}
        while len(self._compositions) > KEPT_COMPOSITIONS:
            del self._compositions[min(s for s in self._compositions if s not in pinned)]

    def observe_checkpoint_dir(self, event: CheckpointSaved | None) -> None:
        """The checkpoint dir as it is now: its latest checkpoint, or None when it has none it can read (gone,
        rolled back to a deleted step, unreadable). Unlike trainer events this may step back."""
        self._directory = (event,)
        self._derive_checkpoint()

    def observe_checkpoint_listing(self, listing: CheckpointListing) -> None:
        """The checkpoint dir's ``global_step_N`` folders and latest file as listed now: the newest start's step
        is compared with the folders written before it (tqmon.derivation.step_regressions)."""
        if listing != self.listing:
            self.listing = listing
            self._rederive()

    def _check_repeat(self, event: StepCompleted, source: str, at: float) -> None:
        """A step the open start already counted: logged again by the same source, or not newer than the
        checkpoint it resumed from (verl steps on from N + 1). Another source's report of a step is not one."""
        obs = self._observed
        if obs is None:
            return
        done = [self._logged[source]] if source in self._logged else []
        if obs.resumed and obs.checkpoint_step is not None:
            done.append(obs.checkpoint_step)
        newest = max(done, default=None)
        self._logged[source] = max(event.global_step, self._logged.get(source, 0))
        if newest is not None and event.global_step <= newest:
            obs.repeated_steps.append((Claim(source, event.global_step, at, event.id), newest))
            self._rederive()

    def _set_run(self, run: RunInfo, config: TrainerConfig) -> None:
        self.run = run
        self.warmup_config = config.warmup_config(run.trainer_mode)

    def _attach(
        self, checkpoint_step: int | None, resumed: bool, at: float, accepts: Callable[[Observed], bool]
    ) -> Observed:
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
        new = Observed(
            index=len(self.records),
            resumed=resumed,
            started_at=at,
            run_id=self.run.run_id if self.run else "",
            checkpoint_step=checkpoint_step,
            window_before=self._last_train_window if resumed else None,
            first_line_at=self._event_time,
            last_step_before=None if self._step_completed is None else max(self._step_completed, self._step_saved or 0),
            last_activity_before=self._last_activity,
            last_saved_before=self._saved_claim,
        )
        self._step_completed = self._step_saved = self._saved_claim = None
        self._logged = {}
        claim = self._restart_hint
        if claim is not None and abs(at - claim.at) <= RESTART_CLAIM_SECONDS:
            new.evidence.append(claim)
        self._restart_hint = None
        self._observed = new
        self.records.append(self._derive(new))
        self.resumes += resumed
        return new

    def _derive_checkpoint(self) -> None:
        if self._directory is not None:
            (current,) = self._directory
            if current is None:
                self.checkpoint = None
                return
            event, source = current, str(SourceName.CHECKPOINT)
        elif self._checkpoint_saved is not None:
            event, source = self._checkpoint_saved
        else:
            return
        statuses = event.status_counts()
        outcomes: tuple[WarmupOutcome, ...] = ()
        if statuses and self.warmup_config is not None:
            reissued = sum(n for status, n in statuses.items() if status in INFLIGHT_STATUSES)
            predicted = predict_resumes(event, reissued, None, self.warmup_config, self.verl_version)
            outcomes = tuple(WarmupOutcome.of(record) for record in predicted)
        self.checkpoint = CheckpointView(
            event.step,
            source,
            statuses,
            checkpoint_doomed(event, self.warmup_config),
            event.orphan_trajectories,
            eviction_rules(self.warmup_config, event.groups is not None)[1] if statuses else (),
            outcomes,
        )

    def _hear_version(self, source: VersionSource, version: VerlVersion | None) -> None:
        """A source's word on the verl release (None: it names none); the most believed one decides, and the
        checkpoint's prediction and the open start follow a change."""
        if version is None:
            self._versions.pop(source, None)
        else:
            self._versions[source] = version
        chosen = choose(self._versions.values())
        if chosen != self.verl_version:
            self.verl_version = chosen
            self._derive_checkpoint()
            self._rederive()

    def _derive(self, obs: Observed) -> ResumeRecord:
        previous = self.records[obs.index - 1].restored if obs.index > 0 else None
        saved = self._compositions.get(obs.checkpoint_step) if obs.checkpoint_step is not None else None
        completed = with_checkpoint(obs, saved, self.warmup_config)
        before = self._before(obs.checkpoint_step)
        semantics = self.verl_version.semantics
        record = derive_record(completed, self.warmup_config, previous, semantics, saved, before, self.listing)
        if obs.index < len(self.records):  # once compared, a quantity keeps its verdict: its series falls back to 0
            record = replace(record, compared=in_order([*self.records[obs.index].compared, *record.compared]))
        return record

    def _before(self, step: int | None) -> SavedCheckpoint | None:
        """The newest composition with TQ state saved before ``step``: what a lost window held at best."""
        steps = [
            s
            for s, c in self._compositions.items()
            if step is not None and s < step and has_tq_dir(c[0].path) is not False
        ]
        return self._compositions[max(steps)] if steps else None

    def _rederive(self) -> None:
        if self._observed is not None:
            self.records[self._observed.index] = self._derive(self._observed)


def _take_decision(obs: Observed, event: WarmupDecided) -> None:
    """A second source's report of the same decision adds what it knows and keeps the rest."""
    if event.target_prompt_groups is not None:
        obs.target = event.target_prompt_groups
    if event.restored_prompt_groups is not None and obs.restored is None:
        obs.restored = event.restored_prompt_groups
    if event.submitted_prompt_groups is not None:
        obs.submitted = event.submitted_prompt_groups
    if event.skip_reason is not None:
        obs.skip_reason = event.skip_reason
    if event.legacy_warmup_batches is not None:
        obs.legacy_batches = event.legacy_warmup_batches


def _claim_decision(obs: Observed, event: WarmupDecided, source: str, at: float) -> None:
    """T, M and R as this source reported the warmup decision."""
    if obs.decided_at is None and (event.submitted_prompt_groups is not None or event.skip_reason is not None):
        obs.decided_at = at
    reported = {
        "target": event.target_prompt_groups,
        "submitted": event.submitted_prompt_groups,
        "restored": event.restored_prompt_groups,
    }
    for quantity, value in reported.items():
        if value is not None:
            obs.claim(quantity, source, value, at, event.id)


def trainer_time(event: Event, source: str, received_at: float) -> float | None:
    """When the trainer did it: the event's own time, or its receipt for a pushed event (posted as it happens).

    A line without a timestamp (verl's JSONL and console step lines) may be read long after it was written
    (a catch-up, ``tqmon analyze``): its receipt is not the trainer's time, so it has none. Nor has a reading
    of the checkpoint dir: it may come before the log lines of the same time, or after a later save.
    """
    if source == UNTIMED_SOURCE:
        return None
    if event.time is not None:
        return event.time.timestamp()
    return received_at if source == PUSHED_SOURCE else None


def _latest(current: float | None, candidate: float | None) -> float | None:
    if candidate is None:
        return current
    return candidate if current is None else max(current, candidate)


def _str_keys(counts: Mapping[Any, int]) -> dict[str, int]:
    return {str(key): value for key, value in counts.items()}


def _describe(event: Event) -> str:
    fields = event.model_dump(exclude={"id", "time", "type"}, exclude_none=True)
    return ", ".join(f"{key}={value}" for key, value in fields.items())
