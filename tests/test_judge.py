"""The judge through the reconciler: sources that contradict each other about a start, and lost windows.

Config: train_batch_size 4, num_warmup_batches 3 (T = 12) unless a test says otherwise. The loaded
checkpoint global_step_40 holds 2 pending, 1 running, 5 finished (steps 38-40: none stale at 41) and no
failure: R = 8, nothing doomed, so a healthy resume's warmup submits 4 and its first window holds 12 groups,
plus the batch of 4 the first step adds before it samples.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from prometheus_client.exposition import generate_latest

from tests.test_exposition import full_snapshot, registry_for
from tqmon.cli import main
from tqmon.derivation import predict_resume
from tqmon.events import CheckpointSaved, GroupCount, parse_event
from tqmon.judge import Bounds, exact, has_tq_dir, window_bounds
from tqmon.reconcile import KEPT_COMPOSITIONS, Reconciler
from tqmon.snapshot import Claim, ResumeRecord, WindowView
from tqmon.warmup import GivenConfig, TrainerConfig, WarmupState

T12 = {"train_batch_size": 4, "num_warmup_batches": 3}
LOADED = [
    GroupCount(status="pending", global_steps=40, count=2),
    GroupCount(status="running", global_steps=40, count=1),
    GroupCount(status="finished", global_steps=39, count=5),
]
SPLIT = {"pending": 2, "running": 1, "finished": 5, "failure": 0}


def ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def window(pending: int, running: int = 0, finished: int = 0, failure: int = 0) -> dict[str, Any]:
    return ev(
        "window_observed", by_status={"pending": pending, "running": running, "finished": finished, "failure": failure}
    )


def checkpoint(step: int = 40, groups: list[GroupCount] | None = None, tq: bool = True) -> CheckpointSaved:
    path = f"/ckpt/global_step_{step}" + ("/transfer_queue" if tq else "")
    return CheckpointSaved(id=f"checkpoint:{step}", step=step, path=path, groups=LOADED if groups is None else groups)


def healthy_log(restored: int = 8, submitted: int = 4, target: int = 12) -> list[dict[str, Any]]:
    return [
        ev("training_started", resumed_from_step=40),
        ev("checkpoint_restored", restored_prompt_groups=restored),
        ev("inflight_reissued", step=41, reissued_prompt_groups=3, cleared_trajectories=3),
        ev(
            "warmup_decided",
            target_prompt_groups=target,
            restored_prompt_groups=restored,
            submitted_prompt_groups=submitted,
        ),
    ]


def fold(
    *steps: tuple[str, dict[str, Any] | CheckpointSaved],
    config: dict[str, Any] | None = None,
    verl_version: str = "",
) -> Reconciler:
    """Apply (source, event) pairs one second apart; the config is given as flags."""
    given = GivenConfig("colocate_async", TrainerConfig(**(config or T12)), "flags")
    state = Reconciler(given)
    if verl_version:
        run = ev("run_started", run_id="r", trainer_mode="colocate_async", verl_version=verl_version, config=T12)
        state.apply(parse_event({"id": "run", **run}), "events", 900.0)
    for index, (source, raw) in enumerate(steps):
        event = raw if isinstance(raw, CheckpointSaved) else parse_event({"id": f"{source}{index}", **raw})
        state.apply(event, source, 1000.0 + index)
    return state


def log(*events: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("log", e) for e in events]


def said(record: ResumeRecord) -> dict[str, dict[str, int]]:
    """Each disagreement as quantity -> source -> value."""
    return {d.quantity: {c.source: c.value for c in d.claims} for d in record.disagreements}


def test_a_healthy_resume_raises_no_disagreement() -> None:
    state = fold(("checkpoint", checkpoint()), *log(*healthy_log(), window(12, 0, 0), window(9, 3, 4)))
    [record] = state.records
    assert record.restored_by_status == SPLIT
    assert record.warmup_state is WarmupState.TOPPED_UP
    assert record.disagreements == ()


def test_a_miscounted_restore_contradicts_the_checkpoint_and_the_live_window() -> None:
    """The miscounted-restore bug: the trainer logs 30 for a checkpoint of 8 and, T being 20, submits nothing;
    the live window then holds 8 + the first step's batch of 4."""
    t20 = T12 | {"num_warmup_batches": 5}
    events = healthy_log(restored=30, submitted=0, target=20)
    state = fold(("checkpoint", checkpoint()), *log(*events, window(4, 3, 5)), config=t20)
    [record] = state.records
    assert record.restored == 30  # the log's R stands: nothing is silently replaced
    assert said(record) == {
        "restored": {"log": 30, "checkpoint": 8},
        "window_after_warmup": {"log R + M": 30, "log": 12},
    }
    window_check = record.disagreements[-1]
    assert window_check.tolerance == "allowed 30..34"  # R + M, up to one batch more; nothing doomed
    assert window_check.claims[1].at == 1005.0  # when the window was seen


