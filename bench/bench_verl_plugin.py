"""What the verl plugin costs the trainer, per call, next to a no-op baseline measured in the same run.

Run with ``.venv/bin/python bench/bench_verl_plugin.py`` (needs the ``verl`` extra; about 20 s). Rows:

- the per-submission hook (``TqmonAgentLoopManager.generate_sequences`` before it dispatches): classify the
  call from the stack and count it, called from a six-frame chain named like verl's step path, against a
  plain function called from the same chain. This is the only per-step cost (one or two calls a step).
- ``EventPoster.post``: enqueue one ready event (tqmon unreachable, so the sender drops in the background),
  and building an event plus enqueueing it, as the plugin does a handful of times per start and per save.
- the window composition read at each checkpoint save, per 10,000 keys (``compose`` of a ``kv_list`` reply;
  the ``kv_list`` call itself costs TransferQueue ~3-4 µs per key, see ../shared/DESIGN.md).
- the plugin-fed window, per replay-buffer sync at 10k and 100k keys, next to verl's own processing of the
  same reply in ``_sync_metadata_from_transfer_queue`` (verl's real method; its ``tq.kv_list`` here returns
  the prepared reply, so the controller round trip, the same with or without the plugin, is left out):
  ``WindowReporter.synced`` on the trainer's thread (C-level copies of the key sets and steps), and
  the events with the orphan count that the reporter's thread builds at most once a second.
- the plugin's GIL time on the trainer process at 100k keys: verl's sync run back to back on the trainer's
  thread (the most syncs, so the most views, the plugin can be offered), alone and watched by the plugin
  (``watch_replay_buffer``, ``WindowReporter`` at its default interval, ``EventPoster`` posting to a real
  ``tqmon serve``), alternating, ``--gil-seconds`` each, twice. The reporter's and the poster's threads run pure
  Python (CPython's GIL waits sleep), so their CPU time (``pthread_getcpuclockid``) is the GIL time they take
  from the trainer; next to it the trainer's sync rate and CPU per sync with and without the plugin.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
import timeit
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqmon.composition import compose
from tqmon.events import InflightReissued, StepCompleted
from tqmon.integrations.poster import EventPoster
from tqmon.integrations.resume import StartReporter
from tqmon.integrations.verl import classify, watch_replay_buffer
from tqmon.integrations.window import WindowReporter, read_buffer
from tqmon.warmup import TrainerConfig

STEP_PATH = ("fit", "step", "prepare_step", "wrapper", "_submit_batch_to_rollout")
GIL_KEYS = 100_000
GIL_ROUNDS = 2  # alone / with the plugin, alternating, so the machine's load drifts over both alike


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chain(leaf: Callable[[], object]) -> Callable[[], object]:
    """``leaf`` called from functions named like verl's step path (outermost first), as verl calls the hook."""
    namespace: dict[str, Any] = {"_leaf": leaf}
    inner = "_leaf"
    for name in reversed(STEP_PATH):
        exec(f"def {name}():\n    return {inner}()\n", namespace)
        inner = name
    function: Callable[[], object] = namespace[inner]
    return function


def per_call_ns(function: Callable[[], object], number: int) -> float:
    """Median of 7 runs, in nanoseconds per call."""
    runs = timeit.repeat(function, number=number, repeat=7)
    return statistics.median(runs) / number * 1e9


