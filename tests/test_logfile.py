"""The log tailer (``tqmon.sources.logfile``) and ``tqmon analyze``.

Files are written line by line (and half lines) while the source tails them; truncation, rotation,
Ray prefixes, ANSI codes, garbage and tqmon restarts on a persisted state dir.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import tqmon
from tqmon.cli import main
from tqmon.postmortem import LogZone, analyze
from tqmon.snapshot import ResumeRecord, SourceHealth, Tally
from tqmon.sources import logfile
from tqmon.sources.logfile import LogSource, parse_chunk, read_lines
from tqmon.store import StateStore
from tqmon.tracker import Tracker
from tqmon.warmup import WarmupState

DEMO_LOG = Path(tqmon.__file__).parent / "data" / "demo-resume.log"
RAY = "(TaskRunnerV1 pid=2314, ip=10.0.3.17) "
BASE = datetime(2026, 11, 28, 22, 0, 0)


def verl(message: str, second: int, *, ray: bool = True, ansi: bool = False) -> str:
    """One verl logger line (``LEVEL:asctime:message``) ``second`` seconds after BASE."""
    stamp = (BASE + timedelta(seconds=second)).strftime("%Y-%m-%d %H:%M:%S") + ",250"
    body = f"INFO:{stamp}:{message}"
    if ansi:
        body = f"\x1b[36m{body}\x1b[0m"
    return (RAY if ray else "") + body + "\n"


def resume(step: int, restored: int, reissued: int, cleared: int, target: int, t0: int) -> list[str]:
    """A verl 0.9.1 resume from global_step_{step} whose warmup decides for target ``target``."""
    warmup = (
        f"Added {target - restored} warmup prompts after restoring {restored} of {target} target prompt groups"
        if restored < target
        else f"Skipping async warmup: {restored} restored prompt groups already fill the {target}-prompt "
        "prefetch window"
    )
    return [
        verl(f"Resuming from /ckpt/run/global_step_{step}, setting global step to {step}", t0, ansi=True),
        verl(f"Loading TransferQueue state from /ckpt/run/global_step_{step}/transfer_queue", t0 + 1),
        verl(f"Restored {restored} training prompt groups from TransferQueue", t0 + 2, ansi=True),
        verl(
            f"Re-issued {reissued} in-flight prompts for step {step + 1}; "
            f"cleared {cleared} old trajectories from partition train",
            t0 + 3,
        ),
        verl(warmup, t0 + 4, ansi=True),
    ]


def append(path: Path, data: str | bytes) -> None:
    with path.open("ab") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)


def new_tracker(state_dir: Path | None = None) -> Tracker:
    return Tracker(StateStore(state_dir))


def count(tracker: Tracker, name: Tally, *labels: str) -> int:
    return tracker.snapshot.counters.get(name, {}).get(labels, 0)


def lines_count(tracker: Tracker) -> dict[str, int]:
    return {o: count(tracker, Tally.LOG_LINES, o) for o in ("event", "ignored", "malformed")}


def events_count(tracker: Tracker) -> tuple[int, int]:
    return count(tracker, Tally.EVENTS, "log", "applied"), count(tracker, Tally.EVENTS, "log", "duplicate")


def health(tracker: Tracker) -> SourceHealth:
    return next(s for s in tracker.snapshot.sources if s.source == "log")


def last(tracker: Tracker) -> ResumeRecord:
    record = tracker.snapshot.last_record
    assert record is not None
    return record


def assert_record(record: ResumeRecord, **expected: Any) -> None:
    actual = {key: getattr(record, key) for key in expected}
    assert actual == expected


@pytest.fixture
def make_source() -> Iterator[Callable[..., LogSource]]:
    made: list[LogSource] = []

    def make(patterns: list[Path | str], tracker: Tracker, interval: float = 1.0) -> LogSource:
        source = LogSource([str(p) for p in patterns], tracker, interval=interval)
        made.append(source)
        return source

    yield make
    for source in made:
        source.stop()


# ------------------------------------------------------------------------------ read_lines / parse_chunk


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_read_lines_yields_complete_lines_with_end_offsets(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(logfile, "CHUNK_BYTES", chunk)
    data = b"alpha\nbe\r\n\nthe partial"
    handle = io.BytesIO(data)

    assert list(read_lines(handle, 0)) == [(6, b"alpha"), (10, b"be\r"), (11, b"")]
    assert list(read_lines(handle, 6)) == [(10, b"be\r"), (11, b"")]
    assert list(read_lines(handle, 11)) == []
    assert list(read_lines(handle, 0, final=True))[-1] == (len(data), b"the partial")
    assert list(read_lines(io.BytesIO(b"x\n"), 0, final=True)) == [(2, b"x")]


def test_parse_chunk_counts_outcomes_and_names_malformed_lines() -> None:
    lines = [
        (22, b"Training from scratch"),
        (30, b"garbage \xff\xfe"),
        (90, b"Restored lots training prompt groups from TransferQueue"),
        (150, verl("Restored 7 training prompt groups from TransferQueue", 0).encode().rstrip(b"\n")),
    ]
    events, outcomes, errors = parse_chunk(lines, "8-123")

    assert dict(outcomes) == {"event": 2, "ignored": 1, "malformed": 1}
    assert [e.type for e in events] == ["training_started", "checkpoint_restored"]
    assert events[0].id == "log:8-123:22"  # no timestamp: file and end offset
    assert events[1].id.startswith("log:")
    assert not events[1].id.startswith("log:8-123")  # timestamped: content id
    assert len(errors) == 1
    assert errors[0].startswith("8-123 byte 90: ")
    assert "training prompt groups from TransferQueue" in errors[0]


# --------------------------------------------------------------------------------------- tailing


def test_tailing_a_resume_written_line_by_line(tmp_path: Path, make_source: Callable[..., LogSource]) -> None:
    log = tmp_path / "trainer.log"
    log.write_bytes(b"")
    tracker = new_tracker()
    source = make_source([log], tracker)
    source.poll()
    assert list(tracker.snapshot.records) == []
    assert health(tracker).ok is True

    # Half a line, cut inside a multi-byte UTF-8 character: nothing until the line is complete.
    line = verl("Resuming from /ckpt/ré/global_step_40, setting global step to 40", 0, ansi=True).encode()
    cut = line.index("é".encode()) + 1
    append(log, line[:cut])
    source.poll()
    assert list(tracker.snapshot.records) == []
    append(log, line[cut:])
    source.poll()
    assert len(tracker.snapshot.records) == 1
    assert_record(
        last(tracker),
        index=0,
        resumed=True,
        checkpoint_step=40,
        restored=None,
        reissued=None,
        target=None,
        expected=None,
        submitted=None,
        warmup_state=WarmupState.UNKNOWN,
    )
    assert "checkpoint_path=/ckpt/ré/global_step_40" in last(tracker).evidence[0].detail
    assert tracker.snapshot.trainer_step == 40

    append(log, verl("Loading TransferQueue state from /ckpt/ré/global_step_40/transfer_queue", 1))
    source.poll()
    assert lines_count(tracker) == {"event": 1, "ignored": 1, "malformed": 0}

    # "Restored 6" + "4 training…": a poll between the halves must not see R = 6.
    restored = verl("Restored 64 training prompt groups from TransferQueue", 2)
    half = restored.index("Restored 6") + len("Restored 6")
    append(log, restored[:half])
    source.poll()
    assert last(tracker).restored is None
    append(log, restored[half:])
    source.poll()
    assert_record(
        last(tracker), restored=64, restored_by_status={"unknown": 64}, target=None, expected=None, reissued=None
    )

    append(log, verl("Re-issued 21 in-flight prompts for step 41; cleared 53 old trajectories from partition train", 3))
    source.poll()
    assert_record(last(tracker), reissued=21, cleared_trajectories=53, submitted=None)

    append(log, verl("Added 32 warmup prompts after restoring 64 of 96 target prompt groups", 4, ansi=True))
    source.poll()
    assert_record(
        last(tracker),
        restored=64,
        target=96,
        expected=32,
        submitted=32,
        over_restored=0,
        under_submitted=0,
        warmup_state=WarmupState.TOPPED_UP,
    )

    append(log, f"{RAY}step:41 - training/global_step:41 - timing_s/gen:3.786\n")
    append(log, verl("pending: 30, running: 40, finished: 22, failure: 4", 60))
    append(log, verl("Saving checkpoint to /ckpt/run/global_step_45", 70))
    source.poll()
    (window,) = tracker.snapshot.windows
    assert dict(window.by_status) == {"pending": 30, "running": 40, "finished": 22, "failure": 4}
    assert tracker.snapshot.checkpoint is not None
    assert tracker.snapshot.checkpoint.step == 45
    assert tracker.snapshot.trainer_step == 45

    # A second start (over-restore), written in one go.
    append(log, "".join(resume(step=60, restored=96, reissued=18, cleared=41, target=64, t0=600)))
    source.poll()
    records = list(tracker.snapshot.records)
    assert len(records) == 2
    assert tracker.snapshot.resumes_total == 2
    assert_record(records[0], checkpoint_step=40, restored=64, submitted=32, warmup_state=WarmupState.TOPPED_UP)
    assert_record(
        records[1],
        index=1,
        resumed=True,
        checkpoint_step=60,
        restored=96,
        reissued=18,
        cleared_trajectories=41,
        target=64,
        expected=0,
        submitted=0,
        over_restored=32,
        warmup_state=WarmupState.SKIPPED_OVER_RESTORED,
    )
    assert records[1].started_at == (BASE + timedelta(seconds=600, milliseconds=250)).astimezone().timestamp()
    assert lines_count(tracker) == {"event": 10, "ignored": 3, "malformed": 0}
    assert events_count(tracker) == (10, 0)
    assert health(tracker).ok is True
    assert health(tracker).last_error is None


def test_the_thread_tails_and_survives_garbage(tmp_path: Path, make_source: Callable[..., LogSource]) -> None:
    log = tmp_path / "trainer.log"
    log.write_bytes(b"")
    tracker = new_tracker()
    source = make_source([log], tracker, interval=0.02)
    source.start()

    append(log, b"\x00\xff\xfe binary \x80\n")
    append(log, "INFO:2026-02-30 10:00:00,000:Restored 5 training prompt groups from TransferQueue\n")
    append(log, "Restored many training prompt groups from TransferQueue\n")
    for line in resume(step=40, restored=96, reissued=21, cleared=53, target=96, t0=0):
        append(log, line)
        time.sleep(0.01)

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (not tracker.snapshot.records or last(tracker).submitted is None):
        time.sleep(0.02)
    source.stop()
    assert "tqmon-log" not in {thread.name for thread in threading.enumerate()}
    assert_record(
        last(tracker), checkpoint_step=40, restored=96, reissued=21, submitted=0, warmup_state=WarmupState.SKIPPED_FULL
    )
    assert lines_count(tracker) == {"event": 4, "ignored": 2, "malformed": 2}
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "malformed_line") == 2
    assert health(tracker).ok is True


# ------------------------------------------------------------------------------ truncation, rotation


@pytest.mark.parametrize("poll_between", [True, False], ids=["poll-after-truncate", "truncate-and-rewrite"])
def test_truncation_reads_the_new_content_once(
    tmp_path: Path, make_source: Callable[..., LogSource], poll_between: bool
) -> None:
    log = tmp_path / "trainer.log"
    filler = [f"{RAY}step:{n} - training/global_step:{n} - timing_s/gen:3.5\n" for n in range(20)]
    log.write_text("".join(resume(step=40, restored=96, reissued=21, cleared=53, target=96, t0=0) + filler))
    tracker = new_tracker()
    source = make_source([log], tracker)
    source.poll()
    assert events_count(tracker) == (4, 0)

    log.write_bytes(b"")  # truncated to 0 (copytruncate, or the trainer reopened it with "w")
    if poll_between:
        source.poll()
        assert events_count(tracker) == (4, 0)
    log.write_text("".join(resume(step=60, restored=96, reissued=18, cleared=41, target=64, t0=600)))
    assert log.stat().st_size < 20 * len(filler[0])  # shorter than what was read: detectable
    source.poll()

    records = list(tracker.snapshot.records)
    assert len(records) == 2
    assert_record(records[0], checkpoint_step=40, reissued=21, warmup_state=WarmupState.SKIPPED_FULL)
    assert_record(
        records[1], checkpoint_step=60, reissued=18, over_restored=32, warmup_state=WarmupState.SKIPPED_OVER_RESTORED
    )
    assert events_count(tracker) == (8, 0)

    source.poll()
    assert events_count(tracker) == (8, 0)
    append(log, verl("Saving checkpoint to /ckpt/run/global_step_61", 700))
    source.poll()
    assert events_count(tracker) == (9, 0)
    assert tracker.snapshot.trainer_step == 61


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (
            "Resuming from /c/global_step_10, setting global step to 10\n"
            "Restored 12 training prompt groups from TransferQueue\n",
            "Resuming from /c/global_step_20, setting global step to 20\n"
            "Restored 34 training prompt groups from TransferQueue\n",
            [(10, 12), (20, 34)],
        ),
        (
            # the same fresh start written again, byte for byte: still a second start
            "Training from scratch\nAdded 8 warmup prompts after restoring 0 of 8 target prompt groups\n",
            "Training from scratch\nAdded 8 warmup prompts after restoring 0 of 8 target prompt groups\n",
            [(0, 0), (0, 0)],
        ),
    ],
    ids=["same-offsets", "same-bytes"],
)
def test_truncated_untimestamped_lines_are_not_taken_for_old_ones(
    tmp_path: Path, make_source: Callable[..., LogSource], before: str, after: str, expected: list[tuple[int, int]]
) -> None:
    """Lines without a timestamp are identified by file and offset; a rewritten file reuses the offsets."""
    log = tmp_path / "trainer.log"
    log.write_text(before)
    tracker = new_tracker()
    source = make_source([log], tracker)
    source.poll()
    log.write_bytes(b"")
    source.poll()
    log.write_text(after)
    source.poll()

    assert [(r.checkpoint_step, r.restored) for r in tracker.snapshot.records] == expected
    assert events_count(tracker) == (4, 0)


@pytest.mark.parametrize("stamped", [True, False], ids=["timestamped", "untimestamped"])
@pytest.mark.parametrize("pattern", ["trainer.log", "trainer.log*"], ids=["exact", "glob-matches-rotated"])
def test_rotation_keeps_lines_written_just_before_it(
    tmp_path: Path, make_source: Callable[..., LogSource], pattern: str, stamped: bool
) -> None:
    def lines(step: int, target: int, t0: int) -> list[str]:
        full = resume(step=step, restored=96, reissued=step // 2, cleared=step, target=target, t0=t0)
        return full if stamped else [clean_line(line) for line in full]

    log = tmp_path / "trainer.log"
    first, second = lines(40, 96, 0), lines(60, 64, 600)
    log.write_text("".join(first[:3]))
    tracker = new_tracker()
    source = make_source([tmp_path / pattern], tracker)
    source.poll()
    assert_record(last(tracker), checkpoint_step=40, restored=96, reissued=None)

    append(log, "".join(first[3:]))  # written, not yet read ...
    os.rename(log, tmp_path / "trainer.log.1")  # ... when the file is rotated
    log.write_text("".join(second[:3]))
    source.poll()
    records = list(tracker.snapshot.records)
    assert len(records) == 2
    assert_record(records[0], checkpoint_step=40, reissued=20, submitted=0, warmup_state=WarmupState.SKIPPED_FULL)
    assert_record(records[1], checkpoint_step=60, restored=96, reissued=None, warmup_state=WarmupState.UNKNOWN)

    append(log, "".join(second[3:]))
    source.poll()
    source.poll()
    assert_record(
        last(tracker), checkpoint_step=60, reissued=30, over_restored=32, warmup_state=WarmupState.SKIPPED_OVER_RESTORED
    )
    assert len(tracker.snapshot.records) == 2
    # The glob also reads trainer.log.1 from its start: every event in it is recognised as already applied.
    assert events_count(tracker) == (8, 4 if pattern.endswith("*") else 0)


def clean_line(line: str) -> str:
    """The bare message of a ``verl()`` line: no prefix, no header, no ANSI."""
    bare = re.sub(r"\x1b\[[0-9;]*m", "", line)
    return re.sub(r"^.*?INFO:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}:", "", bare)


def test_rotation_before_the_new_file_exists(tmp_path: Path, make_source: Callable[..., LogSource]) -> None:
    log = tmp_path / "trainer.log"
    first = resume(step=40, restored=96, reissued=21, cleared=53, target=96, t0=0)
    log.write_text("".join(first[:2]))
    tracker = new_tracker()
    source = make_source([log], tracker)
    source.poll()

    os.rename(log, tmp_path / "trainer.log.1")
    source.poll()
    assert health(tracker).ok is False
    assert str(log) in (health(tracker).last_error or "")
    append(tmp_path / "trainer.log.1", "".join(first[2:]))  # the trainer still writes to the old file
    log.write_text(verl("Resuming from /ckpt/run/global_step_60, setting global step to 60", 600))
    source.poll()

    assert health(tracker).ok is True
    records = list(tracker.snapshot.records)
    assert [r.checkpoint_step for r in records] == [40, 60]
    assert_record(records[0], restored=96, reissued=21, warmup_state=WarmupState.SKIPPED_FULL)
    assert events_count(tracker) == (5, 0)


# ------------------------------------------------------------------------------------------ restart


@pytest.mark.parametrize("stamped", [True, False], ids=["timestamped", "untimestamped"])
def test_restart_never_rereads_a_line(tmp_path: Path, make_source: Callable[..., LogSource], stamped: bool) -> None:
    state = tmp_path / "state"
    log = tmp_path / "trainer.log"

    def lines(step: int, target: int, t0: int) -> list[str]:
        full = resume(step=step, restored=96, reissued=step // 2, cleared=step, target=target, t0=t0)
        return full if stamped else [clean_line(line) for line in full]

    log.write_text(
        "".join(lines(40, 96, 0))
        + "garbage line\n"
        + "Restored many training prompt groups from TransferQueue\n"
        + "pending: 30, running: 40, finished: 22, failure: 4\n"
    )
    store = StateStore(state)
    tracker = Tracker(store)
    source = make_source([log], tracker)
    source.poll()
    records = list(tracker.snapshot.records)
    counters = tracker.snapshot.counters
    assert events_count(tracker) == (5, 0)
    assert lines_count(tracker) == {"event": 5, "ignored": 2, "malformed": 1}
    source.stop()
    store.close()

    store = StateStore(state)
    tracker = Tracker(store)
    assert tracker.replay() == 5
    assert list(tracker.snapshot.records) == records
    assert tracker.snapshot.counters == counters
    source = make_source([log], tracker)
    source.poll()
    source.poll()
    assert list(tracker.snapshot.records) == records
    assert events_count(tracker) == (5, 0)  # no duplicate: nothing was read again
    assert lines_count(tracker) == {"event": 5, "ignored": 2, "malformed": 1}
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "malformed_line") == 1

    append(log, "".join(lines(60, 64, 600)))
    source.poll()
    assert len(tracker.snapshot.records) == 2
    assert_record(last(tracker), checkpoint_step=60, reissued=30, over_restored=32)
    assert events_count(tracker) == (9, 0)

    # The same file through another path has its own cursor and is read again from the start:
    # its events keep their ids, so nothing is applied twice.
    alias = tmp_path / "alias.log"
    alias.symlink_to(log)
    other = make_source([alias], tracker)
    other.poll()
    assert len(tracker.snapshot.records) == 2
    assert events_count(tracker) == (9, 9)
    store.close()


def test_restart_after_truncation_keeps_untimestamped_lines_apart(
    tmp_path: Path, make_source: Callable[..., LogSource]
) -> None:
    state = tmp_path / "state"
    log = tmp_path / "trainer.log"
    log.write_text("Training from scratch\n")
    store = StateStore(state)
    tracker = Tracker(store)
    source = make_source([log], tracker)
    source.poll()
    log.write_bytes(b"")
    source.poll()
    log.write_text("Resuming from /c/global_step_9, setting global step to 9\n")
    source.poll()
    assert [r.checkpoint_step for r in tracker.snapshot.records] == [0, 9]
    source.stop()
    store.close()

    # Truncated again while tqmon is down: the persisted offset is past the end.
    log.write_text("Training from scratch\n")
    store = StateStore(state)
    tracker = Tracker(store)
    tracker.replay()
    source = make_source([log], tracker)
    source.poll()
    source.poll()
    assert [(r.checkpoint_step, r.resumed) for r in tracker.snapshot.records] == [
        (0, False),
        (9, True),
        (0, False),
    ]
    assert events_count(tracker) == (3, 0)
    store.close()


# ------------------------------------------------------------------------------------------ garbage


def test_garbage_does_not_stop_the_source(
    tmp_path: Path, make_source: Callable[..., LogSource], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logfile, "CHUNK_BYTES", 1 << 16)  # the long lines below span many chunks
    log = tmp_path / "trainer.log"
    append(log, b"\x00\x01\x02\xff\xfe garbage \x80\x81\n")
    append(
        log,
        RAY.encode()
        + b"INFO:2026-11-28 22:00:00,000:Resuming from /ckpt/\xff\xfe/global_step_40, setting global step to 40\n",
    )
    append(log, b"x" * (5 << 16) + b"\n")
    append(log, b"Restored " + b"9" * 5000 + b" training prompt groups from TransferQueue\n")
    append(log, verl("Restored many training prompt groups from TransferQueue", 1))
    append(log, "INFO:2026-02-30 10:00:00,000:Restored 5 training prompt groups from TransferQueue\n")
    append(log, "INFO:2026-02-30 10:00:00,000:unrelated\n")
    append(log, b"\r\n")
    append(log, verl("Restored 96 training prompt groups from TransferQueue", 2))
    tracker = new_tracker()
    source = make_source([log], tracker)
    source.poll()

    assert_record(last(tracker), checkpoint_step=40, restored=96)
    assert "/ckpt/\ufffd\ufffd/global_step_40" in last(tracker).evidence[0].detail
    assert lines_count(tracker) == {"event": 2, "ignored": 4, "malformed": 3}
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "malformed_line") == 3
    assert health(tracker).ok is True

    append(log, "Added lots warmup prompts after restoring 96 of 96 target prompt groups\n")
    append(log, verl("Skipping async warmup: 96 restored prompt groups already fill the 96-prompt prefetch window", 3))
    source.poll()
    assert_record(last(tracker), submitted=0, warmup_state=WarmupState.SKIPPED_FULL)
    assert lines_count(tracker) == {"event": 3, "ignored": 4, "malformed": 4}
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "malformed_line") == 4


# --------------------------------------------------------------------------------------------- health


def test_missing_file_marks_the_source_down_until_it_appears(
    tmp_path: Path, make_source: Callable[..., LogSource]
) -> None:
    pattern = tmp_path / "logs" / "trainer-*.log"
    tracker = new_tracker()
    source = make_source([pattern], tracker)
    assert health(tracker).ok is False
    assert health(tracker).last_success is None

    source.poll()
    state = health(tracker)
    assert state.ok is False
    assert state.last_error is not None
    assert str(pattern) in state.last_error
    assert state.last_success is None
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "unavailable") == 1

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer-dir.log").mkdir()  # a directory is not a log
    source.poll()
    assert health(tracker).ok is False
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "unavailable") == 2

    (tmp_path / "logs" / "trainer-0.log").write_text(verl("Training from scratch", 0))
    source.poll()
    state = health(tracker)
    assert state.ok is True
    assert state.last_error is None
    assert state.last_success is not None
    assert state.last_duration is not None
    assert len(tracker.snapshot.records) == 1
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "unavailable") == 2


def test_an_unreadable_file_does_not_stop_the_others(
    tmp_path: Path, make_source: Callable[..., LogSource], monkeypatch: pytest.MonkeyPatch
) -> None:
    broken, fine = tmp_path / "a.log", tmp_path / "b.log"
    broken.write_text(verl("Training from scratch", 0))
    fine.write_text(verl("Saving checkpoint to /ckpt/global_step_3", 100))
    real_open = builtins.open

    def deny(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == str(broken):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(logfile, "open", deny, raising=False)
    tracker = new_tracker()
    source = make_source([tmp_path / "*.log"], tracker)
    source.poll()
    assert tracker.snapshot.trainer_step == 3
    assert list(tracker.snapshot.records) == []
    state = health(tracker)
    assert state.ok is False
    assert state.last_error == f"{broken}: Permission denied"
    assert count(tracker, Tally.SOURCE_ERRORS, "log", "read_error") == 1

    monkeypatch.undo()
    source.poll()
    assert health(tracker).ok is True
    assert len(tracker.snapshot.records) == 1
    assert events_count(tracker) == (2, 0)


# ------------------------------------------------------------------------------ ingest_file, analyze


def test_analyze_reads_a_final_line_without_newline(tmp_path: Path) -> None:
    log = tmp_path / "done.log"
    log.write_text(
        "Training from scratch\n"
        "Restored many training prompt groups from TransferQueue\n"
        "Added 8 warmup prompts after restoring 0 of 8 target prompt groups"  # no trailing newline
    )
    result = analyze([str(log)], zone=LogZone.of("UTC"))
    assert (result.malformed, result.events) == (1, 2)
    [record] = result.records
    assert_record(record, resumed=False, submitted=8, target=8, warmup_state=WarmupState.FRESH_START)


def demo_started(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()


DEMO_EXPECTED = [
    # index, resumed, N, R, K, cleared, T, M expected, M submitted, O, state, started at
    (0, False, 0, 0, 0, 0, 96, 96, 96, 0, "fresh_start", "2026-11-28 21:02:16,739"),
    (1, True, 40, 96, 21, 53, 96, 0, 0, 0, "skipped_full", "2026-11-28 21:40:11,911"),
    (2, True, 60, 96, 18, 41, 64, 0, 0, 32, "skipped_over_restored", "2026-11-28 22:09:38,642"),
]


def test_analyze_prints_one_row_per_start_of_the_demo_log() -> None:
    result = CliRunner().invoke(main, ["analyze", str(DEMO_LOG)])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    zone, header, *rows = result.stdout.strip().splitlines()
    assert zone.startswith("log timestamps read in ") and zone.endswith("(the machine's zone)")
    columns = re.split(r"\s{2,}", header)
    assert len(rows) == 3
    for row, (index, resumed, step, r, k, _cleared, t, m_exp, m_sub, o, state, started) in zip(
        rows, DEMO_EXPECTED, strict=True
    ):
        cells = dict(zip(columns, re.split(r"\s{2,}", row), strict=True))
        started_utc = datetime.fromtimestamp(demo_started(started), UTC).strftime("%Y-%m-%d %H:%M:%S")
        expected = {
            "#": str(index),
            "started (UTC)": started_utc,
            "from": f"step {step}" if resumed else "scratch",
            "R": str(r),
            "K": str(k),
            "T": str(t),
            "M exp": str(m_exp),
            "M sub": str(m_sub),
            "O": str(o),
            # A bare log gives neither failure nor stale for R > 0: the deficit is only a lower bound.
            "deficit": "≥0" if resumed else "0",
            "doomed": "≥0" if resumed else "0",
            "state": state,
        }
        assert {key: cells[key] for key in expected} == expected
        unknown = "deficit at least 0 (doomed failure, stale not known): not known to be ok"
        verdicts = {
            "fresh_start": "ok",
            "skipped_full": f"{unknown} (assuming verl defaults filter_groups=false)",
            "skipped_over_restored": f"over-restored by 32 (kept all run); {unknown} "
            "(assuming verl defaults filter_groups=false)",
        }
        assert cells["verdict"] == verdicts[state]


def analyze_json(*paths: Path) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["analyze", "--json", *map(str, paths)])
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def test_analyze_json_gives_the_records_of_the_demo_log() -> None:
    report = analyze_json(DEMO_LOG)
    assert report["malformed_lines"] == 0
    records = report["records"]
    assert len(records) == 3
    for record, (index, resumed, step, r, k, cleared, t, m_exp, m_sub, o, state, started) in zip(
        records, DEMO_EXPECTED, strict=True
    ):
        assert {
            key: record[key]
            for key in (
                "index",
                "resumed",
                "checkpoint_step",
                "restored",
                "reissued",
                "cleared_trajectories",
                "target",
                "expected",
                "submitted",
                "over_restored",
                "under_submitted",
                "warmup_state",
            )
        } == {
            "index": index,
            "resumed": resumed,
            "checkpoint_step": step,
            "restored": r,
            "reissued": k,
            "cleared_trajectories": cleared,
            "target": t,
            "expected": m_exp,
            "submitted": m_sub,
            "over_restored": o,
            "under_submitted": 0,
            "warmup_state": state,
        }
        assert record["under_submitted_lower_bound"] is resumed
        assert record["started_at"] == pytest.approx(demo_started(started))
        assert {e["source"] for e in record["evidence"]} == {"log"}


def split_demo_log(tmp_path: Path) -> tuple[Path, Path]:
    """The demo log rotated at the preemption: the older half and the newer half."""
    lines = DEMO_LOG.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if "node preempted" in line)
    head, tail = tmp_path / "trainer.log.1", tmp_path / "trainer.log"
    head.write_text("".join(lines[:cut]))
    tail.write_text("".join(lines[cut:]))
    return head, tail


def test_analyze_split_or_repeated_logs_give_the_same_records(tmp_path: Path) -> None:
    whole = analyze_json(DEMO_LOG)
    head, tail = split_demo_log(tmp_path)

    assert analyze_json(head, tail) == whole
    assert analyze_json(DEMO_LOG, DEMO_LOG) == whole  # content ids: the second copy adds nothing


def test_analyze_reports_malformed_lines_and_empty_logs(tmp_path: Path) -> None:
    log = tmp_path / "bad.log"
    log.write_text("Training from scratch\nRestored many training prompt groups from TransferQueue\n")
    result = CliRunner().invoke(main, ["analyze", str(log)])
    assert result.exit_code == 0
    assert "1 malformed verl line(s) skipped" in result.stderr
    assert "scratch" in result.stdout
    assert analyze_json(log)["malformed_lines"] == 1

    started_not = tmp_path / "early.log"
    started_not.write_text("INFO:2026-11-28 21:02:11,416:data.gen_batch_size defaulted to 1.\n")
    result = CliRunner().invoke(main, ["analyze", str(started_not)])
    assert result.exit_code == 0
    assert result.stdout.strip().splitlines()[-1] == f"no trainer start found in {started_not}"

    empty = tmp_path / "empty.log"
    empty.write_text("nothing to see\n")
    result = CliRunner().invoke(main, ["analyze", str(empty)])
    assert result.exit_code == 1
    assert f"{empty} has no verl log line" in result.stderr


@pytest.mark.parametrize(
    ("name", "content", "what"),
    [
        ("status.json", json.dumps({"records": [{"restored": 3}]}).encode(), "is a JSON file, not a verl trainer log"),
        ("metrics.jsonl", b'{"step": 1, "training/global_step": 1}\n', "is a JSON file, not a verl trainer log"),
        ("state.pkl", pickle.dumps({"prompts": list(range(10))}), "is a binary file (a pickle?)"),
    ],
)
def test_analyze_refuses_a_file_that_is_not_a_trainer_log(tmp_path: Path, name: str, content: bytes, what: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    result = CliRunner().invoke(main, ["analyze", str(path)])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {path} {what}" + (
        " (verl's JSONL metrics go to --jsonl)" if "JSON" in what else ", not a verl trainer log"
    )
    assert result.stdout == ""


def test_analyze_sorts_logs_given_out_of_time_order_and_says_so(tmp_path: Path) -> None:
    whole = analyze_json(DEMO_LOG)
    head, tail = split_demo_log(tmp_path)

    swapped = analyze_json(tail, head)  # newest first, as `ls -t` would list them
    assert swapped["records"] == whole["records"]
    assert swapped["notes"] == [f"records out of time order in {tail}, {head}: sorted by their timestamps"]
    text = CliRunner().invoke(main, ["analyze", str(tail), str(head)]).stdout
    assert f"note: records out of time order in {tail}, {head}: sorted by their timestamps" in text


def test_analyze_reads_timestamps_in_the_zone_given_and_says_which(tmp_path: Path) -> None:
    def started(*flags: str) -> float:
        result = CliRunner().invoke(main, ["analyze", "--json", *flags, str(DEMO_LOG)])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["log_timezone"] == (flags[1] if flags else report["log_timezone"])
        return float(report["records"][0]["started_at"])

    utc = started("--log-timezone", "UTC")
    assert utc == datetime(2026, 11, 28, 21, 2, 16, 739000, tzinfo=UTC).timestamp()
    assert started("--log-timezone", "Asia/Kolkata") == utc - 5.5 * 3600  # the same wall clock, 5h30 earlier
    assert started() == demo_started("2026-11-28 21:02:16,739")  # the machine's zone by default
    text = CliRunner().invoke(main, ["analyze", "--log-timezone", "Asia/Kolkata", str(DEMO_LOG)]).stdout
    assert text.splitlines()[0] == "log timestamps read in Asia/Kolkata (--log-timezone zone)"
    assert "2026-11-28 15:32:16" in text  # 21:02:16 IST in the table's UTC
    bad = CliRunner().invoke(main, ["analyze", "--log-timezone", "Mars/Olympus", str(DEMO_LOG)])
    assert bad.exit_code == 2 and "unknown time zone 'Mars/Olympus'" in bad.stderr


def test_analyze_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tqmon.cli", "analyze", "--json", str(DEMO_LOG)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)["records"]
    assert [(r["checkpoint_step"], r["over_restored"], r["warmup_state"]) for r in records] == [
        (0, 0, "fresh_start"),
        (40, 0, "skipped_full"),
        (60, 32, "skipped_over_restored"),
    ]
