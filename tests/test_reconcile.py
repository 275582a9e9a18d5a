"""The reconciler alone: events in, resume records out, with no store, clock or thread.

One table row per way a start can end up: every warmup state, under verl 0.9.1 and the legacy 0.9.0
semantics. The config is verl's CPU-test trainer (train_batch_size 4, num_warmup_batches 3: T = 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import pytest

from tqmon.derivation import predict_resume
from tqmon.events import CheckpointSaved, GroupCount, parse_event
from tqmon.reconcile import Reconciler
from tqmon.snapshot import ResumeRecord
from tqmon.versions import FLAG, UNKNOWN, VerlVersion, named
from tqmon.warmup import LEGACY, GivenConfig, TrainerConfig, WarmupState, skip_reason

T12 = {"train_batch_size": 4, "num_warmup_batches": 3}


def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def resume(step: int, restored: int | None = None, **decision: Any) -> list[dict[str, Any]]:
    """What the log says of a resume from global_step_N: the start, R if logged, the warmup if logged."""
    events = [ev("training_started", resumed_from_step=step)]
    if restored is not None:
        events.append(ev("checkpoint_restored", restored_prompt_groups=restored))
    if decision:
        events.append(ev("warmup_decided", **decision))
    return events


@dataclass(frozen=True)
class Case:
    name: str
    events: list[dict[str, Any]]
    state: WarmupState
    semantics: str = "verl-0.9.1"
    mode: str = "colocate_async"
    config: dict[str, Any] | None = field(default_factory=lambda: dict(T12))
    expect: dict[str, Any] = field(default_factory=dict)  # record fields (dotted: cost.<field>) -> values


CASES = [
    Case(
        "fresh start submits the whole window",
        [ev("training_started"), ev("warmup_decided", target_prompt_groups=12, submitted_prompt_groups=12)],
        WarmupState.FRESH_START,
        expect={"restored": 0, "target": 12, "expected": 12, "submitted": 12, "under_submitted": 0},
    ),
    Case(
        "a partial restore is topped up to T",
        resume(40, 9, target_prompt_groups=12, restored_prompt_groups=9, submitted_prompt_groups=3),
        WarmupState.TOPPED_UP,
        expect={"restored": 9, "expected": 3, "submitted": 3, "over_restored": 0, "under_submitted": 0},
    ),
    Case(
        "a full restore skips the warmup",
        resume(40, 12, target_prompt_groups=12, submitted_prompt_groups=0, skip_reason="window_full"),
        WarmupState.SKIPPED_FULL,
        expect={"restored": 12, "expected": 0, "submitted": 0, "over_restored": 0},
    ),
    Case(
        "an over-restore skips the warmup and keeps the surplus",
        resume(40, 20, target_prompt_groups=12, submitted_prompt_groups=0, skip_reason="window_full"),
        WarmupState.SKIPPED_OVER_RESTORED,
        expect={"restored": 20, "over_restored": 8, "over_filled": 8, "under_submitted": 0},
    ),
    Case(
        "skip.rollout_tq: verl logs nothing, the config says disabled",
        resume(40, 5),
        WarmupState.DISABLED,
        config=T12 | {"skip_rollout_tq": True},
        expect={"target": None, "submitted": 0, "expected": 0},
    ),
    Case(
        "a plugin reports a non-positive warmup",
        resume(40, 5, restored_prompt_groups=5, submitted_prompt_groups=0, skip_reason="non_positive_warmup"),
        WarmupState.DISABLED,
        config=T12 | {"num_warmup_batches": 0},
        expect={"target": None, "submitted": 0, "over_restored": None, "under_submitted": None},
    ),
    Case(
        "num_warmup_batches 0, log only: verl defines no target, so nothing is over-restored",
        resume(40, 5),
        WarmupState.DISABLED,
        config=T12 | {"num_warmup_batches": 0},
        expect={"target": None, "submitted": 0, "over_restored": None, "under_submitted": None},
    ),
    Case(
        "sync mode restores no TransferQueue state",
        resume(40),
        WarmupState.SYNC_MODE,
        mode="sync",
        expect={"restored": 0, "target": 0, "submitted": 0, "doomed": {"failure": 0, "stale": 0, "filtered": 0}},
    ),
    Case(
        "verl 0.9.0 logs whole warmup batches on top of the restore",
        resume(40, 9, legacy_warmup_batches=3),
        WarmupState.LEGACY_UNCONDITIONAL,
        semantics="verl-0.9.0",
        expect={"restored": 9, "expected": 3, "submitted": 12, "over_restored": 0, "over_filled": 9},
    ),
    Case(
        "a full-window top-up of a non-empty restore is the 0.9.0 signature",
        resume(40, 9, target_prompt_groups=12, submitted_prompt_groups=12),
        WarmupState.LEGACY_UNCONDITIONAL,
        semantics="verl-0.9.0",
        expect={"submitted": 12, "expected": 3},
    ),
    Case(
        "R grown by exactly T between resumes is the 0.9.0 signature",
        [*resume(40, 12), ev("step_completed", global_step=41), *resume(50, 24)],
        WarmupState.LEGACY_UNCONDITIONAL,
        semantics="verl-0.9.0",
        expect={"checkpoint_step": 50, "restored": 24, "over_restored": 12},
    ),
    Case(
        "run_started names verl 0.9.0: the semantics follow the version",
        [
            ev("run_started", run_id="r", trainer_mode="colocate_async", verl_version="0.9.0", config=T12),
            *resume(40, 9, target_prompt_groups=12, submitted_prompt_groups=3),
        ],
        WarmupState.TOPPED_UP,
        semantics="verl-0.9.0",
        config=None,
        expect={"run_id": "r", "expected": 3},
    ),
    Case(
        "a resume without a restore line before its warmup lost its window: the live window before tells how much",
        [
            ev("window_observed", by_status={"pending": 3, "running": 2, "finished": 6, "failure": 1}),
            *resume(40, None, target_prompt_groups=12, restored_prompt_groups=0, submitted_prompt_groups=12),
        ],
        WarmupState.LOST_WINDOW,
        expect={"restored": 0, "expected": 12, "submitted": 12, "under_submitted": 0, "cost.lost_prompt_groups": 12},
    ),
    Case(
        "without a config or a warmup line nothing is decided",
        resume(40, 9),
        WarmupState.UNKNOWN,
        config=None,
        expect={"restored": 9, "target": None, "expected": None, "submitted": None, "under_submitted": None},
    ),
]


def fold(events: list[dict[str, Any]], given: GivenConfig | None, source: str = "log") -> Reconciler:
    state = Reconciler(given)
    for index, raw in enumerate(events):
        state.apply(parse_event({"id": f"e{index}", **raw}), source, 1000.0 + index)
    return state


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_warmup_state_and_semantics(case: Case) -> None:
    given = None if case.config is None else GivenConfig(case.mode, TrainerConfig(**case.config), "flags")
    record = fold(case.events, given).records[-1]
    assert (record.warmup_state, record.semantics) == (case.state, case.semantics)
    assert {name: attrgetter(name)(record) for name in case.expect} == case.expect


def test_the_table_covers_every_state_and_both_semantics() -> None:
    assert {case.state for case in CASES} == set(WarmupState)
    assert {case.semantics for case in CASES} == {"verl-0.9.0", "verl-0.9.1"}


COMPOSITION = [
    GroupCount(status="pending", global_steps=40, count=2),
    GroupCount(status="running", global_steps=40, count=1),
    GroupCount(status="finished", global_steps=40, count=3),
    GroupCount(status="finished", global_steps=30, count=4),  # sampled at 41: 41 - 30 + 1 > 8, stale
    GroupCount(status="failure", global_steps=39, count=2),
]


def saved(step: int = 40) -> CheckpointSaved:
    return CheckpointSaved(id=f"checkpoint:{step}", step=step, groups=COMPOSITION)


def test_a_bare_log_resume_is_completed_from_the_checkpoint_it_loaded() -> None:
    given = GivenConfig("colocate_async", TrainerConfig(**T12), "flags")
    state = Reconciler(given)
    state.apply(saved(), "checkpoint", 900.0)
    for index, raw in enumerate(resume(40, 12, target_prompt_groups=12, restored_prompt_groups=12)):
        state.apply(parse_event({"id": f"e{index}", **raw}), "log", 1000.0 + index)
    [record] = state.records
    assert record.restored_by_status == {"pending": 2, "running": 1, "finished": 7, "failure": 2}
    assert record.doomed == {"failure": 2, "stale": 4, "filtered": 0}
    assert record.expected == 0
    assert [e.source for e in record.evidence][-1] == "checkpoint"


@pytest.mark.parametrize(
    ("filtered", "metric", "doomed"),
    [
        (1, "acc", {"failure": 2, "stale": 4, "filtered": 1}),  # the storage units' verdicts
        (0, "acc", {"failure": 2, "stale": 4, "filtered": 0}),  # decided: none filtered, not unknown
        (0, None, {"failure": 2, "stale": 4}),  # no verdicts: filtered unknown
    ],
)
def test_dapo_verdicts_of_a_checkpoint_decide_filtered_for_the_resume_that_loads_it(
    filtered: int, metric: str | None, doomed: dict[str, int]
) -> None:
    """The checkpoint source's verdicts reach the live record of a bare log resume and the preflight alike."""
    trainer = TrainerConfig(**T12, filter_groups=True, filter_groups_metric="acc")
    kept = GroupCount(status="finished", global_steps=40, count=3 - filtered)
    split = [g for g in COMPOSITION if (g.status, g.global_steps) != ("finished", 40)] + [kept]
    if filtered:
        split.append(GroupCount(status="finished", global_steps=40, count=filtered, filtered=True))
    checkpoint = CheckpointSaved(id="checkpoint:40", step=40, groups=split, filter_metric=metric)
    state = Reconciler(GivenConfig("colocate_async", trainer, "flags"))
    state.apply(checkpoint, "checkpoint", 900.0)
    skipped = {"target_prompt_groups": 12, "submitted_prompt_groups": 0, "skip_reason": "window_full"}
    for index, raw in enumerate(resume(40, 12, **skipped)):
        state.apply(parse_event({"id": f"e{index}", **raw}), "log", 1000.0 + index)
    [record] = state.records
    assert record.doomed == doomed
    assert state.checkpoint is not None and state.checkpoint.doomed == doomed
    predicted = predict_resume(checkpoint, reissued=3, cleared=5, config=trainer.warmup_config("colocate_async"))
    assert predicted.doomed == doomed
    assert record.under_submitted == predicted.under_submitted == sum(doomed.values())  # T = R, M = 0


