"""Folds every source's events into observations of trainer starts and derives one resume record per start.

The middle of the pipeline: sources produce events, this module reconciles them, the tracker keeps the
result and publishes it. Nothing here does I/O, reads a clock or takes a lock: given the same events (with
their receive times) it reaches the same state, which is why the tracker can rebuild it by replaying the
store, and why ``tqmon inspect`` predicts a resume with the very derivation the metrics use
(:func:`predict_resume`).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from statistics import fmean
from typing import Any

from tqmon.composition import from_group_counts, window_view
from tqmon.cost import CostInputs, resume_cost
from tqmon.events import (
    CheckpointRestored,
    CheckpointSaved,
    Event,
    GroupCount,
    InflightReissued,
    RunStarted,
    StepCompleted,
    TrainingStarted,
    WarmupDecided,
    WindowObserved,
    restored_groups,
    status_counts,
)
from tqmon.judge import (
    CHECKPOINT_WINDOW,
    CONFIG_SOURCE,
    WINDOW_AFTER_WARMUP,
    Bounds,
    Judgement,
    complete_doomed,
    has_tq_dir,
    in_order,
    is_lost_window,
    judge,
    terminal_groups,
    window_bounds,
)
from tqmon.snapshot import CheckpointView, Claim, Evidence, ResumeRecord, RunInfo, SourceName, WindowView
from tqmon.warmup import (
    DOOM_REASONS,
    PROMPT_STATUSES,
    GivenConfig,
    TrainerConfig,
    WarmupConfig,
    WarmupState,
    decide_warmup,
    doomed_complete,
    is_legacy_growth,
    is_legacy_unconditional,
    is_legacy_version,
    known_doomed,
    legacy_submitted,
    skip_reason,
    target_window,
    under_submitted,
)

STEP_RATE_WINDOW = 10  # steps averaged for the step duration
KEPT_COMPOSITIONS = 16  # checkpoint compositions kept for matching resumes to what they loaded
RESTART_CLAIM_SECONDS = 600.0  # a restart hint and a start reported this close together are one restart
INFERENCE = "inference"  # the source of evidence tqmon inferred rather than heard
REISSUE_FOLLOWERS = ("warmup_decided", "step_completed")  # reports verl's re-issue line comes before

_SKIP_STATES = {
    "sync_mode": WarmupState.SYNC_MODE,
    "skip_rollout_tq": WarmupState.DISABLED,
    "non_positive_warmup": WarmupState.DISABLED,
}

Composition = tuple[CheckpointSaved, str, float]  # a checkpoint_saved event with a split, its source, when


@dataclass
class Observed:
    """What the sources said about one start; everything else in a record is derived from it."""

    index: int
    resumed: bool
    started_at: float
    run_id: str
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None  # the folder verl said it resumed from (``trainer.resume_from_path``)
    restored: int | None = None
    by_status: dict[str, int] | None = None
    groups: list[GroupCount] | None = None
    filter_metric: str | None = None  # the DAPO metric every finished group of ``groups`` was judged with
    reissued: int | None = None
    cleared: int | None = None
    target: int | None = None
    submitted: int | None = None
    skip_reason: str | None = None
    legacy_batches: int | None = None
    first_step_evictions: dict[str, int] | None = None
    first_step_wait: float | None = None
    evidence: list[Evidence] = field(default_factory=list)
    claims: dict[str, list[Claim]] = field(default_factory=dict)  # quantity -> what each source said, in order
    restored_at: float | None = None  # when a source first said TQ state was loaded (verl logs it even for R = 0)
    decided_at: float | None = None  # when the warmup decision was first reported
    window_before: Claim | None = None  # the train window's total last seen before this start opened
    first_window: Claim | None = None  # the first train window seen after it opened
    window_after_decision: Claim | None = None  # the first one seen after the warmup decision

    # What the resume cost (tqmon.cost): trainer times only (see trainer_time), None where not observed.
    first_line_at: float | None = None  # the start's first event, if it carried the trainer's time
    last_step_before: int | None = None  # the last step completed (or saved) before the stop, if steps were seen
    last_activity_before: float | None = None  # the last timed trainer event before the stop
    loop_started_at: float | None = None  # the re-issue or warmup line: verl's step loop starts right after
    first_step_seconds: float | None = None  # the first step's own duration (timing_s/step)

    def claim(self, quantity: str, source: str, value: int, at: float, event_id: str) -> None:
        self.claims.setdefault(quantity, []).append(Claim(source, value, at, event_id))

    def saw_window(self, window: Claim) -> bool:
        """Keep the windows the judge compares; True when this one is kept.

        Only windows seen once the trainer reported its restore (or its decision) count: before that a new
        controller is still being loaded and a poll sees it half-filled.
        """
        reported = [t for t in (self.restored_at, self.decided_at) if t is not None]
        if not reported or window.at < min(reported):
            return False
        kept = self.first_window is None
        if kept:
            self.first_window = window
        if self.window_after_decision is None and self.decided_at is not None and window.at >= self.decided_at:
            self.window_after_decision, kept = window, True
        return kept

    @property
    def decided(self) -> bool:
        """The warmup already reported its decision."""
        return self.submitted is not None or self.skip_reason is not None or self.legacy_batches is not None

    @property
    def sealed(self) -> bool:
        """A start is over once its first step completed; later events belong to a new start."""
        return self.first_step_evictions is not None


# ---------------------------------------------------------------- deriving a record


def derive_record(
    obs: Observed,
    config: WarmupConfig | None,
    previous_restored: int | None,
    verl_version: str = "",
    loaded: Composition | None = None,
    previous: Composition | None = None,
) -> ResumeRecord:
    """Compute T, M expected, O, doomed, the deficit and the warmup state from what was observed.

    ``verl_version`` (from ``run_started``) names the semantics when no log line or count betrays them.
    ``loaded`` is the composition of the checkpoint this start loaded, ``previous`` the newest one before it
    that held TQ state: the sources :mod:`tqmon.judge` checks the others against.
    """
    restored = obs.restored
    if restored is None and config is not None and not restores_tq(config):
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

    state = warmup_state(obs, restored, target, submitted, predicted.state if predicted else None, previous_restored)
    if state is WarmupState.LEGACY_UNCONDITIONAL:
        semantics = "verl-0.9.0"
    keeps_window = restores_tq(config) and (config is None or not config.skip_rollout_tq)
    window_lost = is_lost_window(
        keeps_window=obs.resumed and keeps_window,
        legacy=semantics == "verl-0.9.0",
        restore_reported=obs.restored_at is not None,
        decided=obs.submitted is not None or obs.skip_reason is not None,
        restored=obs.restored,
    )
    evidence = [*obs.evidence, *_lost_evidence(obs, loaded, previous)] if window_lost else obs.evidence
    if window_lost:
        state = WarmupState.LOST_WINDOW

    rules, assumed = eviction_rules(config, obs.groups is not None and obs.checkpoint_step is not None)
    doomed = _doomed(obs, rules, restored)
    under = None
    if target is not None and restored is not None and submitted is not None:
        # Unknown doom reasons count as 0, which makes the deficit a lower bound (and says so).
        lost = sum((doomed or {}).values())
        under = under_submitted(target, restored, min(lost, restored), submitted)
    reissued, cleared = obs.reissued, obs.cleared
    if reissued is None and (not obs.resumed or obs.decided or obs.sealed):
        # verl re-issues before the warmup and logs nothing when there was nothing in flight.
        reissued, cleared = 0, 0
        if obs.resumed:  # a fresh start has nothing to re-issue: no inference there
            evidence = [*evidence, _inferred_reissue(obs)]

    judgement = _judge(obs, config, loaded, restored, submitted, semantics, doomed)
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
        under_submitted_lower_bound=under is not None and not doomed_complete(doomed),
        assumed_defaults=assumed if restored and doomed else (),
        warmup_state=state,
        semantics=semantics,
        first_step_evictions=obs.first_step_evictions,
        first_step_generation_wait_seconds=obs.first_step_wait,
        evidence=tuple(evidence),
        disagreements=judgement.disagreements,
        compared=judgement.compared,
        cost=resume_cost(
            CostInputs(
                checkpoint_step=obs.checkpoint_step,
                started_at=obs.first_line_at,
                last_step_before=obs.last_step_before,
                last_activity_before=obs.last_activity_before,
                loop_started_at=obs.loop_started_at,
                first_step_seconds=obs.first_step_seconds,
                doomed=doomed,
                rollout_n=config.rollout_n if config is not None else None,
            ),
            resumed=obs.resumed,
            lost_prompt_groups=_lost_groups(obs, previous) if window_lost else _nothing_lost(obs, keeps_window),
        ),
    )


def _config_claims(obs: Observed, config: WarmupConfig | None, restored: int | None) -> dict[str, list[Claim]]:
    """T and M as the config tqmon was given predicts them, where the trainer reported them too."""
    if config is None or not restores_tq(config):
        return {}
    claims: dict[str, list[Claim]] = {}
    decision = decide_warmup(config, restored, resumed=obs.resumed) if restored is not None else None
    predictions = {"target": window_target(config), "submitted": decision.submitted if decision else None}
    for quantity, value in predictions.items():
        if value is not None and obs.claims.get(quantity):
            claims[quantity] = [Claim(CONFIG_SOURCE, value, obs.claims[quantity][0].at)]
    if decision is not None and not decision.logged:
        claims.pop("submitted", None)  # verl logs no decision then: whatever a source says is not verl's
    return claims


def _composition_claims(loaded: Composition) -> dict[str, list[Claim]]:
    """R and its split as the loaded checkpoint holds them."""
    event, source, at = loaded
    statuses = event.status_counts() or {}
    claims = {
        f"restored_{status}": [Claim(source, statuses.get(status, 0), at, event.id)] for status in PROMPT_STATUSES
    }
    return claims | {"restored": [Claim(source, sum(statuses.values()), at, event.id)]}


def _judge(
    obs: Observed,
    config: WarmupConfig | None,
    loaded: Composition | None,
    restored: int | None,
    submitted: int | None,
    semantics: str,
    doomed: Mapping[str, int] | None,
) -> Judgement:
    """What the sources of this start were compared on, and where they contradict each other (see
    :mod:`tqmon.judge`)."""
    claims = {quantity: list(said) for quantity, said in obs.claims.items()}
    if semantics != "verl-0.9.0":  # 0.9.0 warms up whole batches whatever the config says of M
        for quantity, said in _config_claims(obs, config, restored).items():
            claims.setdefault(quantity, []).extend(said)
    if loaded is not None and obs.resumed and restores_tq(config):
        for quantity, said in _composition_claims(loaded).items():
            if obs.claims.get(quantity):  # R's split is compared only with a source that split it too
                claims[quantity].extend(said)
    batch = config.train_batch_size if config is not None else None  # what prepare_step adds before sampling
    windows: dict[str, tuple[Claim, Claim | None, Bounds]] = {}
    loaded_doomed = checkpoint_doomed(loaded[0], config) if loaded is not None else None
    loaded_statuses = loaded[0].status_counts() if loaded is not None else None
    if restored is not None and submitted is not None and obs.decided_at is not None:
        source = obs.claims["submitted"][0].source if obs.claims.get("submitted") else CONFIG_SOURCE
        reported = Claim(f"{source} R + M", restored + submitted, obs.decided_at)
        split = status_counts(obs.by_status, obs.groups)  # else the loaded checkpoint's, as for the doomed
        terminal = terminal_groups(split if split is not None else loaded_statuses)
        bounds = window_bounds(reported.value, complete_doomed(doomed, loaded_doomed), restored, batch, terminal)
        windows[WINDOW_AFTER_WARMUP] = (reported, obs.window_after_decision, bounds)
    if loaded is not None and obs.resumed and restores_tq(config):
        event, source, at = loaded
        total = sum((loaded_statuses or {}).values())
        added = None if batch is None or submitted is None else batch + submitted
        bounds = window_bounds(total, complete_doomed(loaded_doomed), total, added, terminal_groups(loaded_statuses))
        windows[CHECKPOINT_WINDOW] = (Claim(source, total, at, event.id), obs.first_window, bounds)
    return judge(claims, windows)


def _inferred_reissue(obs: Observed) -> Evidence:
    """Evidence for K = 0 and no cleared trajectories where no line says so: verl logs its re-issue before the
    warmup decision, and nothing when nothing was in flight. It names the report the line did not precede."""
    after = next((e for e in obs.evidence if e.event_type in REISSUE_FOLLOWERS), None)
    inferred = "reissued_prompt_groups=0, cleared_trajectories=0: inferred from the absence of the re-issue line"
    if after is None:
        return Evidence(INFERENCE, "inflight_reissued", "", obs.started_at, inferred)
    detail = f"{inferred} before {after.event_type} from {after.source}"
    return Evidence(INFERENCE, "inflight_reissued", after.event_id, after.at, detail)


def _nothing_lost(obs: Observed, keeps_window: bool) -> int | None:
    """0 when a resume can have lost no window (a reported restore, a mode that keeps none); None while that
    is not known yet (or never: verl 0.9.0 does not report its restore). A fresh start has no cost at all."""
    return 0 if obs.restored_at is not None or not keeps_window else None


def _lost_groups(obs: Observed, previous: Composition | None) -> int | None:
    """The groups a lost window held: the last live window seen before the restart, else the newest
    checkpoint composition before the one loaded; None when neither is known."""
    if obs.window_before is not None:
        return obs.window_before.value
    if previous is not None:
        return sum((previous[0].status_counts() or {}).values())
    return None


def _lost_evidence(obs: Observed, loaded: Composition | None, previous: Composition | None) -> list[Evidence]:
    """What confirms a lost window beyond the log, and what says how much was lost."""
    found = []
    if loaded is not None and has_tq_dir(loaded[0].path) is False:
        event, source, at = loaded
        found.append(Evidence(source, event.type, event.id, at, f"global_step_{event.step} has no transfer_queue/"))
    if obs.window_before is not None:
        w = obs.window_before
        found.append(
            Evidence(w.source, "window_observed", w.event_id, w.at, f"last window before the restart: {w.value}")
        )
    elif previous is not None:
        event, source, at = previous
        total = sum((event.status_counts() or {}).values())
        found.append(Evidence(source, event.type, event.id, at, f"global_step_{event.step} held {total} groups"))
    return found


def warmup_state(
    obs: Observed,
    restored: int | None,
    target: int | None,
    submitted: int | None,
    predicted: WarmupState | None,
    previous_restored: int | None,
) -> WarmupState:
    """What the warmup did, from what was reported first and from the config where verl logs nothing."""
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


# verl 0.9.1's defaults for the settings that decide evictions (ppo_trainer.yaml: max_off_policy_threshold 8,
# max_off_policy_strategy drop, algorithm.filter_groups.enable False). T's settings are placeholders that the
# doom classification never reads.
VERL_EVICTION_DEFAULTS = WarmupConfig(trainer_mode="colocate_async", train_batch_size=1, num_warmup_batches=0)
EVICTION_SETTINGS = ("max_off_policy_threshold", "max_off_policy_strategy", "filter_groups")


def eviction_rules(config: WarmupConfig | None, per_group: bool) -> tuple[WarmupConfig, tuple[str, ...]]:
    """The config that decides which restored groups are doomed, and the verl defaults it assumed (named
    ``setting=value``): without the trainer config, verl's defaults make filtered computable, and stale too
    when the groups' steps (``per_group``) are known."""
    if config is not None:
        return config, ()
    defaults = VERL_EVICTION_DEFAULTS.model_dump()
    used = EVICTION_SETTINGS if per_group else ("filter_groups",)
    return VERL_EVICTION_DEFAULTS, tuple(f"{name}={_setting(defaults[name])}" for name in used)


