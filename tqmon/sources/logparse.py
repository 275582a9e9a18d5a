"""Turns verl trainer log lines into events. Pure: no file handling here.

Lines look like ``INFO:2026-11-28 22:14:03,123:Restored 12 training prompt groups from TransferQueue``,
possibly behind a Ray ``(TaskRunnerV1 pid=…, ip=…)`` prefix and wrapped in ANSI colour codes. verl's
``console`` logger backend prints each step's metrics in the same output, without a timestamp:
``step:12 - timing_s/step:41.2 - training/off_policy/evicted_samples:3 - …``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Literal

from pydantic import ValidationError

from tqmon.events import (
    CheckpointRestored,
    CheckpointSaved,
    Event,
    InflightReissued,
    TrainingStarted,
    WarmupDecided,
    WindowObserved,
    describe_validation,
)
from tqmon.sources.stepmetrics import is_training_step, step_completed

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RAY_PREFIX = re.compile(r"^\s*\([^()]*\bpid=\d+[^()]*\)\s*")
RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")
LOG_HEADER = re.compile(r"^(?P<level>[A-Z]+):(?P<asctime>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}):(?P<message>.*)$")
STEP_FOLDER = re.compile(r"global_step_(\d+)/?$")
CONSOLE_STEP = re.compile(r"^step:(?P<step>\d+)(?P<metrics>(?: - [^:]+:.*)*)$")
NUMBER = re.compile(r"^(?:np\.\w+\()?(?P<value>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))\)?$")

Outcome = Literal["event", "ignored", "malformed"]


@dataclass(frozen=True, slots=True)
class ParsedLine:
    outcome: Outcome
    event: Event | None = None
    error: str | None = None


def _step_of(folder: str) -> int:
    match = STEP_FOLDER.search(folder)
    if match is None:
        raise ValueError(f"no global_step_N in {folder!r}")
    return int(match.group(1))


Builder = Callable[[re.Match[str], str, datetime | None], Event]


def _resuming(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return TrainingStarted(id=eid, time=at, resumed_from_step=int(m["n"]), checkpoint_path=m["folder"])


def _scratch(_m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return TrainingStarted(id=eid, time=at, resumed_from_step=None)


def _restored(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return CheckpointRestored(id=eid, time=at, restored_prompt_groups=int(m["r"]))


def _reissued(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return InflightReissued(
        id=eid,
        time=at,
        step=int(m["step"]),
        reissued_prompt_groups=int(m["k"]),
        cleared_trajectories=int(m["m"]),
        partition=m["pid"],
    )


def _skipped(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return WarmupDecided(
        id=eid,
        time=at,
        target_prompt_groups=int(m["t"]),
        restored_prompt_groups=int(m["r"]),
        submitted_prompt_groups=0,
        skip_reason="window_full",
    )


def _topped_up(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return WarmupDecided(
        id=eid,
        time=at,
        target_prompt_groups=int(m["t"]),
        restored_prompt_groups=int(m["r"]),
        submitted_prompt_groups=int(m["m"]),
    )


def _legacy(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return WarmupDecided(id=eid, time=at, legacy_warmup_batches=int(m["n"]))


def _window(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    counts = {status: int(m[status]) for status in ("pending", "running", "finished", "failure")}
    return WindowObserved(id=eid, time=at, by_status=counts)


def _saving(m: re.Match[str], eid: str, at: datetime | None) -> Event:
    return CheckpointSaved(id=eid, time=at, step=_step_of(m["folder"]), path=m["folder"])


# (trigger substring, full pattern, builder): a line containing the trigger but not matching the
# pattern is malformed; the trigger keeps the common case (unrelated output) to one substring test.
RULES: tuple[tuple[str, re.Pattern[str], Builder], ...] = (
    ("Resuming from ", re.compile(r"Resuming from (?P<folder>.+), setting global step to (?P<n>\d+)$"), _resuming),
    ("Training from scratch", re.compile(r"Training from scratch$"), _scratch),
    (
        "training prompt groups from TransferQueue",
        re.compile(r"Restored (?P<r>\d+) training prompt groups from TransferQueue$"),
        _restored,
    ),
    (
        "in-flight prompts for step",
        re.compile(
            r"Re-issued (?P<k>\d+) in-flight prompts for step (?P<step>\d+); "
            r"cleared (?P<m>\d+) old trajectories from partition (?P<pid>train|val)$"
        ),
        _reissued,
    ),
    (
        "Skipping async warmup",
        re.compile(
            r"Skipping async warmup: (?P<r>\d+) restored prompt groups already fill the "
            r"(?P<t>\d+)-prompt prefetch window$"
        ),
        _skipped,
    ),
    (
        "warmup prompts after restoring",
        re.compile(r"Added (?P<m>\d+) warmup prompts after restoring (?P<r>\d+) of (?P<t>\d+) target prompt groups$"),
        _topped_up,
    ),
    (
        "warmup batches to the agent loop manager",
        re.compile(r"Added (?P<n>\d+) warmup batches to the agent loop manager$"),
        _legacy,
    ),
    (
        "pending: ",
        re.compile(
            r"pending: (?P<pending>\d+), running: (?P<running>\d+), finished: (?P<finished>\d+), "
            r"failure: (?P<failure>\d+)$"
        ),
        _window,
    ),
    # any folder (spaces allowed); _step_of reports a folder without global_step_N precisely
    ("Saving checkpoint to ", re.compile(r"Saving checkpoint to (?P<folder>.+)$"), _saving),
)


def _console_step(message: str, event_id: str) -> ParsedLine:
    """verl's console logger line (``concat_dict_to_str``): ``step:N`` then `` - key:pformat(value)`` pairs."""
    match = CONSOLE_STEP.match(message)
    if match is None:
        return ParsedLine("malformed", error="looks like a verl console 'step:N - key:value' line but does not parse")
    data: dict[str, float] = {}
    for item in match["metrics"].split(" - ")[1:]:
        key, _, text = item.partition(":")
        number = NUMBER.match(text.strip())
        if number is not None:  # pformat of other numbers (True, complex) says nothing tqmon reads
            value = float(number["value"])
            data[key.strip()] = int(value) if value.is_integer() else value
    if not is_training_step(data):
        return ParsedLine("ignored")  # validation-only metrics
    try:
        return ParsedLine("event", event=step_completed(event_id, int(match["step"]), data))
    except ValidationError as err:
        return ParsedLine("malformed", error=f"step {match['step']}: {describe_validation(err)}")
    except ValueError as err:
        return ParsedLine("malformed", error=f"step {match['step']}: {err}")