@pytest.mark.parametrize(
    ("mode", "config"),
    [
        *((mode, config) for mode in ("colocate_async", "sync") for config in (T12, T12 | {"num_warmup_batches": 5})),
        ("colocate_async", T12 | {"skip_rollout_tq": True}),
        ("colocate_async", None),  # without a config the mode is unknown: R, K and the failures only
    ],
)
def test_the_preflight_predicts_what_the_tracker_derives(mode: str, config: dict[str, Any] | None) -> None:
    """``tqmon inspect`` and the live record take one path: predicting a resume from a checkpoint gives
    the record the reconciler derives once verl reports that resume as the plugin does."""
    trainer = None if config is None else TrainerConfig(**config)
    warmup = None if trainer is None else trainer.warmup_config(mode)
    predicted = predict_resume(saved(), reissued=3, cleared=5, config=warmup)

    given = None if trainer is None else GivenConfig(mode, trainer, "flags")
    state = Reconciler(given)
    state.apply(saved(), "checkpoint", 900.0)
    events = [ev("training_started", resumed_from_step=40)]
    if mode != "sync":  # verl restores and re-issues TransferQueue state in the async modes only
        groups = [g.model_dump() for g in COMPOSITION]
        events.append(ev("checkpoint_restored", step=40, restored_prompt_groups=12, groups=groups))
        events.append(ev("inflight_reissued", step=41, reissued_prompt_groups=3, cleared_trajectories=5))
    if warmup is not None:  # the plugin reports every decision, a skip with its reason
        if predicted.submitted:
            said = {"target_prompt_groups": predicted.target, "submitted_prompt_groups": predicted.submitted}
            events.append(ev("warmup_decided", **said))
        else:
            events.append(ev("warmup_decided", submitted_prompt_groups=0, skip_reason=skip_reason(warmup)))
    for index, raw in enumerate(events):
        state.apply(parse_event({"id": f"e{index}", **raw}), "events", 1000.0 + index)
    live = state.records[-1]

    fields: tuple[str, ...] = ("restored", "reissued", "target", "expected", "submitted", "over_restored", "doomed")
    fields += ("under_submitted",)
    if warmup is not None:
        fields += ("warmup_state",)  # without a config, verl's decision is unknown until it is reported
    assert _pick(predicted, fields) == _pick(live, fields)