def _setting(value: object) -> str:
    """A setting's value as verl's YAML writes it (``false``, ``null``, ``drop``)."""
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def _doomed(obs: Observed, config: WarmupConfig | None, restored: int | None) -> dict[str, int] | None:
    """Doomed restored groups by the reasons that are known; None when none is."""
    if restored == 0:
        return dict.fromkeys(DOOM_REASONS, 0)
    groups = restored_groups(obs.groups) if obs.groups is not None and obs.checkpoint_step is not None else None
    statuses = status_counts(obs.by_status, obs.groups)
    decided = obs.filter_metric is not None
    return known_doomed(config, statuses, groups, obs.checkpoint_step or 0, filter_verdicts=decided)


def restores_tq(config: WarmupConfig | None) -> bool:
    """verl loads TransferQueue state on a resume in the async modes only (sync mode keeps no window)."""
    return config is None or config.trainer_mode != "sync"


def window_target(config: WarmupConfig | None) -> int | None:
    """T, or None where verl defines none: its warmup returns before computing one when ``skip.rollout_tq``
    is on (it replays cached rollouts) or ``num_warmup_batches <= 0``. Sync mode keeps no window, and
    verl's warmup counts its T as 0 there."""
    if config is None:
        return None
    if not restores_tq(config):
        return 0
    if config.skip_rollout_tq or config.num_warmup_batches <= 0:
        return None
    return target_window(config)


