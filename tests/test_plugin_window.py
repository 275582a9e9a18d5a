"""The plugin-fed window without a cluster: the reporter's rate limit, what it reads from verl's replay buffer,
the tracker's handling of the window (a source of its own, live, newest wins) and the TQ poll's back-off rule.

The replay buffer is verl 0.9.1's real ``ReplayBufferAsync``; its sets are filled here the way its sync fills
them (the sync itself needs TransferQueue: ``tests/test_verl_parity.py`` runs it against a real one).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tqmon.composition import compose
from tqmon.events import Event, WindowObserved, parse_event
from tqmon.integrations.window import WindowReporter, read_buffer
from tqmon.service import ConfigError, ServiceConfig
from tqmon.snapshot import Tally
from tqmon.sources.tq import PollSettings, poll_delay
from tqmon.store import StateStore
from tqmon.tracker import Tracker

STATUSES = ("pending", "running", "finished", "failure")


class _Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.posted = threading.Event()

    def post(self, event: Event) -> None:
        self.events.append(event)
        self.posted.set()


def buffer_after_sync(tags: dict[str, dict[str, Any]], partition: str = "train") -> Any:
    """verl's replay buffer holding what its ``_sync_metadata_from_transfer_queue`` makes of ``tags``."""
    pytest.importorskip("verl")
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    buffer = ReplayBufferAsync(
        trainer_mode="colocate_async",
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
    )
    for key, tag in tags.items():  # the body of verl's sync loop
        if tag.get("is_prompt", False):
            buffer.prompt_global_steps[partition][key] = tag["global_steps"]
            getattr(buffer, f"{tag['status']}_keys")[partition].add(key)
        else:
            buffer.partitions[partition].setdefault(key, {}).update(tag)
    return buffer


def window_tags() -> dict[str, dict[str, Any]]:
    """Prompt groups of every status at steps 7..9, one trajectory each for the started ones, two orphans."""
    tags: dict[str, dict[str, Any]] = {}
    for i in range(12):
        uid, status, step = f"{i:032x}", STATUSES[i % 4], 7 + i % 3
        tags[uid] = {"is_prompt": True, "status": status, "global_steps": step}
        if status != "pending":
            tags[f"{uid}_0_0"] = {"status": "success", "global_steps": step}
    tags[f"{99:032x}_0_0"] = tags[f"{98:032x}_0_1"] = {"status": "success", "global_steps": 6}
    return tags


def test_the_reported_window_is_the_composition_of_the_same_keys() -> None:
    tags = window_tags()
    view = read_buffer(buffer_after_sync(tags), "train", at=1.0)
    event = view.event("r/window/train/0")
    want = compose(tags)
    assert event.by_status == want.by_status
    assert {(g.status, g.global_steps): g.count for g in event.groups or []} == dict(want.groups)
    assert (event.trajectories, event.orphan_trajectories) == (want.trajectories, want.orphan_trajectories) == (11, 2)
    assert event.observer == "replay_buffer"


def test_after_a_sample_the_taken_prompts_are_gone_and_their_trajectories_orphaned() -> None:
    tags = window_tags()
    buffer = buffer_after_sync(tags)
    taken = sorted(buffer.finished_keys["train"])[:2]
    event = read_buffer(buffer, "train", at=1.0, removed=taken).event("r/w")
    left = {k: t for k, t in tags.items() if k not in taken}  # what kv_list shows after verl's kv_clear
    assert event.by_status == compose(left).by_status
    assert event.by_status["finished"] == 1
    assert (event.trajectories, event.orphan_trajectories) == (11, 4)
    assert "val" not in buffer.pending_keys  # read without adding entries to verl's defaultdicts


def test_posts_are_rate_limited_and_the_latest_sync_wins() -> None:
    sink = _Sink()
    reporter = WindowReporter(sink, "r/s", interval=0.4)
    tags = window_tags()
    buffer = buffer_after_sync(tags)
    reporter.synced(buffer)
    assert sink.posted.wait(5)
    for i in range(5):  # five syncs inside one interval: only the last is posted
        buffer.pending_keys["train"].add(f"new{i}")
        buffer.prompt_global_steps["train"][f"new{i}"] = 10
        reporter.synced(buffer)
    started = time.monotonic()
    assert reporter.flush(5)
    deadline = time.monotonic() + 5
    while len(sink.events) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() - started >= 0.2  # the second post waited for the interval
    assert (reporter.offered, reporter.posted) == (6, 2)
    trains = [e for e in sink.events if isinstance(e, WindowObserved) and e.partition == "train"]
    assert [e.by_status["pending"] for e in trains] == [3, 8]
    assert len({e.id for e in sink.events}) == 4


