"""One resume record from what the sources observed of one start: T, M expected, O, doomed, the deficit, the
warmup state, the judge's verdict and the cost.

Pure: no I/O, no clock, no lock. The :class:`tqmon.reconcile.Reconciler` fold collects an :class:`Observed`
per start and calls :func:`derive_record`; ``tqmon inspect`` predicts a resume before it happens with the
same derivation (:func:`predict_resume`), so serve, inspect and analyze cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tqmon.cost import CostInputs, resume_cost
from tqmon.events import CheckpointSaved, GroupCount, restored_groups, status_counts
from tqmon.judge import (
    CHECKPOINT_WINDOW,
    CONFIG_SOURCE,
    WINDOW_AFTER_WARMUP,
    Bounds,
    Judgement,
    complete_doomed,
    has_tq_dir,
    is_lost_window,
    judge,
    terminal_groups,
    window_bounds,
)
from tqmon.snapshot import (
    CheckpointListing,
    Claim,
    Evidence,
    RegressionReason,
    ResumeRecord,
    SelfHeal,
    SourceName,
    StepRegression,
)
from tqmon.versions import VerlVersion
from tqmon.warmup import (
    CURRENT,
    DOOM_REASONS,
    LATEST_FILE,
    LEGACY,
    PROMPT_STATUSES,
    STEP_DIR,
    LegacyWarmupFails,
    Semantics,
    WarmupConfig,
    WarmupDecision,
    WarmupState,
    decide_warmup,
    doomed_complete,
    eviction_rules,
    is_legacy_growth,
    is_legacy_unconditional,
    known_doomed,
    legacy_submitted,
    legacy_warmup_batches,
    restores_tq,
    skip_reason,
    under_submitted,
    window_target,
)

INFERENCE = "inference"  # the source of evidence tqmon inferred rather than heard
REISSUE_FOLLOWERS = ("warmup_decided", "step_completed")  # reports verl's re-issue line comes before

_SKIP_STATES = {
    "sync_mode": WarmupState.SYNC_MODE,
    "skip_rollout_tq": WarmupState.DISABLED,
    "non_positive_warmup": WarmupState.DISABLED,
}

SavedCheckpoint = tuple[CheckpointSaved, str, float]  # a checkpoint_saved event with a split, its source, when


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
    sealed_at: float | None = None  # when its first step completed (the line's time, else its receipt)
    first_step_wait: float | None = None
    evidence: list[Evidence] = field(default_factory=list)
    claims: dict[str, list[Claim]] = field(default_factory=dict)  # quantity -> what each source said, in order
    restored_at: float | None = None  # when a source first said TQ state was loaded (verl logs it even for R = 0)
    decided_at: float | None = None  # when the warmup decision was first reported
    window_before: Claim | None = None  # the train window's total last seen before this start opened
    first_window: Claim | None = None  # the first train window seen after it opened
    window_after_decision: Claim | None = None  # the first one seen after the warmup decision
    split_from: str | None = None  # the checkpoint_saved event whose composition completed R's split

    # What the resume cost (tqmon.cost): trainer times only (see trainer_time), None where not observed.
    first_line_at: float | None = None  # the start's first event, if it carried the trainer's time
    last_step_before: int | None = None  # the last step completed (or saved) before the stop, if steps were seen
    last_activity_before: float | None = None  # the last timed trainer event before the stop
    loop_started_at: float | None = None  # the re-issue or warmup line: verl's step loop starts right after
    first_step_seconds: float | None = None  # the first step's own duration (timing_s/step)
    self_heal: SelfHeal | None = None  # the plugin's top-up after the warmup (self_heal_decided)

    @property
    def topped_up(self) -> int:
        """Fresh groups the plugin's self-heal submitted after the warmup: they count in M."""
        return self.self_heal.submitted if self.self_heal is not None else 0

    # Step regressions (verl #7952, #7933): the newest step a trainer source said it saved before this start
    # opened (the value), and each step logged again since (the claim) with the newest step logged before it.
    last_saved_before: Claim | None = None
    repeated_steps: list[tuple[Claim, int]] = field(default_factory=list)

    def claim(self, quantity: str, source: str, value: int, at: float, event_id: str) -> None:
        self.claims.setdefault(quantity, []).append(Claim(source, value, at, event_id))

    def saw_window(self, window: Claim) -> bool:
        """Keep the windows the judge compares; True when this one is kept.

        Only windows seen once the trainer reported its restore (or its decision) count: before that a new
        controller is still being loaded and a poll sees it half-filled. And only those seen before its first
        step completed. The first is the earliest by when it was seen, not by when it arrived: the TQ poller
        and the log race, and the verdict must not depend on which tqmon heard first (the reconciler offers
        again the windows seen before a report that makes them count).
        """
        reported = [t for t in (self.restored_at, self.decided_at) if t is not None]
        if not reported or window.at < min(reported) or (self.sealed_at is not None and window.at > self.sealed_at):
            return False
        kept = self.first_window is None or window.at < self.first_window.at
        if kept:
            self.first_window = window
        after = self.window_after_decision
        if self.decided_at is not None and window.at >= self.decided_at and (after is None or window.at < after.at):
            self.window_after_decision, kept = window, True
        return kept

    def seal(self, at: float, first_step_evictions: dict[str, int]) -> None:
        """Its first step completed at ``at``: a window seen after that is the next step's, even one that
        arrived before the step's line did."""
        self.first_step_evictions, self.sealed_at = first_step_evictions, at
        if self.first_window is not None and self.first_window.at > at:
            self.first_window = None
        if self.window_after_decision is not None and self.window_after_decision.at > at:
            self.window_after_decision = None

    @property
    def decided(self) -> bool:
        """The warmup already reported its decision."""
        return self.submitted is not None or self.skip_reason is not None or self.legacy_batches is not None

    @property
    def sealed(self) -> bool:
        """A start is over once its first step completed; later events belong to a new start."""
        return self.first_step_evictions is not None


