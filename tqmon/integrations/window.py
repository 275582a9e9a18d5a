"""The live window as verl's replay buffer sees it after each of its syncs: TransferQueue read once, by the trainer.

verl 0.9.1's ``ReplayBuffer._sync_metadata_from_transfer_queue`` lists the whole TransferQueue (one ``kv_list``)
on every ``sample``, every ``get_sampleable_count`` and every ``poll_interval`` while it waits, and keeps, per
partition, the prompt keys by status (``pending_keys`` … ``failure_keys``), each prompt's ``global_steps``
(``prompt_global_steps``) and the trajectory keys (``partitions``). :class:`WindowReporter` turns those into
``window_observed`` events (``observer: replay_buffer``), so the sidecar need not list TransferQueue itself.

Framework-agnostic apart from those attribute names (pinned in ``tqmon.integrations.pins``);
``tqmon.integrations.verl`` finds the buffer and calls :meth:`WindowReporter.synced` after each sync and
:meth:`WindowReporter.sampled` after a batch is taken, inside its guard: a failure to read the buffer raises
to that guard, and a failure on the reporter's thread goes to ``on_error``, so the hooks come off at the first.

Cost on the trainer's thread, per sync: C-level copies of the prompt keys' sets and steps (O(prompt groups)) and
of the trajectory key list. Counting by status and step, the orphan count (one split and one lookup per
trajectory key), building the events and posting them run on the reporter's own thread, at most once per
``interval``: a newer sync replaces a view not yet posted (the latest wins).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import repeat
from operator import itemgetter
from typing import Any

from tqmon.events import GroupCount, WindowObserved
from tqmon.integrations.resume import Sink
from tqmon.warmup import PARTITIONS, PROMPT_STATUSES

log = logging.getLogger("tqmon.integrations")

DEFAULT_INTERVAL = 1.0  # seconds between window posts at most ($TQMON_WINDOW_REPORT_INTERVAL)
_UID = itemgetter(0)


@dataclass(frozen=True, slots=True)
class BufferView:
    """One partition of the replay buffer right after a sync, copied so verl may change its sets again.

    Only copies are made on the trainer's thread; counting and the orphans happen when the reporter's thread
    builds the event (:meth:`event`).
    """

    partition: str
    at: float  # wall-clock time of the sync
    steps: Mapping[str, int]  # prompt key -> global_steps
    by_status: tuple[tuple[str, frozenset[str]], ...]  # (status, prompt keys), in PROMPT_STATUSES order
    trajectory_keys: list[str]
    removed: frozenset[str] = frozenset()  # prompt keys verl cleared from TransferQueue after the sync

    def groups(self) -> Counter[tuple[str, int]]:
        """Prompt groups by (status, global_steps)."""
        groups: Counter[tuple[str, int]] = Counter()
        for status, keys in self.by_status:
            groups.update(zip(repeat(status), map(self.steps.__getitem__, keys - self.removed)))
        return groups

    def orphans(self) -> int:
        """Trajectory keys whose uid has no prompt key: one split and one lookup per trajectory key."""
        owners = map(_UID, map(str.partition, self.trajectory_keys, repeat("_")))
        if self.removed:
            owned = sum(1 for uid in owners if uid in self.steps and uid not in self.removed)
        else:
            owned = sum(map(self.steps.__contains__, owners))
        return len(self.trajectory_keys) - owned

    def event(self, event_id: str) -> WindowObserved:
        groups = self.groups()
        by_status: dict[str, int] = dict.fromkeys(PROMPT_STATUSES, 0)
        for (status, _), count in groups.items():
            by_status[status] += count
        return WindowObserved(
            id=event_id,
            time=datetime.fromtimestamp(self.at, UTC),
            partition=self.partition,
            by_status=by_status,
            groups=[
                GroupCount(status=status, global_steps=steps, count=count)
                for (status, steps), count in sorted(groups.items(), key=lambda item: (item[0][1], item[0][0]))
            ],
            trajectories=len(self.trajectory_keys),
            orphan_trajectories=self.orphans(),
            observer="replay_buffer",
        )


def read_buffer(buffer: Any, partition: str, at: float, removed: Collection[str] = ()) -> BufferView:
    """``partition`` of a verl replay buffer after its sync, without the prompt keys in ``removed`` (a batch
    just taken: verl cleared those keys from TransferQueue but not from its sets). C-level copies only, read
    with ``.get``: indexing verl's defaultdicts would add entries to them."""
    return BufferView(
        partition,
        at,
        dict(buffer.prompt_global_steps.get(partition, {})),
        tuple((status, frozenset(getattr(buffer, f"{status}_keys").get(partition, ()))) for status in PROMPT_STATUSES),
        list(buffer.partitions.get(partition, ())),
        frozenset(removed),
    )


class WindowReporter:
    """Posts the newest replay-buffer view at most once per ``interval`` from a daemon thread.

    ``on_error`` hears a view that could not be made into events on that thread (the thread never raises);
    :meth:`stop` drops a view not yet posted and refuses new ones.
    """

    def __init__(
        self,
        sink: Sink,
        ids: str,
        interval: float = DEFAULT_INTERVAL,
        clock: Any = time.time,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self._sink = sink
        self._ids = ids
        self._interval = interval
        self._clock = clock
        self.on_error = on_error
        self._latest: list[BufferView] | None = None
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._posted = 0
        self.offered = 0  # views offered by syncs and samples; posted ones are fewer under the rate limit

    @property
    def posted(self) -> int:
        return self._posted

    def synced(self, buffer: Any) -> None:
        """After verl's ``_sync_metadata_from_transfer_queue``: every partition as the buffer now sees it."""
        at = self._clock()
        self._offer([read_buffer(buffer, partition, at) for partition in PARTITIONS])

    def sampled(self, buffer: Any, partition: str, selected: Collection[str]) -> None:
        """After verl's ``_materialize_batch``: the batch's prompt keys are gone from TransferQueue (their
        trajectories stay until the trainer clears them after the step)."""
        at = self._clock()
        self._offer([read_buffer(buffer, p, at, selected if p == partition else ()) for p in PARTITIONS])

    def stop(self) -> None:
        """Post nothing more: the view waiting for its turn is dropped, later ones are refused."""
        with self._wake:
            self._stopped, self._latest = True, None
            self._wake.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until the newest view was handed to the sink; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._latest is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.wait(remaining)
        return True

    def _offer(self, views: list[BufferView]) -> None:
        with self._wake:
            if self._stopped:
                return
            self._latest = views
            self.offered += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tqmon-window", daemon=True)
                self._thread.start()
            self._wake.notify_all()

    def _run(self) -> None:
        due = 0.0
        while True:
            with self._wake:
                while self._latest is None or time.monotonic() < due:
                    self._wake.wait(None if self._latest is None else due - time.monotonic())
                views, self._latest = self._latest, None
                self._wake.notify_all()  # flush() waits for this
            due = time.monotonic() + self._interval
            self._post(views)

    def _post(self, views: list[BufferView]) -> None:
        try:
            events = [view.event(f"{self._ids}/window/{view.partition}/{self._posted}") for view in views]
        except Exception as err:  # sets verl's code no longer fills as pinned (a prompt without global_steps)
            if self.on_error is None:
                log.exception("tqmon: could not report the replay buffer's window")
            else:
                self.on_error(err)
            return
        for event in events:
            self._sink.post(event)
        self._posted += 1
