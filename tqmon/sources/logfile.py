"""``--log`` and ``--jsonl``: follow verl's logs like ``tail -F`` and feed their lines to the tracker.

Follows truncation and rotation; the byte offset of the last complete line commits together with
the events it produced, so a restarted tqmon neither skips nor re-applies a line.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from tqmon.events import Event
from tqmon.snapshot import Evidence, SourceName
from tqmon.sources.jsonlparse import parse_jsonl_line
from tqmon.sources.logparse import ParsedLine, parse_line
from tqmon.sources.polling import PollingLoop
from tqmon.tracker import Tracker

LineParser = Callable[[str, str], ParsedLine]  # (line, fallback id) -> what it says
CHUNK_BYTES = 1 << 20
BATCH_LINES = 10_000  # lines per transaction when catching up on a long log
log = logging.getLogger(__name__)


@dataclass
class _Followed:
    path: str
    handle: BinaryIO
    inode: tuple[int, int]
    offset: int  # end of the last complete line consumed
    generation: int = 0  # truncations seen: lines rewritten at old offsets get new fallback ids


def read_lines(handle: BinaryIO, offset: int, *, final: bool = False) -> Iterator[tuple[int, bytes]]:
    """Yield (offset after the line, line) for each complete line from ``offset``.

    A trailing partial line is left for the next poll, unless ``final`` (the file is finished).
    """
    handle.seek(offset)
    pending = b""
    position = offset
    while chunk := handle.read(CHUNK_BYTES):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            position += len(line) + 1
            yield position, line
    if final and pending:
        yield position + len(pending), pending


def parse_chunk(
    lines: Iterable[tuple[int, bytes]], file_key: str, parse: LineParser = parse_line
) -> tuple[list[Event], Counter[str], list[str]]:
    """Events, outcome counts and error messages for a run of raw lines."""
    events: list[Event] = []
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    for end, raw in lines:
        parsed = parse(raw.decode("utf-8", errors="replace"), f"log:{file_key}:{end}")
        outcomes[parsed.outcome] += 1
        if parsed.event is not None:
            events.append(parsed.event)
        elif parsed.error is not None:
            errors.append(f"{file_key} byte {end}: {parsed.error}")
    return events, outcomes, errors


def parse_jsonl(line: str, _fallback_id: str) -> ParsedLine:
    """verl's JSONL lines carry no timestamp but are unique by content: their ids come from it."""
    return parse_jsonl_line(line)


def _unmatched(pattern: str) -> str:
    """Why ``pattern`` names no file to follow, as the operator needs to read it."""
    if glob.has_magic(pattern):
        return f"no file matches {pattern} (yet): waiting"
    if os.path.isdir(pattern):
        return f"{pattern} is a directory, not a log file"
    return f"{pattern} does not exist (yet): waiting"


class LogSource:
    """Polls its globs every ``interval`` seconds on a daemon thread.

    The same tailer serves the trainer log (``source="log"``) and verl's JSONL metrics file
    (``source="jsonl"``, which verl truncates on every restart: a truncation is read again from the start).
    """

    def __init__(
        self,
        patterns: list[str],
        tracker: Tracker,
        *,
        interval: float = 1.0,
        source: SourceName = SourceName.LOG,
        parse: LineParser = parse_line,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.patterns = patterns
        self.tracker = tracker
        self.interval = interval
        self.name = source
        self.parse = parse
        self._clock = clock
        self._files: dict[str, _Followed] = {}
        self._loop = PollingLoop(source, tracker, self.poll, interval)
        tracker.register_source(source, stale_after=max(30.0, 10 * interval), watching=", ".join(patterns))

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
        for followed in self._files.values():
            followed.handle.close()

    def poll(self) -> float:
        """One pass over every matching file; a broken file does not stop the others."""
        started = time.monotonic()
        paths = sorted({p for pattern in self.patterns for p in glob.glob(pattern) if os.path.isfile(p)})
        if not paths:
            reason = "read_error" if any(os.path.isdir(p) for p in self.patterns) else "unavailable"
            self.tracker.source_failed(self.name, reason, "; ".join(map(_unmatched, self.patterns)))
            return self.interval
        failures = []
        for path in paths:
            try:
                self._follow(path)
            except OSError as err:
                failures.append(f"{path}: {err.strerror or err}")
        duration = time.monotonic() - started
        if failures:
            self.tracker.source_failed(self.name, "read_error", "; ".join(failures), duration=duration)
        else:
            self.tracker.source_succeeded(self.name, duration)
        return self.interval

    def _open(self, path: str) -> _Followed:
        handle = open(path, "rb")  # noqa: SIM115 - kept open across polls, closed on rotation/stop
        st = os.fstat(handle.fileno())
        inode = (st.st_dev, st.st_ino)
        cursor = self.tracker.cursor(self._cursor_key(path))
        offset = generation = 0
        if isinstance(cursor, dict) and tuple(cursor.get("inode", ())) == inode:
            generation = int(cursor.get("generation", 0))
            if cursor.get("offset", 0) <= st.st_size:
                offset = int(cursor["offset"])
            else:
                generation += 1  # truncated while tqmon was down
        return _Followed(path, handle, inode, offset, generation)

    def _follow(self, path: str) -> None:
        followed = self._files.get(path)
        if followed is None:
            followed = self._files[path] = self._open(path)
        self._drain(followed)
        st = os.stat(path)
        if (st.st_dev, st.st_ino) != followed.inode:
            # Rotated: the old file is drained above; follow the new one from its start.
            followed.handle.close()
            del self._files[path]
            followed = self._files[path] = self._open(path)
            self._drain(followed)
        elif st.st_size < followed.offset:
            log.info("%s was truncated (a trainer restart?); reading it again from the start", path)
            followed.offset = 0
            followed.generation += 1
            detail = f"{path} truncated (generation {followed.generation}): verl reopens it on a restart"
            self.tracker.restart_hint(Evidence(self.name, "file_truncated", path, self._clock(), detail))
            self._drain(followed)

    def _drain(self, followed: _Followed) -> None:
        batch: list[tuple[int, bytes]] = []
        for item in read_lines(followed.handle, followed.offset):
            batch.append(item)
            if len(batch) == BATCH_LINES:
                self._commit(followed, batch)
                batch = []
        if batch:
            self._commit(followed, batch)

    def _commit(self, followed: _Followed, lines: list[tuple[int, bytes]]) -> None:
        file_key = f"{followed.inode[0]}-{followed.inode[1]}"
        if followed.generation:
            file_key += f".{followed.generation}"
        events, outcomes, errors = parse_chunk(lines, file_key, self.parse)
        end = lines[-1][0]
        cursor = {"inode": list(followed.inode), "offset": end, "generation": followed.generation}
        self.tracker.ingest(
            events,
            self.name,
            cursors=[(self._cursor_key(followed.path), cursor)],
            log_lines=outcomes if self.name is SourceName.LOG else None,  # only the trainer log's lines are tallied
        )
        followed.offset = end  # only once stored: a refused commit (state dir full) is read again next poll
        if errors:
            self.tracker.source_error(self.name, "malformed_line", len(errors))
            for message in errors[:5]:
                log.warning("skipped malformed %s line: %s", self.name, message)

    def _cursor_key(self, path: str) -> str:
        return f"{self.name}:{os.path.abspath(path)}"
