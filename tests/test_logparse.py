"""verl log lines → events (``tqmon.sources.logparse``): every line type, Ray prefixes, ANSI, ids, garbage."""

from __future__ import annotations

import calendar
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tqmon.events import (
    CheckpointRestored,
    CheckpointSaved,
    Event,
    InflightReissued,
    TrainingStarted,
    WarmupDecided,
    WindowObserved,
)
from tqmon.sources.logparse import ParsedLine, clean, parse_line

STAMP = "2026-11-28 22:14:03,123"
STAMP_DT = datetime(2026, 11, 28, 22, 14, 3, 123000)
RAY = "(TaskRunnerV1 pid=2314, ip=10.0.3.17) "
FALLBACK = "log:fallback-id:42"

Build = Callable[[str, datetime | None], Event]

# (message, the event it must become given (id, time)); numbers are pairwise distinct so a swapped
# field cannot pass.
EVENT_LINES: list[tuple[str, Build]] = [
    (
        "Resuming from /mnt/ckpt/run-7/global_step_40, setting global step to 40",
        lambda i, t: TrainingStarted(
            id=i, time=t, resumed_from_step=40, checkpoint_path="/mnt/ckpt/run-7/global_step_40"
        ),
    ),
    (
        # a folder with spaces and a comma: the greedy folder group still stops at the last ", setting"
        "Resuming from /mnt/my ckpt, v2/global_step_7, setting global step to 7",
        lambda i, t: TrainingStarted(
            id=i, time=t, resumed_from_step=7, checkpoint_path="/mnt/my ckpt, v2/global_step_7"
        ),
    ),
    ("Training from scratch", lambda i, t: TrainingStarted(id=i, time=t, resumed_from_step=None)),
    (
        "Restored 96 training prompt groups from TransferQueue",
        lambda i, t: CheckpointRestored(id=i, time=t, restored_prompt_groups=96),
    ),
    (
        "Restored 0 training prompt groups from TransferQueue",
        lambda i, t: CheckpointRestored(id=i, time=t, restored_prompt_groups=0),
    ),
    (
        "Re-issued 21 in-flight prompts for step 41; cleared 53 old trajectories from partition train",
        lambda i, t: InflightReissued(
            id=i, time=t, step=41, reissued_prompt_groups=21, cleared_trajectories=53, partition="train"
        ),
    ),
    (
        "Re-issued 3 in-flight prompts for step 8; cleared 5 old trajectories from partition val",
        lambda i, t: InflightReissued(
            id=i, time=t, step=8, reissued_prompt_groups=3, cleared_trajectories=5, partition="val"
        ),
    ),
    (
        "Skipping async warmup: 96 restored prompt groups already fill the 64-prompt prefetch window",
        lambda i, t: WarmupDecided(
            id=i,
            time=t,
            target_prompt_groups=64,
            restored_prompt_groups=96,
            submitted_prompt_groups=0,
            skip_reason="window_full",
        ),
    ),
    (
        "Added 32 warmup prompts after restoring 64 of 96 target prompt groups",
        lambda i, t: WarmupDecided(
            id=i, time=t, target_prompt_groups=96, restored_prompt_groups=64, submitted_prompt_groups=32
        ),
    ),
    (
        "Added 2 warmup batches to the agent loop manager",
        lambda i, t: WarmupDecided(id=i, time=t, legacy_warmup_batches=2),
    ),
    (
        "pending: 11, running: 23, finished: 62, failure: 4",
        lambda i, t: WindowObserved(
            id=i, time=t, partition="train", by_status={"pending": 11, "running": 23, "finished": 62, "failure": 4}
        ),
    ),
    (
        "Saving checkpoint to /mnt/ckpt/run-7/global_step_60",
        lambda i, t: CheckpointSaved(id=i, time=t, step=60, path="/mnt/ckpt/run-7/global_step_60"),
    ),
    (
        "Saving checkpoint to /mnt/ckpt/run-7/global_step_60/",
        lambda i, t: CheckpointSaved(id=i, time=t, step=60, path="/mnt/ckpt/run-7/global_step_60/"),
    ),
    (
        # the message itself holds colons: only the first two separate level and asctime
        "Saving checkpoint to s3://bucket/run:7/global_step_5",
        lambda i, t: CheckpointSaved(id=i, time=t, step=5, path="s3://bucket/run:7/global_step_5"),
    ),
    (
        "Saving checkpoint to /mnt/my ckpt/global_step_12",
        lambda i, t: CheckpointSaved(id=i, time=t, step=12, path="/mnt/my ckpt/global_step_12"),
    ),
]

