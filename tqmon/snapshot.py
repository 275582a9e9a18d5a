"""Immutable views the tracker publishes; exporters and the API read them without locks or I/O."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from tqmon.cost import ResumeCost
from tqmon.events import PluginWindow
from tqmon.versions import UNKNOWN, VerlVersion
from tqmon.warmup import TRAIN, WarmupState


class SourceName(enum.StrEnum):
    """Every source tqmon has; the values of the ``source`` label. A new source adds its name here."""

    TQ = "tq"
    CHECKPOINT = "checkpoint"
    LOG = "log"
    JSONL = "jsonl"
    EVENTS = "events"
    REPLAY_BUFFER = "replay_buffer"  # the verl plugin's window after each replay buffer sync


# The trainer-time rule (tqmon.reconcile.trainer_time, and the store's retention query built from the same names):
# a reading of the checkpoint dir is not the trainer's doing, so it has no trainer time and its checkpoint is
# not a step the trainer saved; an event pushed to the API is posted as it happens, so its receipt is its time.
UNTIMED_SOURCE = SourceName.CHECKPOINT
PUSHED_SOURCE = SourceName.EVENTS


class Tally(enum.StrEnum):
    """What the tracker counts (label values in the comments); the exporters name the metric of each."""

    EVENTS = "events"  # (source, applied | duplicate)
    EVENTS_REJECTED = "events_rejected"  # (reason,): an event API request turned away
    LOG_LINES = "log_lines"  # (event | ignored | malformed,): trainer log lines read
    SOURCE_ERRORS = "source_errors"  # (source, reason)
    PICKLE_REFUSALS = "checkpoint_pickle_refusals"  # (reason,): a controller_state.pkl refused before unpickling


# The tallies only one source counts: exported while that source runs (an absent source's counter is no data,
# not a misleading 0).
TALLY_OWNERS = {Tally.LOG_LINES: SourceName.LOG, Tally.PICKLE_REFUSALS: SourceName.CHECKPOINT}


@dataclass(frozen=True, slots=True)
class Evidence:
    """One fact a source reported about a resume: which source said what, and when."""

    source: str
    event_type: str
    event_id: str
    at: float
    detail: str


@dataclass(frozen=True, slots=True)
class Claim:
    """One source's value for a quantity of a start: the evidence behind a disagreement."""

    source: str
    value: int
    at: float
    event_id: str = ""


@dataclass(frozen=True, slots=True)
class Disagreement:
    """Sources that reported one quantity of a start differently, beyond any legitimate difference."""

    quantity: str
    claims: tuple[Claim, ...]
    tolerance: str  # what was allowed: "exact" or the range the live window may legitimately take

    def describe(self) -> str:
        said = "; ".join(f"{c.source} said {c.value}" for c in self.claims)
        return f"{self.quantity}: {said} ({self.tolerance})"


class RegressionReason(enum.StrEnum):
    """Why a start's step went back (the ``reason`` of tqmon_resume_step_regression_steps)."""

    LATEST_FILE_MISSING = "latest_file_missing"  # no latest_checkpointed_iteration.txt: verl started from scratch
    LATEST_FILE_STALE = "latest_file_stale"  # it named an older global_step_N than the newest saved
    RESUME_CHOICE = "resume_choice"  # verl did not load what the latest file named: resume_mode/resume_from_path
    UNKNOWN = "unknown"  # the checkpoint dir is not watched, or its latest file changed since the start
    STEP_REPEATED = "step_repeated"  # a step logged again within one start (counted twice)


@dataclass(frozen=True, slots=True)
class StepRegression:
    """A start that began older than a step already saved, or a step logged twice: both steps and why."""

    step: int  # the step the start began at (0 for a fresh start), or the step logged again
    newer_step: int  # the newest step saved before the start, or the newest step logged before the repeat
    reason: RegressionReason

    @property
    def steps(self) -> int:
        """Steps of progress thrown away (a start) or counted twice (a repeat)."""
        return self.newer_step - self.step + (self.reason is RegressionReason.STEP_REPEATED)


@dataclass(frozen=True, slots=True)
class CheckpointListing:
    """The checkpoint dir's ``global_step_N`` folders and its latest file, as the checkpoint source listed them:
    what a start's step is compared with. Times are the folders' and the file's mtimes."""

    steps: tuple[tuple[int, float], ...]  # (N, when global_step_N was written), ascending N
    latest: int | None  # the step latest_checkpointed_iteration.txt names; None: missing or unreadable
    latest_at: float | None  # its mtime; None: missing
    latest_error: str | None = None  # why it could not be read (None: read, or missing)


@dataclass(frozen=True, slots=True)
class SelfHeal:
    """The verl plugin's self-heal decision for a start (``self_heal_decided``), as it reported it."""

    mode: str  # dry-run | on
    target: int  # T
    restored: int  # R
    doomed: Mapping[str, int]  # the known reasons
    warmup_submitted: int  # M, verl's warmup
    deficit: int  # before the top-up
    deficit_exact: bool
    max_top_up: int
    planned: int  # what the mode would submit
    submitted: int  # what it submitted (counts in M for the deficit after it)
    reason: str
    event_id: str


