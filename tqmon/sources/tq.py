"""``--ray-address``: the live prefetch window, read from the trainer's TransferQueue controller.

The sidecar is a guest in the trainer's cluster. A child process joins the Ray cluster as a driver, looks
up the named actor ``TransferQueueController`` (namespace ``transfer_queue``), reads every partition with
one ``kv_list`` request over its own ZMQ client and sends back only the aggregate. It never calls
``tq.init()``/``tq.close()``, creates no actor, has no storage manager (it cannot put, get or clear data),
and every call is bounded by a timeout; the service spaces the polls so its share of the controller's single
request thread stays under a budget.

Why a child process: Ray ends a driver whose cluster is gone (after 60 s without its GCS), and decoding a
million-key reply holds the GIL for a second. In the child, the first is a restart of the poller, not of
tqmon and its other sources, and the second does not stall ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from tqmon.composition import Composition, CompositionError, compose, window_view
from tqmon.snapshot import SourceName, TQPollView, WindowView
from tqmon.sources.polling import PollingLoop
from tqmon.tracker import Tracker
from tqmon.warmup import PARTITIONS

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
MIN_HORIZON = 30.0  # seconds a poll stays fresh at least
FEEDER = SourceName.REPLAY_BUFFER  # the source (the verl plugin) whose fresh window turns the poll into a cross-check
STARTUP_GRACE = 60.0  # a new poller process imports Ray and TransferQueue and joins the cluster
log = logging.getLogger(__name__)


class TQUnavailable(Exception):
    """The cluster or the controller cannot be reached (yet); the message says which."""


def _poll_setting(default: float, help: str) -> Any:
    """A ``PollSettings`` field that is the ``tqmon serve --tq-<name>`` flag."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class PollSettings:
    """How tqmon may load the controller: ``kv_list`` runs on its only request thread, so each poll stalls
    the trainer's own TQ calls for about as long as it takes."""

    budget: float = _poll_setting(
        0.01,
        "Largest share of the TQ controller's request thread tqmon's kv_list polls may take (0.01 = 1%); "
        "wins over --tq-max-interval.",
    )
    min_interval: float = _poll_setting(
        1.0, "Fastest poll interval, used for --tq-fast-period seconds after a resume or a new controller."
    )
    max_interval: float = _poll_setting(15.0, "Steady poll interval, unless the budget needs longer.")
    fast_period: float = _poll_setting(
        300.0, "Seconds of fast polling after a resume is detected (when the window matters most)."
    )
    cross_check_interval: float = _poll_setting(
        600.0,
        "While the verl plugin reports the window from the replay buffer's own sync (source replay_buffer), "
        "kv_list polls only every this many seconds, as a cross-check; 0 keeps polling at the budget's interval.",
    )
    smoothing: float = 0.3  # weight of the newest poll's cost in the running estimate

    def validate(self) -> None:
        if not 0 < self.budget <= 1:
            raise ValueError(f"--tq-budget must be in (0, 1], got {self.budget}")
        if not 0 < self.min_interval <= self.max_interval:
            raise ValueError(
                f"need 0 < --tq-min-interval <= --tq-max-interval, got {self.min_interval} and {self.max_interval}"
            )
        if self.fast_period < 0:
            raise ValueError(f"--tq-fast-period must not be negative, got {self.fast_period}")
        if self.cross_check_interval < 0:
            raise ValueError(f"--tq-cross-check-interval must not be negative, got {self.cross_check_interval}")


@dataclass
class PollBudget:
    """Chooses the next poll interval from what polls cost (the poller's run-time state).

    tqmon keeps ``cost / interval`` under ``settings.budget``: steady polling at ``max_interval``, the fast
    end (``min_interval``) for ``fast_period`` seconds after a resume, and slower than both when the
    budget demands it (the budget always wins: the trainer comes first).
    """

    settings: PollSettings = field(default_factory=PollSettings)
    cost: float | None = None  # smoothed seconds per kv_list
    fast_until: float = 0.0

    def record(self, seconds: float) -> None:
        weight = self.settings.smoothing
        self.cost = seconds if self.cost is None else weight * seconds + (1 - weight) * self.cost

    def hurry(self, now: float) -> None:
        """A resume (or a new controller) was seen: the window matters most now."""
        self.fast_until = now + self.settings.fast_period

    def interval(self, now: float, last_cost: float = 0.0) -> float:
        floor = max(self.cost or 0.0, last_cost) / self.settings.budget
        wanted = self.settings.min_interval if now < self.fast_until else self.settings.max_interval
        return max(wanted, floor)

    def busy_ratio(self, interval: float) -> float | None:
        return None if self.cost is None else self.cost / (self.cost + interval)