def test_a_miscounted_restore_keeps_its_verdict_whatever_the_arrival_order_and_while_the_trainer_saves_on() -> None:
    """The verdict on the miscounted restore is the same whether the log or the checkpoint's composition
    arrives first, and it stays once the trainer has saved more checkpoints after the resume than tqmon keeps
    compositions (it saves every 2 steps in the demo, so after ~17 s): the loaded one stays pinned."""
    t20 = T12 | {"num_warmup_batches": 5}
    logged = log(
        *healthy_log(restored=30, submitted=0, target=20), window(4, 3, 5), ev("step_completed", global_step=41)
    )
    saves_after: list[tuple[str, dict[str, Any] | CheckpointSaved]] = [
        ("checkpoint", checkpoint(step, [GroupCount(status="pending", global_steps=step, count=8)]))
        for step in range(42, 42 + KEPT_COMPOSITIONS + 2)
    ]
    expected = {"restored": {"log": 30, "checkpoint": 8}, "window_after_warmup": {"log R + M": 30, "log": 12}}
    loaded: tuple[str, dict[str, Any] | CheckpointSaved] = ("checkpoint", checkpoint())
    for steps in ([loaded, *logged], [*logged, loaded]):
        state = fold(*steps, *saves_after, config=t20)
        [record] = state.records
        assert said(record) == expected
        assert record.disagreements[-1].tolerance == "allowed 30..34"  # global_step_40's split: nothing doomed


def test_the_window_compared_is_the_first_polled_after_the_decision_whichever_source_tqmon_hears_first() -> None:
    """The TQ poller and the log race: the window polled after the decision (the log's lines carry the trainer's
    times, 1001-1004) and before the first step completed is the one compared, whether it arrives before the
    log lines (the log lags), between them and the step line, or after the step line; a poll taken after the
    step line is not (the next step has changed the window since)."""
    t20 = T12 | {"num_warmup_batches": 5}
    lines = [
        ("log", parse_event({"id": f"log{i}", "time": 1001.0 + i, **e}))
        for i, e in enumerate(healthy_log(restored=30, submitted=0, target=20))
    ]
    polled = ("tq", WindowView("train", "tq", 1005.0, {"pending": 4, "running": 4}))
    step = ("log", parse_event({"id": "step", **ev("step_completed", global_step=41)}))  # untimed: its receipt
    later = ("tq", WindowView("train", "tq", 1020.0, {"pending": 30}))
    orders = {
        "log lags": [polled, *lines, step],
        "in order": [*lines, polled, step],
        "poll lags": [*lines, step, polled],
    }
    for name, arrivals in orders.items():
        state = Reconciler(GivenConfig("colocate_async", TrainerConfig(**t20), "flags"))
        state.apply(checkpoint(), "checkpoint", 1000.0)
        for received, (source, item) in enumerate([*arrivals, later], start=1006):
            if isinstance(item, WindowView):
                state.observe_windows([item])
            else:
                state.apply(item, source, float(received))
        [record] = state.records
        assert said(record) == {
            "restored": {"log": 30, "checkpoint": 8},
            "window_after_warmup": {"log R + M": 30, "tq": 8},
        }, name
        assert record.disagreements[-1].claims[1].at == 1005.0, name


def test_every_pair_of_sources_is_compared() -> None:
    """The plugin's K and split against the log and the checkpoint; T and M against the config."""
    plugin = ev("checkpoint_restored", restored_prompt_groups=8, by_status=SPLIT | {"running": 0, "finished": 6})
    state = fold(
        ("checkpoint", checkpoint()),
        *log(*healthy_log(target=16, submitted=8)),
        ("events", plugin),
        ("events", ev("inflight_reissued", step=41, reissued_prompt_groups=2)),
    )
    [record] = state.records
    assert said(record) == {
        "restored_running": {"events": 0, "checkpoint": 1},
        "restored_finished": {"events": 6, "checkpoint": 5},
        "reissued": {"log": 3, "events": 2},
        "target": {"log": 16, "config": 12},
        "submitted": {"log": 8, "config": 4},
    }