@dataclass(frozen=True, slots=True)
class ResumeRecord:
    """One trainer start (a resume from global_step_N, or a fresh start) and what its warmup did."""

    index: int
    resumed: bool
    started_at: float
    run_id: str = ""
    checkpoint_step: int | None = None  # N
    restored: int | None = None  # R
    restored_by_status: Mapping[str, int] | None = None  # statuses, or {"unknown": R} for a bare total
    reissued: int | None = None  # K
    cleared_trajectories: int | None = None
    target: int | None = None  # T
    expected: int | None = None  # max(0, T - R): what verl 0.9.1 submits, whatever the semantics
    submitted: int | None = None  # M actually submitted
    over_restored: int | None = None  # O
    # max(0, R + M - T): the window above T after warmup, all run (O under 0.9.1; 0.9.0 stacks M on the restore)
    over_filled: int | None = None
    doomed: Mapping[str, int] | None = None  # only the reasons that are known
    under_submitted: int | None = None
    warmup_state: WarmupState = WarmupState.UNKNOWN
    semantics: str = "verl-0.9.1"
    first_step_evictions: Mapping[str, int] | None = None
    first_step_generation_wait_seconds: float | None = None
    evidence: tuple[Evidence, ...] = ()
    # The deficit counts unknown doom reasons as 0: at least ``under_submitted``, not exactly.
    under_submitted_lower_bound: bool = False
    # verl defaults assumed for settings no config gave (``setting=value``), where they decided a number.
    assumed_defaults: tuple[str, ...] = ()
    disagreements: tuple[Disagreement, ...] = ()  # sources that contradict each other about this start
    # The quantities two claims were ever given for (tqmon.judge.QUANTITIES order); only these have a verdict.
    compared: tuple[str, ...] = ()
    cost: ResumeCost = field(default_factory=ResumeCost)  # what the resume cost; all unknown for a fresh start
    # The start began older than a step already saved, and steps logged twice since (empty: none seen).
    step_regressions: tuple[StepRegression, ...] = ()
    self_heal: SelfHeal | None = None  # the plugin's top-up after the warmup; None when it was off

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def disagreement_counts(self) -> dict[str, int]:
        """Each quantity compared, with the disagreements found on it (0: agreed); one never compared has no
        verdict. A quantity stays once compared, so its count falls back rather than vanishes."""
        return {q: sum(d.quantity == q for d in self.disagreements) for q in self.compared}


@dataclass(frozen=True, slots=True)
class RunInfo:
    run_id: str
    trainer_mode: str
    verl_version: str
    config: Mapping[str, Any] | None
    config_source: str  # where the warmup knobs came from: "events", "flags" or "none"


@dataclass(frozen=True, slots=True)
class SourceHealth:
    """A source's last attempt; whether it is up is decided at scrape time against the clock."""

    source: str
    ok: bool
    last_success: float | None
    last_duration: float | None
    last_error: str | None
    stale_after: float | None  # None: a push source, never stale

    def up(self, now: float) -> bool:
        if not self.ok:
            return False
        if self.stale_after is None:
            return True
        return self.last_success is not None and now - self.last_success <= self.stale_after


@dataclass(frozen=True, slots=True)
class WindowView:
    """The live window of one partition as the freshest source last saw it."""

    partition: str
    source: str
    observed_at: float
    by_status: Mapping[str, int]
    trajectories: int | None = None
    orphan_trajectories: int | None = None
    age_buckets: tuple[tuple[float, int], ...] | None = None  # cumulative (le, count), +Inf last
    age_sum: float | None = None
    max_age: float | None = None  # how long it stays fresh, if longer than --stale-after (a slow poller)

    @property
    def total(self) -> int:
        return sum(self.by_status.values())


@dataclass(frozen=True, slots=True)
class TQPollView:
    """The live TransferQueue poller: which controller it watches and what its polling costs."""

    controller_id: str | None  # None until a controller was found
    epochs: int  # controllers seen for this run; a new id is a new epoch (a trainer restart)
    interval: float  # poll interval in force
    busy_ratio: float | None  # estimated share of the controller's request thread tqmon uses
    reply_keys: int | None  # keys in the last kv_list reply; None when the last poll failed
    fast_until: float | None  # polling at the fast end until then (after a resume)
    cross_check: bool = False  # another source feeds the window: kv_list is only a sparse cross-check now


WindowReader = Literal["reporting", "kv_list", "unobserved"]  # tqmon_plugin_window_state
PLUGIN_WINDOW_READERS: tuple[str, ...] = get_args(WindowReader)


@dataclass(frozen=True, slots=True)
class PluginView:
    """The verl plugin's last ``plugin_state_changed``: how it reports the window, and why."""

    window: PluginWindow
    reason: str
    changed_at: float