def poll_delay(now: float, last_poll: float, interval: float, fed_until: float | None, cross_check: float) -> float:
    """Seconds until the next ``kv_list`` (0: poll now); the whole cross-check policy, without I/O.

    Normally the next poll comes ``interval`` (the budget's choice) after the last. While another source's
    window is fresh (until ``fed_until``: the verl plugin reports the replay buffer's own view), the trainer
    already paid for that view, so the poll becomes a cross-check every ``cross_check`` seconds, and polling
    resumes once that window goes stale. ``cross_check`` 0 switches the back-off off.
    """
    if fed_until is None or now >= fed_until or cross_check <= 0:
        return max(0.0, last_poll + interval - now)
    return max(0.0, min(last_poll + max(interval, cross_check), fed_until) - now)


def compose_partitions(reply: dict[str, dict[str, Any]]) -> tuple[dict[str, Composition], int]:
    """``train`` and ``val`` of one ``kv_list`` reply, and the reply's key count."""
    return {p: compose(reply.get(p) or {}) for p in PARTITIONS}, sum(len(tags) for tags in reply.values())


def windows_of(
    compositions: dict[str, Composition], trainer_step: int | None, observed_at: float, max_age: float | None = None
) -> list[WindowView]:
    """The live windows of one poll (see :func:`tqmon.composition.window_view` for the ages)."""
    return [window_view(p, SourceName.TQ, c, trainer_step, observed_at, max_age) for p, c in compositions.items()]


def windows_from(
    reply: dict[str, dict[str, Any]], trainer_step: int | None, observed_at: float, max_age: float | None = None
) -> tuple[list[WindowView], int]:
    compositions, keys = compose_partitions(reply)
    return windows_of(compositions, trainer_step, observed_at, max_age), keys


class ControllerClient:
    """A read-only handle on the trainer's TQ controller: lookup, identity and ``kv_list``, all time-bounded."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._actor_id: str | None = None
        self._client: Any = None
        self._lookup: tuple[str, Any] | None = None  # (actor id, ObjectRef) of a get_zmq_server_info in flight
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
        # One lookup at a time: a hung controller (SIGSTOP) is waited on again, never sent a second call.
        if self._lookup is None or self._lookup[0] != actor_id:
            self._lookup = (actor_id, handle.get_zmq_server_info.remote())
        try:
            info: Any = ray.get(self._lookup[1], timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"controller did not answer get_zmq_server_info within {self.timeout:g}s") from None
        except ray.exceptions.RayError as err:
            self._lookup = None
            raise TQUnavailable(f"controller lookup failed: {type(err).__name__}: {err}") from None
        self._lookup = None
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


@dataclass(frozen=True, slots=True)
class Reading:
    """One poll's result, small enough to cross a pipe (the aggregate, never the reply)."""

    controller_id: str
    new_controller: bool
    compositions: dict[str, Composition]
    keys: int
    cost: float  # seconds kv_list took


# Every failure a poll expects, by the source error reason it is counted under (and sent across the pipe as).
_ERRORS: dict[str, type[Exception]] = {
    "unavailable": TQUnavailable,
    "timeout": TimeoutError,
    "invalid_data": CompositionError,
}


def error_kind(err: Exception) -> str:
    return next((kind for kind, cls in _ERRORS.items() if isinstance(err, cls)), "unavailable")


def read_controller(client: ControllerClient, kv_timeout: float) -> Reading:
    client.connect()
    new_controller = client.find()
    started = time.monotonic()
    reply = client.kv_list(kv_timeout)
    cost = time.monotonic() - started
    compositions, keys = compose_partitions(reply)
    return Reading(client.controller_id or "", new_controller, compositions, keys, cost)


