"""What a resume cost (issue 12 §4): steps lost, downtime, time to the first step, rollouts wasted.

The pure derivation (``tqmon.cost``), the reconciler's choice of what counts as trainer time, and a log and
JSONL whose steps verl's own ``Tracking`` wrote (console and file backends), read by ``tqmon analyze`` and
``tqmon serve``. Every expected number is derived by hand in the comments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from tests.conftest import sample_value
from tqmon.cli import main
from tqmon.cost import CostInputs, ResumeCost, elapsed, resume_cost, steps_lost, time_to_first_step, wasted_rollouts
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
)
from tqmon.reconcile import Reconciler
from tqmon.snapshot import SourceName
from tqmon.warmup import TrainerConfig

LOG_FORMAT = "%(levelname)s:%(asctime)s:%(message)s"  # verl's
DAY = "2026-11-28"


def at(clock: str) -> float:
    """A wall-clock time of the test day, local time (verl's log timestamps carry no zone)."""
    return datetime.strptime(f"{DAY} {clock}", "%Y-%m-%d %H:%M:%S").astimezone().timestamp()


def when(clock: str) -> datetime:
    return datetime.fromtimestamp(at(clock)).astimezone()


# ---------------------------------------------------------------- the pure derivation


def test_steps_lost_is_the_last_step_before_the_stop_minus_the_checkpoint() -> None:
    assert steps_lost(7, 4) == 3
    assert steps_lost(4, 4) == 0  # stopped right after a checkpoint: nothing lost, known
    assert steps_lost(None, 4) is None  # no step seen before the stop
    assert steps_lost(3, 4) is None  # the steps seen are not the run's last: unknown, never negative


def test_times_need_both_ends_in_order() -> None:
    assert elapsed(100.0, 160.5) == 60.5
    assert elapsed(None, 160.5) is None and elapsed(100.0, None) is None
    assert elapsed(200.0, 100.0) is None  # two clocks disagreeing is not a negative downtime
    assert time_to_first_step(100.0, 130.0, 12.5) == 42.5  # 30 s to the step loop, then the 12.5 s step
    assert time_to_first_step(100.0, None, 12.5) is None
    assert time_to_first_step(100.0, 130.0, None) is None


def test_wasted_rollouts_need_every_doom_reason_and_rollout_n() -> None:
    assert wasted_rollouts({"failure": 1, "stale": 4, "filtered": 0}, 8) == 40
    assert wasted_rollouts({"failure": 0, "stale": 0, "filtered": 0}, 8) == 0  # known: nothing wasted
    assert wasted_rollouts({"failure": 1, "filtered": 0}, 8) is None  # stale unknown: a guess otherwise
    assert wasted_rollouts({"failure": 1, "stale": 4, "filtered": 0}, None) is None
    assert wasted_rollouts(None, 8) is None


def test_a_fresh_start_costs_nothing_countable() -> None:
    inputs = CostInputs(0, 10.0, 5, 1.0, 20.0, 3.0, {"failure": 0, "stale": 0, "filtered": 0}, 4)
    assert resume_cost(inputs, resumed=False) == ResumeCost()
    assert resume_cost(inputs, resumed=True) == ResumeCost(5, 9.0, 13.0, 0, None)


# ---------------------------------------------------------------- what the reconciler counts

CONFIG = TrainerConfig(train_batch_size=4, num_warmup_batches=2, rollout_n=8)


def fold(events: list[tuple[Event, str]], received_at: float = 0.0) -> Reconciler:
    state = Reconciler()
    for event, source in events:
        state.apply(event, source, received_at)
    return state


def first_run(steps: int = 5) -> list[tuple[Event, str]]:
    """A fresh start at 10:00, steps 1..steps (step 4 saved at 10:02), a replay buffer line at 10:03:30."""
    log, jsonl = SourceName.LOG, SourceName.JSONL
    events: list[tuple[Event, str]] = [
        (TrainingStarted(id="s0", time=when("10:00:00")), log),
        (WarmupDecided(id="w0", time=when("10:00:05"), target_prompt_groups=8, restored_prompt_groups=0,
                       submitted_prompt_groups=8), log),
    ]  # fmt: skip
    for step in range(1, steps + 1):
        if step == 4:
            events.append((CheckpointSaved(id="c4", time=when("10:02:00"), step=4), log))
        events.append((StepCompleted(id=f"j{step}", global_step=step, step_seconds=30.0), jsonl))
    events.append((WindowObserved(id="p", time=when("10:03:30"), by_status={"pending": 2}), log))
    return events


RESTORED = [  # what global_step_4 held, as the verl plugin reports it
    GroupCount(status=status, global_steps=g, count=n)
    for status, g, n in (("pending", 4, 1), ("running", 4, 1), ("finished", 4, 5), ("failure", 3, 1))
]


def resume(*, reissue: bool = True) -> list[tuple[Event, str]]:
    """Resumed from global_step_4 at 10:10; re-issue at 10:11:00, warmup at 10:11:05; step 5 took 42.5 s."""
    log = SourceName.LOG
    events: list[tuple[Event, str]] = [
        (TrainingStarted(id="s1", time=when("10:10:00"), resumed_from_step=4), log),
        (CheckpointRestored(id="r1", time=when("10:10:20"), restored_prompt_groups=8, groups=RESTORED),
         SourceName.EVENTS),
    ]  # fmt: skip
    if reissue:
        events.append((InflightReissued(id="k1", time=when("10:11:00"), step=5, reissued_prompt_groups=2), log))
    events += [
        (WarmupDecided(id="w1", time=when("10:11:05"), target_prompt_groups=8, restored_prompt_groups=8,
                       submitted_prompt_groups=0, skip_reason="window_full"), log),
        (StepCompleted(id="j5b", global_step=5, step_seconds=42.5, evicted_prompt_groups={"failure": 1}),
         SourceName.JSONL),
    ]  # fmt: skip
    return events


def run_started() -> tuple[Event, str]:
    # The new process announces itself at 10:09 (the plugin): not activity before the stop.
    return (RunStarted(id="rs", time=when("10:09:00"), run_id="r", trainer_mode="colocate_async", config=CONFIG),
            SourceName.EVENTS)  # fmt: skip


def test_a_resume_costs_what_its_sources_say() -> None:
    # steps lost: step 5 completed before the stop, resumed from 4: 1. Downtime: 10:03:30 (the last timed line;
    # the untimed JSONL steps and the new process's run_started do not count) to 10:10:00 = 390 s. Time to the
    # first step: 10:10:00 to the warmup line at 10:11:05 = 65 s, plus step 5's 42.5 s = 107.5 s. Wasted: the
    # restore's 1 failed group (groups of step 4 are 5 - 4 + 1 = 2 <= 8 old: none stale; no DAPO) x n 8 = 8.
    # Groups lost: the plugin reported the restore, so the window was kept: 0.
    state = fold([run_started(), *first_run(), *resume()], received_at=at("12:00:00"))
    fresh, resumed = state.records
    assert fresh.cost == ResumeCost()
    assert resumed.cost == ResumeCost(steps_lost=1, downtime_seconds=390.0, time_to_first_step_seconds=107.5,
                                      wasted_rollouts=8, lost_prompt_groups=0)  # fmt: skip


def test_without_step_completions_before_the_stop_steps_lost_is_unknown() -> None:
    # A log with checkpoint saves but no step lines: the last step before the stop is at least 4, maybe more.
    events = [e for e in first_run() if not isinstance(e[0], StepCompleted)]
    resumed = fold([*events, *resume()]).records[-1]
    assert resumed.cost.steps_lost is None
    assert resumed.cost.downtime_seconds == 390.0


def test_a_save_after_the_last_step_line_counts_as_completed() -> None:
    # Steps 1..3 logged, then step 4 saved (its line never written): resumed from 4, nothing lost (0, known).
    resumed = fold([*first_run(steps=4)[:-1], *resume()]).records[-1]
    assert resumed.cost.steps_lost == 0


def test_the_step_loop_starts_after_the_reissue_when_the_warmup_logs_nothing() -> None:
    # Warmup disabled (no warmup line): the re-issue at 10:11:00 is the last line before the loop: 60 + 42.5.
    events = [e for e in resume() if not isinstance(e[0], WarmupDecided)]
    resumed = fold([*first_run(), *events]).records[-1]
    assert resumed.cost.time_to_first_step_seconds == 102.5
    # Neither line: the validation before training may run after the restore line, so unknown.
    events = [e for e in events if not isinstance(e[0], InflightReissued)]
    assert fold([*first_run(), *events]).records[-1].cost.time_to_first_step_seconds is None


def test_checkpoint_dir_readings_and_untimed_lines_are_not_trainer_time() -> None:
    # The checkpoint source read global_step_6 (saved at 10:20, after the resume) before the log caught up:
    # its mtime is not activity before this stop. The resume's own first line without a time: no downtime.
    late = (CheckpointSaved(id="c6", time=when("10:20:00"), step=6), SourceName.CHECKPOINT)
    resumed = fold([*first_run(), late, *resume()]).records[-1]
    assert resumed.cost.downtime_seconds == 390.0
    untimed = [(TrainingStarted(id="s1", resumed_from_step=4), SourceName.LOG), *resume()[1:]]
    assert fold([*first_run(), *untimed]).records[-1].cost.downtime_seconds is None


def test_the_stores_retention_query_keeps_exactly_the_events_with_a_trainer_time() -> None:
    # Retention keeps the last timed event before each start with SQL (store.BEFORE_START); the reconciler
    # decides the same in Python (trainer_time). Every event type from every source: both agree.
    import sqlite3

    from tqmon.events import dump_event
    from tqmon.reconcile import trainer_time
    from tqmon.store import BEFORE_START

    events: list[Event] = [
        RunStarted(id="r", run_id="p/e", trainer_mode="colocate_async", verl_version="0.9.1", config=CONFIG),
        TrainingStarted(id="s", resumed_from_step=4),
        TrainingStarted(id="st", time=when("10:00:00"), resumed_from_step=4),
        StepCompleted(id="k", global_step=5),
        StepCompleted(id="kt", time=when("10:01:00"), global_step=5),
        CheckpointSaved(id="c", time=when("10:02:00"), step=6),
    ]
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE events (seq INTEGER, type TEXT, source TEXT, body TEXT, received_at REAL)")
    rows = [(e, str(source)) for e in events for source in SourceName]
    for seq, (event, source) in enumerate(rows):
        db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?)", (seq, event.type, source, dump_event(event), 7.0))
    condition = BEFORE_START[2][0]
    kept = {
        (t, s, json.loads(b)["id"])
        for t, s, b in db.execute(f"SELECT type, source, body FROM events WHERE {condition}")
    }
    timed = {(e.type, s, e.id) for e, s in rows if e.type != "run_started" and trainer_time(e, s, 7.0) is not None}
    assert kept == timed
    assert ("step_completed", "events", "k") in kept and ("step_completed", "log", "k") not in kept
    assert not any(source == SourceName.CHECKPOINT for _, source, _ in kept)


