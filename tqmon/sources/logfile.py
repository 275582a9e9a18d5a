"""``--log``: follows verl trainer logs like ``tail -F`` and feeds their lines to the tracker.

Follows truncation and rotation; the byte offset of the last complete line commits together with
the events it produced, so a restarted tqmon neither skips nor re-applies a line.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from tqmon.events import Event
from tqmon.sources.logparse import parse_line
from tqmon.tracker import Tracker

SOURCE = "log"
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


def parse_chunk(lines: Iterable[tuple[int, bytes]], file_key: str) -> tuple[list[Event], Counter[str], list[str]]:
    """Events, outcome counts and error messages for a run of raw lines."""
    events: list[Event] = []
    outcomes: Counter[str] = Counter()
    errors: list[str] = []
    for end, raw in lines:
        parsed = parse_line(raw.decode("utf-8", errors="replace"), f"log:{file_key}:{end}")
        outcomes[parsed.outcome] += 1
        if parsed.event is not None:
            events.append(parsed.event)
        elif parsed.error is not None:
            errors.append(f"{file_key} byte {end}: {parsed.error}")
    return events, outcomes, errors


def ingest_file(path: str, tracker: Tracker) -> int:
    """Read a finished log whole into ``tracker``; returns how many malformed verl lines were skipped."""
    with open(path, "rb") as handle:
        st = os.fstat(handle.fileno())
        events, outcomes, errors = parse_chunk(read_lines(handle, 0, final=True), f"{st.st_dev}-{st.st_ino}")
    tracker.ingest(events, SOURCE, log_lines=outcomes)
    for message in errors[:5]:
        log.warning("skipped malformed log line: %s", message)
    return len(errors)


class LogSource:
    """Polls its globs every ``interval`` seconds on a daemon thread."""

    def __init__(self, patterns: list[str], tracker: Tracker, *, interval: float = 1.0) -> None:
        self.patterns = patterns
        self.tracker = tracker
        self.interval = interval
        self._files: dict[str, _Followed] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tqmon-log", daemon=True)
        tracker.register_source(SOURCE, stale_after=max(30.0, 10 * interval))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # poll() may be driven directly, without the thread
            self._thread.join(timeout=5)
        for followed in self._files.values():
            followed.handle.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as err:  # the thread must outlive any one bad poll
                log.exception("log poll failed")
                self.tracker.source_failed(SOURCE, "read_error", f"poll failed: {err}")
            self._stop.wait(self.interval)

    def poll(self) -> None:
        """One pass over every matching file; never raises (a broken file must not stop the others)."""
        started = time.monotonic()
        paths = sorted({p for pattern in self.patterns for p in glob.glob(pattern) if os.path.isfile(p)})
        if not paths:
            self.tracker.source_failed(SOURCE, "unavailable", f"no file matches {', '.join(self.patterns)}")
            return
        failures = []
        for path in paths:
            try:
                self._follow(path)
            except OSError as err:
                failures.append(f"{path}: {err.strerror or err}")
        duration = time.monotonic() - started
        if failures:
            self.tracker.source_failed(SOURCE, "read_error", "; ".join(failures), duration=duration)
        else:
            self.tracker.source_succeeded(SOURCE, duration)

    def _open(self, path: str) -> _Followed:
        handle = open(path, "rb")  # noqa: SIM115 - kept open across polls, closed on rotation/stop
        st = os.fstat(handle.fileno())
        inode = (st.st_dev, st.st_ino)
        cursor = self.tracker.cursor(_cursor_key(path))
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
            log.info("%s was truncated; reading it again from the start", path)
            followed.offset = 0
            followed.generation += 1
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
        events, outcomes, errors = parse_chunk(lines, file_key)
        followed.offset = lines[-1][0]
        cursor = {"inode": list(followed.inode), "offset": followed.offset, "generation": followed.generation}
        self.tracker.ingest(events, SOURCE, cursors=[(_cursor_key(followed.path), cursor)], log_lines=outcomes)
        if errors:
            self.tracker.source_error(SOURCE, "malformed_line", len(errors))
            for message in errors[:5]:
                log.warning("skipped malformed log line: %s", message)


def _cursor_key(path: str) -> str:
    return f"log:{os.path.abspath(path)}"