# How a message reaches the log: (name, decorate(message) -> raw line, has a timestamp).
DECORATIONS: list[tuple[str, Callable[[str], str], bool]] = [
    ("header", lambda m: f"INFO:{STAMP}:{m}", True),
    ("warning-level", lambda m: f"WARNING:{STAMP}:{m}", True),
    ("ray-prefix", lambda m: f"{RAY}INFO:{STAMP}:{m}", True),
    ("ray-pid-only", lambda m: f"(pid=77) INFO:{STAMP}:{m}", True),
    ("ray-ansi-inside", lambda m: f"{RAY}\x1b[36mINFO:{STAMP}:{m}\x1b[0m", True),
    (
        "ansi-around-prefix",
        lambda m: f"\x1b[36m(TaskRunnerV1 pid=2314, ip=10.0.3.17)\x1b[0m \x1b[1;32mINFO:{STAMP}:{m}\x1b[0m",
        True,
    ),
    ("crlf-and-spaces", lambda m: f"  {RAY}INFO:{STAMP}: {m}  \r", True),
    ("no-header", lambda m: m, False),
    ("no-header-ray-ansi", lambda m: f"{RAY}\x1b[33m{m}\x1b[0m", False),
]


def local_stamp(dt: datetime) -> float:
    """Seconds since the epoch of a naive local time, computed without datetime's own conversion."""
    return time.mktime(dt.timetuple()) + dt.microsecond / 1e6


@pytest.mark.parametrize(("decoration", "decorate", "stamped"), DECORATIONS, ids=[d[0] for d in DECORATIONS])
@pytest.mark.parametrize(("message", "build"), EVENT_LINES, ids=[m[:40] for m, _ in EVENT_LINES])
def test_each_verl_line_becomes_its_event(
    message: str, build: Build, decoration: str, decorate: Callable[[str], str], stamped: bool
) -> None:
    parsed = parse_line(decorate(message), FALLBACK)

    assert parsed.outcome == "event", parsed.error
    assert parsed.error is None
    event = parsed.event
    assert event is not None
    if stamped:
        assert event.time is not None
        assert event.time.tzinfo is not None
        assert event.time.timestamp() == pytest.approx(local_stamp(STAMP_DT))
        assert event.id != FALLBACK
        assert event.id.startswith("log:")
    else:
        assert event.time is None
        assert event.id == FALLBACK
    assert event == build(event.id, event.time)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "   ",
        "\r",
        "2026-11-28 21:02:03,118\tINFO worker.py:1888 -- Started a local Ray instance. View the dashboard",
        f"{RAY}step:61 - training/global_step:61 - timing_s/gen:3.786 - actor/pg_loss:-0.0486",
        "Training Progress:  19%|██▍      | 61/320 [01:01<1:02:11, 41.2s/it]",
        f"{RAY}INFO:2026-11-28 22:09:47,468:Loading TransferQueue state from /ckpt/global_step_60/transfer_queue",
        "Loading TransferQueue state from /ckpt/global_step_60/transfer_queue",
        f"{RAY}INFO:2026-11-28 22:09:18,496:data.gen_batch_size defaulted to 1.",
        "(raylet) node preempted: spot instance reclaimed",
        f"{RAY}[Rank 0] Saved model to /mnt/ckpt/global_step_60/actor",
        f"{RAY}Initial validation metrics: {{'val-core/openai/gsm8k/reward/mean@1': 0.4121}}",
        "Restored 12 validation prompts",
        "\x1b[31mERROR\x1b[0m something else broke",
        # an impossible date on a line that is not verl's is still just unrelated output
        "INFO:2026-02-30 10:00:00,000:unrelated message",
        "\x00\x01\ufffd\ufffd binary junk",
    ],
)
def test_unrelated_output_is_ignored(line: str) -> None:
    assert parse_line(line, FALLBACK) == ParsedLine("ignored")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("Restored many training prompt groups from TransferQueue", "training prompt groups from TransferQueue"),
        (f"{RAY}INFO:{STAMP}:Restored -3 training prompt groups from TransferQueue", "training prompt groups"),
        (f"INFO:{STAMP}:Saving checkpoint to /x/foo", "no global_step_N in '/x/foo'"),
        ("Saving checkpoint to /ckpt/global_step_20/actor", "no global_step_N"),
        ("Resuming from /ckpt/global_step_40, setting global step to forty", "Resuming from"),
        (
            "Re-issued 3 in-flight prompts for step 41; cleared 2 old trajectories from partition test",
            "in-flight prompts for step",
        ),
        ("Re-issued some in-flight prompts for step 41", "in-flight prompts for step"),
        ("Skipping async warmup: all restored prompt groups already fill the window", "Skipping async warmup"),
        ("Added 5 warmup prompts after restoring 1 of many target prompt groups", "warmup prompts after restoring"),
        ("Added two warmup batches to the agent loop manager", "warmup batches to the agent loop manager"),
        ("pending: 1, running: 2, finished: 3", "pending:"),
        ("Training from scratch (again)", "Training from scratch"),
        # 5000 digits: beyond Python's int() limit, reported instead of raised
        ("Restored 1" + "0" * 5000 + " training prompt groups from TransferQueue", "digits"),
        # a verl line with an impossible date is corrupted, not a crash
        ("INFO:2026-13-01 10:00:00,000:Restored 5 training prompt groups from TransferQueue", "timestamp"),
        (f"{RAY}INFO:2026-02-30 22:14:03,123:Training from scratch", "2026-02-30"),
    ],
)
def test_verl_looking_lines_that_do_not_parse_are_malformed(line: str, problem: str) -> None:
    parsed = parse_line(line, FALLBACK)

    assert parsed.outcome == "malformed"
    assert parsed.event is None
    assert parsed.error is not None
    assert problem in parsed.error
    assert "\n" not in parsed.error