def test_a_step_reported_by_the_log_and_the_jsonl_counts_once_in_the_step_duration() -> None:
    # Steps 1-5 of 30 s from the JSONL, then step 5 again (the console line) claiming 90 s: the mean stays 30.
    state = fold([*first_run(), (StepCompleted(id="l5", global_step=5, step_seconds=90.0), SourceName.LOG)])
    assert state.step_seconds == 30.0
    # Step 5 trained again after the resume is a new step: (5 x 30 + 42.5) / 6.
    assert fold([*first_run(), *resume()]).step_seconds == (5 * 30.0 + 42.5) / 6


def test_rollout_n_is_a_trainer_setting_with_its_verl_path(tmp_path: Path) -> None:
    from tqmon.hydra_config import load_trainer_config
    from tqmon.warmup import verl_setting

    assert verl_setting("rollout_n").path == "actor_rollout_ref.rollout.n"
    config = tmp_path / "config.yaml"
    config.write_text(
        "data: {train_batch_size: 4}\nactor_rollout_ref: {rollout: {n: 5}}\n"
        "trainer: {v1: {trainer_mode: colocate_async, colocate_async: {num_warmup_batches: 2}}}\n"
    )
    assert load_trainer_config(config).config.rollout_n == 5
    with pytest.raises(ValueError, match="rollout_n"):
        TrainerConfig(train_batch_size=4, num_warmup_batches=2, rollout_n=0)