def _pick(record: ResumeRecord, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(record, name) for name in names}


PREDICTED = ("restored", "reissued", "target", "expected", "submitted", "over_restored", "over_filled", "doomed")


def test_the_0_9_0_preflight_predicts_what_the_tracker_derives_from_0_9_0s_log() -> None:
    """verl 0.9.0 logs no restore count and no T: only ``Added {n} warmup batches``. Its prediction, from the
    checkpoint and the config, is the record the reconciler derives once that line arrives, and the line itself
    tells the reconciler the release, so the checkpoint's prediction narrows from both warmups to 0.9.0's."""
    trainer = TrainerConfig(**T12)
    predicted = predict_resume(
        saved(), reissued=3, cleared=5, config=trainer.warmup_config("colocate_async"), semantics=LEGACY
    )
    # R = 12 (doomed 6), T = 12; 0.9.0 submits 3 whole batches of 4 whatever R: the window starts at 24.
    assert (predicted.semantics, predicted.warmup_state) == ("verl-0.9.0", WarmupState.LEGACY_UNCONDITIONAL)
    assert _pick(predicted, ("restored", "target", "submitted", "over_restored", "over_filled")) == {
        "restored": 12,
        "target": 12,
        "submitted": 12,
        "over_restored": 0,
        "over_filled": 12,
    }
    assert (predicted.expected, predicted.under_submitted) == (0, 0)  # 0.9.1 would have submitted nothing

    state = Reconciler(GivenConfig("colocate_async", trainer, "flags"))
    state.apply(saved(), "checkpoint", 900.0)
    assert state.checkpoint is not None
    assert [o.semantics for o in state.checkpoint.outcomes] == ["verl-0.9.1", "verl-0.9.0"]  # unknown yet
    log = [
        ev("training_started", resumed_from_step=40),
        ev("inflight_reissued", step=41, reissued_prompt_groups=3, cleared_trajectories=5),
        ev("warmup_decided", legacy_warmup_batches=3),
    ]
    for index, raw in enumerate(log):
        state.apply(parse_event({"id": f"e{index}", **raw}), "log", 1000.0 + index)
    live = state.records[-1]
    assert _pick(predicted, (*PREDICTED, "under_submitted", "warmup_state", "semantics")) == _pick(
        live, (*PREDICTED, "under_submitted", "warmup_state", "semantics")
    )
    assert (state.verl_version.source, state.verl_version.semantics) == ("log", "verl-0.9.0")
    [outcome] = state.checkpoint.outcomes
    assert (outcome.semantics, outcome.submitted, outcome.over_filled) == ("verl-0.9.0", 12, 12)