def test_timestamps_are_local_time_like_pythons_logging_asctime() -> None:
    """verl's asctime is local time: in Tokyo 22:14:03 is 13:14:03 UTC."""
    with timezone("Asia/Tokyo"):
        event = parse_line(f"INFO:{STAMP}:Training from scratch", FALLBACK).event
    assert event is not None
    assert event.time is not None
    utc = calendar.timegm(STAMP_DT.timetuple()) + 0.123
    assert event.timestamp(0.0) == pytest.approx(utc - 9 * 3600)


@contextmanager
def timezone(name: str) -> Iterator[None]:
    saved = os.environ.get("TZ")
    os.environ["TZ"] = name
    time.tzset()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = saved
        time.tzset()


# ------------------------------------------------------------------------------------------ ids


def event_id(line: str, fallback: str = FALLBACK) -> str:
    event = parse_line(line, fallback).event
    assert event is not None, line
    return event.id


def test_same_timestamped_line_gets_the_same_id_whatever_the_decoration() -> None:
    message = "Restored 96 training prompt groups from TransferQueue"
    variants = [
        f"INFO:{STAMP}:{message}",
        f"{RAY}INFO:{STAMP}:{message}",
        f"(TaskRunnerV1 pid=99, ip=10.9.9.9) INFO:{STAMP}:{message}",
        f"{RAY}\x1b[36mINFO:{STAMP}:{message}\x1b[0m",
        f"\x1b[36m{RAY.strip()}\x1b[0m INFO:{STAMP}:{message}",
        f"{RAY}INFO:{STAMP}:{message}\r",
    ]
    # different fallback ids (a different file, a different offset) must not matter either
    ids = {event_id(line, f"log:1-{n}:{n * 100}") for n, line in enumerate(variants)}

    assert len(ids) == 1
    (only,) = ids
    assert only.startswith("log:")
    assert len(only) == len("log:") + 20
    assert not only.startswith("log:1-")


def test_different_lines_get_different_ids() -> None:
    lines = [
        f"INFO:{STAMP}:Restored 96 training prompt groups from TransferQueue",
        f"INFO:{STAMP}:Restored 95 training prompt groups from TransferQueue",
        # a periodic line repeated one millisecond later is a new observation
        f"INFO:{STAMP}:pending: 1, running: 2, finished: 3, failure: 0",
        "INFO:2026-11-28 22:14:03,124:pending: 1, running: 2, finished: 3, failure: 0",
        # the demo log has two different lines in the same millisecond
        "INFO:2026-11-28 21:54:17,689:pending: 12, running: 20, finished: 64, failure: 0",
        "INFO:2026-11-28 21:54:17,689:Saving checkpoint to /mnt/ckpt/gsm8k-qwen2.5-7b-async/global_step_60",
        f"WARNING:{STAMP}:Restored 96 training prompt groups from TransferQueue",
    ]
    ids = [event_id(line) for line in lines]
    assert len(set(ids)) == len(lines)