# ---------------------------------------------------------------- a log whose steps verl's logger wrote


@contextlib.contextmanager
def verl_output(log: Path, jsonl: Path) -> Iterator[logging.Logger]:
    """One trainer process's output: verl-format log records and, through stdout, verl's console logger,
    interleaved in ``log`` in the order written; verl's file logger writes ``jsonl`` (truncated per process)."""
    with open(log, "a", encoding="utf-8") as handle, contextlib.redirect_stdout(handle):
        logger = logging.getLogger(f"verl.trainer.ppo.v1.trainer_base.{log.stat().st_size}")
        logger.propagate = False
        handler = logging.StreamHandler(handle)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
        try:
            yield logger
        finally:
            logger.removeHandler(handler)


def line(logger: logging.Logger, clock: str, message: str) -> None:
    """A log record of verl's at a fixed time (the format is verl's; only the clock is the test's)."""
    created = at(clock)
    record = logging.makeLogRecord(
        {"name": logger.name, "levelno": logging.INFO, "levelname": "INFO", "msg": message, "created": created,
         "msecs": 0.0}
    )  # fmt: skip
    logger.handle(record)


def step_metrics(seconds: float, failure: int = 0, stale: int = 0) -> dict[str, Any]:
    """What verl 0.9.1's fit() hands Tracking.log for a training step (the keys tqmon reads, and others)."""
    return {
        "training/global_step": 0,
        "timing_s/gen": 3.25,
        "timing_s/step": seconds,
        "training/rollout_failure/evicted_samples": failure,
        "training/off_policy/evicted_samples": stale,
        "training/filter_groups/evicted_samples": 0,
        "actor/pg_loss": -0.0125,
    }


