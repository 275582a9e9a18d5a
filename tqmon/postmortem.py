"""``tqmon analyze``: a post-mortem of finished verl logs with the derivation ``serve`` uses.

The logs, verl's JSONL metrics file, the checkpoint dir and the trainer config feed an in-memory tracker
exactly as the live sources would, so a post-mortem gets the numbers ``serve`` would have had. Only the
order differs: the files are read whole, so their events are put in time order first.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from tqmon.checkpoint.layout import listing, read_checkpoint
from tqmon.checkpoint.unpickler import CheckpointError
from tqmon.events import Event
from tqmon.service import SOURCES, ServiceConfig
from tqmon.snapshot import CheckpointListing, ResumeRecord, SourceName
from tqmon.sources.logfile import parse_chunk, parse_jsonl, read_lines
from tqmon.sources.logparse import LOG_HEADER, clean, parse_line
from tqmon.store import StateStore
from tqmon.tracker import Tracker
from tqmon.versions import FLAG, VerlVersion, betrayed_by, choose, installed, named
from tqmon.warmup import STEP_DIR, GivenConfig

SNIFF_BYTES = 64 * 1024  # enough of a file to tell a binary or JSON file from a log


class NotATrainerLog(ValueError):
    """A file given as a trainer log that is not one; the message names the file and what it is."""


@dataclass(frozen=True, slots=True)
class LogZone:
    """The zone verl's zone-less log timestamps are read in, and how it was chosen (shown in the output)."""

    zone: tzinfo
    name: str
    chosen: str  # "--log-timezone" or "the machine's"

    @classmethod
    def of(cls, name: str | None) -> LogZone:
        """``name`` (an IANA zone such as ``Europe/Paris`` or ``UTC``), or the machine's zone when None."""
        if name is None:
            local = datetime.now().astimezone().tzinfo
            assert local is not None
            return cls(local, datetime.now().astimezone().strftime("%Z (UTC%z)"), "the machine's")
        try:
            return cls(ZoneInfo(name), name, "--log-timezone")
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r} (an IANA name such as UTC or Europe/Paris)") from None


@dataclass
class PostMortem:
    records: tuple[ResumeRecord, ...]
    malformed: int
    zone: LogZone
    events: int  # log events applied (each line read twice counts once)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "records": [record.to_json() for record in self.records],
            "malformed_lines": self.malformed,
            "log_timezone": self.zone.name,
            "notes": self.notes,
        }


def sniff(path: str) -> None:
    """Refuse what is plainly not a verl trainer log, naming what it is."""
    with open(path, "rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if b"\x00" in head or head[:1] == b"\x80":  # a pickle starts with PROTO (0x80); binaries hold NULs
        raise NotATrainerLog(f"{path} is a binary file (a pickle?), not a verl trainer log")
    text = head.decode("utf-8", errors="replace").lstrip()
    if text[:1] in ("{", "[") and (_is_json(text.splitlines()[0]) or _is_json(Path(path).read_text(errors="replace"))):
        raise NotATrainerLog(f"{path} is a JSON file, not a verl trainer log (verl's JSONL metrics go to --jsonl)")


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def read_log(path: str, zone: LogZone) -> tuple[list[Event], int]:
    """A trainer log's events and its malformed verl lines; a file without one verl log line is refused."""
    sniff(path)
    with open(path, "rb") as handle:
        st = os.fstat(handle.fileno())
        lines = list(read_lines(handle, 0, final=True))
    parse = functools.partial(parse_line, zone=zone.zone)
    events, outcomes, errors = parse_chunk(lines, f"{st.st_dev}-{st.st_ino}", parse)
    verl_lines = outcomes["event"] + outcomes["malformed"]
    if not verl_lines and not any(LOG_HEADER.match(clean(raw.decode("utf-8", errors="replace"))) for _, raw in lines):
        raise NotATrainerLog(
            f"{path} has no verl log line (LEVEL:YYYY-MM-DD hh:mm:ss,mmm:message): not a verl trainer log"
        )
    return events, len(errors)


def in_time_order(per_file: Sequence[tuple[str, list[Event]]]) -> tuple[list[Event], str | None]:
    """Every file's events merged by time (stable; an event without a time keeps its predecessor's), and a
    note when that is not the order the files and their lines were given in. A line read twice (the same
    log given twice, a rotated copy) counts once, as the tracker would apply it once."""
    keyed: list[tuple[float, int, Event]] = []
    last = float("-inf")
    seen: set[str] = set()
    for _path, events in per_file:
        for event in events:
            if event.id in seen:
                continue
            seen.add(event.id)
            last = event.time.timestamp() if event.time is not None else last
            keyed.append((last, len(keyed), event))
    ordered = sorted(keyed, key=lambda item: item[:2])
    if [item[1] for item in ordered] == list(range(len(keyed))):
        return [event for _, _, event in ordered], None
    given = ", ".join(path for path, _ in per_file)
    return [event for _, _, event in ordered], f"records out of time order in {given}: sorted by their timestamps"


def checkpoint_events(root: Path, filter_metric: str | None = None) -> tuple[list[Event], list[str]]:
    """Every ``global_step_N`` under ``root`` (oldest first), so each resume gets the composition it loaded;
    with DAPO's ``filter_metric`` also its filtered groups, read from the storage units as ``serve`` does."""
    steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in root.glob(STEP_DIR.format("*")) if _step_dir(p))
    events: list[Event] = []
    notes: list[str] = []
    for step in steps:
        try:
            reading = read_checkpoint(root, step, filter_metric=filter_metric)
        except CheckpointError as err:
            notes.append(f"checkpoint {STEP_DIR.format(step)} skipped: {err}")
            continue
        if reading.filter_error is not None:
            notes.append(f"checkpoint {STEP_DIR.format(step)}: DAPO's filtered groups unknown: {reading.filter_error}")
        events.append(reading.to_event())
    if not steps:
        notes.append(f"no {STEP_DIR.format('N')} in {root}: doomed groups come from the logs alone")
    return events, notes