@dataclass(frozen=True, slots=True)
class WarmupOutcome:
    """What the warmup of a resume would do under one verl release's semantics: a predicted record's numbers."""

    semantics: str
    target: int | None  # T
    submitted: int | None  # M
    warmup_state: WarmupState
    over_restored: int | None  # O
    over_filled: int | None
    under_submitted: int | None
    under_submitted_lower_bound: bool

    @classmethod
    def of(cls, record: ResumeRecord) -> WarmupOutcome:
        return cls(
            record.semantics,
            record.target,
            record.submitted,
            record.warmup_state,
            record.over_restored,
            record.over_filled,
            record.under_submitted,
            record.under_submitted_lower_bound,
        )


@dataclass(frozen=True, slots=True)
class CheckpointView:
    """The newest checkpoint seen, and what a resume from it would restore."""

    step: int
    source: str
    by_status: Mapping[str, int] | None = None
    doomed: Mapping[str, int] | None = None
    orphan_trajectories: int | None = None
    assumed_defaults: tuple[str, ...] = ()  # verl defaults the doomed groups assumed (no trainer config)
    # The warmup of a resume from it under the known verl version, or under each while it is unknown.
    outcomes: tuple[WarmupOutcome, ...] = ()


@dataclass(frozen=True, slots=True)
class StateHealth:
    """The state dir as the last write found it; ``failures`` counts refused writes by reason."""

    writable: bool = True
    error: str | None = None
    failures: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class OTLPView:
    """The OTLP push exporter's delivery record; only present while ``--otlp-endpoint`` is on."""

    export_failures: Mapping[str, int]  # signal -> exports that failed after the SDK's retries
    dropped_log_records: int  # resume log records dropped because the bounded queue was full


@dataclass(frozen=True, slots=True)
class Snapshot:
    built_at: float
    version: str
    stale_after: float
    run: RunInfo | None
    target_window: int | None
    windows: tuple[WindowView, ...]  # the newest of each (source, partition); see fresh_windows
    trainer_step: int | None
    trainer_last_event: float | None
    trainer_stepped_at: float | None  # when a completed or saved step last moved trainer_step on: progress
    trainer_step_seconds: float | None  # mean duration of the last steps (verl timing_s/step)
    resumes_total: int
    records_total: int
    last_record: ResumeRecord | None
    checkpoint: CheckpointView | None
    tq: TQPollView | None
    sources: tuple[SourceHealth, ...]
    counters: Mapping[Tally, Mapping[tuple[str, ...], int]]  # label values -> value
    records: tuple[ResumeRecord, ...] = ()  # every start, oldest first (records_total of them)
    otlp: OTLPView | None = None  # set by the OTLP exporter on the snapshot it and /metrics render
    state: StateHealth = StateHealth()  # the state dir; failures are the store's, counted in memory
    plugin: PluginView | None = None  # the verl plugin's last reported state
    verl_version: VerlVersion = UNKNOWN  # the release predictions assume, and its source

    def fresh_until(self, window: WindowView) -> float:
        """When a window stops being served: frozen data is never served as fresh."""
        return window.observed_at + max(self.stale_after, window.max_age or 0.0)

    def fresh_windows(self, now: float) -> tuple[WindowView, ...]:
        """The window of each partition that is served: the newest fresh one of any source."""
        newest: dict[str, WindowView] = {}
        for window in self.windows:
            if now <= self.fresh_until(window) and (
                window.partition not in newest or window.observed_at > newest[window.partition].observed_at
            ):
                newest[window.partition] = window
        return tuple(newest.values())

    def window_fresh_until(self, source: str) -> float | None:
        """Until when ``source`` has a fresh window (the TQ poll backs off while the plugin's is); None: none yet."""
        return max((self.fresh_until(w) for w in self.windows if w.source == source), default=None)

    def train_window(self, now: float) -> WindowView | None:
        """The prefetch window served now (the train partition's fresh window), if any."""
        return next((w for w in self.fresh_windows(now) if w.partition == TRAIN), None)

    def window_reader(self, now: float) -> WindowReader:
        """Who reads the live window now: ``reporting`` (the verl plugin, while its window is fresh),
        ``kv_list`` (the TQ poll, ``--ray-address``) or ``unobserved`` (neither)."""
        fed_until = self.window_fresh_until(SourceName.REPLAY_BUFFER)
        plugin_reports = self.plugin is None or self.plugin.window == "reporting"
        if plugin_reports and fed_until is not None and now <= fed_until:
            return "reporting"
        return "kv_list" if self.tq is not None else "unobserved"

    def window_status(self, now: float) -> str:
        train = self.train_window(now)
        if train is None or self.target_window is None:
            return "unknown"
        if train.total < self.target_window:
            return "under_filled"
        if train.total > self.target_window:
            return "over_filled"
        return "ok"

    def ready(self, now: float) -> bool:
        """At least one source succeeded and every source is up (nothing served is stale)."""
        return any(s.last_success is not None for s in self.sources) and all(s.up(now) for s in self.sources)