@pytest.fixture
def verl_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A fresh start (steps 1-5, checkpoint 4) preempted after step 5, and a resume from global_step_4."""
    from verl.utils.tracking import Tracking

    log, jsonl = tmp_path / "trainer.log", tmp_path / "metrics.jsonl"
    log.touch()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(jsonl))
    with verl_output(log, jsonl) as verl:
        line(verl, "10:00:00", "Training from scratch")
        tracking = Tracking("tqmon", "cost", default_backend=["console", "file"])
        line(verl, "10:00:05", "Added 8 warmup prompts after restoring 0 of 8 target prompt groups")
        for step in range(1, 6):
            if step == 4:
                line(verl, "10:02:00", "Saving checkpoint to /ckpt/global_step_4")
            tracking.log(data=step_metrics(30.0) | {"training/global_step": step}, step=step)
        line(verl, "10:03:30", "pending: 2, running: 3, finished: 3, failure: 0")
        tracking.finish()
    with verl_output(log, jsonl) as verl:  # the resumed process: verl truncates the JSONL
        line(verl, "10:10:00", "Resuming from /ckpt/global_step_4, setting global step to 4")
        tracking = Tracking("tqmon", "cost", default_backend=["console", "file"])
        line(verl, "10:10:20", "Restored 8 training prompt groups from TransferQueue")
        line(
            verl,
            "10:11:00",
            "Re-issued 2 in-flight prompts for step 5; cleared 2 old trajectories from partition train",
        )
        line(
            verl,
            "10:11:05",
            "Skipping async warmup: 8 restored prompt groups already fill the 8-prompt prefetch window",
        )
        tracking.log(data=step_metrics(42.5, failure=1, stale=2) | {"training/global_step": 5}, step=5)
        tracking.finish()
    return log, jsonl


# Steps lost: step 5 was the last before the stop, resumed from 4: 1. Downtime: the replay buffer line at
# 10:03:30 to "Resuming from" at 10:10:00: 390 s. To the first step: the warmup line 65 s after the first
# line, plus step 5's timing_s/step 42.5: 107.5 s. Rollouts wasted: a bare log says R = 8 but not how many
# failed or are stale, so unknown (never 0). Groups lost: verl logged its restore ("Restored 8"), so no window
# was lost: 0.
WANT = ResumeCost(steps_lost=1, downtime_seconds=390.0, time_to_first_step_seconds=107.5, lost_prompt_groups=0)


def test_analyze_reads_the_cost_from_verls_console_step_lines(verl_run: tuple[Path, Path]) -> None:
    log, jsonl = verl_run
    assert json.loads(jsonl.read_text().splitlines()[0])["step"] == 5  # verl's file logger, truncated at the resume
    assert "step:5 - training/global_step:5 - timing_s/gen:3.25 - timing_s/step:42.5" in log.read_text()
    result = CliRunner().invoke(main, ["analyze", "--json", str(log)], catch_exceptions=False)
    fresh, resumed = json.loads(result.output)["records"]
    assert fresh["cost"] == dict.fromkeys(
        ("steps_lost", "downtime_seconds", "time_to_first_step_seconds", "wasted_rollouts", "lost_prompt_groups")
    )
    assert resumed["cost"] == {
        "steps_lost": 1,
        "downtime_seconds": 390.0,
        "time_to_first_step_seconds": 107.5,
        "wasted_rollouts": None,
        "lost_prompt_groups": 0,
    }
    table = CliRunner().invoke(main, ["analyze", str(log)], catch_exceptions=False).output.splitlines()
    assert table[0].startswith("log timestamps read in ")  # analyze names the zone first
    header, row = table[1], table[3]
    assert "steps lost  downtime  to 1st step  wasted rollouts  groups lost" in header
    assert "skipped_full  1           390.0s    107.5s       unknown          0            " in row


def test_serve_exports_the_cost_of_a_verl_log_and_jsonl(verl_run: tuple[Path, Path], tqmon_factory: Any) -> None:
    log, jsonl = verl_run
    tqmon = tqmon_factory(["--log", str(log), "--jsonl", str(jsonl), "--log-interval", "0.1"]).start()
    want = {
        "tqmon_resume_lost_steps": float(WANT.steps_lost or 0),
        "tqmon_resume_downtime_seconds": WANT.downtime_seconds,
        "tqmon_resume_time_to_first_step_seconds": WANT.time_to_first_step_seconds,
        "tqmon_resume_lost_prompt_groups": WANT.lost_prompt_groups,
        'tqmon_resume_first_step_evicted_prompt_groups{reason="stale"}': 2.0,
    }
    deadline = time.monotonic() + 20
    while any(sample_value(text := tqmon.metrics(), k) != v for k, v in want.items()):
        assert time.monotonic() < deadline, {k: sample_value(text, k) for k in want}
        time.sleep(0.1)
    assert sample_value(text, "tqmon_resume_wasted_rollouts") is None  # unknown: omitted, never 0
    status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()["records"][-1]
    assert status["cost"] == {
        "steps_lost": 1,
        "downtime_seconds": 390.0,
        "time_to_first_step_seconds": 107.5,
        "wasted_rollouts": None,
        "lost_prompt_groups": 0,
    }
