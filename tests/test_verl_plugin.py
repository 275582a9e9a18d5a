"""The verl plugin's parts without a trainer: delivery, submission classification, and what the tracker
makes of one start reported through two doors (verl's log and the plugin), and of the verl version."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TqmonProcess, free_port
from tqmon.composition import compose
from tqmon.events import Event, GroupCount, SelfHealDecided, WarmupDecided, parse_event
from tqmon.integrations.logs import RateLimitedLog
from tqmon.integrations.poster import EventPoster
from tqmon.integrations.resume import StartReporter
from tqmon.integrations.selfheal import decide, self_heal_settings
from tqmon.store import StateStore
from tqmon.tracker import Tracker
from tqmon.warmup import TrainerConfig, WarmupState, plan_top_up, version_semantics

CONFIG = {"train_batch_size": 4, "num_warmup_batches": 2}  # T = 8


def ev(kind: str, eid: str, **fields: Any) -> Event:
    return parse_event({"type": kind, "id": eid, **fields})


# ---------------------------------------------------------------- delivery


def test_poster_delivers_batches_to_a_live_tqmon(tqmon_factory: Callable[..., TqmonProcess]) -> None:
    tqmon = tqmon_factory(["--token", "s3cret"]).start()
    poster = EventPoster(tqmon.url, "s3cret")
    for step in (11, 12, 13):
        poster.post(ev("step_completed", f"r/step/{step}", global_step=step))
    assert poster.flush(10)
    assert (poster.stats.sent, poster.stats.dropped) == (3, 0)
    status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()
    assert status["trainer_step"] == 13


def test_poster_drops_and_counts_when_tqmon_is_away(caplog: pytest.LogCaptureFixture) -> None:
    slept: list[float] = []
    poster = EventPoster(f"http://127.0.0.1:{free_port()}", retry_delays=(0.5, 2.0), sleep=slept.append)
    poster.post(ev("step_completed", "r/step/1", global_step=1))  # returns at once, never raises
    assert poster.flush(10)
    assert (poster.stats.sent, poster.stats.dropped) == (0, 1)
    assert slept == [0.5, 2.0]  # retried, then dropped
    assert "dropped 1 event(s), 1 in total" in caplog.text


def test_poster_does_not_retry_a_refusal(tqmon_factory: Callable[..., TqmonProcess]) -> None:
    tqmon = tqmon_factory(["--token", "s3cret"]).start()
    slept: list[float] = []
    poster = EventPoster(tqmon.url, "wrong", sleep=slept.append)
    poster.post(ev("step_completed", "r/step/1", global_step=1))
    assert poster.flush(10)
    assert (poster.stats.dropped, slept) == (1, [])
    assert poster.stats.last_error is not None and "HTTP 401" in poster.stats.last_error


def test_poster_drops_when_its_queue_is_full() -> None:
    poster = EventPoster(f"http://127.0.0.1:{free_port()}", capacity=1, retry_delays=(60.0,), sleep=lambda _: None)
    poster._thread = object()  # type: ignore[assignment]  # no sender: the queue only fills
    poster.post(ev("step_completed", "r/step/1", global_step=1))
    poster.post(ev("step_completed", "r/step/2", global_step=2))
    assert (poster.stats.enqueued, poster.stats.dropped) == (1, 1)


# ---------------------------------------------------------------- what a submission is


def _classify_from(*names: str) -> str:
    """Call ``classify`` at the bottom of a chain of functions named like verl's (outermost first)."""
    from tqmon.integrations.verl import classify

    namespace: dict[str, Any] = {"classify": classify, "sys": sys}
    exec("def _bottom():\n    return classify(sys._getframe(0))\n", namespace)
    inner = "_bottom"
    for name in reversed(names):
        exec(f"def {name}():\n    return {inner}()\n", namespace)
        inner = name
    result: str = namespace[inner]()
    return result


@pytest.mark.parametrize(
    ("stack", "kind"),
    [
        (("fit", "_reissue_inflight_prompts"), "reissue"),
        (("fit", "on_train_begin", "_add_async_warmup_batches", "_add_prompts_to_generate"), "warmup"),
        (("fit", "on_train_begin", "_add_batch_to_generate", "wrapper"), "warmup"),  # verl 0.9.0's warmup
        (("fit", "step", "prepare_step", "wrapper", "_submit_batch_to_rollout"), "step"),
        (("fit", "step", "_step_once", "sample", "wait_for_sampleable", "_add_prompts_to_generate"), "refill"),
        (("fit", "step", "prepare_step", "wait_for_sampleable", "_add_prompts_to_generate"), "refill"),
        (("fit", "_validate"), "validation"),
        (("fit", "_resubmit_inflight", "_submit_batch_to_rollout"), "unknown"),  # a renamed re-issue
        (("main", "my_rollout_loop"), "unknown"),  # a custom trainer's own path
    ],
)
def test_submissions_are_classified_by_verls_functions_on_the_stack(stack: tuple[str, ...], kind: str) -> None:
    pytest.importorskip("verl")
    assert _classify_from(*stack) == kind