def test_a_buffer_that_cannot_be_read_raises_to_the_hooks_guard_and_offers_nothing() -> None:
    reporter = WindowReporter(_Sink(), "r/s")
    with pytest.raises(AttributeError, match="prompt_global_steps"):
        reporter.synced(object())  # the plugin's hook catches it and takes itself off (test_verl_plugin.py)
    assert reporter.offered == 0


def test_a_stopped_reporter_drops_its_waiting_view_and_takes_no_more() -> None:
    sink = _Sink()
    reporter = WindowReporter(sink, "r/s", interval=3600.0)
    buffer = buffer_after_sync(window_tags())
    reporter.synced(buffer)
    assert sink.posted.wait(5) and reporter.flush(5)
    reporter.synced(buffer)  # waits an hour for its turn
    reporter.stop()
    reporter.synced(buffer)
    assert reporter.flush(1)  # nothing is waiting any more
    assert (reporter.offered, reporter.posted, len(sink.events)) == (2, 1, 2)


def plugin_window(eid: str, at: float, pending: int, steps: int = 9) -> Event:
    return parse_event(
        {
            "id": eid,
            "type": "window_observed",
            "time": at,
            "by_status": {"pending": pending, "running": 0, "finished": 1, "failure": 0},
            "groups": [
                {"status": "pending", "global_steps": steps, "count": pending},
                {"status": "finished", "global_steps": 2, "count": 1},
            ],
            "trajectories": 3,
            "orphan_trajectories": 1,
            "observer": "replay_buffer",
        }
    )


def test_the_plugin_window_is_a_live_source_with_ages_and_is_not_stored(tmp_path: Path) -> None:
    now = [1000.0]
    tracker = Tracker(StateStore(tmp_path), stale_after=60, clock=lambda: now[0])
    tracker.ingest([parse_event({"id": "s", "type": "step_completed", "global_step": 10})], "events")
    tracker.ingest([plugin_window("w/1", 1000.0, pending=2)], "events")
    snapshot = tracker.snapshot
    [window] = snapshot.fresh_windows(1000.0)
    assert (window.source, window.trajectories, window.orphan_trajectories) == ("replay_buffer", 3, 1)
    assert dict(window.by_status) == {"pending": 2, "running": 0, "finished": 1, "failure": 0}
    # ages against the trainer step 10: two groups of age 1, one of age 8
    assert window.age_sum == 2 * 1 + 8
    assert dict(window.age_buckets or ()) == {0.0: 0, 1.0: 2, 2.0: 2, 4.0: 2, 8.0: 3, 16.0: 3, 32.0: 3, 64.0: 3,
                                              float("inf"): 3}  # fmt: skip
    health = {s.source: s for s in snapshot.sources}["replay_buffer"]
    assert health.up(1000.0) and not health.up(1061.0)
    assert snapshot.window_fresh_until("replay_buffer") == 1060.0
    assert snapshot.counters[Tally.EVENTS][("events", "applied")] == 2

    restarted = Tracker(StateStore(tmp_path), stale_after=60, clock=lambda: now[0])
    assert restarted.replay() == 1  # the step, not the live window
    assert restarted.snapshot.windows == ()
    assert restarted.snapshot.counters[Tally.EVENTS][("events", "applied")] == 2


def test_each_source_keeps_its_newest_window_and_the_newest_is_served() -> None:
    tracker = Tracker(StateStore(None), stale_after=60)
    tracker.ingest([plugin_window("w/2", 2000.0, pending=5)], "events")
    tracker.ingest([plugin_window("w/1", 1990.0, pending=4)], "events")  # a retried older post
    log_window = parse_event(
        {"id": "l", "type": "window_observed", "time": 1995.0, "by_status": {"pending": 7, "running": 0,
                                                                              "finished": 0, "failure": 0}}
    )  # fmt: skip
    tracker.ingest([log_window], "log")
    snapshot = tracker.snapshot
    assert {(w.source, w.by_status["pending"]) for w in snapshot.windows} == {("replay_buffer", 5), ("log", 7)}
    [served] = snapshot.fresh_windows(2001.0)
    assert (served.source, served.by_status["pending"]) == ("replay_buffer", 5)


def test_a_window_whose_groups_disagree_with_its_counts_is_rejected() -> None:
    with pytest.raises(ValueError, match="disagrees with groups"):
        parse_event(
            {
                "id": "w",
                "type": "window_observed",
                "by_status": {"pending": 1, "running": 0, "finished": 0, "failure": 0},
                "groups": [{"status": "running", "global_steps": 1, "count": 1}],
            }
        )


