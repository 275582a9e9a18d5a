"""``--ray-address``: the live prefetch window, read from the trainer's TransferQueue controller.

The sidecar is a guest in the trainer's cluster. It joins the Ray cluster as a driver, looks up the
named actor ``TransferQueueController`` (namespace ``transfer_queue``) and reads every partition with
one ``kv_list`` request over its own ZMQ client. It never calls ``tq.init()``/``tq.close()``, creates no
actor, has no storage manager (it cannot put, get or clear data), bounds every call with a timeout,
and spaces its polls so its share of the controller's single request thread stays under a budget.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from tqmon.catalog import AGE_BUCKETS, PARTITIONS
from tqmon.composition import Composition, CompositionError, compose
from tqmon.snapshot import TQPollView, WindowView
from tqmon.tracker import Tracker

SOURCE = "tq"
CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
TRAIN = "train"
MIN_HORIZON = 30.0  # seconds a poll stays fresh at least
log = logging.getLogger(__name__)


class TQUnavailable(Exception):
    """The cluster or the controller cannot be reached (yet); the message says which."""


@dataclass
class PollBudget:
    """Chooses the next poll interval from what polls cost.

    ``kv_list`` runs on the controller's only request thread, so each poll stalls the trainer's own TQ
    calls for about as long as it takes. tqmon keeps ``cost / interval`` under ``budget``: steady polling
    at ``max_interval``, the fast end (``min_interval``) for ``fast_period`` seconds after a resume, and
    slower than both when the budget demands it (the budget always wins: the trainer comes first).
    """

    budget: float = 0.01
    min_interval: float = 1.0
    max_interval: float = 15.0
    fast_period: float = 300.0
    smoothing: float = 0.3
    cost: float | None = None  # smoothed seconds per kv_list
    fast_until: float = 0.0

    def validate(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"--tq-budget must be in (0, 1], got {self.budget}")
        if not 0 < self.min_interval <= self.max_interval:
            raise ValueError(
                f"need 0 < --tq-min-interval <= --tq-max-interval, got {self.min_interval} and {self.max_interval}"
            )
        if self.fast_period < 0:
            raise ValueError(f"--tq-fast-period must not be negative, got {self.fast_period}")

    def record(self, seconds: float) -> None:
        self.cost = seconds if self.cost is None else self.smoothing * seconds + (1 - self.smoothing) * self.cost

    def hurry(self, now: float) -> None:
        """A resume (or a new controller) was seen: the window matters most now."""
        self.fast_until = now + self.fast_period

    def interval(self, now: float, last_cost: float = 0.0) -> float:
        floor = max(self.cost or 0.0, last_cost) / self.budget
        wanted = self.min_interval if now < self.fast_until else self.max_interval
        return max(wanted, floor)

    def busy_ratio(self, interval: float) -> float | None:
        return None if self.cost is None else self.cost / (self.cost + interval)


def windows_from(
    reply: dict[str, dict[str, Any]], trainer_step: int | None, observed_at: float, max_age: float | None = None
) -> tuple[list[WindowView], int]:
    """Windows of ``train`` and ``val`` from one ``kv_list`` reply, and the reply's key count.

    Ages are the trainer step minus each group's tag ``global_steps``; without a trainer step from
    another source, the newest tag stands in for it.
    """
    views: list[WindowView] = []
    for partition in PARTITIONS:
        composition = compose(reply.get(partition) or {})
        views.append(_window(partition, composition, trainer_step, observed_at, max_age))
    return views, sum(len(tags) for tags in reply.values())


def _window(
    partition: str, c: Composition, trainer_step: int | None, observed_at: float, max_age: float | None
) -> WindowView:
    step = trainer_step if trainer_step is not None else c.newest_step
    buckets, age_sum = c.age_histogram(step, AGE_BUCKETS) if step is not None else (None, None)
    return WindowView(
        partition,
        SOURCE,
        observed_at,
        c.by_status,
        trajectories=c.trajectories,
        orphan_trajectories=c.orphan_trajectories,
        age_buckets=buckets,
        age_sum=age_sum,
        max_age=max_age,
    )


class ControllerClient:
    """A read-only handle on the trainer's TQ controller: lookup, identity and ``kv_list``, all time-bounded."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._actor_id: str | None = None
        self._client: Any = None
        self.controller_id: str | None = None

    def connect(self) -> None:
        # Ray's C++ failure handler would print a stack trace on every SIGTERM, the normal way a sidecar stops.
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        import ray

        if ray.is_initialized():
            return
        try:
            ray.init(
                address=self.address,
                namespace=CONTROLLER_NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise TQUnavailable(f"cannot join the Ray cluster at {self.address!r}: {err}") from err

    def find(self) -> bool:
        """Look the controller up; True if it is a different one than before (a new epoch)."""
        import ray

        try:
            handle = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        except ValueError:
            self.forget()
            raise TQUnavailable(
                f"no {CONTROLLER_NAME} actor in namespace {CONTROLLER_NAMESPACE!r} (trainer not started?)"
            ) from None
        actor_id = handle._actor_id.hex()  # stable for the actor's life; a restarted trainer makes a new one
        if actor_id == self._actor_id:
            return False
        self.forget()
        try:
            info: Any = ray.get(handle.get_zmq_server_info.remote(), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"controller did not answer get_zmq_server_info within {self.timeout:g}s") from None
        except ray.exceptions.RayError as err:
            raise TQUnavailable(f"controller lookup failed: {type(err).__name__}: {err}") from None
        from transfer_queue.client import AsyncTransferQueueClient

        # No storage manager: this client can list keys and tags, never read, write or clear data.
        self._client = AsyncTransferQueueClient(f"tqmon_{os.getpid()}", info)
        self._actor_id, self.controller_id = actor_id, str(info.id)
        return True

    def kv_list(self, timeout: float) -> dict[str, dict[str, Any]]:
        """Every partition's ``{key: tag}`` in one request (the controller serves it on one thread)."""
        request = asyncio.wait_for(self._client.async_kv_list(None), timeout)
        try:
            reply: dict[str, dict[str, Any]] = self._loop.run_until_complete(request)
        except TimeoutError:
            self.forget()  # the socket is now in an unknown state; the next poll looks the controller up again
            raise TimeoutError(f"kv_list did not answer within {timeout:g}s") from None
        except RuntimeError as err:
            self.forget()
            raise TQUnavailable(str(err)) from None
        return reply

    def forget(self) -> None:
        """Drop our own client (never the controller): its zmq context and sockets are closed."""
        if self._client is not None:
            self._client.close()
        self._client, self._actor_id = None, None

    def close(self) -> None:
        self.forget()
        self._loop.close()


class TQSource:
    """Polls the controller on a thread; publishes live windows, or drops them the moment it is lost."""

    def __init__(self, tracker: Tracker, client: ControllerClient, budget: PollBudget) -> None:
        self.tracker = tracker
        self.client = client
        self.budget = budget
        self._records_seen = tracker.snapshot.records_total
        self._epochs = tracker.controller_epochs()
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tqmon-tq", daemon=True)
        tracker.register_source(SOURCE, stale_after=self.horizon(budget.max_interval))
        tracker.drop_windows(SOURCE, self._view(budget.max_interval, None))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.client.timeout + 5)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(self.poll())

    def poll(self) -> float:
        """One poll; returns the seconds to wait before the next. Never raises."""
        started = time.monotonic()
        cost = 0.0
        try:
            self.client.connect()
            if self.client.find():
                self._new_epoch()
            call = time.monotonic()
            reply = self.client.kv_list(self.kv_list_timeout())
            cost = time.monotonic() - call
            self.budget.record(cost)
            snapshot = self.tracker.snapshot
            interval = self.budget.interval(time.time(), cost)
            horizon = self.horizon(interval)
            windows, keys = windows_from(reply, snapshot.trainer_step, time.time(), horizon)
        except (TQUnavailable, TimeoutError, CompositionError) as err:
            return self._failed(err, time.monotonic() - started)
        except Exception as err:  # a bug must not kill the thread or leave stale windows served
            log.exception("tq poll failed")
            return self._failed(err, time.monotonic() - started)
        self._maybe_hurry(snapshot.records_total)
        self._lost = False
        interval = self.budget.interval(time.time(), cost)
        self.tracker.observe_windows(windows, self._view(interval, keys))
        self.tracker.source_succeeded(SOURCE, time.monotonic() - started, stale_after=horizon)
        return interval

    def kv_list_timeout(self) -> float:
        """``--tq-timeout``, stretched for a window so big that kv_list itself takes longer (1M keys: ~5 s)."""
        return max(self.client.timeout, 3 * (self.budget.cost or 0.0))

    def horizon(self, interval: float) -> float:
        """How long a successful poll stays fresh: until two more polls could have failed."""
        return max(MIN_HORIZON, 3 * interval + self.kv_list_timeout())

    def _new_epoch(self) -> None:
        controller = self.client.controller_id or ""
        self._epochs = self.tracker.controller_epoch(controller, f"TransferQueue controller {controller} found")
        self.budget.hurry(time.time())
        log.info("watching TransferQueue controller %s (epoch %d)", controller, self._epochs)

    def _maybe_hurry(self, records_total: int) -> None:
        if records_total != self._records_seen:
            self._records_seen = records_total
            self.budget.hurry(time.time())

    def _failed(self, err: Exception, duration: float) -> float:
        reason = {TimeoutError: "timeout", CompositionError: "invalid_data"}.get(type(err), "unavailable")
        if not self._lost and self.client.controller_id is not None:
            self._lost = True
            self.budget.hurry(time.time())  # a lost controller usually means a restart is coming: watch closely
        interval = self.budget.interval(time.time())
        self.tracker.drop_windows(SOURCE, self._view(interval, None))
        self.tracker.source_failed(SOURCE, reason, f"{type(err).__name__}: {err}", duration=duration)
        return min(interval, self.budget.max_interval)

    def _view(self, interval: float, keys: int | None) -> TQPollView:
        return TQPollView(
            controller_id=self.client.controller_id,
            epochs=self._epochs,
            interval=interval,
            busy_ratio=self.budget.busy_ratio(interval),
            reply_keys=keys,
            fast_until=self.budget.fast_until or None,
        )