def test_the_version_comes_from_run_started_the_log_the_flag_and_the_installed_verl_in_that_order() -> None:
    installed = VerlVersion("0.9.1", "installed", "verl-0.9.1", "the verl package next to tqmon")
    flag = named("0.9.0", "flag", FLAG)
    given = GivenConfig("colocate_async", TrainerConfig(**T12), "flags")
    state = Reconciler(given, [installed])
    state.apply(saved(), "checkpoint", 900.0)

    def told() -> tuple[str | None, str | None, list[tuple[str, int | None]]]:
        assert state.checkpoint is not None
        outcomes = [(o.semantics, o.submitted) for o in state.checkpoint.outcomes]
        return state.verl_version.source, state.verl_version.semantics, outcomes

    assert told() == ("installed", "verl-0.9.1", [("verl-0.9.1", 0)])
    assert flag is not None
    state = Reconciler(given, [installed, flag])
    state.apply(saved(), "checkpoint", 900.0)
    assert told() == ("flag", "verl-0.9.0", [("verl-0.9.0", 12)])
    # The log's own 0.9.1 line beats the flag; the plugin's run_started beats the log; one naming no release
    # (verl's __version__ unreadable) decides nothing, and the log's word stands again.
    state.apply(parse_event({"id": "r", **ev("checkpoint_restored", restored_prompt_groups=12)}), "log", 1000.0)
    assert told() == ("log", "verl-0.9.1", [("verl-0.9.1", 0)])
    assert state.verl_version.version == ">=0.9.1"
    run = ev("run_started", run_id="r", trainer_mode="colocate_async", verl_version="0.9.0", config=T12)
    state.apply(parse_event({"id": "run", **run}), "events", 1001.0)
    assert told() == ("run_started", "verl-0.9.0", [("verl-0.9.0", 12)])
    state.apply(parse_event({"id": "run2", **run | {"verl_version": ""}}), "events", 1002.0)
    assert told() == ("log", "verl-0.9.1", [("verl-0.9.1", 0)])
    # The plugin's own reports are not the log's lines: they tell nothing of the release.
    state = Reconciler(given)
    state.apply(parse_event({"id": "p", **ev("checkpoint_restored", restored_prompt_groups=12)}), "events", 1000.0)
    assert state.verl_version == UNKNOWN