def derive_record(
    obs: Observed,
    config: WarmupConfig | None,
    previous_restored: int | None,
    semantics: Semantics | None = None,
    loaded: SavedCheckpoint | None = None,
    previous: SavedCheckpoint | None = None,
    listing: CheckpointListing | None = None,
) -> ResumeRecord:
    """Compute T, M expected, O, the over-fill, doomed, the deficit and the warmup state from what was observed.

    ``semantics`` is the warmup of the verl version tqmon knows (:mod:`tqmon.versions`); what this start's own
    log line or counts betray wins over it, and without either it is 0.9.1's.
    ``loaded`` is the composition of the checkpoint this start loaded, ``previous`` the newest one before it
    that held TQ state: the sources :mod:`tqmon.judge` checks the others against. ``listing`` is the checkpoint
    dir as last listed: the start's step is compared with the newest ``global_step_N`` saved before it.
    """
    restored = obs.restored
    if restored is None and config is not None and not restores_tq(config):
        restored = 0
    if restored is None and obs.resumed is False:
        restored = 0  # a fresh start restores nothing
    config_target = window_target(config)
    target = obs.target if obs.target is not None else config_target

    decision = decide_warmup(config, restored, resumed=obs.resumed) if config and restored is not None else None
    predicted = decision
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
    semantics = semantics or CURRENT
    if obs.legacy_batches is not None:
        semantics = LEGACY
        submitted = legacy_submitted(config, obs.legacy_batches) if config else None

    state = warmup_state(obs, restored, target, submitted, predicted.state if predicted else None, previous_restored)
    if state is WarmupState.LEGACY_UNCONDITIONAL:
        semantics = LEGACY
    keeps_window = restores_tq(config) and (config is None or not config.skip_rollout_tq)
    window_lost = is_lost_window(
        keeps_window=obs.resumed and keeps_window,
        legacy=semantics == LEGACY,
        restore_reported=obs.restored_at is not None,
        decided=obs.submitted is not None or obs.skip_reason is not None,
        restored=obs.restored,
    )
    evidence = [*obs.evidence, *_lost_evidence(obs, loaded, previous)] if window_lost else obs.evidence
    if window_lost:
        state = WarmupState.LOST_WINDOW

    rules, assumed = eviction_rules(config, obs.groups is not None and obs.checkpoint_step is not None)
    doomed = _doomed(obs, rules, restored)
    under = over_filled = None
    if target is not None and restored is not None and submitted is not None:
        # Unknown doom reasons count as 0, which makes the deficit a lower bound (and says so).
        lost = sum((doomed or {}).values())
        under = under_submitted(target, restored, min(lost, restored), submitted + obs.topped_up)
        over_filled = max(0, restored + submitted + obs.topped_up - target)
    reissued, cleared = obs.reissued, obs.cleared
    if reissued is None and (not obs.resumed or obs.decided or obs.sealed):
        # verl re-issues before the warmup and logs nothing when there was nothing in flight.
        reissued, cleared = 0, 0
        if obs.resumed:  # a fresh start has nothing to re-issue: no inference there
            evidence = [*evidence, _inferred_reissue(obs)]

    # The checkpoint's own doomed groups, unless they are this start's already (its split came from there).
    loaded_doomed = doomed if loaded is not None and obs.split_from == loaded[0].id else None
    if loaded is not None and loaded_doomed is None:
        loaded_doomed = checkpoint_doomed(loaded[0], config)
    predictions = _config_claims(obs, config_target, decision) if restores_tq(config) else {}
    judgement = _judge(obs, config, loaded, restored, submitted, semantics, (doomed, loaded_doomed), predictions)
    by_status: dict[str, int] | None = None
    if obs.by_status is not None:
        by_status = dict(obs.by_status)
    elif restored == 0:
        by_status = dict.fromkeys(PROMPT_STATUSES, 0)  # nothing restored: every status is known-empty
    elif restored is not None:
        by_status = {"unknown": restored}

    regressions, regression_evidence = step_regressions(obs, listing)
    evidence = [*evidence, *regression_evidence]
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
        over_filled=over_filled,
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
        step_regressions=regressions,
        self_heal=obs.self_heal,
    )


