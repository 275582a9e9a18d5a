"""Retention: the state dir stays bounded over months of steps, so startup (a replay) stays flat.

State is the fold of the stored events, so only events the fold no longer needs may go: an event is
kept while it is evidence of a retained resume record (the last ``--retain-records``, started within
``--retain-days``; the latest start always) or what its cost reads from before it (the last step
completed and saved, the last timed trainer event), or among the newest of its type that the live state
reads (the step rate, checkpoint compositions a future resume completes from, the windows), or the
run config in force for those. Everything else older than ``--retain-min-age`` is deleted; the
resumes of dropped records stay counted in ``tqmon_resumes_total``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqmon.reconcile import KEPT_COMPOSITIONS, STEP_RATE_WINDOW
from tqmon.snapshot import ResumeRecord
from tqmon.store import PRUNED_RESUMES, RETRY_SECONDS, StateStore
from tqmon.tracker import Tracker

INTERVAL_SECONDS = 300.0  # at most; a short --retain-min-age prunes more often
NEWEST_KEPT = {
    "step_completed": STEP_RATE_WINDOW,
    "checkpoint_saved": KEPT_COMPOSITIONS,
    "window_observed": 16,
}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """How much history the state dir keeps; each field is the ``tqmon serve --retain-<name>`` flag."""

    records: int = field(
        default=1000,
        metadata={"help": "Resume records kept in the state dir (with the events behind them); older ones are pruned."},
    )
    days: float = field(
        default=365.0,
        metadata={"help": "Resume records older than this many days are pruned too (the latest start is always kept)."},
    )
    min_age: float = field(
        default=3600.0,
        metadata={
            "help": "Seconds an event is kept whatever retention says: a post retried within it is still a duplicate."
        },
    )

    def validate(self) -> None:
        if self.records < 1:
            raise ValueError(f"--retain-records must be at least 1, got {self.records}")
        if self.days <= 0:
            raise ValueError(f"--retain-days must be positive, got {self.days}")
        if self.min_age < 0:
            raise ValueError(f"--retain-min-age must not be negative, got {self.min_age}")

    @property
    def interval(self) -> float:
        """Seconds between retention rounds."""
        return min(INTERVAL_SECONDS, max(1.0, self.min_age / 4))


def first_retained(records: Sequence[ResumeRecord], policy: RetentionPolicy, now: float) -> int:
    """Index of the oldest record kept; the latest start is always kept."""
    if not records:
        return 0
    first = max(0, len(records) - policy.records)
    horizon = now - policy.days * 86400.0
    while first < len(records) - 1 and records[first].started_at < horizon:
        first += 1
    return first


def dead_cursor_keys(keys: Sequence[str]) -> list[str]:
    """Cursors of followed files (``source:/abs/path``) whose file is gone: rotated away for good."""
    return [key for key in keys if key.partition(":")[2].startswith("/") and not os.path.exists(key.partition(":")[2])]


class Retention:
    """Prunes once at start and then every :data:`INTERVAL_SECONDS` on a daemon thread, which also
    republishes the state dir's health every second (a disk that came back shows without an event)."""

    def __init__(
        self,
        tracker: Tracker,
        store: StateStore,
        policy: RetentionPolicy,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tracker = tracker
        self.store = store
        self.policy = policy
        self._clock = clock
        self._accounted = 0  # records (in the tracker's list) whose resumes are already in the store's meta
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tqmon-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        next_round = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_round:
                    next_round = time.monotonic() + self.policy.interval
                    self.prune()
                self.tracker.refresh_state()
            except Exception:  # retention must never take the service down
                log.exception("retention round failed")
            self._stop.wait(RETRY_SECONDS)

    def prune(self) -> int:
        """One round; returns the number of events deleted."""
        now = self._clock()
        records = self.tracker.snapshot.records
        first = first_retained(records, self.policy, now)
        dropped = records[self._accounted : first] if first > self._accounted else []
        deleted = self.store.prune(
            [[evidence.event_id for evidence in record.evidence] for record in records[first:]],
            newest=NEWEST_KEPT,
            received_before=now - self.policy.min_age,
            dead_cursors=dead_cursor_keys(self.store.cursor_keys()),
            meta_increments={PRUNED_RESUMES: sum(r.resumed for r in dropped)},
        )
        if deleted is None:
            return 0
        self._accounted = max(self._accounted, first)
        if deleted:
            log.info("retention: deleted %d events, keeping %d records", deleted, len(records) - first)
        return deleted