@pytest.mark.parametrize(
    ("mode", "config", "state", "submitted"),
    [
        ("sync", T12, WarmupState.SYNC_MODE, 0),  # 0.9.0's sync trainer has no async warmup either
        ("colocate_async", T12 | {"skip_rollout_tq": True}, WarmupState.DISABLED, 0),  # it returns first
        ("colocate_async", T12 | {"num_warmup_batches": 0}, WarmupState.LEGACY_UNCONDITIONAL, 0),  # range(0)
        ("colocate_async", T12 | {"num_warmup_batches": 1.5}, WarmupState.UNKNOWN, None),  # range(1.5) raises
    ],
)
def test_verl_0_9_0_warms_up_only_through_its_loop(
    mode: str, config: dict[str, Any], state: WarmupState, submitted: int | None
) -> None:
    warmup = TrainerConfig(**config).warmup_config(mode)
    record = predict_resume(saved(), reissued=3, cleared=5, config=warmup, semantics=LEGACY)
    assert (record.semantics, record.warmup_state, record.submitted) == ("verl-0.9.0", state, submitted)


def test_a_second_source_corroborates_rather_than_opening_a_new_start() -> None:
    decided = ev("warmup_decided", target_prompt_groups=12, restored_prompt_groups=9, submitted_prompt_groups=3)
    state = fold(resume(40, 9, **decided | {"type": "warmup_decided"}), None)
    state.apply(parse_event({"id": "plugin", **decided}), "events", 2000.0)
    assert len(state.records) == 1  # the plugin said what the log said: the same start
    state.apply(parse_event({"id": "log-again", **decided}), "log", 2001.0)
    assert len(state.records) == 2  # the log deciding twice is a second start


def test_k_inferred_from_a_missing_re_issue_line_says_so_in_the_evidence() -> None:
    """verl logs no re-issue when nothing was in flight: once its warmup decided without that line, K and the
    cleared trajectories are 0 by inference, and the record's evidence names what they were inferred from.
    Until then they are unknown; a reported re-issue is evidence of its own, not an inference."""
    given = GivenConfig("colocate_async", TrainerConfig(**T12), "flags")
    decision = {"target_prompt_groups": 12, "restored_prompt_groups": 9, "submitted_prompt_groups": 3}
    events = resume(40, 9, **decision)
    waiting = fold(events[:2], given).records[-1]
    assert (waiting.reissued, waiting.cleared_trajectories) == (None, None)
    assert [e.source for e in waiting.evidence] == ["log", "log"]

    record = fold(events, given).records[-1]
    assert (record.reissued, record.cleared_trajectories) == (0, 0)
    inferred = record.evidence[-1]
    assert (inferred.source, inferred.event_type, inferred.event_id, inferred.at) == (
        "inference",
        "inflight_reissued",
        "e2",  # the warmup decision, before which verl would have logged its re-issue
        1002.0,
    )
    assert inferred.detail == (
        "reissued_prompt_groups=0, cleared_trajectories=0: inferred from the absence of the re-issue line"
        " before warmup_decided from log"
    )
    reissue = ev("inflight_reissued", step=41, reissued_prompt_groups=0, cleared_trajectories=0)
    reported = fold([*events[:2], reissue, events[2]], given).records[-1]
    assert "inference" not in {e.source for e in reported.evidence}


def test_the_trainer_progresses_when_a_step_moves_its_global_step_on() -> None:
    """``trainer_stepped_at`` (the alerts' and the status page's "the trainer progresses") moves with a step that
    changes the global step, from the log or the events; a repeated report of a step, a checkpoint dir read, a
    resume going back to its checkpoint's step and any other event do not move it."""
    state = Reconciler(GivenConfig("colocate_async", TrainerConfig(**T12), "flags"))

    def apply(at: float, source: str, **event: Any) -> float | None:
        state.apply(parse_event({"id": f"{source}:{at}", **event}), source, at)
        return state.trainer_stepped_at

    assert apply(100.0, "log", **ev("training_started", resumed_from_step=40)) is None  # a start is no step
    assert apply(160.0, "log", **ev("step_completed", global_step=41)) == 160.0
    assert apply(170.0, "jsonl", **ev("step_completed", global_step=41)) == 160.0  # the same step again
    assert apply(175.0, "log", **ev("checkpoint_saved", step=41)) == 160.0  # saved where it stands
    assert apply(180.0, "checkpoint", **saved(50).model_dump(mode="json")) == 160.0  # the dir: maybe another run
    assert apply(190.0, "log", **ev("window_observed", by_status={"pending": 3})) == 160.0  # talking, not stepping
    assert state.trainer_last_event == 190.0
    assert apply(220.0, "events", **ev("checkpoint_saved", step=42)) == 220.0  # saved a step not seen completing
    assert apply(300.0, "log", **ev("training_started", resumed_from_step=40)) == 220.0  # a resume goes back
    assert state.trainer_step == 40
    assert apply(330.0, "log", **ev("step_completed", global_step=41)) == 330.0  # and steps forward again