def test_untimestamped_lines_take_the_fallback_id() -> None:
    line = "Restored 96 training prompt groups from TransferQueue"
    assert event_id(line, "log:1-2:300") == "log:1-2:300"
    assert event_id(line, "log:1-2:900") == "log:1-2:900"


# ---------------------------------------------------------------------------------------- clean


@pytest.mark.parametrize(
    ("raw", "cleaned"),
    [
        (f"{RAY}INFO:{STAMP}:x", f"INFO:{STAMP}:x"),
        (f"\x1b[36m{RAY}\x1b[0mhello\x1b[0m", "hello"),
        ("(AgentLoopWorker pid=12, ip=10.0.0.2, actor_id=abc) hi", "hi"),
        ("\x1b[1;31mred\x1b[0m  \r", "red"),
        # parentheses that are not a Ray prefix stay
        ("(raylet) node preempted", "(raylet) node preempted"),
        ("step (pid=3) later", "step (pid=3) later"),
    ],
)
def test_clean_strips_ansi_ray_prefix_and_whitespace(raw: str, cleaned: str) -> None:
    assert clean(raw) == cleaned


# --------------------------------------------------------------------------------------- fuzzing

TRIGGERS = [
    "Resuming from ",
    "Training from scratch",
    "Restored 3 training prompt groups from TransferQueue",
    "Re-issued 1 in-flight prompts for step 2; cleared 3 old trajectories from partition train",
    "Skipping async warmup: ",
    "Added 1 warmup prompts after restoring 2 of 3 target prompt groups",
    "Added 1 warmup batches to the agent loop manager",
    "pending: 1, running: 2, finished: 3, failure: 4",
    "Saving checkpoint to ",
]


@st.composite
def log_lines(draw: st.DrawFn) -> str:
    """Header-shaped lines with arbitrary (often impossible) dates and verl-ish or random messages."""
    fields = [draw(st.integers(0, 9999))] + [draw(st.integers(0, 99)) for _ in range(5)]
    millis = draw(st.integers(0, 999))
    year, month, day, hour, minute, second = fields
    stamp = f"{year:04d}-{month:02d}-{day:02d} {hour:02d}:{minute:02d}:{second:02d},{millis:03d}"
    message = draw(st.sampled_from(TRIGGERS)) + draw(st.text(max_size=30))
    prefix = draw(st.sampled_from(["", RAY, "\x1b[36m", f"\x1b[36m{RAY}"]))
    return f"{prefix}INFO:{stamp}:{message}"


@settings(max_examples=300, deadline=None)
@given(st.one_of(log_lines(), st.text(max_size=200)))
def test_parse_line_never_raises_and_is_consistent(line: str) -> None:
    parsed = parse_line(line, FALLBACK)

    assert parsed.outcome in {"event", "ignored", "malformed"}
    assert (parsed.event is not None) == (parsed.outcome == "event")
    assert (parsed.error is not None) == (parsed.outcome == "malformed")
    if parsed.event is not None:
        assert (parsed.event.id == FALLBACK) == (parsed.event.time is None)


def test_ray_dedup_suffix_is_stripped() -> None:
    line = (
        "(TaskRunnerV1 pid=1, ip=10.0.0.1) INFO:2026-11-28 22:14:03,123:pending: 1, running: 2, finished: 3, failure: 4"
    )
    parsed = parse_line(line + " [repeated 3x across cluster]", "fb")
    assert parsed.outcome == "event" and isinstance(parsed.event, WindowObserved)
    assert dict(parsed.event.by_status) == {"pending": 1, "running": 2, "finished": 3, "failure": 4}


def test_counts_beyond_float_precision_are_malformed() -> None:
    # 2**53 + 1 cannot be exported exactly as a Prometheus sample: refused, not silently rounded.
    parsed = parse_line(
        f"INFO:2026-11-28 22:14:03,123:Restored {2**53 + 1} training prompt groups from TransferQueue", "fb"
    )
    assert parsed.outcome == "malformed"
    assert parsed.error is not None and "restored_prompt_groups" in parsed.error