def step_regressions(
    obs: Observed, listing: CheckpointListing | None
) -> tuple[tuple[StepRegression, ...], list[Evidence]]:
    """A start older than a step already saved (verl #7952: no latest file, ``resume_mode=auto`` starts from 0
    while checkpoints exist), and the steps logged twice since (verl #7933), each with the evidence for it.

    Saved before the start means a trainer's save seen before it opened, or a ``global_step_N`` folder written
    before it began (its mtime): the start's own saves never count against it.
    """
    step = obs.checkpoint_step if obs.resumed and obs.checkpoint_step is not None else 0
    found: list[StepRegression] = []
    evidence: list[Evidence] = []
    folders = [(n, at) for n, at in listing.steps if at < obs.started_at] if listing is not None else []
    newest_folder = max(folders, default=None)
    saved = obs.last_saved_before
    candidates = [*([newest_folder[0]] if newest_folder else []), *([saved.value] if saved else [])]
    newer = max(candidates, default=None)
    if newer is not None and newer > step:
        reason, why = _regression_reason(obs, step, newer, listing)
        found.append(StepRegression(step, newer, reason))
        if newest_folder is not None:
            n, at = newest_folder
            evidence.append(
                Evidence(SourceName.CHECKPOINT, "checkpoint_dir_listed", "", at, f"{STEP_DIR.format(n)} saved before")
            )
        if saved is not None:
            evidence.append(
                Evidence(saved.source, "checkpoint_saved", saved.event_id, saved.at, f"saved step {saved.value} before")
            )
        began = f"resumed from step {step}" if obs.resumed else "started from scratch (step 0)"
        detail = f"step regression: {began} while step {newer} was saved: {why}"
        evidence.append(Evidence(INFERENCE, "step_regression", "", obs.started_at, detail))
    for claim, before in obs.repeated_steps:
        found.append(StepRegression(claim.value, before, RegressionReason.STEP_REPEATED))
        detail = f"step {claim.value} logged again after step {before}: counted twice"
        evidence.append(Evidence(claim.source, "step_completed", claim.event_id, claim.at, detail))
    return tuple(found), evidence