def test_legitimate_differences_are_tolerated() -> None:
    """A newer checkpoint than the one loaded, polls while the trainer restores or samples, and a window
    that already holds the first step's batch: none is a contradiction."""
    newer = checkpoint(42, [GroupCount(status="finished", global_steps=42, count=3)])
    state = fold(
        ("checkpoint", checkpoint()),
        ("checkpoint", newer),
        *log(ev("training_started", resumed_from_step=40)),
        ("tq", window(0)),  # the new controller is still empty: the restore is not reported yet
        *log(*healthy_log()[1:]),
        ("tq", window(16)),  # R + M + the first step's batch
    )
    [record] = state.records
    assert record.disagreements == ()
    assert record.restored_by_status == SPLIT


def test_a_live_window_outside_the_checkpoint_composition_is_a_disagreement() -> None:
    state = fold(("checkpoint", checkpoint()), *log(*healthy_log()[:2]), ("tq", window(3)))
    [record] = state.records
    assert said(record) == {"checkpoint_window": {"checkpoint": 8, "tq": 3}}


def test_the_poller_feeds_the_open_start_through_observe_windows() -> None:
    state = fold(("checkpoint", checkpoint()), *log(*healthy_log()))
    state.observe_windows([WindowView("train", "tq", 1010.0, {"pending": 20})])
    [record] = state.records
    assert said(record) == {
        "window_after_warmup": {"log R + M": 12, "tq": 20},
        "checkpoint_window": {"checkpoint": 8, "tq": 20},
    }


def test_a_lost_window_is_confirmed_by_the_checkpoint_dir_and_sized_by_the_previous_composition() -> None:
    before = checkpoint(30, [GroupCount(status="finished", global_steps=30, count=11)])
    state = fold(
        ("checkpoint", before),
        ("checkpoint", checkpoint(40, [], tq=False)),
        *log(
            ev("training_started", resumed_from_step=40),
            ev("warmup_decided", target_prompt_groups=12, restored_prompt_groups=0, submitted_prompt_groups=12),
        ),
    )
    [record] = state.records
    assert record.warmup_state is WarmupState.LOST_WINDOW
    assert record.cost.lost_prompt_groups == 11
    details = [e.detail for e in record.evidence if e.source == "checkpoint"]
    assert "global_step_40 has no transfer_queue/" in details
    assert "global_step_30 held 11 groups" in details
    assert record.disagreements == ()  # R 0 everywhere: the sources agree, the window is just gone


def test_a_restore_line_or_verl_090_is_not_a_lost_window() -> None:
    decided = ev("warmup_decided", target_prompt_groups=12, restored_prompt_groups=0, submitted_prompt_groups=12)
    start = ev("training_started", resumed_from_step=40)
    restored_nothing = fold(*log(start, ev("checkpoint_restored", restored_prompt_groups=0), decided))
    assert restored_nothing.records[0].warmup_state is WarmupState.TOPPED_UP
    legacy = fold(*log(start, decided), verl_version="0.9.0")
    assert legacy.records[0].warmup_state is not WarmupState.LOST_WINDOW
    unknown = fold(*log(start, decided, window(20)))  # the window seen after the restart is not what was lost
    [record] = unknown.records
    assert (record.warmup_state, record.cost.lost_prompt_groups) == (WarmupState.LOST_WINDOW, None)


def test_the_pure_pieces() -> None:
    assert exact("k", [Claim("log", 3, 1.0), Claim("events", 3, 2.0), Claim("log", 3, 3.0)]) is None
    contradiction = exact("k", [Claim("log", 3, 1.0), Claim("events", 3, 2.0), Claim("log", 4, 3.0)])
    assert contradiction is not None and [c.at for c in contradiction.claims] == [1.0, 2.0, 3.0]
    assert window_bounds(12, None, 8, 4) == Bounds(4, 16)  # a bare total: all restored groups may be evicted
    assert window_bounds(12, None, 8, 4, terminal=5) == Bounds(7, 16)  # only finished and failed ones
    assert window_bounds(12, 2, 8, None, terminal=5) == Bounds(10, None)
    assert (has_tq_dir("/c/global_step_4/transfer_queue.old"), has_tq_dir("/c/global_step_4/"), has_tq_dir(None)) == (
        True,
        False,
        None,
    )