def _poller_main(conn: Connection, address: str, timeout: float) -> None:
    """The child: answers ``kv_timeout`` requests with a Reading or ``(kind, message)`` until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    client = ControllerClient(address, timeout)
    while True:
        try:
            kv_timeout = conn.recv()
        except (EOFError, OSError):
            return  # tqmon is gone
        try:
            answer: Reading | tuple[str, str] = read_controller(client, kv_timeout)
        except (TQUnavailable, TimeoutError, CompositionError) as err:
            answer = (error_kind(err), str(err))
        except Exception as err:  # report a bug as this poll's failure; the next request tries again
            answer = ("unavailable", f"{type(err).__name__}: {err}")
        conn.send(answer)


class PollerProcess:
    """The parent's handle on the child that talks to Ray; restarts it when it dies or stops answering."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded server
        self._process: Any = None
        self._conn: Connection | None = None
        self._fresh = False

    def read(self, kv_timeout: float) -> Reading:
        """Raises TQUnavailable, TimeoutError or CompositionError, like a poll in this process would."""
        if self._process is None or not self._process.is_alive():
            self._start()
        conn, process = self._conn, self._process  # close() may run concurrently (tqmon stopping)
        if conn is None or process is None:
            raise TQUnavailable("the TQ poller process was stopped")
        wait = 2 * self.timeout + kv_timeout + (STARTUP_GRACE if self._fresh else 5.0)
        try:
            conn.send(kv_timeout)
            if not conn.poll(wait):
                self.close()
                raise TimeoutError(f"the TQ poller process did not answer within {wait:g}s; it will be restarted")
            answer: Reading | tuple[str, str] = conn.recv()
        except (EOFError, OSError):
            code = process.exitcode
            self.close()
            log.warning("the TQ poller process exited (code %s); a new one starts at the next poll", code)
            raise TQUnavailable(
                f"the TQ poller process exited (code {code}): the Ray cluster at {self.address!r} is gone?"
            ) from None
        self._fresh = False
        if isinstance(answer, Reading):
            return answer
        kind, message = answer
        raise _ERRORS[kind](message)

    def _start(self) -> None:
        self.close()
        parent, child = self._context.Pipe()
        self._process = self._context.Process(
            target=_poller_main, args=(child, self.address, self.timeout), name="tqmon-tq-poller", daemon=True
        )
        self._process.start()
        child.close()
        self._conn, self._fresh = parent, True

    def close(self) -> None:
        conn, process = self._conn, self._process
        self._process, self._conn = None, None
        if conn is not None:
            conn.close()
        if process is not None:
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


