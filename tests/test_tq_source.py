"""The live TransferQueue source against a real controller on a local Ray cluster.

This test process plays the trainer: it owns the cluster, calls ``tq.init``/``tq.close`` and puts
verl-shaped keys. ``tqmon serve --ray-address`` runs as a real subprocess that joins the cluster.

The window put in ``fill_window`` (trainer step unknown to tqmon, so the newest tag, 12, stands in):

    pending 2 (g=12) · running 1 (g=12) · finished 3 (g=11), 1 (g=8) · failure 1 (g=4)   -> 8 groups
    ages 0: 3, 1: 3, 4: 1, 8: 1 -> buckets le0 3, le1 6, le2 6, le4 7, le8 8, ... sum 3 + 4 + 8 = 15
    trajectories: 2 per finished group (8) + 1 of a running group + 2 orphans = 11; val: 1 prompt
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import sample_value
from tests.test_checkpoint import prompt_fields, put_prompts, put_trajectories
from tqmon.snapshot import TQPollView
from tqmon.sources.tq import PollBudget, PollerProcess, PollSettings, TQSource, windows_from
from tqmon.store import StateStore
from tqmon.tracker import Tracker

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

BUDGET = 0.2  # generous, so the test polls often; the default 1% is exercised in test_poll_budget_*
FAST = ["--tq-min-interval", "0.2", "--tq-max-interval", "0.5", "--tq-timeout", "2", "--tq-budget", str(BUDGET)]
TRAIN = 'partition="train"'


def uid(i: int) -> str:
    return uuid.UUID(int=1000 + i).hex


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster with no TransferQueue yet; yields its GCS address."""
    import ray

    context: Any = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        import transfer_queue as tq

        tq.close()
        ray.shutdown()


def tq_init() -> Any:
    import transfer_queue as tq
    from omegaconf import OmegaConf

    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 500}}}))
    return tq


def fill_window(tq: Any) -> None:
    p = [uid(i) for i in range(8)]
    put_prompts(tq, p[0:2], 12, "pending")
    put_prompts(tq, p[2:3], 12, "running")
    put_prompts(tq, p[3:6], 11, "finished")
    put_prompts(tq, p[6:7], 8, "finished")
    put_prompts(tq, p[7:8], 4, "failure")
    put_trajectories(tq, [f"{u}_0_{i}" for u in p[3:7] for i in range(2)], 11)
    put_trajectories(tq, [f"{p[2]}_0_0"], 12)
    put_trajectories(tq, [f"{uid(100 + i)}_0_0" for i in range(2)], 10)  # their prompt keys are gone
    tq.kv_batch_put(
        keys=[uid(50)],
        partition_id="val",
        tags=[{"is_prompt": True, "status": "pending", "global_steps": 12}],
        fields=prompt_fields(1),
    )


def named_actors() -> set[tuple[str, str]]:
    import ray

    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


def controller_id() -> str:
    import ray

    return str(ray.get_actor("TransferQueueController", namespace="transfer_queue")._actor_id.hex())


def wait_for(proc: Any, check: Callable[[str], bool], timeout: float = 30.0) -> str:
    """The first exposition for which ``check`` holds."""
    deadline = time.monotonic() + timeout
    text: str = ""
    while time.monotonic() < deadline:
        text = proc.metrics()
        if check(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout}s; last exposition:\n{text}")


def value(text: str, series: str) -> float | None:
    return sample_value(text, series)