LOST_LOG = """\
INFO:2026-11-28 22:00:00,000:Training from scratch
INFO:2026-11-28 22:00:01,000:Added 12 warmup prompts after restoring 0 of 12 target prompt groups
INFO:2026-11-28 22:00:02,000:pending: 16, running: 0, finished: 0, failure: 0
INFO:2026-11-28 22:10:00,000:Saving checkpoint to /ckpt/global_step_10
INFO:2026-11-28 22:20:00,000:Resuming from /ckpt/global_step_10, setting global step to 10
INFO:2026-11-28 22:20:01,000:Added 12 warmup prompts after restoring 0 of 12 target prompt groups
INFO:2026-11-28 22:20:02,000:pending: 3, running: 0, finished: 0, failure: 0
"""


def test_analyze_shows_a_lost_window_and_a_window_short_of_its_warmup(tmp_path: Path) -> None:
    """From the log alone: the resume has no "Restored" line before its warmup (lost, 16 groups as the last
    window before the restart said), and its first window holds 3 of the 0 + 12 just submitted."""
    path = tmp_path / "trainer.log"
    path.write_text(LOST_LOG)
    result = CliRunner().invoke(main, ["analyze", "--json", str(path)])
    assert result.exit_code == 0, result.output
    fresh, resumed = json.loads(result.stdout)["records"]
    assert (fresh["warmup_state"], fresh["disagreements"]) == ("fresh_start", [])
    assert fresh["cost"]["lost_prompt_groups"] is None  # a fresh start costs nothing countable
    assert (resumed["warmup_state"], resumed["cost"]["lost_prompt_groups"]) == ("lost_window", 16)
    [disagreement] = resumed["disagreements"]
    assert disagreement["quantity"] == "window_after_warmup"
    assert [(c["source"], c["value"]) for c in disagreement["claims"]] == [("log R + M", 12), ("log", 3)]
    assert disagreement["tolerance"] == "allowed 12.."  # no config: the batch a step adds is unknown

    table = CliRunner().invoke(main, ["analyze", str(path)])
    lines = table.stdout.strip().splitlines()
    header, row = next(line for line in lines if line.startswith("#  started")), lines[-1]
    assert "lost_window" in row
    assert row[header.index("groups lost") :].split()[0] == "16"  # the resume's cost: one count, one column
    assert "LOST WINDOW: resumed without transfer_queue/ (16 prompt groups lost, all re-generated)" in row
    assert "sources disagree: window_after_warmup: log R + M said 12; log said 3 (allowed 12..)" in row


def test_a_plugin_contradicting_the_log_on_r_is_the_same_start_and_the_log_stands() -> None:
    """The second door reporting another R is a contradiction about this start, not a new start; the record
    keeps the first report whole rather than mixing one source's total with another's split."""
    plugin = ev("checkpoint_restored", restored_prompt_groups=8, by_status=SPLIT)
    state = fold(*log(*healthy_log(restored=30, submitted=0, target=12)), ("events", plugin))
    [record] = state.records
    assert (record.restored, record.restored_by_status) == (30, {"unknown": 30})
    assert said(record)["restored"] == {"log": 30, "events": 8}
    assert [e.source for e in record.evidence].count("events") == 1


def test_inspect_predicts_a_lost_window_only_without_the_tq_dir() -> None:
    """``tqmon inspect`` shares the derivation: an empty TQ dir restores 0 groups (verl reports it), a
    missing one loses the window."""
    config = TrainerConfig(**T12).warmup_config("colocate_async")
    empty = predict_resume(checkpoint(40, []), reissued=0, cleared=0, config=config)
    assert (empty.warmup_state, empty.cost.lost_prompt_groups) == (WarmupState.TOPPED_UP, 0)
    missing = predict_resume(checkpoint(40, [], tq=False), reissued=0, cleared=0, config=config)
    assert (missing.warmup_state, missing.cost.lost_prompt_groups) == (WarmupState.LOST_WINDOW, None)
    assert missing.evidence[-1].detail == "global_step_40 has no transfer_queue/"


