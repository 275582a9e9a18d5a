"""The verl plugin on a verl that renamed what its hooks touch: refused in one line, never raising into verl,
and the sidecar's own kv_list poll takes the window over at once.

The renamed verl is verl 0.9.1's real ``replay_buffer.py`` with exact edits (``tests/verl_release.py``),
running against a real TransferQueue on local Ray; the trainer, its manager and the live tqmon are those of
``tests/test_verl_parity.py``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import tests.verl_release as release
from tests import test_verl_parity
from tests.conftest import TqmonProcess
from tests.test_checkpoint import put_prompts
from tests.test_verl_parity import (
    WINDOW,
    RecordingManager,
    clear_window,
    gauge,
    make_trainer,
    put_trajectories,
    submit_window,
    train_uids,
    verl_config,
)
from tqmon.events import Event
from tqmon.integrations.verl import HOOK, BufferWatch, plugin, watch_replay_buffer
from tqmon.integrations.window import WindowReporter

pytestmark = pytest.mark.parity
cluster = test_verl_parity.cluster  # this module's own Ray cluster and TransferQueue (module-scoped fixture)


class _Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def post(self, event: Event) -> None:
        self.events.append(event)


class _States:
    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def __call__(self, window: str, reason: str) -> None:
        self.said.append((window, reason))


def test_a_renamed_parameter_called_by_keyword_never_raises_from_a_wrapper(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    tq = cluster
    clear_window(tq)
    uids = [uuid.uuid4().hex for _ in range(3)]
    put_prompts(tq, uids, 5, "finished")
    put_trajectories(tq, uids, 5)
    buffer: Any = release.replay_buffer(release.RENAMED_PARAMETER)
    states, sink = _States(), _Sink()
    reporter = WindowReporter(sink, "r/s", interval=0.0)
    caplog.set_level("WARNING", logger="tqmon.integrations")

    # The plugin sees the signature differ from its pin and wraps nothing: verl's call by keyword is verl's alone.
    assert watch_replay_buffer(buffer, reporter, states) is False
    assert states.said[0][0] == "refused" and "prompt_uids" in states.said[0][1]
    batch, _ = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    taken = {key.split("_")[0] for key in batch.keys}
    assert len(batch.keys) == len(taken) == 2 and train_uids(tq) == set(uids) - taken

    # Even past that check (a wrapper on the renamed method), the call by keyword runs verl's method and
    # returns its batch; tqmon's part fails on binding the pinned name, so the hook comes off and says so.
    watch = BufferWatch(buffer, reporter, states)
    watch.hook("_materialize_batch", watch.after_materialize)
    batch, _ = buffer.sample(global_steps=6, partition_id="train", batch_size=1)
    assert len(batch.keys) == 1 and train_uids(tq) == set()  # verl took the last group and cleared its key
    assert "_materialize_batch" not in vars(buffer) and watch.state == "failed"
    assert states.said[-1] == ("failed", "_materialize_batch: KeyError: 'selected_prompt_uids'")
    failures = [r for r in caplog.records if "hook failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert sink.events == []


def test_a_verl_that_renamed_a_hooked_method_is_refused_and_the_kv_list_poll_takes_over(
    cluster: Any,
    tmp_path: Path,
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import ray

    tq = cluster
    clear_window(tq)
    # Fast polls, but the default 600 s cross-check and 300 s --stale-after: without the plugin's word the poll
    # would hold for minutes after the plugin stopped.
    fast = ["--tq-min-interval", "0.2", "--tq-max-interval", "0.5", "--tq-budget", "1"]
    tqmon = tqmon_factory(["--ray-address", ray.get_runtime_context().gcs_address, *fast]).start()
    monkeypatch.setenv("TQMON_URL", tqmon.url)

    def tq_state() -> tuple[dict[str, Any], float]:
        status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()
        return status, next(s for s in status["sources"] if s["source"] == "tq")["last_success"] or 0.0

    # verl 0.9.1 as released: the plugin watches the replay buffer and the poll backs off to its cross-check.
    config = verl_config(tmp_path / "released", ())
    trainer = make_trainer(config)
    trainer.agent_loop_manager = RecordingManager.create(config=config, llm_client=None)
    submit_window(tq, trainer, WINDOW, orphans=0, step=5)
    trainer.replay_buffer.get_sampleable_count(6, "train")  # a sync: the plugin posts its window
    deadline = time.monotonic() + 30
    while not tq_state()[0]["tq"]["cross_check"]:
        assert time.monotonic() < deadline, tq_state()[0]
        time.sleep(0.1)
    status, held_since = tq_state()
    assert status["plugin"]["window_reader"] == "reporting" and status["plugin"]["state"] == "reporting"
    assert gauge(tqmon.metrics(), "tqmon_plugin_window_state", state="reporting") == 1

    # The trainer restarts on a verl whose replay buffer calls _materialize_batch something else.
    renamed_config = verl_config(tmp_path / "renamed", ())
    renamed = make_trainer(renamed_config)
    renamed.replay_buffer = release.replay_buffer(release.RENAMED_METHOD, refill_fn=renamed._add_prompts_to_generate)
    renamed.agent_loop_manager = RecordingManager.create(config=renamed_config, llm_client=None)
    renamed.global_steps = 6
    caplog.clear()
    caplog.set_level("WARNING", logger="tqmon.integrations")
    renamed._add_prompts_to_generate(1)  # its first submission: the plugin looks at the buffer, and refuses
    [line] = [r.getMessage() for r in caplog.records if r.name == "tqmon.integrations"]
    assert line.startswith("tqmon: not watching the replay buffer (ReplayBufferAsync): ReplayBufferAsync has no ")
    assert "attribute _materialize_batch. This verl (0.9.1) is not the verl 0.9.1 tqmon's hooks are pinned to" in line
    assert not any(hasattr(value, HOOK) for value in vars(renamed.replay_buffer).values())  # nothing wrapped
    poster = plugin(renamed_config).poster
    assert poster is not None and poster.flush(10)
    refused = time.monotonic()

    # The sidecar drops the plugin's window and polls again at once, not when that window would go stale.
    while tq_state()[1] <= held_since or gauge(tqmon.metrics(), "tqmon_plugin_window_state", state="kv_list") != 1:
        assert time.monotonic() - refused < 10, tq_state()[0]
        time.sleep(0.1)
    status, _ = tq_state()
    assert status["plugin"]["window_reader"] == "kv_list"
    assert (status["plugin"]["state"], status["plugin"]["reason"]) == ("refused", line)
    assert status["tq"]["cross_check"] is False
    assert {w["source"] for w in status["windows"]} == {"tq"}
    assert "replay_buffer" not in {s["source"] for s in status["sources"]}
    metrics = tqmon.metrics()
    assert gauge(metrics, "tqmon_plugin_window_state", state="reporting") == 0
    train = {(w["source"], w["partition"]): w for w in status["windows"]}[("tq", "train")]
    assert train["by_status"] == {"pending": 3, "running": 1, "finished": 6, "failure": 1}  # WINDOW and the new one
    page = httpx.get(tqmon.url + "/", timeout=5).text
    assert 'data-reader="kv_list"' in page and '<b data-k="plugin-state">refused</b>' in page

    # verl's renamed code runs untouched: the first sample evicts the failure group, refills it, takes a batch.
    batch, _ = renamed.replay_buffer.sample(global_steps=6, partition_id="train", batch_size=4)
    assert len({key.split("_")[0] for key in batch.keys}) == 4


def test_a_verl_trainer_without_the_replay_buffer_attribute_is_refused_by_name(
    cluster: Any,
    tmp_path: Path,
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tq = cluster
    clear_window(tq)
    tqmon = tqmon_factory().start()
    monkeypatch.setenv("TQMON_URL", tqmon.url)
    config = verl_config(tmp_path, ())
    trainer = make_trainer(config)
    trainer.sampler = vars(trainer).pop("replay_buffer")  # verl's trainer as a release calling it `sampler`
    trainer.global_steps = 1
    trainer.agent_loop_manager = RecordingManager.create(config=config, llm_client=None)
    caplog.set_level("WARNING", logger="tqmon.integrations")
    trainer._add_prompts_to_generate(2)  # verl's own submission path: dispatched whatever tqmon makes of it
    trainer._add_prompts_to_generate(1)  # looked at once only
    assert len(train_uids(tq)) == 3
    [line] = [r.getMessage() for r in caplog.records if r.name == "tqmon.integrations"]
    assert line.startswith(
        "tqmon: not watching the replay buffer: PPOTrainerColocateAsync has no attribute replay_buffer."
    )
    assert not any(hasattr(value, HOOK) for value in vars(trainer.sampler).values())
    poster = plugin(config).poster
    assert poster is not None and poster.flush(10)
    status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()
    changed_at = status["plugin"].pop("changed_at")
    assert status["plugin"] == {"window_reader": "unobserved", "state": "refused", "reason": line}
    assert abs(changed_at - time.time()) < 30  # the plugin's event has no time of its own: its receipt
    assert gauge(tqmon.metrics(), "tqmon_plugin_window_state", state="unobserved") == 1