def _event_id(text: str, at: datetime | None, fallback_id: str) -> str:
    """Timestamped lines get an id from their content, so the same line read twice (a rotated copy, a
    second log of the same trainer, a restart) is applied once."""
    return "log:" + hashlib.sha1(text.encode()).hexdigest()[:20] if at is not None else fallback_id


def clean(line: str) -> str:
    """Strip ANSI codes, the Ray actor prefix, Ray's ``[repeated Nx across cluster]`` and whitespace."""
    return RAY_REPEATED.sub("", RAY_PREFIX.sub("", ANSI.sub("", line))).strip()


def parse_line(line: str, fallback_id: str, zone: tzinfo | None = None) -> ParsedLine:
    """Parse one raw line; ``fallback_id`` identifies it when it carries no timestamp. verl's timestamps
    carry no zone: they are read in ``zone``, else in the machine's."""
    text = clean(line)
    header = LOG_HEADER.match(text)
    at: datetime | None = None
    bad_time: str | None = None
    message = text
    if header is not None:
        message = header["message"].strip()
        try:
            naive = datetime.strptime(header["asctime"], "%Y-%m-%d %H:%M:%S,%f")
            at = naive.replace(tzinfo=zone) if zone is not None else naive.astimezone()
        except (ValueError, OverflowError) as err:  # e.g. 2026-02-30: the regex only checks the shape
            bad_time = f"invalid timestamp {header['asctime']!r}: {err}"
    if message.startswith("step:"):
        return _console_step(message, _event_id(text, at, fallback_id))
    for trigger, pattern, build in RULES:
        if trigger not in message:
            continue
        if bad_time is not None:
            return ParsedLine("malformed", error=bad_time)
        match = pattern.search(message)
        if match is None:
            return ParsedLine("malformed", error=f"looks like a verl {trigger.strip()!r} line but does not parse")
        try:
            return ParsedLine("event", event=build(match, _event_id(text, at, fallback_id), at))
        except ValidationError as err:
            return ParsedLine("malformed", error=describe_validation(err))
        except ValueError as err:
            return ParsedLine("malformed", error=str(err))
    return ParsedLine("ignored")