class _Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def post(self, event: Event) -> None:
        self.events.append(event)


def test_the_warmup_is_measured_and_decided_by_the_first_step_batch() -> None:
    sink = _Sink()
    reporter = StartReporter(sink, "r/s", TrainerConfig(**CONFIG), "colocate_async")
    window = compose({"a": {"is_prompt": True, "status": "running", "global_steps": 9}, "a_0_0": {}})
    reporter.started(9, "/ckpt/global_step_9", window)
    reporter.submitted("reissue", 1)
    reporter.submitted("warmup", 5)
    reporter.submitted("warmup", 2)
    reporter.submitted("step", 4)
    reporter.submitted("refill", 1)
    types = [event.type for event in sink.events]
    assert types == ["training_started", "checkpoint_restored", "inflight_reissued", "warmup_decided"]
    decided = sink.events[-1]
    assert isinstance(decided, WarmupDecided)
    assert (decided.restored_prompt_groups, decided.submitted_prompt_groups, decided.skip_reason) == (1, 7, None)
    assert dict(reporter.submissions) == {"reissue": 1, "warmup": 7, "step": 4, "refill": 1}


def test_an_unknown_submission_does_not_end_the_warmup_count() -> None:
    sink = _Sink()
    reporter = StartReporter(sink, "r/s", TrainerConfig(**CONFIG), "colocate_async")
    reporter.started(9, "/ckpt/global_step_9", compose({}))
    reporter.submitted("warmup", 5)
    reporter.submitted("unknown", 3)  # through no pinned verl function: not the step's batch
    reporter.submitted("warmup", 2)  # the warmup is still counted
    assert [event.type for event in sink.events] == ["training_started", "checkpoint_restored"]
    reporter.submitted("step", 4)
    reporter.submitted("refill", 1)
    assert dict(reporter.submissions) == {"warmup": 7, "unknown": 3, "step": 4, "refill": 1}
    # The unknown submission may have been the re-issue or part of the warmup: neither K = 0 nor M = 7 is a
    # measured fact, so the plugin reports no decision (verl's own log line still does).
    assert [event.type for event in sink.events] == ["training_started", "checkpoint_restored"]


def test_an_unknown_submission_after_the_decision_changes_nothing() -> None:
    sink = _Sink()
    reporter = StartReporter(sink, "r/s", TrainerConfig(**CONFIG), "colocate_async")
    reporter.started(None, None, None)
    reporter.submitted("warmup", 8)
    reporter.submitted("step", 4)
    reporter.submitted("unknown", 2)
    decided = sink.events[-1]
    assert isinstance(decided, WarmupDecided) and decided.submitted_prompt_groups == 8
    assert [event.type for event in sink.events] == ["training_started", "warmup_decided"]


@pytest.mark.parametrize(
    ("config", "skip_reason"),
    [
        ({}, "window_full"),
        ({"num_warmup_batches": 0}, "non_positive_warmup"),
        ({"skip_rollout_tq": True}, "skip_rollout_tq"),
    ],
)
def test_a_warmup_that_submitted_nothing_says_why(config: dict[str, Any], skip_reason: str) -> None:
    sink = _Sink()
    reporter = StartReporter(sink, "r/s", TrainerConfig(**(CONFIG | config)), "colocate_async")
    reporter.started(9, None, compose({}))
    reporter.submitted("step", 4)
    reissued, decided = sink.events[-2:]
    assert reissued.type == "inflight_reissued" and getattr(reissued, "reissued_prompt_groups", None) == 0
    assert isinstance(decided, WarmupDecided) and decided.skip_reason == skip_reason


# ---------------------------------------------------------------- one start, two doors


