"""SQLite persistence under ``--state-dir``: the applied events, counters and source cursors.

State is the fold of the applied events, so a restart replays them; an event and the source cursor
that produced it commit in one transaction, so ``kill -9`` can neither lose nor double-apply one.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tqmon.events import Event, dump_event, load_event

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    source TEXT NOT NULL,
    received_at REAL NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL,
    labels TEXT NOT NULL,
    value INTEGER NOT NULL,
    PRIMARY KEY (name, labels)
);
CREATE TABLE IF NOT EXISTS cursors (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS run_binding (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    identity TEXT NOT NULL
);
"""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    event: Event
    source: str
    received_at: float


class StateStore:
    """One connection shared by the service's threads, serialised by a lock (writes are tiny)."""

    def __init__(self, state_dir: Path | None) -> None:
        """``state_dir=None`` keeps everything in memory (``tqmon analyze``, tests)."""
        self.path: Path | str = ":memory:"
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            self.path = state_dir / "tqmon.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def commit(
        self,
        events: Iterable[tuple[Event, str, float]],
        *,
        counters: Iterable[tuple[str, str, int]] = (),
        cursors: Iterable[tuple[str, object]] = (),
        count_events_as: str | None = None,
    ) -> list[bool]:
        """Store events (source, received_at), counter increments and cursors atomically.

        ``count_events_as`` names a counter incremented, in the same transaction, by the events stored
        (labels ``source|applied``) and ignored as already stored (``source|duplicate``).
        Returns, per event, whether it was new (False: its id was stored before).
        """
        rows = list(events)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                fresh = [
                    self._db.execute(
                        "INSERT OR IGNORE INTO events (id, source, received_at, body) VALUES (?, ?, ?, ?)",
                        (event.id, source, received_at, dump_event(event)),
                    ).rowcount
                    == 1
                    for event, source, received_at in rows
                ]
                if count_events_as is not None:
                    tally = Counter(
                        f"{source}|{'applied' if is_new else 'duplicate'}"
                        for (_event, source, _at), is_new in zip(rows, fresh, strict=True)
                    )
                    counters = [*counters, *((count_events_as, labels, n) for labels, n in tally.items())]
                self._db.executemany(
                    "INSERT INTO counters (name, labels, value) VALUES (?, ?, ?) "
                    "ON CONFLICT (name, labels) DO UPDATE SET value = value + excluded.value",
                    list(counters),
                )
                self._db.executemany(
                    "INSERT INTO cursors (key, value) VALUES (?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    [(key, json.dumps(value)) for key, value in cursors],
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return fresh

    def events(self) -> Iterator[StoredEvent]:
        with self._lock:
            rows = self._db.execute("SELECT body, source, received_at FROM events ORDER BY seq").fetchall()
        for body, source, received_at in rows:
            yield StoredEvent(load_event(body), source, received_at)

    def counters(self) -> dict[tuple[str, str], int]:
        with self._lock:
            rows = self._db.execute("SELECT name, labels, value FROM counters").fetchall()
        return {(name, labels): value for name, labels, value in rows}

    def bound_run(self) -> dict[str, str] | None:
        """The identity of the run this state belongs to (:mod:`tqmon.binding`), or None if not bound yet."""
        with self._lock:
            row = self._db.execute("SELECT identity FROM run_binding WHERE id = 1").fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def bind_run(self, identity: Mapping[str, str]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO run_binding (id, identity) VALUES (1, ?) "
                "ON CONFLICT (id) DO UPDATE SET identity = excluded.identity",
                (json.dumps(dict(identity), sort_keys=True),),
            )

    def cursor(self, key: str) -> object | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM cursors WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])