def window_tags(keys: int) -> dict[str, dict[str, Any]]:
    """A verl-shaped partition: prompt groups with one trajectory each."""
    tags: dict[str, dict[str, Any]] = {}
    for i in range(keys // 2):
        uid = uuid.UUID(int=i + 1).hex
        tags[uid] = {"is_prompt": True, "status": "finished", "global_steps": i % 8}
        tags[f"{uid}_0_0"] = {"status": "success", "global_steps": i % 8}
    return tags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gil-seconds", type=float, default=10.0, help="length of each GIL-time phase")
    args = parser.parse_args()
    number = 200_000
    reporter = StartReporter(
        _NullSink(), "bench/0", TrainerConfig(train_batch_size=4, num_warmup_batches=1), "colocate_async"
    )
    reporter.submitted("step", 4)  # past the warmup decision: what every later step pays

    def hook() -> None:
        reporter.submitted(classify(sys._getframe(1)), 4)

    def noop() -> None:
        return None

    poster = EventPoster(f"http://127.0.0.1:{unused_port()}", capacity=10 * number, retry_delays=())
    ready = StepCompleted(id="bench/step/1", global_step=1)

    def build_and_post() -> None:
        poster.post(InflightReissued(id="bench/reissue", step=11, reissued_prompt_groups=3, cleared_trajectories=2))

    tags = window_tags(10_000)
    rows = [
        ("no-op call through verl's step path (baseline)", per_call_ns(chain(noop), number)),
        ("submission hook: classify + count (per step)", per_call_ns(chain(hook), number)),
        ("no-op call (baseline)", per_call_ns(noop, number)),
        ("EventPoster.post of a built event", per_call_ns(lambda: poster.post(ready), number)),
        ("build InflightReissued + EventPoster.post", per_call_ns(build_and_post, number // 10)),
        ("compose 10,000 keys (per checkpoint save)", per_call_ns(lambda: compose(tags), 20)),
    ]
    print(f"{'operation':<50} {'ns/call':>12} {'µs/call':>10}")
    for name, ns in rows:
        print(f"{name:<50} {ns:>12,.0f} {ns / 1000:>10.2f}")
    assert poster.flush(600)  # its sender drops in the background: done before the tables below
    print(f"(poster: {poster.stats.enqueued:,} enqueued, {poster.stats.dropped:,} dropped as tqmon was away)")
    print()
    print(window_table())
    print()
    print(gil_table(args.gil_seconds))


def window_table() -> str:
    """Per sync, in ms: verl's own processing of a reply, and what the plugin adds, at 10k and 100k keys."""
    labels = (
        "verl _sync_metadata_from_transfer_queue, kv_list excluded",
        "plugin: WindowReporter.synced (trainer thread)",
        "plugin: events + orphans (reporter thread, <= 1/s)",
    )
    small, large = window_costs(10_000), window_costs(100_000)
    lines = [f"{'per replay-buffer sync':<58} {'10k keys ms':>12} {'100k keys ms':>13} {'of verl':>8}"]
    for index, label in enumerate(labels):
        share = f"{large[index] / large[0]:.1%}" if index else ""
        lines.append(f"{label:<58} {small[index]:>12.2f} {large[index]:>13.2f} {share:>8}")
    return "\n".join(lines)


def window_costs(size: int) -> tuple[float, float, float]:
    """Milliseconds per call: verl's sync of a ``size``-key reply, the plugin's hook, the reporter's events."""
    buffer = verl_buffer()
    with verl_listing(size):
        verl = per_call_ns(buffer._sync_metadata_from_transfer_queue, 3)
    reporter = WindowReporter(_NullSink(), "bench/window", interval=3600.0)  # posts once, then waits
    synced = per_call_ns(lambda: reporter.synced(buffer), 10)
    views = [read_buffer(buffer, partition, 0.0) for partition in ("train", "val")]
    events = per_call_ns(lambda: [view.event("bench/w") for view in views], 5)
    return verl / 1e6, synced / 1e6, events / 1e6


def verl_buffer() -> Any:
    """verl 0.9.1's own replay buffer, as its trainer builds it by default."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    return ReplayBufferAsync(
        trainer_mode="colocate_async",
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
    )


@contextmanager
def verl_listing(size: int) -> Iterator[None]:
    """verl's replay-buffer module lists a prepared ``size``-key reply instead of calling TransferQueue."""
    from bench_tq_poll import key_and_tag
    from verl.trainer.ppo.v1 import replay_buffer as verl_replay_buffer

    listing = verl_replay_buffer.tq
    verl_replay_buffer.tq = _Listing({"train": dict(key_and_tag(i) for i in range(size)), "val": {}})
    try:
        yield
    finally:
        verl_replay_buffer.tq = listing


@dataclass
class GilPhase:
    """One phase of verl's back-to-back syncs: the trainer's syncs and the plugin threads' CPU (= GIL) time."""

    seconds: float = 0.0
    syncs: int = 0
    trainer_cpu: float = 0.0
    reporter_cpu: float = 0.0
    poster_cpu: float = 0.0
    posts: int = 0

    def add(self, other: GilPhase) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds of one of this process's threads."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def gil_phase(buffer: Any, seconds: float, reporter: WindowReporter, threads: dict[str, threading.Thread]) -> GilPhase:
    """verl's sync back to back on this (the trainer's) thread for ``seconds``; ``threads`` are the plugin's
    (``tqmon-window``, ``tqmon-poster``), measured in every phase: without the plugin they stay idle."""
    reporter_cpu, poster_cpu = thread_cpu(threads["tqmon-window"]), thread_cpu(threads["tqmon-poster"])
    posted = reporter.posted
    phase = GilPhase()
    cpu, started = time.thread_time(), time.monotonic()
    while time.monotonic() - started < seconds:
        buffer._sync_metadata_from_transfer_queue()
        phase.syncs += 1
    phase.seconds = time.monotonic() - started
    phase.trainer_cpu = time.thread_time() - cpu
    phase.reporter_cpu = thread_cpu(threads["tqmon-window"]) - reporter_cpu
    phase.poster_cpu = thread_cpu(threads["tqmon-poster"]) - poster_cpu
    phase.posts = reporter.posted - posted
    return phase


def settle(reporter: WindowReporter, poster: EventPoster) -> None:
    """Wait until the plugin's threads are idle: the reporter took the newest view, built and posted its events
    (a build takes a fraction of the seconds waited here), and the poster sent them."""
    assert reporter.flush(30)
    time.sleep(2.0)
    assert poster.flush(30)


def gil_table(seconds: float) -> str:
    """The plugin's GIL time at ``GIL_KEYS`` keys next to the trainer's syncs with and without it."""
    from bench_service import running

    alone, watched = verl_buffer(), verl_buffer()
    totals = {"alone": GilPhase(), "plugin": GilPhase()}
    with tempfile.TemporaryDirectory() as tmp, running(Path(tmp) / "state") as tqmon, verl_listing(GIL_KEYS):
        before = set(threading.enumerate())
        poster = EventPoster(tqmon.url)
        reporter = WindowReporter(poster, "bench/gil")  # the default interval: at most one post a second
        assert watch_replay_buffer(watched, reporter)
        for buffer in (alone, watched):
            buffer._sync_metadata_from_transfer_queue()  # warm: verl's sets hold the window from here on
        settle(reporter, poster)
        threads = {thread.name: thread for thread in set(threading.enumerate()) - before}
        for _ in range(GIL_ROUNDS):
            totals["alone"].add(gil_phase(alone, seconds, reporter, threads))
            totals["plugin"].add(gil_phase(watched, seconds, reporter, threads))
            settle(reporter, poster)  # nothing of this phase spills into the next
        sent, dropped = poster.stats.sent, poster.stats.dropped
    base, plugin = totals["alone"], totals["plugin"]
    per_post = plugin.reporter_cpu / max(plugin.posts, 1)
    rows = [
        (
            "verl syncs per second: alone / with the plugin",
            f"{base.syncs / base.seconds:.2f} / {plugin.syncs / plugin.seconds:.2f}",
            f"{plugin.syncs / plugin.seconds / (base.syncs / base.seconds):.1%}",
        ),
        (
            "trainer thread CPU per sync: alone / with the plugin (ms)",
            f"{base.trainer_cpu / base.syncs * 1e3:.1f} / {plugin.trainer_cpu / plugin.syncs * 1e3:.1f}",
            f"{plugin.trainer_cpu / plugin.syncs / (base.trainer_cpu / base.syncs):.1%}",
        ),
        ("reporter posts per second", f"{plugin.posts / plugin.seconds:.2f}", ""),
        (
            "reporter thread GIL per post (ms)",
            f"{per_post * 1e3:.1f}",
            f"{per_post / (base.trainer_cpu / base.syncs):.1%}",
        ),
        ("reporter thread GIL share of the trainer's wall time", f"{plugin.reporter_cpu / plugin.seconds:.2%}", ""),
        ("poster thread GIL share (JSON + HTTP to tqmon)", f"{plugin.poster_cpu / plugin.seconds:.2%}", ""),
        ("plugin threads' CPU in the phases without it (ms)", f"{(base.reporter_cpu + base.poster_cpu) * 1e3:.1f}", ""),
    ]
    header = f"plugin on the trainer process, {GIL_KEYS:,} keys, {GIL_ROUNDS} x {seconds:g} s per side"
    lines = [f"{header:<60} {'value':>15} {'ratio':>8}"]
    lines += [f"{label:<60} {value:>15} {ratio:>8}" for label, value, ratio in rows]
    lines.append(
        f"(posts to tqmon: {sent} events sent, {dropped} dropped; ratios: with / alone, or / verl's CPU per sync)"
    )
    return "\n".join(lines)


class _Listing:
    """Stands in for ``transfer_queue`` inside verl's replay-buffer module: ``kv_list`` returns one reply."""

    def __init__(self, reply: dict[str, dict[str, Any]]) -> None:
        self._reply = reply

    def kv_list(self, *_: Any) -> dict[str, dict[str, Any]]:
        return self._reply


class _NullSink:
    def post(self, event: object) -> None:
        return None


if __name__ == "__main__":
    main()