@pytest.mark.parametrize(
    ("now", "last", "interval", "fed_until", "cross_check", "delay"),
    [
        (100.0, 95.0, 15.0, None, 600.0, 10.0),  # no plugin: the budget's interval
        (100.0, 95.0, 15.0, 99.0, 600.0, 10.0),  # its window went stale: polling resumes at once
        (100.0, 95.0, 15.0, 400.0, 600.0, 300.0),  # fed: wait, but wake when its window would go stale
        (100.0, 95.0, 15.0, 9000.0, 600.0, 595.0),  # fed: the next cross-check
        (100.0, 95.0, 15.0, 9000.0, 0.0, 10.0),  # back-off switched off
        (100.0, 95.0, 30.0, 9000.0, 10.0, 25.0),  # a cross-check never polls faster than the budget allows
        (100.0, 0.0, 15.0, 9000.0, 60.0, 0.0),  # a cross-check is due
    ],
)
def test_the_poll_backs_off_to_a_cross_check_while_the_plugin_feeds_the_window(
    now: float, last: float, interval: float, fed_until: float | None, cross_check: float, delay: float
) -> None:
    assert poll_delay(now, last, interval, fed_until, cross_check) == pytest.approx(delay)


def test_a_negative_cross_check_interval_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="--tq-cross-check-interval must not be negative, got -1"):
        ServiceConfig(tq=PollSettings(cross_check_interval=-1.0)).validate()


def plugin_state(eid: str, window: str, at: float, reason: str = "") -> Event:
    return parse_event({"id": eid, "type": "plugin_state_changed", "time": at, "window": window, "reason": reason})


@pytest.mark.parametrize("stopped", ["refused", "failed", "off"])
def test_a_plugin_that_stops_reporting_drops_its_window_and_wakes_the_poll(stopped: str, tmp_path: Path) -> None:
    from tqmon.exporters.values import metric_values
    from tqmon.snapshot import SourceName, TQPollView

    now = [1000.0]
    announced: list[str] = []
    tracker = Tracker(StateStore(tmp_path), stale_after=60, clock=lambda: now[0], announce=announced.append)
    woken: list[str] = []
    tracker.on_plugin_stopped(lambda: woken.append("poll"))

    def reader() -> str:
        values = {spec.name: series for spec, series in metric_values(tracker.snapshot, now[0])}
        [current] = [s.labels[0] for s in values["tqmon_plugin_window_state"] if s.value == 1]  # type: ignore[union-attr]
        return current

    assert reader() == "unobserved"  # no plugin, no --ray-address
    tracker.observe_windows((), TQPollView("c1", 1, 600.0, 0.001, 20, None, cross_check=True))  # --ray-address
    assert reader() == "kv_list"
    log = parse_event({"id": "l", "type": "window_observed", "time": 999.0, "by_status": {"pending": 7}})
    tracker.ingest([log], "log")
    tracker.ingest([plugin_state("p/0", "reporting", 999.0), plugin_window("w/1", 1000.0, pending=2)], "events")
    assert (reader(), tracker.window_fresh_until(SourceName.REPLAY_BUFFER), woken) == ("reporting", 1060.0, [])

    tracker.ingest([plugin_state("p/1", stopped, 1001.0, f"the plugin {stopped}")], "events")
    snapshot = tracker.snapshot
    assert woken == ["poll"]  # the TQ poll need not wait until 1060 for the plugin's window to go stale
    assert tracker.window_fresh_until(SourceName.REPLAY_BUFFER) is None
    assert [(w.source, w.by_status["pending"]) for w in snapshot.windows] == [("log", 7)]  # other sources stay
    assert "replay_buffer" not in {s.source for s in snapshot.sources}  # gone on purpose, not down
    assert snapshot.plugin is not None and (snapshot.plugin.window, snapshot.plugin.reason) == (
        stopped,
        f"the plugin {stopped}",
    )
    assert reader() == "kv_list"
    assert (
        announced[-1]
        == f"verl plugin: {stopped}, the window is not reported from the replay buffer: the plugin {stopped}"
    )

    tracker.ingest([plugin_window("w/2", 1002.0, pending=3)], "events")  # a view it had queued before it stopped
    assert [w.source for w in tracker.snapshot.windows] == ["log"] and reader() == "kv_list"
    assert "replay_buffer" not in {s.source for s in tracker.snapshot.sources}

    restarted = Tracker(StateStore(tmp_path), stale_after=60, clock=lambda: now[0])
    restarted.replay()  # the state is stored: a restarted tqmon still ignores a plugin that stopped
    assert restarted.snapshot.plugin == snapshot.plugin

    tracker.ingest([plugin_state("p2/0", "reporting", 1003.0), plugin_window("w2/1", 1003.0, pending=4)], "events")
    assert reader() == "reporting" and woken == ["poll"]
    now[0] = 1064.0  # its window went stale: the poll reads the window again
    assert reader() == "kv_list"