def _regression_reason(
    obs: Observed, step: int, newer: int, listing: CheckpointListing | None
) -> tuple[RegressionReason, str]:
    """Why verl began at ``step`` while ``newer`` was saved, from the latest file as it was at the start."""
    if listing is None:
        return RegressionReason.UNKNOWN, "the checkpoint dir is not watched (--checkpoint-dir)"
    if listing.latest_error is not None:
        return RegressionReason.UNKNOWN, listing.latest_error
    if listing.latest is None:
        return RegressionReason.LATEST_FILE_MISSING, f"{LATEST_FILE} is missing (verl's resume_mode=auto starts fresh)"
    if listing.latest_at is not None and listing.latest_at >= obs.started_at:
        return RegressionReason.UNKNOWN, f"{LATEST_FILE} was rewritten since the start (it names {listing.latest} now)"
    if listing.latest < newer and listing.latest == step and obs.resumed:
        return RegressionReason.LATEST_FILE_STALE, f"{LATEST_FILE} is stale: it names {step}, not {newer}"
    named = f" ({obs.checkpoint_path})" if obs.checkpoint_path else ""
    return (
        RegressionReason.RESUME_CHOICE,
        f"{LATEST_FILE} names {listing.latest}, verl loaded another{named}: trainer.resume_mode/resume_from_path",
    )


def _config_claims(obs: Observed, target: int | None, decision: WarmupDecision | None) -> dict[str, list[Claim]]:
    """T and M as the config tqmon was given predicts them (``decision``: its warmup decision for this start),
    where the trainer reported them too."""
    claims: dict[str, list[Claim]] = {}
    predictions = {"target": target, "submitted": decision.submitted if decision else None}
    for quantity, value in predictions.items():
        if value is not None and obs.claims.get(quantity):
            claims[quantity] = [Claim(CONFIG_SOURCE, value, obs.claims[quantity][0].at)]
    if decision is not None and not decision.logged:
        claims.pop("submitted", None)  # verl logs no decision then: whatever a source says is not verl's
    return claims


def _composition_claims(loaded: SavedCheckpoint) -> dict[str, list[Claim]]:
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
    loaded: SavedCheckpoint | None,
    restored: int | None,
    submitted: int | None,
    semantics: Semantics,
    doomed_of: tuple[Mapping[str, int] | None, Mapping[str, int] | None],
    predictions: dict[str, list[Claim]],
) -> Judgement:
    """What the sources of this start were compared on, and where they contradict each other (see
    :mod:`tqmon.judge`). ``doomed_of``: the start's doomed groups and the loaded checkpoint's; ``predictions``:
    what the config predicts of the reported quantities."""
    doomed, loaded_doomed = doomed_of
    claims = {quantity: list(said) for quantity, said in obs.claims.items()}
    if semantics != LEGACY:  # 0.9.0 warms up whole batches whatever the config says of M
        for quantity, said in predictions.items():
            claims.setdefault(quantity, []).extend(said)
    if loaded is not None and obs.resumed and restores_tq(config):
        for quantity, said in _composition_claims(loaded).items():
            if obs.claims.get(quantity):  # R's split is compared only with a source that split it too
                claims[quantity].extend(said)
    # What prepare_step adds before sampling, and the plugin's self-heal right after it.
    batch = config.train_batch_size + obs.topped_up if config is not None else None
    windows: dict[str, tuple[Claim, Claim | None, Bounds]] = {}
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