def test_waits_for_a_controller_reads_the_window_and_follows_loss_and_return(
    cluster: str, tqmon_factory, tmp_path: Path
) -> None:
    before = named_actors()
    log = tmp_path / "trainer.log"
    log.write_text("")
    proc = tqmon_factory(["--ray-address", cluster, "--log", str(log), "--log-interval", "0.2", *FAST]).start()

    # No controller yet: tqmon waits, reads down, counts the failure and creates nothing.
    text = wait_for(proc, lambda t: (value(t, 'tqmon_source_errors_total{reason="unavailable",source="tq"}') or 0) >= 2)
    assert value(text, 'tqmon_source_up{source="tq"}') == 0
    assert "tqmon_window_prompt_groups{" not in text
    assert named_actors() == before
    status = httpx.get(proc.url + "/api/v1/status").json()
    tq_health = next(s for s in status["sources"] if s["source"] == "tq")
    assert "no TransferQueueController actor" in tq_health["last_error"]

    tq = tq_init()
    first = controller_id()
    fill_window(tq)
    # kv_batch_put registers its keys before it sets their tags, so a poll can land in between: wait for
    # the poll that saw the last put (the val prompt) tagged.
    val_pending = 'tqmon_window_prompt_groups{partition="val",status="pending"}'
    text = wait_for(proc, lambda t: value(t, "tqmon_tq_reply_keys") == 8 + 11 + 1 and value(t, val_pending) == 1)
    assert value(text, 'tqmon_source_up{source="tq"}') == 1
    assert {
        s: value(text, f'tqmon_window_prompt_groups{{{TRAIN},status="{s}"}}')
        for s in ("pending", "running", "finished", "failure")
    } == {"pending": 2, "running": 1, "finished": 4, "failure": 1}
    assert value(text, f"tqmon_window_trajectories{{{TRAIN}}}") == 11
    assert value(text, f"tqmon_window_orphan_trajectories{{{TRAIN}}}") == 2
    assert value(text, 'tqmon_window_orphan_trajectories{partition="val"}') == 0
    buckets = {
        le: value(text, f'tqmon_window_prompt_group_age_steps_bucket{{le="{le}"}}')
        for le in ("0.0", "1.0", "2.0", "4.0", "8.0", "+Inf")
    }
    assert buckets == {"0.0": 3, "1.0": 6, "2.0": 6, "4.0": 7, "8.0": 8, "+Inf": 8}
    assert value(text, "tqmon_window_prompt_group_age_steps_gsum") == 15
    assert value(text, "tqmon_tq_controller_epochs_total") == 1
    interval = value(text, "tqmon_tq_poll_interval_seconds")
    busy = value(text, "tqmon_tq_controller_busy_ratio")
    assert interval is not None and busy is not None
    assert 0.2 <= interval < 0.5  # the fast end after a new controller, unless the budget needs longer
    assert 0 < busy <= BUDGET

    # The trainer moves on: tqmon follows (a running group finished, two trajectories arrived).
    tq.kv_batch_put(keys=[uid(2)], partition_id="train", tags=[{"status": "finished"}])
    text = wait_for(proc, lambda t: value(t, f'tqmon_window_prompt_groups{{{TRAIN},status="finished"}}') == 5)
    assert value(text, f'tqmon_window_prompt_groups{{{TRAIN},status="running"}}') == 0

    # The controller goes away: down within one timeout, and its window is not served as fresh.
    lost = time.monotonic()
    tq.close()
    text = wait_for(proc, lambda t: value(t, 'tqmon_source_up{source="tq"}') == 0, timeout=15)
    assert time.monotonic() - lost < 2 + 1 + 2  # timeout + interval + scrape slack
    assert "tqmon_window_prompt_groups{" not in text
    assert "tqmon_window_prompt_group_age_steps_bucket" not in text
    assert value(text, "tqmon_tq_reply_keys") is None

    # A new controller (a restarted trainer) is a new epoch; tqmon reads it and never made one itself.
    tq = tq_init()
    assert controller_id() != first
    put_prompts(tq, [uid(200)], 13, "pending")
    text = wait_for(proc, lambda t: value(t, "tqmon_tq_controller_epochs_total") == 2)
    # (A key whose put is still in flight can be listed before its tag arrives: wait for the tag.)
    text = wait_for(proc, lambda t: value(t, f'tqmon_window_prompt_groups{{{TRAIN},status="pending"}}') == 1)
    assert value(text, "tqmon_tq_reply_keys") == 1
    assert value(text, f"tqmon_window_trajectories{{{TRAIN}}}") == 0
    assert value(text, 'tqmon_source_up{source="tq"}') == 1

    # The log then reports the resume: the new controller is evidence of that start, next to the log's.
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    log.write_text(f"INFO:{now},000:Resuming from /ckpt/global_step_12, setting global step to 12\n")
    wait_for(proc, lambda t: value(t, "tqmon_resumes_total") == 1)
    record = httpx.get(proc.url + "/api/v1/status").json()["records"][-1]
    assert [(e["source"], e["event_type"]) for e in record["evidence"]] == [
        ("tq", "controller_started"),
        ("log", "training_started"),
    ]


