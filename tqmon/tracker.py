"""Run state: the reconciler's fold of every source's events, persisted, counted and published.

Writers (sources, the API) call the public methods below; each call persists what it must, folds the
new events in (:mod:`tqmon.reconcile`) and publishes a fresh immutable :class:`Snapshot`. Readers take
``tracker.snapshot`` and never block a writer.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from tqmon import __version__
from tqmon.events import CheckpointSaved, Event, WindowObserved
from tqmon.reconcile import Reconciler
from tqmon.snapshot import (
    CheckpointListing,
    Evidence,
    Snapshot,
    SourceHealth,
    SourceName,
    Tally,
    TQPollView,
    WindowView,
)
from tqmon.store import PRUNED_RESUMES, StateStore
from tqmon.versions import VerlVersion
from tqmon.warmup import GivenConfig

EPOCH_CURSOR = "tq:controller"

Increment = tuple[Tally, tuple[str, ...], int]  # a tally, its label values, by how much


@dataclass
class _Health:
    stale_after: float | None
    ok: bool = False
    last_success: float | None = None
    last_duration: float | None = None
    last_error: str | None = None
    watching: str | None = None  # what the source reads (a path, an address), for its stderr lines
    said: str | None = None  # the last state line announced; None while nothing was wrong


@dataclass(frozen=True, slots=True)
class TrainerProgress:
    """What the TQ poller needs of the run to schedule itself: the step to age groups by, and the starts seen."""

    step: int | None
    starts: int


class Tracker:
    """Owns run state; the only writer of the store and the snapshot."""

    def __init__(
        self,
        store: StateStore,
        *,
        stale_after: float = 300.0,
        given: GivenConfig | None = None,
        versions: Iterable[VerlVersion] = (),
        clock: Callable[[], float] = time.time,
        announce: Callable[[str], None] | None = None,
    ) -> None:
        """``announce`` receives one line per change of a source's state (``tqmon serve`` prints it on stderr);
        ``versions``, the verl release as tqmon was told it (``--verl-version``, the verl installed next to it)."""
        self._store = store
        self._announce = announce
        self._stale_after = stale_after
        self._clock = clock
        self._lock = threading.RLock()
        self._state = Reconciler(given, versions)
        self._health: dict[str, _Health] = {}
        self._tq: TQPollView | None = None
        self._counters: dict[Tally, Counter[tuple[str, ...]]] = {tally: Counter() for tally in Tally}
        self._pruned_resumes = 0  # resumes of the records retention dropped (still in tqmon_resumes_total)
        self._plugin_stopped: list[Callable[[], None]] = []
        self._snapshot = self._build()

    # ---------------------------------------------------------------- reading

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def progress(self) -> TrainerProgress:
        """The trainer's step and how many starts were seen, for a source that schedules by them."""
        snapshot = self._snapshot
        return TrainerProgress(snapshot.trainer_step, snapshot.records_total)

    def window_fresh_until(self, source: str) -> float | None:
        """Until when ``source`` has a fresh window, for a poller that backs off while another source feeds it."""
        return self._snapshot.window_fresh_until(source)

    def on_plugin_stopped(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (quick, non-blocking) when the verl plugin says it stopped reporting the window:
        a poller backing off for the plugin's window must not wait for that window to go stale."""
        with self._lock:
            self._plugin_stopped.append(callback)

    def wanted_checkpoint(self) -> tuple[int, str | None] | None:
        """The step (and the folder, if the trainer named it) of the checkpoint the newest start resumed from,
        while its composition is not known: for the checkpoint source to read it."""
        with self._lock:
            return self._state.wanted_checkpoint()

    def cursor(self, key: str) -> object | None:
        return self._store.cursor(key)

    def controller_epochs(self) -> int:
        seen = self._store.cursor(EPOCH_CURSOR)
        return int(seen["epochs"]) if isinstance(seen, dict) else 0

    # ---------------------------------------------------------------- writing

    def replay(self) -> int:
        """Rebuild state from the store after a restart; returns the number of events replayed."""
        with self._lock:
            count = 0
            for stored in self._store.events():
                self._state.apply(stored.event, stored.source, stored.received_at)
                count += 1
            self._pruned_resumes = self._store.meta(PRUNED_RESUMES)
            for (name, labels), value in self._store.counters().items():
                if name in Tally.__members__.values():
                    self._counters[Tally(name)][tuple(labels.split("|"))] = value
            self._publish()
            return count

    def ingest(
        self,
        events: Sequence[Event],
        source: str,
        *,
        cursors: Iterable[tuple[str, object]] = (),
        log_lines: Mapping[str, int] | None = None,
    ) -> tuple[int, int]:
        """Persist and apply events from one source; returns (applied, duplicates)."""
        received_at = self._clock()
        live = [e for e in events if _is_live(e)]  # the plugin's windows: applied, never stored (one a second)
        increments = [
            *((Tally.LOG_LINES, (outcome,), n) for outcome, n in (log_lines or {}).items()),
            (Tally.EVENTS, (source, "applied"), len(live)),
        ]
        with self._lock:
            stored = iter(
                self._commit(((e, source, received_at) for e in events if not _is_live(e)), increments, cursors)
            )
            fresh = [_is_live(e) or next(stored) for e in events]
            plugin = self._state.plugin
            for event, is_new in zip(events, fresh, strict=True):
                if is_new:
                    self._state.apply(event, source, received_at)
            for event in live:
                if self._state.accepts_window(event.source_name(source)):
                    self._live_source_seen(event.source_name(source), event.timestamp(received_at))
            if self._state.plugin is not plugin and not self._state.plugin_reports:
                self._plugin_stops()
            self._publish()
            applied = sum(fresh)
            return applied, len(events) - applied

    def reject(self, reason: str) -> None:
        self.count(Tally.EVENTS_REJECTED, (reason,))

    def count(self, tally: Tally, labels: tuple[str, ...], n: int = 1) -> None:
        """Count what no event moves (a rejected request, a refused pickle), persisted like every tally."""
        with self._lock:
            self._commit((), [(tally, labels, n)])
            self._publish()

    def refresh_state(self) -> None:
        """Republish when the state dir's health changed unprompted (a probe found the disk back)."""
        with self._lock:
            if self._store.health() != self._snapshot.state:
                self._publish()

    def register_source(self, source: str, stale_after: float | None, *, watching: str | None = None) -> None:
        """Declare a source; ``stale_after=None`` marks a push source (the API), up while tqmon serves.

        ``watching`` names what it reads, for the line announcing its recovery."""
        with self._lock:
            self._health.setdefault(source, _Health(stale_after, ok=stale_after is None, watching=watching))
            self._publish()

    def source_succeeded(
        self, source: str, duration: float, *, stale_after: float | None = None, state: str | None = None
    ) -> None:
        """``stale_after`` moves the source's staleness horizon (a poller whose interval adapts); ``state``
        names a healthy state worth a line (``no checkpoint saved yet``)."""
        with self._lock:
            health = self._health[source]
            if stale_after is not None:
                health.stale_after = stale_after
            if state is not None:
                self._say(source, health, state)
            elif health.said is not None:  # it recovers: say so once
                self._say(source, health, f"{health.watching}: reading" if health.watching else "up")
                health.said = None
            health.ok, health.last_success, health.last_duration, health.last_error = (
                True,
                self._clock(),
                duration,
                None,
            )
            self._publish()

    def source_expected(self, source: str, stale_after: float) -> None:
        """The source will next succeed later than usual, on purpose (a poll backing off): move its horizon."""
        with self._lock:
            self._health[source].stale_after = stale_after
            self._publish()

    def source_failed(self, source: str, reason: str, message: str, *, duration: float | None = None) -> None:
        with self._lock:
            health = self._health[source]
            health.ok, health.last_error = False, message
            self._say(source, health, message)
            if duration is not None:
                health.last_duration = duration
            self._commit((), [(Tally.SOURCE_ERRORS, (source, reason), 1)])
            self._publish()

    def source_error(self, source: str, reason: str, count: int = 1) -> None:
        """Count bad records (a malformed line) without marking the source down."""
        self.count(Tally.SOURCE_ERRORS, (source, reason), count)

    def observe_windows(self, windows: Sequence[WindowView], poll: TQPollView) -> None:
        """Live windows from a poll; not persisted (the next poll supersedes them)."""
        with self._lock:
            self._state.observe_windows(windows)
            self._tq = poll
            self._publish()

    def drop_windows(self, source: str, poll: TQPollView | None = None) -> None:
        """Forget a source's windows at once: a lost controller's last reply must not be served as fresh."""
        with self._lock:
            self._state.drop_windows(source)
            if poll is not None:
                self._tq = poll
            self._publish()

    def controller_epoch(self, controller_id: str, detail: str) -> int:
        """Record the TQ controller now watched; returns the epoch count (persisted across tqmon restarts).

        A controller with a new id means the trainer restarted: evidence for the start it belongs to.
        """
        with self._lock:
            seen = self._store.cursor(EPOCH_CURSOR)
            last_id, epochs = (seen["id"], int(seen["epochs"])) if isinstance(seen, dict) else (None, 0)
            if controller_id == last_id:
                return epochs
            epochs += 1
            self._commit((), [], [(EPOCH_CURSOR, {"id": controller_id, "epochs": epochs})])
            self.restart_hint(Evidence(SourceName.TQ, "controller_started", controller_id, self._clock(), detail))
            return epochs

    def observe_checkpoint_dir(self, event: CheckpointSaved | None) -> None:
        """The checkpoint dir's latest checkpoint as read now (None: none readable); the tqmon_checkpoint_*
        series follow it, back to an older step or away. Not persisted: the source reads again at start."""
        with self._lock:
            self._state.observe_checkpoint_dir(event)
            self._publish()

    def observe_checkpoint_listing(self, listing: CheckpointListing) -> None:
        """The checkpoint dir's folders and latest file as listed now, for the step regression of the newest
        start. Not persisted: the source lists again at start, and the folders' mtimes date them."""
        with self._lock:
            self._state.observe_checkpoint_listing(listing)
            self._publish()

    def restart_hint(self, evidence: Evidence) -> None:
        """A sign of a trainer restart that is not itself a verl event (a new TQ controller, a truncated JSONL)."""
        with self._lock:
            self._state.hint(evidence)
            self._publish()

    # ---------------------------------------------------------------- persisting and publishing

    def _say(self, source: str, health: _Health, line: str) -> None:
        """Announce a source's state when it changes: the one place its problems reach the operator."""
        if line != health.said:
            health.said = line
            if self._announce is not None:
                self._announce(f"{source}: {line}")

    def _plugin_stops(self) -> None:
        """The plugin no longer reports the window (off, refused, failed): its source is gone on purpose, not
        down (nothing to wait for; readiness must not fail for it), and the TQ poll is woken at once."""
        plugin = self._state.plugin
        self._health.pop(SourceName.REPLAY_BUFFER, None)
        if plugin is not None and self._announce is not None:
            self._announce(
                f"verl plugin: {plugin.window}, the window is not reported from the replay buffer: {plugin.reason}"
            )
        for callback in self._plugin_stopped:
            callback()

    def _live_source_seen(self, source: str, at: float) -> None:
        """A source named by a live window (the plugin's ``replay_buffer``) is up while its windows arrive."""
        health = self._health.setdefault(source, _Health(self._stale_after))
        health.ok, health.last_error = True, None
        health.last_success = max(health.last_success or at, at)

    def _commit(
        self,
        events: Iterable[tuple[Event, str, float]],
        increments: Sequence[Increment],
        cursors: Iterable[tuple[str, object]] = (),
    ) -> list[bool]:
        """The one way state changes reach the store and the counters: store first, so a crash never
        inflates a counter; then the same increments in memory. Returns, per event, whether it was new."""
        rows = list(events)
        increments = [(tally, labels, n) for tally, labels, n in increments if n]
        fresh = self._store.commit(
            rows,
            counters=[(tally.value, "|".join(labels), n) for tally, labels, n in increments],
            cursors=cursors,
            count_events_as=Tally.EVENTS.value,
        )
        outcomes = Counter(
            (source, "applied" if new else "duplicate") for (_, source, _), new in zip(rows, fresh, strict=True)
        )
        for tally, labels, n in [*increments, *((Tally.EVENTS, key, n) for key, n in outcomes.items())]:
            self._counters[tally][labels] += n
        return fresh

    def _publish(self) -> None:
        self._snapshot = self._build()

    def _build(self) -> Snapshot:
        state = self._state
        return Snapshot(
            built_at=self._clock(),
            version=__version__,
            stale_after=self._stale_after,
            run=state.run,
            target_window=state.target_window,
            windows=tuple(state.windows.values()),
            trainer_step=state.trainer_step,
            trainer_last_event=state.trainer_last_event,
            trainer_stepped_at=state.trainer_stepped_at,
            trainer_step_seconds=state.step_seconds,
            resumes_total=state.resumes + self._pruned_resumes,
            records_total=len(state.records),
            last_record=state.records[-1] if state.records else None,
            checkpoint=state.checkpoint,
            tq=self._tq,
            sources=tuple(
                SourceHealth(name, h.ok, h.last_success, h.last_duration, h.last_error, h.stale_after)
                for name, h in sorted(self._health.items())
            ),
            counters={tally: dict(values) for tally, values in self._counters.items()},
            records=tuple(state.records),
            state=self._store.health(),
            plugin=state.plugin,
            verl_version=state.verl_version,
        )


def _is_live(event: Event) -> TypeGuard[WindowObserved]:
    """A window an observer (the verl plugin) reports about every second: applied, not persisted."""
    return isinstance(event, WindowObserved) and event.observer is not None