def _lost_groups(obs: Observed, previous: SavedCheckpoint | None) -> int | None:
    """The groups a lost window held: the last live window seen before the restart, else the newest
    checkpoint composition before the one loaded; None when neither is known."""
    if obs.window_before is not None:
        return obs.window_before.value
    if previous is not None:
        return sum((previous[0].status_counts() or {}).values())
    return None


def _lost_evidence(obs: Observed, loaded: SavedCheckpoint | None, previous: SavedCheckpoint | None) -> list[Evidence]:
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


def _doomed(obs: Observed, config: WarmupConfig | None, restored: int | None) -> dict[str, int] | None:
    """Doomed restored groups by the reasons that are known; None when none is."""
    if restored == 0:
        return dict.fromkeys(DOOM_REASONS, 0)
    groups = restored_groups(obs.groups) if obs.groups is not None and obs.checkpoint_step is not None else None
    statuses = status_counts(obs.by_status, obs.groups)
    decided = obs.filter_metric is not None
    return known_doomed(config, statuses, groups, obs.checkpoint_step or 0, filter_verdicts=decided)


def with_checkpoint(obs: Observed, saved: SavedCheckpoint | None, config: WarmupConfig | None) -> Observed:
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
        split_from=event.id,
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


def predict_resume(
    saved: CheckpointSaved,
    reissued: int,
    cleared: int | None,
    config: WarmupConfig | None,
    semantics: Semantics = CURRENT,
) -> ResumeRecord:
    """The record a resume from ``saved`` gets once verl has reported it, before it happens.

    The checkpoint gives R's composition and K (``cleared``: the trajectories the re-issue clears, None where
    unknown); the config and ``semantics``, the warmup of the verl release that resumes, give the warmup
    decision and what verl logs of it: 0.9.1 decides as :func:`tqmon.warmup.decide_warmup` says, 0.9.0 loops
    :func:`tqmon.warmup.legacy_warmup_batches` (nothing is decided where that loop fails) and never logs its
    restore. :func:`derive_record` does the rest, as for a live resume.
    """
    at = saved.timestamp(0.0)
    loaded = (saved, SourceName.CHECKPOINT.value, at)
    obs = Observed(index=0, resumed=True, started_at=at, run_id="", checkpoint_step=saved.step)
    obs = with_checkpoint(obs, loaded, config)
    if obs.restored is not None:
        obs.reissued, obs.cleared = reissued, cleared
    if has_tq_dir(saved.path) is not False and restores_tq(config) and semantics == CURRENT:
        obs.restored_at = at  # verl 0.9.1 reports every restore it loads, an empty one too; without the dir, none
    if config is not None:
        _report_decision(obs, config, semantics)
    return derive_record(obs, config, None, semantics, loaded=loaded)


def _report_decision(obs: Observed, config: WarmupConfig, semantics: Semantics) -> None:
    """What verl will report of its warmup decision: 0.9.0 its whole batches (neither T nor R), or nothing where
    its loop fails; 0.9.1 its logged decision, or nothing where it returns silently (the config says why)."""
    if semantics == LEGACY:
        try:
            obs.legacy_batches = legacy_warmup_batches(config)
        except LegacyWarmupFails:
            return  # the trainer stops before deciding
        if obs.legacy_batches is not None:
            return
    decision = decide_warmup(config, obs.restored or 0, resumed=True)
    if decision.logged:
        obs.target, obs.submitted = decision.target, decision.submitted
    else:
        obs.skip_reason = skip_reason(config)


def predict_resumes(
    saved: CheckpointSaved, reissued: int, cleared: int | None, config: WarmupConfig | None, version: VerlVersion
) -> tuple[ResumeRecord, ...]:
    """:func:`predict_resume` under the warmup of ``version``, or under each warmup while it is unknown."""
    return tuple(predict_resume(saved, reissued, cleared, config, semantics) for semantics in version.predicted)