def test_attaching_polling_and_dying_leave_the_trainer_untouched(cluster: str, tqmon_factory) -> None:
    import transfer_queue as tq

    tq.close()
    tq = tq_init()
    fill_window(tq)
    keys = tq.kv_list("train")["train"]
    actor, actors = controller_id(), named_actors()

    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = tqmon_factory(["--ray-address", cluster, *FAST]).start()
        wait_for(proc, lambda t: value(t, "tqmon_tq_reply_keys") == 20)
        time.sleep(1)  # several polls
        proc.kill(sig)
        assert proc.proc is not None and proc.proc.returncode == -sig  # uvicorn re-raises SIGTERM after shutdown
        if sig == signal.SIGTERM:
            assert "Application shutdown complete" in proc.log_path.read_text()
        # Same controller, same keys and tags, data still readable, no actor added or removed.
        assert controller_id() == actor
        assert tq.kv_list("train")["train"] == keys
        data = tq.kv_batch_get(keys=[uid(0)], partition_id="train")
        assert data["input_ids"][0].tolist() == [1, 1, 1, 1]
        assert named_actors() == actors
        # The trainer's own calls still work after the sidecar died mid-session.
        put_prompts(tq, [uid(300 + sig)], 13, "pending")
        tq.kv_clear(keys=[uid(300 + sig)], partition_id="train")