def _step_dir(path: Path) -> bool:
    return path.is_dir() and path.name.rsplit("_", 1)[1].isdigit()


@dataclass
class Reading:
    """What reading one source whole gave: its events in the order to apply them, and what to tell."""

    events: list[Event] = field(default_factory=list)
    malformed: int = 0
    notes: list[str] = field(default_factory=list)
    listing: CheckpointListing | None = None  # the checkpoint dir's folders and latest file


def _read_checkpoints(config: ServiceConfig, _zone: LogZone) -> Reading:
    assert config.checkpoint_dir is not None
    metric = config.trainer.config.dapo_metric if config.trainer is not None else None
    events, notes = checkpoint_events(config.checkpoint_dir, metric)
    return Reading(events, 0, notes, listing(config.checkpoint_dir))


def _read_logs(config: ServiceConfig, zone: LogZone) -> Reading:
    per_file = [(path, read_log(path, zone)) for path in config.log]
    ordered, note = in_time_order([(path, events) for path, (events, _) in per_file])
    return Reading(ordered, sum(bad for _, (_, bad) in per_file), [note] if note is not None else [])


def _read_jsonl(config: ServiceConfig, _zone: LogZone) -> Reading:
    """verl truncates its JSONL file at every restart: it holds the last start's steps; its lines carry no time."""
    reading = Reading()
    for path in config.jsonl:
        with open(path, "rb") as handle:
            events, _outcomes, errors = parse_chunk(read_lines(handle, 0, final=True), path, parse_jsonl)
        reading.events += events
        reading.malformed += len(errors)
    return reading


# How analyze reads each file source of tqmon.service.SOURCES whole (a live TransferQueue has no past).
READERS: dict[SourceName, Callable[[ServiceConfig, LogZone], Reading]] = {
    SourceName.CHECKPOINT: _read_checkpoints,
    SourceName.LOG: _read_logs,
    SourceName.JSONL: _read_jsonl,
}


def analyze(
    logs: Sequence[str],
    *,
    jsonl: Sequence[str] = (),
    checkpoint_dir: Path | None = None,
    given: GivenConfig | None = None,
    zone: LogZone,
) -> PostMortem:
    """Fold the files into a tracker as ``serve`` would, source by source in the order of
    :data:`tqmon.service.SOURCES`, from the settings ``serve`` would have been given."""
    config = ServiceConfig(log=tuple(logs), jsonl=tuple(jsonl), checkpoint_dir=checkpoint_dir, trainer=given)
    tracker = Tracker(StateStore(None), given=given)
    malformed, applied, notes = 0, 0, []  # applied: the log's events (each line read twice counts once)
    for spec in SOURCES:
        read = READERS.get(spec.name)
        if read is None or not spec.enabled(config):
            continue
        reading = read(config, zone)
        tracker.register_source(spec.name, stale_after=None)
        if reading.listing is not None:
            tracker.observe_checkpoint_listing(reading.listing)
        tracker.ingest(reading.events, spec.name)
        malformed += reading.malformed
        notes += reading.notes
        applied += len(reading.events) if spec.name == SourceName.LOG else 0
    return PostMortem(tracker.snapshot.records, malformed, zone, applied, notes)


def inspected_version(logs: Sequence[str], flag: str | None) -> VerlVersion:
    """The verl release ``tqmon inspect`` predicts for: the trainer logs' own lines (the newest telling one), then
    ``--verl-version``, then the verl installed next to tqmon; unknown without any."""
    events, _ = in_time_order([(path, read_log(path, LogZone.of(None))[0]) for path in logs])
    told = [version for version in map(betrayed_by, events) if version is not None]
    flagged = None if flag is None else named(flag, "flag", FLAG)
    return choose([told[-1] if told else None, flagged, installed()])