class TQSource:
    """Polls the controller on a thread; publishes live windows, or drops them the moment it is lost."""

    name = SourceName.TQ

    def __init__(
        self, tracker: Tracker, poller: PollerProcess, budget: PollBudget, clock: Callable[[], float] = time.time
    ) -> None:
        self.tracker = tracker
        self.poller = poller
        self.budget = budget
        self.controller_id: str | None = None
        self._clock = clock
        self._starts_seen = tracker.progress().starts
        self._epochs = tracker.controller_epochs()
        self._lost = False
        self._ok = False  # the last poll succeeded: only then may the poll back off to a cross-check
        self._holding = False  # backing off for the plugin's window since the last poll
        self._keys: int | None = None  # keys in the last reply
        self._last_poll, self._interval = -float("inf"), 0.0
        self._loop = PollingLoop(self.name, tracker, self._turn, budget.settings.max_interval, interrupt=poller.close)
        tracker.register_source(
            self.name, stale_after=self.horizon(budget.settings.max_interval), watching=f"Ray cluster {poller.address}"
        )
        tracker.drop_windows(self.name, self._view(budget.settings.max_interval, None))
        tracker.on_plugin_stopped(self._loop.wake)  # its window is gone: stop backing off for it at once

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def _turn(self) -> float:
        """One turn of the polling loop: poll if due, then the seconds until the next is due (re-decided on
        waking: the plugin's window may have been renewed or gone stale meanwhile)."""
        if self._delay() <= 0:
            self._holding, self._ok = False, False
            self._last_poll, self._interval = self._clock(), self.poll()
        delay = self._delay()
        if delay > 0 and self._ok and self._cross_checking() and not self._holding:
            self._hold(self._interval)
        return delay

    def _delay(self) -> float:
        cross_check = self.budget.settings.cross_check_interval if self._ok else 0.0  # a failure retries as usual
        fed_until = self.tracker.window_fresh_until(FEEDER)
        return poll_delay(self._clock(), self._last_poll, self._interval, fed_until, cross_check)

    def poll(self) -> float:
        """One poll; returns the seconds to wait before the next."""
        started = time.monotonic()
        try:
            reading = self.poller.read(self.kv_list_timeout())
        except (TQUnavailable, TimeoutError, CompositionError) as err:
            return self._failed(err, time.monotonic() - started)
        self.controller_id = reading.controller_id
        if reading.new_controller:
            self._new_epoch()
        self.budget.record(reading.cost)
        progress = self.tracker.progress()
        interval = self.budget.interval(self._clock(), reading.cost)
        cross_check = self._cross_checking()
        # A cross-check's window is served like any poll's; the source stays up until the next cross-check.
        effective = max(interval, self.budget.settings.cross_check_interval) if cross_check else interval
        windows = windows_of(reading.compositions, progress.step, self._clock(), self.horizon(interval))
        self._maybe_hurry(progress.starts)
        self._lost, self._ok, self._keys = False, True, reading.keys
        self.tracker.observe_windows(windows, self._view(effective, reading.keys, cross_check))
        self.tracker.source_succeeded(self.name, time.monotonic() - started, stale_after=self.horizon(effective))
        return interval

    def kv_list_timeout(self) -> float:
        """``--tq-timeout``, stretched for a window so big that kv_list itself takes longer (1M keys: ~5 s)."""
        return max(self.poller.timeout, 3 * (self.budget.cost or 0.0))

    def horizon(self, interval: float) -> float:
        """How long a successful poll stays fresh: until two more polls could have failed."""
        return max(MIN_HORIZON, 3 * interval + self.kv_list_timeout())

    def _new_epoch(self) -> None:
        controller = self.controller_id or ""
        self._epochs = self.tracker.controller_epoch(controller, f"TransferQueue controller {controller} found")
        self.budget.hurry(self._clock())
        log.info("watching TransferQueue controller %s (epoch %d)", controller, self._epochs)

    def _maybe_hurry(self, starts: int) -> None:
        if starts != self._starts_seen:
            self._starts_seen = starts
            self.budget.hurry(self._clock())

    def _failed(self, err: Exception, duration: float) -> float:
        if not self._lost and self.controller_id is not None:
            self._lost = True
            self.budget.hurry(self._clock())  # a lost controller usually means a restart is coming: watch closely
        interval = self.budget.interval(self._clock())
        self.tracker.drop_windows(self.name, self._view(interval, None))
        self.tracker.source_failed(self.name, error_kind(err), f"{type(err).__name__}: {err}", duration=duration)
        return min(interval, self.budget.settings.max_interval)

    def _hold(self, interval: float) -> None:
        """The poll backs off for the plugin's window: say so, and stay up until the cross-check is overdue."""
        self._holding = True
        cross_check = self.budget.settings.cross_check_interval
        effective = max(interval, cross_check)
        self.tracker.observe_windows((), self._view(effective, self._keys, cross_check=True))
        self.tracker.source_expected(self.name, self.horizon(effective))
        log.info("the verl plugin reports the window: kv_list only every %g s, as a cross-check", cross_check)

    def _cross_checking(self) -> bool:
        """The plugin's window is fresh and the poll may back off for it."""
        fed_until = self.tracker.window_fresh_until(FEEDER)
        return self.budget.settings.cross_check_interval > 0 and fed_until is not None and self._clock() < fed_until

    def _view(self, interval: float, keys: int | None, cross_check: bool = False) -> TQPollView:
        return TQPollView(
            controller_id=self.controller_id,
            epochs=self._epochs,
            interval=interval,
            busy_ratio=self.budget.busy_ratio(interval),
            reply_keys=keys,
            fast_until=self.budget.fast_until or None,
            cross_check=cross_check,
        )
