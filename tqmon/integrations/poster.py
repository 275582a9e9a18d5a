"""Delivers events to tqmon's ``POST /api/v1/events`` from a daemon thread, so a trainer only ever enqueues.

The queue is bounded and ``post`` never blocks or raises: when the queue is full, or tqmon stays away
after a few retries, or it refuses a batch, the events are dropped, counted and logged (at most one
log line per ``log_every`` seconds). Standard library only: a trainer image needs nothing extra.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from tqmon.events import Event
from tqmon.integrations.logs import RateLimitedLog

log = logging.getLogger("tqmon.integrations")

EVENTS_PATH = "/api/v1/events"
RETRY_DELAYS = (0.5, 2.0, 5.0)  # seconds before each retry of a batch while tqmon is away


@dataclass
class PosterStats:
    enqueued: int = 0
    sent: int = 0
    dropped: int = 0
    last_error: str | None = None


class EventPoster:
    """A bounded queue in front of one background sender."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        capacity: int = 1000,
        batch_size: int = 100,
        timeout: float = 2.0,
        retry_delays: tuple[float, ...] = RETRY_DELAYS,
        log_every: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.endpoint = url.rstrip("/") + EVENTS_PATH
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._queue: queue.Queue[Event] = queue.Queue(capacity)
        self._batch_size = batch_size
        self._timeout = timeout
        self._retry_delays = retry_delays
        self._sleep = sleep
        self._drops = RateLimitedLog(log, log_every)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.stats = PosterStats()

    def post(self, event: Event) -> None:
        """Enqueue one event; never blocks, never raises."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._drop(1, "queue full")
            return
        self.stats.enqueued += 1
        if self._thread is None:
            self._start()

    def flush(self, timeout: float) -> bool:
        """Wait until every enqueued event was sent or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._queue.all_tasks_done.wait(remaining)
        return True

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tqmon-poster", daemon=True)
                self._thread.start()
                atexit.register(self.flush, 2.0)  # the last events of a finishing trainer still go out

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self._batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._deliver(batch)
            except Exception as err:  # the sender must outlive any surprise
                self._drop(len(batch), f"{type(err).__name__}: {err}")
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _deliver(self, batch: list[Event]) -> None:
        body = ("[" + ",".join(event.model_dump_json(exclude_none=True) for event in batch) + "]").encode()
        for delay in (*self._retry_delays, None):
            error = self._send(body)
            if error is None:
                self.stats.sent += len(batch)
                return
            retryable, message = error
            if not retryable or delay is None:
                self._drop(len(batch), message)
                return
            self._sleep(delay)

    def _send(self, body: bytes) -> tuple[bool, str] | None:
        """None on success, else (worth retrying, why)."""
        request = urllib.request.Request(self.endpoint, data=body, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                response.read()
            return None
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode(errors="replace")
            return err.code >= 500, f"HTTP {err.code} from {self.endpoint}: {detail}"
        except (OSError, ValueError) as err:  # refused, timed out, DNS, bad URL
            return True, f"{self.endpoint} unreachable: {err}"

    def _drop(self, n: int, why: str) -> None:
        self.stats.dropped += n
        self.stats.last_error = why
        self._drops.warning(f"tqmon: dropped {n} event(s), {self.stats.dropped} in total: {why}")