LOG = [
    ev("training_started", "log:1", resumed_from_step=10),
    ev("checkpoint_restored", "log:2", restored_prompt_groups=6),
    ev("inflight_reissued", "log:3", step=11, reissued_prompt_groups=2, cleared_trajectories=1),
    ev("warmup_decided", "log:4", target_prompt_groups=8, restored_prompt_groups=6, submitted_prompt_groups=2),
]
PLUGIN = [
    ev("training_started", "p/start", resumed_from_step=10),
    ev(
        "checkpoint_restored",
        "p/restore",
        step=10,
        restored_prompt_groups=6,
        groups=[
            {"status": "running", "global_steps": 10, "count": 2},
            {"status": "finished", "global_steps": 10, "count": 3},
            {"status": "failure", "global_steps": 9, "count": 1},
        ],
    ),
    ev("inflight_reissued", "p/reissue", step=11, reissued_prompt_groups=2, cleared_trajectories=1),
    ev("warmup_decided", "p/warmup", restored_prompt_groups=6, submitted_prompt_groups=2),
]


@pytest.mark.parametrize("log_first", [True, False])
def test_one_start_reported_by_the_log_and_the_plugin_is_one_record(log_first: bool) -> None:
    t = Tracker(StateStore(None))
    first, second = (LOG, PLUGIN) if log_first else (PLUGIN, LOG)
    t.ingest(first, "log" if log_first else "events")
    t.ingest(second, "events" if log_first else "log")
    [record] = t.snapshot.records
    assert (record.restored, record.reissued, record.target, record.submitted) == (6, 2, 8, 2)
    assert record.restored_by_status == {"pending": 0, "running": 2, "finished": 3, "failure": 1}
    assert record.warmup_state is WarmupState.TOPPED_UP
    assert len(record.evidence) == 8


def test_a_second_start_from_the_same_door_is_a_new_record() -> None:
    t = Tracker(StateStore(None))
    t.ingest(LOG, "log")
    t.ingest([ev(e.type, e.id + "b", **e.model_dump(exclude={"id", "type", "time"})) for e in LOG], "log")
    assert [r.checkpoint_step for r in t.snapshot.records] == [10, 10]


# ---------------------------------------------------------------- which semantics


@pytest.mark.parametrize(
    ("version", "semantics"),
    [
        ("0.9.0", "verl-0.9.0"),
        ("0.9.0rc1", "verl-0.9.0"),
        ("0.8.5", "verl-0.9.0"),
        ("0.9.1", "verl-0.9.1"),
        ("0.10.0", "verl-0.9.1"),
        ("", None),  # no release named: unknown, not assumed
        ("main", None),
    ],
)
def test_verl_versions_before_0_9_1_are_legacy(version: str, semantics: str | None) -> None:
    assert version_semantics(version) == semantics


@pytest.mark.parametrize(("version", "semantics"), [("0.9.0", "verl-0.9.0"), ("0.9.1", "verl-0.9.1")])
def test_run_started_verl_version_names_the_semantics(version: str, semantics: str, tmp_path: Path) -> None:
    t = Tracker(StateStore(tmp_path / "state.db"))
    run = ev("run_started", "run", run_id="r", trainer_mode="colocate_async", verl_version=version, config=CONFIG)
    fresh = [
        ev("training_started", "s"),
        ev("warmup_decided", "w", restored_prompt_groups=0, submitted_prompt_groups=8),
    ]
    t.ingest([run, *fresh], "events")
    [record] = t.snapshot.records
    assert (record.semantics, record.warmup_state) == (semantics, WarmupState.FRESH_START)


def test_the_legacy_log_line_means_0_9_0_whatever_the_version_says() -> None:
    t = Tracker(StateStore(None))
    run = ev("run_started", "run", run_id="r", trainer_mode="colocate_async", verl_version="0.9.1", config=CONFIG)
    t.ingest([run, *LOG[:3], ev("warmup_decided", "log:5", legacy_warmup_batches=2)], "log")
    [record] = t.snapshot.records
    assert (record.semantics, record.submitted, record.warmup_state) == (
        "verl-0.9.0",
        8,
        WarmupState.LEGACY_UNCONDITIONAL,
    )


# ---------------------------------------------------------------- the pinned verl


