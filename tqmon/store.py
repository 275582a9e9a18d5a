"""SQLite persistence under ``--state-dir``: the applied events, counters and source cursors.

State is the fold of the applied events, so a restart replays them; an event and the source cursor
that produced it commit in one transaction, so ``kill -9`` can neither lose nor double-apply one.

The disk may fail under a running tqmon (read-only, full, the dir deleted). Events are then refused
(:class:`StateUnavailable`: the API answers 503, a source re-reads later), while counter increments and
cursors wait in memory and are written with the next commit that succeeds; a deleted state dir is
recreated from the still-open database. ``docs/reliability.md`` has the whole fault matrix.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from tqmon.events import Event, dump_event, load_event
from tqmon.snapshot import PUSHED_SOURCE, UNTIMED_SOURCE, StateHealth
from tqmon.statelock import StateError, StateLock

DB_NAME = "tqmon.sqlite3"
SCHEMA_VERSION = 2  # PRAGMA user_version; 0 with tqmon's tables = version 1 (before versioning)
PRUNED_RESUMES = "pruned_resumes"  # meta key: resumes of the records retention dropped
RETRY_SECONDS = 1.0  # an unwritable store is probed at most this often while nothing else writes
log = logging.getLogger(__name__)

SCHEMA_V1 = """
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

# v1 -> v2: the event type as a column (retention keeps the newest events of some types), a key/value
# table for what retention pruned (the resumes it dropped still count in tqmon_resumes_total), and the
# counters renamed from the metric names tqmon 0.x stored (``tqmon_<tally>_total``) to the tracker's tallies.
MIGRATE_V1_V2 = """
ALTER TABLE events ADD COLUMN type TEXT NOT NULL DEFAULT '';
UPDATE events SET type = coalesce(json_extract(body, '$.type'), '');
CREATE INDEX events_by_type ON events (type, seq);
CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT INTO counters (name, labels, value)
    SELECT substr(name, 7, length(name) - 12), labels, value FROM counters WHERE name LIKE 'tqmon!_%!_total' ESCAPE '!'
    ON CONFLICT (name, labels) DO UPDATE SET value = value + excluded.value;
DELETE FROM counters WHERE name LIKE 'tqmon!_%!_total' ESCAPE '!';
"""
V1_TABLES = {"events", "counters", "cursors"}  # run_binding came late in v1: a v1 store may lack it
# What the reconciler reads from before a start, for the resume's cost (tqmon.cost): the last step the trainer
# completed, the last it saved, and its latest timed event (reconcile.trainer_time, by the sources named in
# tqmon.snapshot: the event's time, or the receipt of a pushed one). Retention keeps, before every retained
# start, the first event of each (condition, order).
BEFORE_START = (
    ("type = 'step_completed'", "seq DESC"),
    (f"type = 'checkpoint_saved' AND source != '{UNTIMED_SOURCE}'", "seq DESC"),
    (
        f"type != 'run_started' AND source != '{UNTIMED_SOURCE}' "
        f"AND (source = '{PUSHED_SOURCE}' OR json_extract(body, '$.time') IS NOT NULL)",
        "coalesce(julianday(json_extract(body, '$.time')), 2440587.5 + received_at / 86400.0) DESC",
    ),
)


class StateCorrupt(StateError):
    """The state file is not a tqmon database (truncated, damaged, or another program's)."""


class StateTooNew(StateError):
    """The state file was written by a newer tqmon whose schema this one does not know."""