def test_poll_budget_keeps_the_controller_share_under_the_budget() -> None:
    budget = PollBudget(PollSettings(budget=0.01, min_interval=1.0, max_interval=15.0, fast_period=300.0))
    assert budget.interval(now=0.0) == 15.0  # steady, nothing measured yet
    budget.record(0.002)  # a 2 ms kv_list: 0.2 s would do, the bounds decide
    assert budget.interval(now=0.0) == 15.0
    budget.hurry(now=100.0)
    assert budget.interval(now=150.0) == 1.0  # fast after a resume ...
    assert budget.interval(now=400.1) == 15.0  # ... for fast_period seconds
    budget.record(0.5)  # smoothed cost 0.3 * 0.5 + 0.7 * 0.002 = 0.1514 s
    assert budget.cost == pytest.approx(0.1514)
    assert budget.interval(now=150.0) == pytest.approx(15.14)  # the budget wins over the fast end ...
    assert budget.interval(now=500.0, last_cost=0.3) == pytest.approx(30.0)  # ... and over max_interval
    share = budget.busy_ratio(budget.interval(now=500.0))
    assert share is not None and share < 0.01


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"budget": 0.0}, "--tq-budget must be in (0, 1]"),
        ({"budget": 1.5}, "--tq-budget must be in (0, 1]"),
        ({"min_interval": 0.0}, "need 0 < --tq-min-interval <= --tq-max-interval"),
        ({"min_interval": 20.0}, "need 0 < --tq-min-interval <= --tq-max-interval"),
        ({"fast_period": -1.0}, "--tq-fast-period must not be negative"),
    ],
)
def test_poll_budget_rejects_settings_that_cannot_work(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PollSettings(**fields).validate()


def test_a_budget_stretched_interval_keeps_the_source_up_and_its_window_fresh(tmp_path: Path) -> None:
    """At 1M keys kv_list takes ~5 s, so the 1% budget polls every ~9 min: data stays fresh until 3 polls fail."""
    now = 1_000_000.0
    tracker = Tracker(StateStore(None), stale_after=300.0, clock=lambda: now)
    budget = PollBudget(PollSettings(budget=0.01, min_interval=1.0, max_interval=15.0))
    source = TQSource(tracker, PollerProcess("127.0.0.1:1", timeout=5.0), budget)
    budget.record(5.4)
    interval = budget.interval(now)
    assert interval == pytest.approx(540.0)
    assert source.kv_list_timeout() == pytest.approx(16.2)  # --tq-timeout 5 would cut every 1M-key poll short
    horizon = source.horizon(interval)
    assert horizon == pytest.approx(3 * 540.0 + 16.2)

    reply = {"train": {uid(1): {"is_prompt": True, "status": "pending", "global_steps": 3}}}
    windows, keys = windows_from(reply, None, now, horizon)
    tracker.observe_windows(windows, TQPollView("c", 1, interval, budget.busy_ratio(interval), keys, None))
    tracker.source_succeeded("tq", 5.4, stale_after=horizon)
    later = now + interval + 60  # past --stale-after (300 s) and the next poll's due time, before horizon
    snapshot = tracker.snapshot
    assert [w.partition for w in snapshot.fresh_windows(later)] == ["train", "val"]
    assert next(s for s in snapshot.sources if s.source == "tq").up(later)
    assert not next(s for s in snapshot.sources if s.source == "tq").up(now + horizon + 1)
    assert snapshot.fresh_windows(now + horizon + 1) == ()


TRAINER = """
import os, sys, time
import ray, transfer_queue as tq
from omegaconf import OmegaConf
context = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 100}}}))
tq.kv_batch_put(keys=["p0"], partition_id="train", tags=[{"is_prompt": True, "status": "pending", "global_steps": 3}])
print(context.address_info["gcs_address"], flush=True)
time.sleep(3600)
"""


def test_the_whole_cluster_going_away_costs_the_poller_not_tqmon(tmp_path: Path, tqmon_factory) -> None:
    """A preempted node takes its Ray cluster along; Ray then ends every driver, which must not be tqmon."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert trainer.stdout is not None
        address = trainer.stdout.readline().strip()
        log = tmp_path / "trainer.log"
        log.write_text("")
        # Ray ends a driver 60 s after losing its GCS; 5 s here so the poller process dies within the test.
        env = {"RAY_gcs_rpc_server_reconnect_timeout_s": "5", "RAY_AUTH_MODE": "token"}
        args = ["--ray-address", address, "--log", str(log), "--log-interval", "0.2", *FAST]
        proc = tqmon_factory(args, env=env).start()
        wait_for(proc, lambda t: value(t, f'tqmon_window_prompt_groups{{{TRAIN},status="pending"}}') == 1)
        os.killpg(trainer.pid, signal.SIGKILL)  # the trainer and its whole Ray cluster
        text = wait_for(proc, lambda t: value(t, 'tqmon_source_up{source="tq"}') == 0)
        assert "tqmon_window_prompt_groups{" not in text
        time.sleep(15)  # past Ray's reconnect timeout: the poller process has been ended at least once
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_path.read_text()[-2000:]
        now = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write_text(f"INFO:{now},000:Resuming from /ckpt/global_step_3, setting global step to 3\n")
        text = wait_for(proc, lambda t: value(t, "tqmon_resumes_total") == 1)  # the other sources carry on
        assert value(text, 'tqmon_source_up{source="log"}') == 1
        assert value(text, 'tqmon_source_up{source="tq"}') == 0
        unavailable = value(text, 'tqmon_source_errors_total{reason="unavailable",source="tq"}') or 0
        timeouts = value(text, 'tqmon_source_errors_total{reason="timeout",source="tq"}') or 0
        assert unavailable + timeouts >= 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)


def test_a_fresh_plugin_window_turns_the_poll_into_a_cross_check_and_back(cluster: str, tqmon_factory) -> None:
    import transfer_queue as tq

    tq.close()
    tq = tq_init()
    fill_window(tq)
    proc = tqmon_factory(["--ray-address", cluster, *FAST, "--stale-after", "3"]).start()
    wait_for(proc, lambda t: value(t, "tqmon_tq_reply_keys") == 20)

    def feed(n: int) -> None:
        """The verl plugin's window, as it posts it after a replay-buffer sync."""
        window = {
            "id": f"p/window/train/{n}",
            "type": "window_observed",
            "time": time.time(),
            "by_status": {"pending": 2, "running": 1, "finished": 4, "failure": 1},
            "observer": "replay_buffer",
        }
        assert httpx.post(proc.url + "/api/v1/events", json=window, timeout=5).status_code == 200

    def tq_state() -> tuple[dict[str, Any], float]:
        status = httpx.get(proc.url + "/api/v1/status", timeout=5).json()
        return status["tq"], next(s for s in status["sources"] if s["source"] == "tq")["last_success"]

    feed(0)
    deadline = time.monotonic() + 10
    while not tq_state()[0]["cross_check"] and time.monotonic() < deadline:
        time.sleep(0.1)
    poll, held_since = tq_state()
    assert poll["cross_check"] is True and poll["interval"] == 600
    for n in range(1, 5):  # two seconds fed, ten polls at the 0.2 s pace: none happens before the cross-check
        feed(n)
        time.sleep(0.5)
    assert tq_state()[1] == held_since
    text = proc.metrics()
    assert value(text, 'tqmon_source_up{source="tq"}') == 1  # backing off on purpose is not being down
    assert value(text, 'tqmon_source_up{source="replay_buffer"}') == 1
    assert value(text, "tqmon_tq_poll_interval_seconds") == 600

    # The plugin goes quiet: its window goes stale after --stale-after and polling resumes at the usual pace.
    text = wait_for(proc, lambda t: value(t, 'tqmon_source_up{source="replay_buffer"}') == 0, timeout=10)
    deadline = time.monotonic() + 10
    while tq_state()[1] == held_since and time.monotonic() < deadline:
        time.sleep(0.1)
    poll, resumed = tq_state()
    assert resumed > held_since and poll["cross_check"] is False