def test_every_pin_matches_the_installed_verl(tmp_path: Path) -> None:
    """A verl upgrade that renames, moves or re-signs anything the plugin touches fails here, not in a run."""
    verl = pytest.importorskip("verl")
    import tomllib

    from tests.test_verl_parity import make_trainer, verl_config
    from tqmon.integrations import pins

    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert f"verl=={pins.VERL_VERSION}" in extra["verl"]  # the version tests run against is the pinned one
    assert verl.__version__ == pins.VERL_VERSION

    trainer = make_trainer(verl_config(tmp_path, ()))  # instance attributes exist on instances only
    instances = {pins.TRAINER: trainer, pins.REPLAY_BUFFER: trainer.replay_buffer}
    assert type(trainer.replay_buffer).__name__ == "ReplayBufferAsync"
    for pin in pins.ALL:
        owner = pins.resolve(pin)  # the class is still where the pin says
        target = instances.get(pin.owner, owner) if pin.parameters is None else owner
        assert pins.difference(pin, target) is None, pin
        if pin.parameters is not None:  # the same seen from an instance, the way the plugin checks it
            assert pins.difference(pin, instances.get(pin.owner, owner)) is None, pin
    assert {pin.name for pin in pins.ALL} >= {"_sync_metadata_from_transfer_queue", "_materialize_batch"}


def test_a_difference_from_a_pin_is_named() -> None:
    pytest.importorskip("verl")
    from tests.verl_release import RENAMED_ATTRIBUTE, RENAMED_METHOD, RENAMED_PARAMETER, replay_buffer
    from tqmon.integrations import pins

    assert pins.differences(replay_buffer(RENAMED_METHOD), pins.REPLAY_BUFFER_PINS) == [
        "ReplayBufferAsync has no attribute _materialize_batch"
    ]
    assert pins.differences(replay_buffer(RENAMED_ATTRIBUTE), pins.REPLAY_BUFFER_PINS) == [
        "ReplayBufferAsync has no attribute prompt_global_steps"
    ]
    assert pins.differences(replay_buffer(RENAMED_PARAMETER), pins.REPLAY_BUFFER_PINS) == [
        "ReplayBufferAsync._materialize_batch(partition_id, prompt_uids, partition_snapshot) differs from the "
        "pinned _materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)"
    ]


class _States:
    """What the plugin tells the sidecar about its window reporting."""

    def __init__(self) -> None:
        self.said: list[tuple[str, str]] = []

    def __call__(self, window: str, reason: str) -> None:
        self.said.append((window, reason))


@pytest.mark.parametrize(
    ("edits", "missing"),
    [("RENAMED_METHOD", "_materialize_batch"), ("RENAMED_ATTRIBUTE", "prompt_global_steps")],
)
def test_a_verl_with_a_renamed_hook_target_is_refused_in_one_clear_line(
    edits: str, missing: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("verl")
    import tests.verl_release as release
    from tqmon.integrations.verl import HOOK, watch_replay_buffer
    from tqmon.integrations.window import WindowReporter

    buffer = release.replay_buffer(getattr(release, edits))
    states = _States()
    caplog.set_level("WARNING", logger="tqmon.integrations")
    assert watch_replay_buffer(buffer, WindowReporter(_Sink(), "r/s"), states) is False
    [line] = [r.getMessage() for r in caplog.records if r.name == "tqmon.integrations"]
    assert f"ReplayBufferAsync has no attribute {missing}" in line
    assert "is not the verl 0.9.1 tqmon's hooks are pinned to" in line and "kv_list" in line
    assert "not a verl replay buffer" not in caplog.text
    assert states.said == [("refused", line)]
    assert not any(hasattr(value, HOOK) for value in vars(buffer).values())  # nothing wrapped


def test_a_wrapper_passes_verls_own_error_through_and_stays(caplog: pytest.LogCaptureFixture) -> None:
    """A call verl itself refuses raises verl's error, unchanged; tqmon's part never ran, so nothing failed."""
    pytest.importorskip("verl")
    from tests.test_plugin_window import buffer_after_sync
    from tqmon.integrations.verl import HOOK, BufferWatch
    from tqmon.integrations.window import WindowReporter

    buffer = buffer_after_sync({})
    states = _States()
    watch = BufferWatch(buffer, WindowReporter(_Sink(), "r/s"), states)
    assert watch.install()
    with pytest.raises(TypeError) as raised:
        buffer._materialize_batch("train", selected=[], partition_snapshot={})
    assert "_materialize_batch() got an unexpected keyword argument 'selected'" in str(raised.value)
    assert getattr(vars(buffer)["_materialize_batch"], HOOK) is not None and watch.state == "reporting"
    assert [window for window, _ in states.said] == ["reporting"]
    wrapper = vars(buffer)["_materialize_batch"]
    assert wrapper.__name__ == "_materialize_batch" and wrapper.__module__ == "tqmon.integrations.verl"
    assert not hasattr(wrapper, "__wrapped__")  # inspect and tracebacks see tqmon's wrapper, not verl's method
    assert "tqmon" not in caplog.text


def test_a_failure_on_the_reporters_thread_unwraps_and_reports_failed(caplog: pytest.LogCaptureFixture) -> None:
    """verl's sets no longer as pinned (a prompt key without global_steps): the hook comes off at once."""
    pytest.importorskip("verl")
    from tests.test_plugin_window import buffer_after_sync
    from tqmon.integrations.verl import BufferWatch
    from tqmon.integrations.window import WindowReporter

    buffer = buffer_after_sync({"a" * 32: {"is_prompt": True, "status": "pending", "global_steps": 3}})
    buffer.running_keys["train"].add("b" * 32)  # no prompt_global_steps entry
    sink, states = _Sink(), _States()
    reporter = WindowReporter(sink, "r/s", interval=0.0)
    watch = BufferWatch(buffer, reporter, states)
    assert watch.install()
    reporter.synced(buffer)  # what the sync's hook does after verl's sync
    deadline = time.monotonic() + 5
    while watch.state != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.state == "failed"
    assert "_sync_metadata_from_transfer_queue" not in vars(buffer) and "_materialize_batch" not in vars(buffer)
    assert [window for window, _ in states.said] == ["reporting", "failed"]
    assert states.said[-1][1].startswith("the window reporter's thread: KeyError")
    assert sink.events == []  # nothing posted, and nothing will be
    reporter.synced(buffer)
    assert reporter.offered == 1
    [record] = [r for r in caplog.records if r.name == "tqmon.integrations"]
    assert record.exc_info is not None and "verl's methods are restored" in record.getMessage()


def test_the_rate_limited_log_says_the_first_in_full_then_once_a_minute_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from tqmon.integrations.logs import RateLimitedLog

    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("tqmon.test"), every=60.0, clock=lambda: now[0])
    err = KeyError("global_steps")
    assert limited.warning("hook failed", exc_info=err)
    for _ in range(5):  # every sync within the minute: counted, not logged
        now[0] += 10
        assert not limited.warning("hook failed", exc_info=err)
    now[0] += 11  # 61 s after the first line
    assert limited.warning("hook failed", exc_info=err)
    first, second = [r for r in caplog.records if r.name == "tqmon.test"]
    assert (first.getMessage(), first.exc_info is not None) == ("hook failed", True)
    assert second.getMessage() == "hook failed (7 times so far; at most one line every 60 s)"
    assert second.exc_info is None