class StateUnavailable(Exception):
    """A write the state dir refused (read-only, full, deleted): nothing of it was stored."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    event: Event
    source: str
    received_at: float


def failure_reason(err: sqlite3.Error) -> str:
    """The ``tqmon_state_write_failures_total`` reason of an SQLite error."""
    name = getattr(err, "sqlite_errorname", "")
    if name.startswith("SQLITE_READONLY"):
        return "read_only"
    if name == "SQLITE_FULL":
        return "no_space"
    if name.startswith("SQLITE_CANTOPEN"):
        return "missing"
    return "io_error"


class StateStore:
    """One connection shared by the service's threads, serialised by a lock (writes are tiny)."""

    def __init__(self, state_dir: Path | None, *, exclusive: bool = False, recover: bool = False) -> None:
        """``state_dir=None`` keeps everything in memory (``tqmon analyze``, tests).

        ``exclusive`` takes the state dir's lock (``tqmon serve``: one writer per dir). ``recover`` moves
        a corrupt or foreign state file aside and starts empty instead of refusing to start.
        """
        self.state_dir = state_dir
        self.path: Path | str = ":memory:"
        self._exclusive = exclusive
        self._state_lock: StateLock | None = None
        self._lock = threading.Lock()
        self._pending_counters: Counter[tuple[str, str]] = Counter()
        self._pending_cursors: dict[str, object] = {}
        self._failures: Counter[str] = Counter()
        self._error: str | None = None
        self._last_attempt = 0.0
        self.moved_aside: Path | None = None
        if state_dir is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            if exclusive:
                self._state_lock = StateLock(state_dir)
            self.path = state_dir / DB_NAME
        try:
            self._db = self._open()
        except StateCorrupt as err:
            if not recover:
                raise
            self.moved_aside = self._move_aside()
            log.warning("%s; moved it to %s and starting empty: the sources are read again", err, self.moved_aside)
            self._db = self._open()
        self._inode = self._file_inode()

    # ---------------------------------------------------------------- opening

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._migrate(db)
            problem = db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if problem != "ok":
                raise StateCorrupt(self._corrupt_message(problem))
        except sqlite3.DatabaseError as err:
            db.close()
            name = getattr(err, "sqlite_errorname", "")
            if name == "SQLITE_NOTADB" or name.startswith("SQLITE_CORRUPT"):
                raise StateCorrupt(self._corrupt_message(str(err))) from None
            raise StateError(f"state file {self.path} cannot be opened ({failure_reason(err)}): {err}") from None
        except StateError:
            db.close()
            raise
        return db

    def _corrupt_message(self, problem: str) -> str:
        return (
            f"state file {self.path} is not a usable tqmon database ({problem}); "
            "restart with --recover (TQMON_RECOVER=1) to move it aside and rebuild from the sources"
        )

    def _migrate(self, db: sqlite3.Connection) -> None:
        """Bring an older schema up to :data:`SCHEMA_VERSION`; refuse a newer or a foreign one."""
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        tables.discard("sqlite_sequence")
        if version > SCHEMA_VERSION:
            raise StateTooNew(
                f"state file {self.path} has schema version {version}, newer than this tqmon's "
                f"{SCHEMA_VERSION}; run the newer tqmon, or give this one another --state-dir"
            )
        if version == 0 and tables and not tables >= V1_TABLES:
            raise StateCorrupt(self._corrupt_message(f"foreign tables {sorted(tables)}"))
        if version == SCHEMA_VERSION:
            return
        if tables:
            log.info("migrating %s from schema %d to %d", self.path, version or 1, SCHEMA_VERSION)
        db.execute("BEGIN IMMEDIATE")  # SQLite DDL is transactional: a crash leaves the old schema whole
        try:
            for statement in f"{SCHEMA_V1};{MIGRATE_V1_V2}".split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _move_aside(self) -> Path:
        """Rename the state file (and its WAL) to ``<name>.corrupt-<UTC time>``; nothing is deleted."""
        assert isinstance(self.path, Path)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{self.path}{suffix}")
            if source.exists():
                source.rename(f"{target}{suffix}")
        return target

    def _file_inode(self) -> tuple[int, int] | None:
        if not isinstance(self.path, Path):
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._state_lock is not None:
                self._state_lock.release()

    # ---------------------------------------------------------------- writing

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

        Raises :class:`StateUnavailable` when events cannot be stored; a commit of counters and cursors
        alone never fails: they wait in memory for the next commit that succeeds.
        """
        rows = list(events)
        counter_rows = list(counters)
        cursor_rows = list(cursors)
        with self._lock:
            self._last_attempt = time.monotonic()
            try:
                self._ensure_file()
                return self._write(rows, counter_rows, cursor_rows, count_events_as)
            except (sqlite3.Error, OSError, StateError) as err:
                message = self._failed(err)
                if rows:
                    raise StateUnavailable(message) from None
                for name, labels, n in counter_rows:
                    self._pending_counters[(name, labels)] += n
                self._pending_cursors.update(cursor_rows)
                return []

    def _write(
        self,
        rows: list[tuple[Event, str, float]],
        counters: list[tuple[str, str, int]],
        cursors: list[tuple[str, object]],
        count_events_as: str | None,
    ) -> list[bool]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            fresh = [
                self._db.execute(
                    "INSERT OR IGNORE INTO events (id, source, received_at, body, type) VALUES (?, ?, ?, ?, ?)",
                    (event.id, source, received_at, dump_event(event), event.type),
                ).rowcount
                == 1
                for event, source, received_at in rows
            ]
            tally = Counter(self._pending_counters)
            for name, labels, n in counters:
                tally[(name, labels)] += n
            if count_events_as is not None:
                for (_event, source, _at), is_new in zip(rows, fresh, strict=True):
                    tally[(count_events_as, f"{source}|{'applied' if is_new else 'duplicate'}")] += 1
            self._db.executemany(
                "INSERT INTO counters (name, labels, value) VALUES (?, ?, ?) "
                "ON CONFLICT (name, labels) DO UPDATE SET value = value + excluded.value",
                [(name, labels, n) for (name, labels), n in tally.items()],
            )
            self._db.executemany(
                "INSERT INTO cursors (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [(key, json.dumps(value)) for key, value in {**self._pending_cursors, **dict(cursors)}.items()],
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        self._pending_counters.clear()
        self._pending_cursors.clear()
        if self._error is not None:
            log.warning("state writes resumed in %s after: %s", self.path, self._error)
            self._error = None
        return fresh

    def _failed(self, err: BaseException) -> str:
        if isinstance(err, sqlite3.Error):
            reason = failure_reason(err)
        elif isinstance(err, OSError):
            reason = "no_space" if err.errno == 28 else "read_only" if err.errno == 30 else "io_error"
        else:
            reason = "missing"
        message = f"state dir {self.state_dir} not writable ({reason}): {err}"
        if self._error is None:
            log.error("%s; serving from memory, events are refused until it recovers", message)
        self._error = message
        self._failures[reason] += 1
        return message

    def _ensure_file(self) -> None:
        """A deleted state file still takes writes, which a restart would never see: recreate it first."""
        if self._inode is None or self._file_inode() == self._inode:
            return
        assert isinstance(self.path, Path) and self.state_dir is not None
        log.error("state file %s vanished under tqmon; recreating it from the open database", self.path)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._exclusive:
            if self._state_lock is not None:
                self._state_lock.release()
                self._state_lock = None
            self._state_lock = StateLock(self.state_dir)
        partial = self.path.with_name(self.path.name + ".rebuild")
        partial.unlink(missing_ok=True)
        self._db.execute("VACUUM INTO ?", (str(partial),))
        partial.rename(self.path)
        self._db.close()
        self._db = self._open()
        self._inode = self._file_inode()

    # ---------------------------------------------------------------- health

    def health(self) -> StateHealth:
        """Whether the last write succeeded; an unwritable store is probed again at most every second."""
        if self._error is not None and time.monotonic() - self._last_attempt >= RETRY_SECONDS:
            self.commit(())
        with self._lock:
            return StateHealth(self._error is None, self._error, tuple(sorted(self._failures.items())))

    # ---------------------------------------------------------------- reading

    def events(self) -> Iterator[StoredEvent]:
        with self._lock:
            try:
                rows = self._db.execute("SELECT body, source, received_at FROM events ORDER BY seq").fetchall()
            except sqlite3.DatabaseError as err:
                raise StateCorrupt(self._corrupt_message(str(err))) from None
        for body, source, received_at in rows:
            try:
                event = load_event(body)
            except ValidationError as err:
                problem = f"stored event unreadable: {err.errors()[0]['msg']}"
                raise StateCorrupt(self._corrupt_message(problem)) from None
            yield StoredEvent(event, source, received_at)

    def counters(self) -> dict[tuple[str, str], int]:
        with self._lock:
            rows = self._db.execute("SELECT name, labels, value FROM counters").fetchall()
        stored = Counter({(name, labels): value for name, labels, value in rows})
        return dict(stored + self._pending_counters)

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
            if key in self._pending_cursors:
                return self._pending_cursors[key]
            row = self._db.execute("SELECT value FROM cursors WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    # ---------------------------------------------------------------- retention

    def meta(self, key: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return 0 if row is None else int(row[0])

    def cursor_keys(self) -> list[str]:
        with self._lock:
            return [row[0] for row in self._db.execute("SELECT key FROM cursors")]

    def stored_events(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])

    def prune(
        self,
        records: Iterable[Iterable[str]],
        *,
        newest: dict[str, int],
        received_before: float,
        dead_cursors: Iterable[str] = (),
        meta_increments: dict[str, int] | None = None,
    ) -> int | None:
        """Delete events received before ``received_before`` unless they are evidence of a retained record (the
        event ids of each in ``records``) or, per :data:`BEFORE_START`, read before one; among the
        ``newest[type]`` of their type; or the run config in force for a kept event.
        Returns how many events went, None when the disk failed (counted; the next round retries)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._db.execute("CREATE TEMP TABLE IF NOT EXISTS keep (id TEXT PRIMARY KEY)")
                    self._db.execute("CREATE TEMP TABLE IF NOT EXISTS evidence (record INTEGER, id TEXT)")
                    self._db.execute("DELETE FROM keep")
                    self._db.execute("DELETE FROM evidence")
                    self._db.executemany(
                        "INSERT INTO evidence VALUES (?, ?)",
                        ((n, event_id) for n, ids in enumerate(records) for event_id in ids),
                    )
                    self._db.execute("INSERT OR IGNORE INTO keep SELECT id FROM evidence")
                    for condition, order in BEFORE_START:
                        self._db.execute(
                            "INSERT OR IGNORE INTO keep SELECT before FROM (SELECT (SELECT id FROM events "
                            f"WHERE seq < opened AND {condition} ORDER BY {order} LIMIT 1) AS before FROM "
                            "(SELECT min(events.seq) AS opened FROM evidence JOIN events ON events.id = evidence.id "
                            "GROUP BY evidence.record)) WHERE before IS NOT NULL"
                        )
                    for kind, n in newest.items():
                        self._db.execute(
                            "INSERT OR IGNORE INTO keep SELECT id FROM events WHERE type = ? ORDER BY seq DESC LIMIT ?",
                            (kind, n),
                        )
                    # The run_started in force when the oldest kept event arrived, and every later one.
                    self._db.execute(
                        "INSERT OR IGNORE INTO keep SELECT id FROM events WHERE type = 'run_started' AND seq >= "
                        "coalesce((SELECT max(seq) FROM events WHERE type = 'run_started' AND seq <= "
                        "coalesce((SELECT min(seq) FROM events WHERE id IN (SELECT id FROM keep)), 1e18)), 0)"
                    )
                    deleted = self._db.execute(
                        "DELETE FROM events WHERE received_at < ? AND id NOT IN (SELECT id FROM keep)",
                        (received_before,),
                    ).rowcount
                    self._db.executemany("DELETE FROM cursors WHERE key = ?", ((key,) for key in dead_cursors))
                    self._db.executemany(
                        "INSERT INTO meta (key, value) VALUES (?, ?) "
                        "ON CONFLICT (key) DO UPDATE SET value = value + excluded.value",
                        list((meta_increments or {}).items()),
                    )
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as err:
                self._failed(err)
                return None
            return deleted
