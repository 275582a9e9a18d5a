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
  ``WindowReporter.synced`` on the trainer's thread (counts by status and step, copies of the key sets), and
  the events with the orphan count that the reporter's thread builds at most once a second.
"""

from __future__ import annotations

import socket
import statistics
import sys
import timeit
import uuid
from collections.abc import Callable
from typing import Any

from tqmon.composition import compose
from tqmon.events import InflightReissued, StepCompleted
from tqmon.integrations.poster import EventPoster
from tqmon.integrations.resume import StartReporter
from tqmon.integrations.verl import classify
from tqmon.integrations.window import WindowReporter, read_buffer
from tqmon.warmup import TrainerConfig

STEP_PATH = ("fit", "step", "prepare_step", "wrapper", "_submit_batch_to_rollout")


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
    print(f"(poster: {poster.stats.enqueued:,} enqueued, {poster.stats.dropped:,} dropped as tqmon was away)")
    print()
    print(window_table())


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
    from bench_tq_poll import key_and_tag
    from verl.trainer.ppo.v1 import replay_buffer as verl_replay_buffer

    reply = {"train": dict(key_and_tag(i) for i in range(size)), "val": {}}
    buffer = verl_replay_buffer.ReplayBufferAsync(
        trainer_mode="colocate_async",
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
    )
    listing = verl_replay_buffer.tq
    verl_replay_buffer.tq = _Listing(reply)  # verl's own method, fed the prepared reply
    try:
        verl = per_call_ns(buffer._sync_metadata_from_transfer_queue, 3)
    finally:
        verl_replay_buffer.tq = listing
    reporter = WindowReporter(_NullSink(), "bench/window", interval=3600.0)  # posts once, then waits
    synced = per_call_ns(lambda: reporter.synced(buffer), 10)
    views = [read_buffer(buffer, partition, 0.0) for partition in ("train", "val")]
    events = per_call_ns(lambda: [view.event("bench/w") for view in views], 5)
    return verl / 1e6, synced / 1e6, events / 1e6


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