def with_checkpoint(obs: Observed, saved: Composition | None, config: WarmupConfig | None) -> Observed:
    """A resume whose log gave only a total (or nothing: verl 0.9.0), completed from the checkpoint it loaded.

    ``tq.load_checkpoint(global_step_N)`` restores exactly that checkpoint's composition, so when the
    checkpoint source read it (and the totals agree), R's split by status and step is known too.
    """
    if saved is None or not obs.resumed or obs.by_status is not None or obs.groups is not None:
        return obs
    event, source, at = saved
    statuses = event.status_counts()
    if statuses is None or event.step != obs.checkpoint_step or not restores_tq(config):
        return obs
    total = sum(statuses.values())
    if obs.restored not in (None, total):
        return obs  # the trainer restored something else: the log's total stands
    evidence = Evidence(source, event.type, event.id, at, f"composition of global_step_{event.step}: {statuses}")
    return replace(
        obs,
        restored=total,
        by_status=statuses,
        groups=event.groups,
        filter_metric=event.filter_metric,
        evidence=[*obs.evidence, evidence],
    )


def checkpoint_doomed(event: CheckpointSaved, config: WarmupConfig | None) -> dict[str, int] | None:
    """Doomed groups of a resume from this checkpoint (verl's eviction defaults without the config); None when
    the checkpoint's composition is unknown."""
    statuses = event.status_counts()
    if statuses is None:
        return None
    groups = restored_groups(event.groups) if event.groups is not None else None
    rules = eviction_rules(config, groups is not None)[0]
    return known_doomed(rules, statuses, groups, event.step, filter_verdicts=event.filter_metric is not None)


