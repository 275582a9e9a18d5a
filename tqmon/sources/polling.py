"""The source contract: a name, ``start``/``stop``, and one polling loop every polled source runs on.

A source reports to the tracker through its public API only (``ingest``, ``observe_windows``,
``source_succeeded``/``source_failed``, ...). Its ``poll`` does one look and returns the seconds until the
next; expected failures are its own to report, and anything else is a bug the loop reports the same way
for every source: the source reads down, its live windows are dropped, and the next poll tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from tqmon.snapshot import SourceName
from tqmon.tracker import Tracker

JOIN_TIMEOUT = 15.0  # seconds ``stop`` waits for a poll in flight (a TQ poll is bounded by its own timeout)
log = logging.getLogger(__name__)


class Source(Protocol):
    """What the service starts and stops."""

    name: SourceName

    def start(self) -> None: ...

    def stop(self) -> None: ...


class PollingLoop:
    """Calls ``poll`` on a daemon thread until stopped, waiting what each poll returns."""

    def __init__(
        self,
        name: SourceName,
        tracker: Tracker,
        poll: Callable[[], float],
        retry_after: float,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """``interrupt`` ends a poll in flight when the source stops (the TQ poller's child process)."""
        self.name = name
        self._tracker = tracker
        self._poll = poll
        self._retry_after = retry_after
        self._interrupt = interrupt
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the wait before the next poll early (stop, or wake)
        self._thread = threading.Thread(target=self._run, name=f"tqmon-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Re-decide now rather than at the end of the wait: what the wait was for changed."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._interrupt is not None:
            self._interrupt()
        if self._thread.is_alive():  # a source may be polled directly, without the thread
            self._thread.join(timeout=JOIN_TIMEOUT)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_once())
            self._wake.clear()

    def poll_once(self) -> float:
        """One poll under the shared error policy; returns the seconds to wait."""
        try:
            return self._poll()
        except Exception as err:  # a bug must not kill the thread or leave stale windows served
            log.exception("%s poll failed", self.name)
            self._tracker.drop_windows(self.name)
            self._tracker.source_failed(self.name, "read_error", f"poll failed: {type(err).__name__}: {err}")
            return self._retry_after