def test_the_docs_table_lists_every_pin() -> None:
    from tqmon.integrations import pins

    doc = (Path(__file__).parents[1] / "docs" / "verl.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `verl.")]
    stated = [row.split(" | ")[:3] for row in rows]
    expected = [
        [f"| `{pin.owner}`", f"`{pin.name}`", f"`{pin.parameters}`" if pin.parameters else "instance attribute"]
        for pin in pins.ALL
    ]
    assert stated == expected
    assert f"The hooks are written against verl **{pins.VERL_VERSION}**" in doc


# ---------------------------------------------------------------- the self-heal's decision, without a trainer

HEAL = {"train_batch_size": 4, "num_warmup_batches": 3, "max_off_policy_threshold": 3}  # T = 12
# R = 9 at global_step_10: failure 1, stale 2 (global_steps 5 at the sample of step 11), finished 4, in flight 2.
HEAL_GROUPS = [
    GroupCount(status="pending", global_steps=10, count=1),
    GroupCount(status="running", global_steps=10, count=1),
    GroupCount(status="finished", global_steps=10, count=4),
    GroupCount(status="finished", global_steps=5, count=2),
    GroupCount(status="failure", global_steps=10, count=1),
]


def heal_decision(mode: str, submit: Callable[[int], object], **config: Any) -> tuple[SelfHealDecided, RateLimitedLog]:
    """What the plugin decides and posts for HEAL_GROUPS after a warmup of M = 3; ``measured`` is the groups
    ``submit`` was asked for, as generate_sequences would count them."""
    sink, asked = _Sink(), []
    failures = RateLimitedLog(logging.getLogger("tqmon.integrations"))

    def counted(n: int) -> object:
        asked.append(n)
        return submit(n)

    warmup = TrainerConfig(**{**HEAL, **config}).warmup_config("colocate_async")
    event = decide(sink, "r/s/self_heal", mode, None, warmup, HEAL_GROUPS, 10, 3, counted, lambda: sum(asked), failures)  # type: ignore[arg-type]
    assert sink.events == [event]
    return event, failures