def predict_resume(saved: CheckpointSaved, reissued: int, cleared: int, config: WarmupConfig | None) -> ResumeRecord:
    """The record a resume from ``saved`` gets once verl has reported it, before it happens.

    The checkpoint gives R's composition and K; the config gives the warmup decision, which verl logs (or
    not) exactly as :func:`tqmon.warmup.decide_warmup` says. :func:`derive_record` does the rest, as for a
    live resume.
    """
    at = saved.timestamp(0.0)
    loaded = (saved, SourceName.CHECKPOINT.value, at)
    obs = Observed(index=0, resumed=True, started_at=at, run_id="", checkpoint_step=saved.step)
    obs = with_checkpoint(obs, loaded, config)
    if obs.restored is not None:
        obs.reissued, obs.cleared = reissued, cleared
    if has_tq_dir(saved.path) is not False and restores_tq(config):
        obs.restored_at = at  # verl reports every restore it loads, an empty one too; without the dir, none
    if config is not None:
        decision = decide_warmup(config, obs.restored or 0, resumed=True)
        if decision.logged:
            obs.target, obs.submitted = decision.target, decision.submitted
        else:
            obs.skip_reason = skip_reason(config)
    return derive_record(obs, config, None, loaded=loaded)


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

    def __init__(self, given: GivenConfig | None = None) -> None:
        self.run: RunInfo | None = None
        self.warmup_config: WarmupConfig | None = None
        self.records: list[ResumeRecord] = []
        self.resumes = 0
        self.trainer_step: int | None = None
        self.trainer_last_event: float | None = None
        self.trainer_stepped_at: float | None = None  # when a completed or saved step last moved trainer_step on
        self.windows: dict[tuple[str, str], WindowView] = {}  # (source, partition) -> the newest seen
        self.checkpoint: CheckpointView | None = None
        self._observed: Observed | None = None
        self._checkpoint_saved: tuple[CheckpointSaved, str] | None = None  # the event behind ``checkpoint``
        # The checkpoint dir as the checkpoint source last read it (None: nothing readable there); once read,
        # it, not the trainer's "saved" events, is what ``checkpoint`` shows, rollbacks and deletions included.
        self._directory: tuple[CheckpointSaved | None] | None = None
        self._restart_hint: Evidence | None = None  # a restart sign no start has claimed yet
        self._step_seconds: deque[float] = deque(maxlen=STEP_RATE_WINDOW)
        self._compositions: dict[int, Composition] = {}  # step -> a checkpoint's composition
        self._last_train_window: Claim | None = None  # never dropped: a lost window's size after a restart
        # Since the open start began: the last step the trainer completed and saved, and its last timed event.
        self._step_completed: int | None = None
        self._step_saved: int | None = None
        self._last_activity: float | None = None
        self._event_time: float | None = None  # trainer_time of the event being applied
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
        match event:
            case RunStarted():
                run = RunInfo(
                    event.run_id, event.trainer_mode, event.verl_version, event.config.model_dump(), SourceName.EVENTS
                )
                self._set_run(run, event.config)
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
            case StepCompleted():
                self.trainer_step = event.global_step
                # The log's console line and the JSONL report the same step: its duration counts once.
                repeated = self._step_completed is not None and event.global_step <= self._step_completed
                self._step_completed = max(event.global_step, self._step_completed or 0)
                if event.step_seconds is not None and not repeated:
                    self._step_seconds.append(event.step_seconds)
                obs = self._observed
                if obs is not None and not obs.sealed:
                    evicted = _str_keys(event.evicted_prompt_groups)
                    obs.first_step_evictions = {r: evicted.get(r, 0) for r in DOOM_REASONS}
                    obs.first_step_wait = event.generation_wait_seconds
                    obs.first_step_seconds = event.step_seconds
                    evidence_of = obs
            case CheckpointSaved():
                self._saved(event, source, at)
            case WindowObserved():
                self._observe_window(event, event.source_name(source), seen)
        if isinstance(event, StepCompleted | CheckpointSaved) and self.trainer_step != step_before:
            # The trainer progresses (what the alerts and the status page read); a resume going back is not a step.
            self.trainer_stepped_at = _latest(self.trainer_stepped_at, seen)
        if evidence_of is not None:
            evidence_of.evidence.append(Evidence(source, event.type, event.id, at, _describe(event)))
            self._rederive()
        if not isinstance(event, RunStarted):  # a new process announcing itself is not activity before a stop
            self._last_activity = _latest(self._last_activity, self._event_time)

    def _observe_window(self, event: WindowObserved, source: str, at: float) -> None:
        """A pushed window; one with a composition gets ages like a polled one."""
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
        if window.partition != "train":
            return
        seen = Claim(window.source, window.total, window.observed_at, event_id)
        self._last_train_window = seen
        obs = self._observed
        if obs is not None and not obs.sealed and obs.saw_window(seen):
            self._rederive()

    def _saved(self, event: CheckpointSaved, source: str, at: float) -> None:
        if source != SourceName.CHECKPOINT:  # the checkpoint dir may hold an older run's checkpoint
            self.trainer_step = event.step
            self._step_saved = max(event.step, self._step_saved or 0)
        current = self.checkpoint
        bare = event.status_counts() is None
        if not bare:
            self._compositions[event.step] = (event, source, at)
            while len(self._compositions) > KEPT_COMPOSITIONS:
                del self._compositions[min(self._compositions)]
        # Never step back, and a bare log line never hides a composition read for the same step.
        older = current is not None and event.step < current.step
        if not older and not (bare and current is not None and current.step == event.step and current.by_status):
            self._checkpoint_saved = (event, source)
            self._derive_checkpoint()
        if not bare:
            self._rederive()  # the open start may have resumed from this very checkpoint

    def observe_checkpoint_dir(self, event: CheckpointSaved | None) -> None:
        """The checkpoint dir as it is now: its latest checkpoint, or None when it has none it can read (gone,
        rolled back to a deleted step, unreadable). Unlike trainer events this may step back."""
        self._directory = (event,)
        self._derive_checkpoint()

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
        )
        self._step_completed = self._step_saved = None
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
        self.checkpoint = CheckpointView(
            event.step,
            source,
            event.status_counts(),
            checkpoint_doomed(event, self.warmup_config),
            event.orphan_trajectories,
            eviction_rules(self.warmup_config, event.groups is not None)[1] if event.status_counts() else (),
        )

    def _derive(self, obs: Observed) -> ResumeRecord:
        previous = self.records[obs.index - 1].restored if obs.index > 0 else None
        saved = self._compositions.get(obs.checkpoint_step) if obs.checkpoint_step is not None else None
        completed = with_checkpoint(obs, saved, self.warmup_config)
        version = self.run.verl_version if self.run else ""
        before = self._before(obs.checkpoint_step)
        record = derive_record(completed, self.warmup_config, previous, version, saved, before)
        if obs.index < len(self.records):  # once compared, a quantity keeps its verdict: its series falls back to 0
            record = replace(record, compared=in_order([*self.records[obs.index].compared, *record.compared]))
        return record

    def _before(self, step: int | None) -> Composition | None:
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
    if source == SourceName.CHECKPOINT:
        return None
    if event.time is not None:
        return event.time.timestamp()
    return received_at if source == SourceName.EVENTS else None


def _latest(current: float | None, candidate: float | None) -> float | None:
    if candidate is None:
        return current
    return candidate if current is None else max(current, candidate)


def _str_keys(counts: Mapping[Any, int]) -> dict[str, int]:
    return {str(key): value for key, value in counts.items()}


def _describe(event: Event) -> str:
    fields = event.model_dump(exclude={"id", "time", "type"}, exclude_none=True)
    return ", ".join(f"{key}={value}" for key, value in fields.items())
