"""The tracker's reconciliation of events into resume records, and its persistence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqmon.events import Event, parse_event
from tqmon.snapshot import Tally
from tqmon.store import StateStore
from tqmon.tracker import Tracker
from tqmon.warmup import WarmupState

CONFIG = {"train_batch_size": 4, "num_warmup_batches": 3}  # T = 12 in the async modes


def ev(kind: str, eid: str, **fields: Any) -> Event:
    return parse_event({"type": kind, "id": eid, **fields})


def run_started(eid: str = "run", mode: str = "colocate_async", **config: Any) -> Event:
    return ev("run_started", eid, run_id="r1", trainer_mode=mode, verl_version="0.9.1", config=CONFIG | config)


def tracker(path: Path | None = None) -> Tracker:
    return Tracker(StateStore(path))


def test_log_style_resume_without_config() -> None:
    t = tracker()
    t.ingest(
        [
            ev("training_started", "a", resumed_from_step=40),
            ev("checkpoint_restored", "b", restored_prompt_groups=9),
            ev("inflight_reissued", "c", step=41, reissued_prompt_groups=3, cleared_trajectories=5),
            ev("warmup_decided", "d", target_prompt_groups=12, restored_prompt_groups=9, submitted_prompt_groups=3),
        ],
        "log",
    )
    [record] = t.snapshot.records
    assert (record.checkpoint_step, record.restored, record.reissued, record.target) == (40, 9, 3, 12)
    assert (record.expected, record.submitted, record.over_restored) == (3, 3, 0)
    assert record.restored_by_status == {"unknown": 9}
    assert record.doomed == {"filtered": 0}  # failure and stale unknown without a split; filtered by default
    assert record.assumed_defaults == ("filter_groups=false",)
    assert record.under_submitted == 0  # lower bound: unknown doomed groups count as 0
    assert record.under_submitted_lower_bound
    assert record.warmup_state is WarmupState.TOPPED_UP
    assert t.snapshot.resumes_total == 1
    assert [e.event_type for e in record.evidence] == [
        "training_started",
        "checkpoint_restored",
        "inflight_reissued",
        "warmup_decided",
    ]


def test_plugin_composition_makes_doomed_and_deficit_exact() -> None:
    t = tracker()
    groups = [
        {"status": "pending", "global_steps": 40, "count": 2},
        {"status": "failure", "global_steps": 39, "count": 2},
        {"status": "finished", "global_steps": 30, "count": 3},  # span 41 - 30 + 1 = 12 > 8: stale
        {"status": "finished", "global_steps": 40, "count": 2},
    ]
    t.ingest(
        [
            run_started(),
            ev("training_started", "a", resumed_from_step=40),
            ev("checkpoint_restored", "b", step=40, restored_prompt_groups=9, groups=groups),
            ev("warmup_decided", "d", target_prompt_groups=12, restored_prompt_groups=9, submitted_prompt_groups=3),
        ],
        "events",
    )
    record = t.snapshot.records[-1]
    assert record.restored_by_status == {"pending": 2, "running": 0, "finished": 5, "failure": 2}
    assert record.doomed == {"failure": 2, "stale": 3, "filtered": 0}
    assert record.under_submitted == 12 - (9 - 5 + 3)
    assert record.reissued == 0  # the warmup came and no re-issue line: nothing was in flight


def test_two_sources_reporting_one_resume_make_one_record() -> None:
    t = tracker()
    t.ingest([ev("training_started", "log:1", resumed_from_step=40)], "log")
    t.ingest([ev("checkpoint_restored", "log:2", restored_prompt_groups=9)], "log")
    by_status = {"pending": 2, "running": 1, "finished": 4, "failure": 2}
    t.ingest([ev("checkpoint_restored", "p:1", step=40, restored_prompt_groups=9, by_status=by_status)], "events")
    [record] = t.snapshot.records
    assert record.restored_by_status == by_status
    assert record.doomed == {"failure": 2, "filtered": 0}  # stale needs the groups' steps
    assert {e.source for e in record.evidence} == {"log", "events"}


def test_each_new_start_opens_a_record_and_counts_resumes_only() -> None:
    t = tracker()
    t.ingest(
        [
            ev("training_started", "a"),
            ev("warmup_decided", "b", target_prompt_groups=12, restored_prompt_groups=0, submitted_prompt_groups=12),
            ev("step_completed", "c", global_step=1),
            ev("training_started", "d", resumed_from_step=20),
            ev("checkpoint_restored", "e", restored_prompt_groups=12),
            ev(
                "warmup_decided",
                "f",
                target_prompt_groups=12,
                restored_prompt_groups=12,
                submitted_prompt_groups=0,
                skip_reason="window_full",
            ),
            ev("training_started", "g", resumed_from_step=40),
            ev("checkpoint_restored", "h", restored_prompt_groups=16),
            ev(
                "warmup_decided",
                "i",
                target_prompt_groups=8,
                restored_prompt_groups=16,
                submitted_prompt_groups=0,
                skip_reason="window_full",
            ),
        ],
        "log",
    )
    states = [r.warmup_state for r in t.snapshot.records]
    assert states == [WarmupState.FRESH_START, WarmupState.SKIPPED_FULL, WarmupState.SKIPPED_OVER_RESTORED]
    assert t.snapshot.records[-1].over_restored == 8
    assert t.snapshot.resumes_total == 2
    assert t.snapshot.records[0].first_step_evictions == {"failure": 0, "stale": 0, "filtered": 0}


def test_legacy_warmup_line_and_growth_are_detected() -> None:
    t = tracker()
    t.ingest(
        [
            run_started(),
            ev("training_started", "a", resumed_from_step=10),
            ev("checkpoint_restored", "b", restored_prompt_groups=12),
            ev("warmup_decided", "c", legacy_warmup_batches=3),
        ],
        "log",
    )
    record = t.snapshot.records[-1]
    assert record.warmup_state is WarmupState.LEGACY_UNCONDITIONAL
    assert (record.submitted, record.expected, record.semantics) == (12, 0, "verl-0.9.0")
    # Growth by exactly T between two resumes with no 0.9.1 warmup line is the same signature.
    t.ingest(
        [
            ev("step_completed", "d", global_step=11),
            ev("training_started", "e", resumed_from_step=20),
            ev("checkpoint_restored", "f", restored_prompt_groups=24),
        ],
        "log",
    )
    assert t.snapshot.records[-1].warmup_state is WarmupState.LEGACY_UNCONDITIONAL


def test_silent_decisions_come_from_the_config() -> None:
    t = tracker()
    t.ingest(
        [
            run_started(skip_rollout_tq=True),
            ev("training_started", "a", resumed_from_step=5),
            ev("checkpoint_restored", "b", restored_prompt_groups=4),
        ],
        "log",
    )
    assert t.snapshot.records[-1].warmup_state is WarmupState.DISABLED
    assert t.snapshot.records[-1].expected == 0
    t2 = tracker()
    t2.ingest([run_started(mode="sync"), ev("training_started", "a", resumed_from_step=5)], "log")
    assert t2.snapshot.records[-1].warmup_state is WarmupState.SYNC_MODE
    assert t2.snapshot.records[-1].restored == 0


def test_restart_replays_state_and_ignores_repeated_ids(tmp_path: Path) -> None:
    t = tracker(tmp_path)
    events = [
        ev("training_started", "a", resumed_from_step=40),
        ev("checkpoint_restored", "b", restored_prompt_groups=9),
    ]
    assert t.ingest(events, "log", cursors=[("log:/x", {"offset": 120})], log_lines={"event": 2, "ignored": 5}) == (
        2,
        0,
    )
    t.reject("malformed_json")
    t.register_source("log", stale_after=30)
    t.source_error("log", "malformed_line", 2)
    before = list(t.snapshot.records)

    again = tracker(tmp_path)
    assert again.replay() == 2
    assert list(again.snapshot.records) == before
    assert again.cursor("log:/x") == {"offset": 120}
    counters = again.snapshot.counters
    assert counters[Tally.EVENTS_REJECTED] == {("malformed_json",): 1}
    assert counters[Tally.LOG_LINES] == {("event",): 2, ("ignored",): 5}
    assert counters[Tally.SOURCE_ERRORS] == {("log", "malformed_line"): 2}
    assert again.ingest(events, "log") == (0, 2)
    assert again.snapshot.resumes_total == 1
    assert again.snapshot.counters[Tally.EVENTS][("log", "duplicate")] == 2


def test_window_status_and_readiness_follow_the_clock() -> None:
    now = [1000.0]
    t = Tracker(StateStore(None), stale_after=60, clock=lambda: now[0])
    t.ingest([run_started()], "events")
    counts = {"pending": 4, "running": 4, "finished": 2, "failure": 0}
    t.ingest([ev("window_observed", "w", time=now[0], by_status=counts)], "log")
    snap = t.snapshot
    assert snap.window_status(now[0]) == "under_filled"  # 10 < T = 12
    assert snap.window_status(now[0] + 61) == "unknown"  # stale data is not served as fresh
    t.register_source("log", stale_after=30)
    assert not t.snapshot.ready(now[0])
    t.source_succeeded("log", 0.01)
    assert t.snapshot.ready(now[0] + 30) and not t.snapshot.ready(now[0] + 31)


def test_a_logged_target_wins_over_a_config_the_start_did_not_run_with() -> None:
    """tqmon was told T = 12, but this start logged T = 8 (an older config): M expected follows the log."""
    t = tracker()
    t.ingest([run_started()], "events")
    t.ingest(
        [
            ev("training_started", "a", resumed_from_step=40),
            ev("checkpoint_restored", "b", restored_prompt_groups=5),
            ev("warmup_decided", "c", target_prompt_groups=8, restored_prompt_groups=5, submitted_prompt_groups=3),
        ],
        "log",
    )
    [record] = t.snapshot.records
    assert (record.target, record.expected, record.submitted, record.over_restored) == (8, 3, 3, 0)
    assert record.warmup_state is WarmupState.TOPPED_UP
    assert t.snapshot.target_window == 8