def test_the_self_heal_submits_exactly_the_derived_deficit() -> None:
    event, _ = heal_decision("on", lambda n: n)
    # max(0, 12 - (9 - 3 + 3)) = 3, doomed by tqmon's one classification.
    assert event.doomed_prompt_groups == {"failure": 1, "stale": 2, "filtered": 0}
    assert (event.deficit_prompt_groups, event.deficit_exact) == (3, True)
    assert (event.planned_prompt_groups, event.submitted_prompt_groups, event.max_top_up) == (3, 3, 12)
    dry, _ = heal_decision("dry-run", lambda n: pytest.fail("dry-run submitted"))
    assert (dry.planned_prompt_groups, dry.submitted_prompt_groups) == (3, 0)
    assert dry.reason == "would submit 3: deficit 3"


def test_a_lower_bound_submits_only_its_known_part_and_says_so() -> None:
    # DAPO on without any group judged filtered: `filtered` is not known, the known deficit is still 3.
    event, _ = heal_decision("on", lambda n: n, filter_groups=True)
    assert event.deficit_exact is False and "filtered" not in event.doomed_prompt_groups
    assert event.submitted_prompt_groups == 3
    assert "a lower bound: doomed filtered not known" in event.reason


def test_the_warmup_off_tops_up_nothing() -> None:
    for off in ({"num_warmup_batches": 0}, {"skip_rollout_tq": True}):
        event, _ = heal_decision("on", lambda n: pytest.fail("submitted with the warmup off"), **off)
        assert (event.planned_prompt_groups, event.submitted_prompt_groups) == (0, 0)
        assert "the warmup is off" in event.reason


def test_the_cap_and_the_fetch_size_only_lower_the_top_up() -> None:
    warmup = TrainerConfig(**HEAL).warmup_config("colocate_async")
    doomed = {"failure": 1, "stale": 2, "filtered": 0}
    assert plan_top_up(warmup, 9, doomed, 3, 2).planned == 2
    assert "capped at max_top_up 2" in plan_top_up(warmup, 9, doomed, 3, 2).reason
    sync_chunks = TrainerConfig(**{**HEAL, "gen_batch_size": 2}).warmup_config("colocate_async")
    assert sync_chunks.effective_gen_batch_size == 1  # verl forces 1 in async modes: nothing to round


def test_a_failing_top_up_is_logged_counted_and_reported_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    def broken(n: int) -> object:
        raise RuntimeError("dataloader exhausted")

    with caplog.at_level(logging.WARNING, "tqmon.integrations"):
        event, failures = heal_decision("on", broken)
    assert failures.count == 1
    assert event.reason.startswith("failed submitting 3: RuntimeError: dataloader exhausted")
    assert event.submitted_prompt_groups == 3  # what reached the submission before it failed, as measured
    assert "verl goes on without it" in caplog.text


@pytest.mark.parametrize(
    ("override", "env", "expected"),
    [
        (None, None, ("off", None)),
        (None, "dry-run", ("dry-run", None)),
        ({"self_heal": "on", "self_heal_max_top_up": 5}, "dry-run", ("on", 5)),
        ({"self_heal": "sometimes"}, None, ("off", None)),
        ({"self_heal": "on", "self_heal_max_top_up": -1}, None, ("off", None)),
    ],
)
def test_the_self_heal_mode_comes_from_the_override_then_the_environment(
    override: dict[str, Any] | None, env: str | None, expected: tuple[str, int | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omegaconf import OmegaConf

    config = OmegaConf.create({"trainer": {}} if override is None else {"trainer": {}, "tqmon": override})
    OmegaConf.set_struct(config, True)  # verl's config is a struct: a missing section must read as absent
    if env is None:
        monkeypatch.delenv("TQMON_SELF_HEAL", raising=False)
    else:
        monkeypatch.setenv("TQMON_SELF_HEAL", env)
    monkeypatch.delenv("TQMON_SELF_HEAL_MAX_TOP_UP", raising=False)
    assert self_heal_settings(config) == expected


def test_sync_mode_and_another_verl_refuse_the_self_heal_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import verl

    from tqmon.integrations.verl import heal_refusal

    assert heal_refusal("colocate_async") is None
    line = heal_refusal("sync")
    assert line is not None and "\n" not in line and "sync" in line
    monkeypatch.setattr(verl, "__version__", "0.9.0")
    line = heal_refusal("colocate_async")
    assert line is not None and "\n" not in line and "(0.9.0)" in line and "0.9.1" in line