def test_tqmon_inspect_says_a_checkpoint_without_its_tq_dir_loses_the_window(tmp_path: Path) -> None:
    (tmp_path / "global_step_6").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")
    flags = ["--trainer-mode", "colocate_async", "--train-batch-size", "4", "--num-warmup-batches", "2"]
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    headline = result.stdout.splitlines()[0]
    assert headline.endswith("of 8 — LOST WINDOW: no transfer_queue/ to restore, the warmup re-generates it all")
    assert "warmup M         8 (lost_window)" in result.stdout


def test_with_dapo_unknown_the_first_sample_evicts_only_finished_and_failed_groups() -> None:
    """DAPO on without its metric: how many finished groups it filters is unknown, but the first sample evicts
    only finished and failed groups (5 of the 8 restored). A window of 6 after R + M = 12 lost pending or
    running groups, which no eviction explains; the checkpoint window of 2 likewise (8 - 5 = 3 at least)."""
    dapo = T12 | {"filter_groups": True}
    after = fold(("checkpoint", checkpoint()), *log(*healthy_log(), window(1, 0, 5)), config=dapo)
    [record] = after.records
    assert record.doomed == {"failure": 0, "stale": 0}  # filtered unknown
    assert said(record) == {"window_after_warmup": {"log R + M": 12, "log": 6}}
    assert record.disagreements[0].tolerance == "allowed 7..16"
    restored = fold(("checkpoint", checkpoint()), *log(*healthy_log()[:2]), ("tq", window(2)), config=dapo)
    assert said(restored.records[0]) == {"checkpoint_window": {"checkpoint": 8, "tq": 2}}
    healthy = fold(("checkpoint", checkpoint()), *log(*healthy_log(), window(4, 3, 0)), config=dapo)
    assert healthy.records[0].disagreements == ()  # all 5 finished groups filtered away: 12 - 5 = 7 is allowed


def test_a_source_contradicting_itself_is_a_disagreement() -> None:
    """verl logs one count twice ("Restored 8 ..." then "... after restoring 9 of 12"): the log disagrees with
    itself, whatever its first line said."""
    state = fold(*log(*healthy_log()[:3], healthy_log(restored=9)[3]))
    [record] = state.records
    [disagreement] = record.disagreements
    assert disagreement.quantity == "restored"
    assert [(c.source, c.value) for c in disagreement.claims] == [("log", 8), ("log", 9)]
    assert disagreement.describe() == "restored: log said 8; log said 9 (exact)"


def test_only_quantities_two_claims_were_given_for_are_compared() -> None:
    """The log alone says R twice and K once; the config predicts T and M: K, R's split and the live windows
    were not compared, so they have no verdict (not a 0 that reads as agreement)."""
    state = fold(*log(*healthy_log()))
    [record] = state.records
    assert record.compared == ("restored", "target", "submitted")
    assert record.disagreements == ()
    with_window = fold(("checkpoint", checkpoint()), *log(*healthy_log(), window(12)))
    live = ("window_after_warmup", "checkpoint_window")
    assert with_window.records[0].compared == ("restored", "target", "submitted", *live)


def test_a_disagreement_once_found_falls_back_to_0_rather_than_vanishing() -> None:
    """tqmon's flags said 5 warmup batches (T 20, M 12) where the trainer logged T 12 and M 4: both disagree.
    The trainer's run_started, arriving late, turns the warmup off in the config, which then predicts neither:
    nothing contradicts the log any more. The record keeps both quantities compared, so their series fall
    back to 0 (an alert on them resolves on a value) rather than vanishing."""
    state = fold(*log(*healthy_log()), config=T12 | {"num_warmup_batches": 5})
    assert said(state.records[0]) == {"target": {"log": 12, "config": 20}, "submitted": {"log": 4, "config": 12}}
    config = T12 | {"num_warmup_batches": 0}
    run = ev("run_started", run_id="r", trainer_mode="colocate_async", verl_version="0.9.1", config=config)
    state.apply(parse_event({"id": "run", **run}), "events", 1010.0)
    [record] = state.records
    assert (record.compared, record.disagreements) == (("restored", "target", "submitted"), ())
    snapshot = replace(full_snapshot(), last_record=record)
    text = generate_latest(registry_for(snapshot)).decode()
    assert [line for line in text.splitlines() if line.startswith("tqmon_resume_source_disagreements")] == [
        'tqmon_resume_source_disagreements{quantity="restored"} 0.0',
        'tqmon_resume_source_disagreements{quantity="target"} 0.0',
        'tqmon_resume_source_disagreements{quantity="submitted"} 0.0',
    ]
