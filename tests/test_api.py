"""The HTTP service over real HTTP against ``tqmon serve`` subprocesses: every event type (single and
batched), idempotency, auth, each kind of bad input, health/readiness/OpenAPI/content negotiation,
persistence across ``kill -9``, and the examples of ``docs/events.md``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TqmonProcess, free_port, sample_value
from tqmon.catalog import REJECT_REASONS
from tqmon.events import EVENT_TYPE_NAMES

Factory = Callable[..., TqmonProcess]
EVENTS_DOC = Path(__file__).resolve().parent.parent / "docs" / "events.md"
T0 = 1_700_000_000  # 2023-11-14T22:13:20Z
MAX_BODY = 2048
NOT_UTC = {"TZ": "XXX-5:30"}  # a local zone 5h30 east of UTC: a naive `time` must still read as UTC

# ---------------------------------------------------------------- a resume from global_step_10, T = 12

RUN: dict[str, Any] = {
    "id": "run-a/run",
    "type": "run_started",
    "time": T0 - 10,
    "run_id": "run-a",
    "trainer_mode": "colocate_async",
    "verl_version": "0.9.1",
    "config": {"train_batch_size": 4, "num_warmup_batches": 3},  # async: gbs = 1, so T = 3 * 4 = 12
}
START: dict[str, Any] = {
    "id": "run-a/start/10",
    "type": "training_started",
    "time": T0,
    "resumed_from_step": 10,
    "checkpoint_path": "/ckpt/run-a/global_step_10",
}
RESTORE: dict[str, Any] = {
    "id": "run-a/restore/10",
    "type": "checkpoint_restored",
    "time": "2023-11-14T22:13:21Z",  # T0 + 1
    "step": 10,
    "restored_prompt_groups": 6,
    "by_status": {"pending": 2, "running": 1, "finished": 2, "failure": 1},
}
REISSUE: dict[str, Any] = {
    "id": "run-a/reissue/11",
    "type": "inflight_reissued",
    "time": "2023-11-14T22:13:22",  # no offset: UTC, T0 + 2
    "step": 11,
    "reissued_prompt_groups": 3,
    "cleared_trajectories": 5,
}
WARMUP: dict[str, Any] = {
    "id": "run-a/warmup/11",
    "type": "warmup_decided",
    "time": "2023-11-14T23:13:23+01:00",  # T0 + 3
    "target_prompt_groups": 12,
    "restored_prompt_groups": 6,
    "submitted_prompt_groups": 6,
}
HEAL: dict[str, Any] = {  # the plugin's self-heal in dry-run: recorded, nothing submitted
    "id": "run-a/self_heal/11",
    "type": "self_heal_decided",
    "time": T0 + 4,
    "mode": "dry-run",
    "target_prompt_groups": 12,
    "restored_prompt_groups": 6,
    "doomed_prompt_groups": {"failure": 1, "filtered": 0},  # stale is not known: the deficit is a lower bound
    "warmup_prompt_groups": 6,
    "deficit_prompt_groups": 1,
    "deficit_exact": False,
    "max_top_up": 12,
    "planned_prompt_groups": 1,
    "submitted_prompt_groups": 0,
    "reason": "would submit 1: deficit 1 (a lower bound: doomed stale not known)",
}
STEP: dict[str, Any] = {
    "id": "run-a/step/11",
    "type": "step_completed",
    "time": T0 + 60,
    "global_step": 11,
    "evicted_prompt_groups": {"failure": 1},
    "generation_wait_seconds": 2.5,
    "step_seconds": 50.0,
}
SAVE: dict[str, Any] = {
    "id": "run-a/save/12",
    "type": "checkpoint_saved",
    "time": T0 + 120,
    "step": 12,
    "path": "/ckpt/run-a/global_step_12",
    "by_status": {"pending": 4, "running": 4, "finished": 4},
}
WINDOW: dict[str, Any] = {  # no time: a window is live data, served only while fresh (received now)
    "id": "run-a/window/12",
    "type": "window_observed",
    "partition": "train",
    "by_status": {"pending": 5, "running": 4, "finished": 2},
}
PLUGIN: dict[str, Any] = {  # the verl plugin met a verl that differs from its pins: it wraps nothing
    "id": "run-a/plugin/0",
    "type": "plugin_state_changed",
    "time": T0 + 121,
    "window": "refused",
    "reason": "ReplayBufferAsync has no attribute _materialize_batch",
}
RESUME: list[dict[str, Any]] = [RUN, START, RESTORE, REISSUE, WARMUP, HEAL, STEP, SAVE, WINDOW, PLUGIN]
assert {e["type"] for e in RESUME} == EVENT_TYPE_NAMES

# R = 6 (1 failure, stale unknown with the default threshold 8 and no per-step composition), M = 6:
# under_submitted = max(0, 12 - (6 - 1 + 6)) = 1.
RESUME_RECORD: dict[str, Any] = {
    "index": 0,
    "resumed": True,
    "started_at": T0,
    "run_id": "run-a",
    "checkpoint_step": 10,
    "restored": 6,
    "restored_by_status": {"pending": 2, "running": 1, "finished": 2, "failure": 1},
    "reissued": 3,
    "cleared_trajectories": 5,
    "target": 12,
    "expected": 6,
    "submitted": 6,
    "over_restored": 0,
    "over_filled": 0,  # R + M - T: 6 + 6 - 12
    "doomed": {"failure": 1, "filtered": 0},
    "under_submitted": 1,
    "warmup_state": "topped_up",
    "semantics": "verl-0.9.1",
    "first_step_evictions": {"failure": 1, "stale": 0, "filtered": 0},
    "first_step_generation_wait_seconds": 2.5,
    # The restore gave statuses, not the groups' steps: stale is unknown, so the deficit is a lower bound.
    "under_submitted_lower_bound": True,
    "assumed_defaults": [],
    "disagreements": [],  # the plugin said R twice alike, and T and M as the config predicts them
    "compared": ["restored", "target", "submitted"],  # K and the split only the plugin said; no window before the step
    # No trainer activity before this start and stale unknown: only the time to the first step is known,
    # from the warmup decision at T0 + 3 and the step's own 50 s; the restore was reported: no window lost.
    "cost": {
        "steps_lost": None,
        "downtime_seconds": None,
        "time_to_first_step_seconds": 53.0,
        "wasted_rollouts": None,
        "lost_prompt_groups": 0,
    },
    "step_regressions": [],  # the first start: nothing saved before it; step 11 after a resume from 10
    "self_heal": {
        "mode": "dry-run",
        "target": 12,
        "restored": 6,
        "doomed": {"failure": 1, "filtered": 0},
        "warmup_submitted": 6,
        "deficit": 1,
        "deficit_exact": False,
        "max_top_up": 12,
        "planned": 1,
        "submitted": 0,
        "reason": "would submit 1: deficit 1 (a lower bound: doomed stale not known)",
        "event_id": "run-a/self_heal/11",
    },
    "verdict": "UNDER-SUBMITTED by at least 1 (doomed stale not known)",
}
RESUME_EVIDENCE = [
    ("events", "training_started", START["id"], T0),
    ("events", "checkpoint_restored", RESTORE["id"], T0 + 1),
    ("events", "inflight_reissued", REISSUE["id"], T0 + 2),
    ("events", "warmup_decided", WARMUP["id"], T0 + 3),
    ("events", "self_heal_decided", HEAL["id"], T0 + 4),
    ("events", "step_completed", STEP["id"], T0 + 60),
]
RESUME_SERIES: dict[str, float | None] = {
    'tqmon_run_info{run_id="run-a",trainer_mode="colocate_async",verl_version="0.9.1"}': 1,
    "tqmon_resumes_total": 1,
    "tqmon_last_resume_checkpoint_step": 10,
    "tqmon_last_resume_timestamp_seconds": T0,
    'tqmon_resume_restored_prompt_groups{status="pending"}': 2,
    'tqmon_resume_restored_prompt_groups{status="running"}': 1,
    'tqmon_resume_restored_prompt_groups{status="finished"}': 2,
    'tqmon_resume_restored_prompt_groups{status="failure"}': 1,
    'tqmon_resume_restored_prompt_groups{status="unknown"}': None,
    "tqmon_resume_reissued_prompt_groups": 3,
    "tqmon_resume_warmup_target_prompt_groups": 12,
    "tqmon_resume_warmup_expected_prompt_groups": 6,
    "tqmon_resume_warmup_submitted_prompt_groups": 6,
    "tqmon_resume_over_restored_prompt_groups": 0,
    'tqmon_resume_doomed_prompt_groups{reason="failure"}': 1,
    'tqmon_resume_doomed_prompt_groups{reason="stale"}': None,  # unknown, so omitted
    'tqmon_resume_doomed_prompt_groups{reason="filtered"}': 0,
    "tqmon_resume_under_submitted_prompt_groups": 1,  # a dry-run submits nothing: the deficit stays
    'tqmon_resume_self_heal_prompt_groups{mode="dry-run"}': 1,
    'tqmon_resume_self_heal_prompt_groups{mode="on"}': None,
    'tqmon_resume_warmup_state{state="topped_up"}': 1,
    'tqmon_resume_warmup_state{state="unknown"}': 0,
    "tqmon_checkpoint_step": 12,
    'tqmon_checkpoint_prompt_groups{status="finished"}': 4,
    'tqmon_checkpoint_prompt_groups{status="failure"}': 0,
    "tqmon_trainer_global_step": 12,
    "tqmon_window_target_prompt_groups": 12,
    'tqmon_window_prompt_groups{partition="train",status="pending"}': 5,
    'tqmon_window_prompt_groups{partition="train",status="running"}': 4,
    'tqmon_window_prompt_groups{partition="train",status="finished"}': 2,
    'tqmon_window_prompt_groups{partition="train",status="failure"}': 0,
    'tqmon_window_status{status="under_filled"}': 1,  # 11 live < T = 12
    'tqmon_window_status{status="ok"}': 0,
    'tqmon_events_total{outcome="applied",source="events"}': 10,
    # No --ray-address and the plugin refused: nothing reads the window (the posted one came as a plain event).
    'tqmon_plugin_window_state{state="unobserved"}': 1,
    'tqmon_plugin_window_state{state="kv_list"}': 0,
    'tqmon_plugin_window_state{state="reporting"}': 0,
    'tqmon_events_total{outcome="duplicate",source="events"}': 0,
}

# ---------------------------------------------------------------- helpers


def post(proc: TqmonProcess, body: object, *, token: str | None = None) -> httpx.Response:
    """POST a JSON value (or raw bytes, sent as they are) to the event API."""
    headers = {"content-type": "application/json"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(proc.url + "/api/v1/events", content=content, headers=headers, timeout=10)


def post_ok(proc: TqmonProcess, body: object, *, token: str | None = None) -> dict[str, int]:
    response = post(proc, body, token=token)
    assert response.status_code == 200, response.text
    result: dict[str, int] = response.json()
    return result


def status(proc: TqmonProcess, **params: int) -> dict[str, Any]:
    response = httpx.get(proc.url + "/api/v1/status", params=params, timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def state(proc: TqmonProcess) -> dict[str, Any]:
    """The status without the health of the sources (a successful post, even of duplicates, is news there)."""
    return {k: v for k, v in status(proc).items() if k != "sources"}


def assert_series(proc: TqmonProcess, expected: Mapping[str, float | None]) -> None:
    """Each named series has its value in one scrape (None: not exposed)."""
    exposition = proc.metrics()
    assert {name: sample_value(exposition, name) for name in expected} == dict(expected)


def rejected(proc: TqmonProcess) -> dict[str, float | None]:
    exposition = proc.metrics()
    return {r: sample_value(exposition, f'tqmon_events_rejected_total{{reason="{r}"}}') for r in REJECT_REASONS}


def tqmon_series(exposition: str, *, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """Every ``tqmon_*`` sample line (process metrics and volatile-by-nature lines aside)."""
    samples = {}
    for line in exposition.splitlines():
        if line.startswith("tqmon_") and not line.startswith(exclude):
            name, _, value = line.rpartition(" ")
            samples[name] = value
    return samples


def split_record(record: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """A record without its evidence, and the evidence as (source, type, id, at) tuples."""
    fields = {k: v for k, v in record.items() if k != "evidence"}
    evidence = [(e["source"], e["event_type"], e["event_id"], e["at"]) for e in record["evidence"]]
    return fields, evidence


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TQMON_")}


# ---------------------------------------------------------------- every event type


def test_each_event_type_posted_singly_changes_the_state(tqmon_factory: Factory) -> None:
    proc = tqmon_factory(env=NOT_UTC).start()
    empty = status(proc)
    assert (empty["run"], empty["records"], empty["resumes_total"], empty["trainer_step"]) == (None, [], 0, None)
    installed = {"version": "0.9.1", "source": "installed", "semantics": "verl-0.9.1"}  # the venv pins verl 0.9.1
    assert {key: empty["verl_version"][key] for key in installed} == installed
    assert_series(proc, {"tqmon_resumes_total": 0, "tqmon_trainer_global_step": None})
    one = {"accepted": 1, "applied": 1, "duplicates": 0}

    assert post_ok(proc, RUN) == one
    now = status(proc)
    assert now["run"] == {
        "run_id": "run-a",
        "trainer_mode": "colocate_async",
        "verl_version": "0.9.1",
        "config": {
            "train_batch_size": 4,
            "gen_batch_size": None,
            "num_warmup_batches": 3.0,
            "skip_rollout_tq": False,
            "max_off_policy_threshold": 8,
            "max_off_policy_strategy": "drop",
            "filter_groups": False,
            "filter_groups_metric": None,
            "rollout_n": None,
        },
        "config_source": "events",
    }
    assert (now["target_window"], now["records"], now["resumes_total"]) == (12, [], 0)
    told = {"version": "0.9.1", "source": "run_started", "semantics": "verl-0.9.1", "detail": "the verl plugin"}
    assert now["verl_version"] == told  # the plugin's word outranks the installed verl
    assert_series(
        proc,
        {
            'tqmon_run_info{run_id="run-a",trainer_mode="colocate_async",verl_version="0.9.1"}': 1,
            "tqmon_window_target_prompt_groups": 12,
            "tqmon_resumes_total": 0,
            "tqmon_trainer_last_event_timestamp_seconds": T0 - 10,
        },
    )

    assert post_ok(proc, START) == one
    now = status(proc)
    assert (now["resumes_total"], now["records_total"], now["trainer_step"]) == (1, 1, 10)
    fields, evidence = split_record(now["records"][-1])
    assert {k: fields[k] for k in ("resumed", "started_at", "run_id", "checkpoint_step", "target")} == {
        "resumed": True,
        "started_at": T0,
        "run_id": "run-a",
        "checkpoint_step": 10,
        "target": 12,
    }
    assert (fields["restored"], fields["restored_by_status"], fields["expected"]) == (None, None, None)
    assert (fields["reissued"], fields["warmup_state"]) == (None, "unknown")
    assert evidence == RESUME_EVIDENCE[:1]
    assert_series(
        proc,
        {
            "tqmon_resumes_total": 1,
            "tqmon_trainer_global_step": 10,
            "tqmon_last_resume_checkpoint_step": 10,
            "tqmon_last_resume_timestamp_seconds": T0,
            "tqmon_resume_warmup_target_prompt_groups": 12,
            'tqmon_resume_warmup_state{state="unknown"}': 1,
            'tqmon_resume_restored_prompt_groups{status="pending"}': None,
            "tqmon_resume_warmup_expected_prompt_groups": None,
        },
    )

    assert post_ok(proc, RESTORE) == one
    fields, evidence = split_record(status(proc)["records"][-1])
    assert fields["restored"] == 6
    assert fields["restored_by_status"] == {"pending": 2, "running": 1, "finished": 2, "failure": 1}
    assert (fields["expected"], fields["over_restored"], fields["doomed"]) == (6, 0, {"failure": 1, "filtered": 0})
    assert (fields["submitted"], fields["under_submitted"], fields["warmup_state"]) == (None, None, "unknown")
    assert evidence == RESUME_EVIDENCE[:2]
    assert_series(
        proc,
        {
            'tqmon_resume_restored_prompt_groups{status="pending"}': 2,
            'tqmon_resume_restored_prompt_groups{status="failure"}': 1,
            'tqmon_resume_restored_prompt_groups{status="unknown"}': None,
            "tqmon_resume_warmup_expected_prompt_groups": 6,
            "tqmon_resume_over_restored_prompt_groups": 0,
            'tqmon_resume_doomed_prompt_groups{reason="failure"}': 1,
            'tqmon_resume_doomed_prompt_groups{reason="stale"}': None,
            "tqmon_resume_warmup_submitted_prompt_groups": None,
            "tqmon_resumes_total": 1,
        },
    )

    assert post_ok(proc, REISSUE) == one
    fields, evidence = split_record(status(proc)["records"][-1])
    assert (fields["reissued"], fields["cleared_trajectories"]) == (3, 5)
    assert evidence == RESUME_EVIDENCE[:3]
    assert_series(proc, {"tqmon_resume_reissued_prompt_groups": 3})

    assert post_ok(proc, WARMUP) == one
    fields, evidence = split_record(status(proc)["records"][-1])
    assert (fields["submitted"], fields["warmup_state"], fields["under_submitted"]) == (6, "topped_up", 1)
    assert evidence == RESUME_EVIDENCE[:4]
    assert_series(
        proc,
        {
            "tqmon_resume_warmup_submitted_prompt_groups": 6,
            'tqmon_resume_warmup_state{state="topped_up"}': 1,
            'tqmon_resume_warmup_state{state="unknown"}': 0,
            "tqmon_resume_under_submitted_prompt_groups": 1,
        },
    )

    assert post_ok(proc, HEAL) == one
    fields, evidence = split_record(status(proc)["records"][-1])
    heal = fields["self_heal"]
    assert (heal["mode"], heal["deficit"], heal["deficit_exact"], heal["planned"], heal["submitted"]) == (
        "dry-run",
        1,
        False,
        1,
        0,
    )
    assert (heal["target"], heal["restored"], heal["warmup_submitted"], heal["event_id"]) == (12, 6, 6, HEAL["id"])
    assert fields["under_submitted"] == 1  # a dry-run submits nothing
    assert evidence == RESUME_EVIDENCE[:5]
    assert_series(proc, {'tqmon_resume_self_heal_prompt_groups{mode="dry-run"}': 1})

    assert post_ok(proc, STEP) == one
    now = status(proc)
    fields, evidence = split_record(now["records"][-1])
    assert fields["first_step_evictions"] == {"failure": 1, "stale": 0, "filtered": 0}
    assert fields["first_step_generation_wait_seconds"] == 2.5
    assert evidence == RESUME_EVIDENCE
    assert now["trainer_step"] == 11
    assert_series(proc, {"tqmon_trainer_global_step": 11, "tqmon_trainer_last_event_timestamp_seconds": T0 + 60})

    assert post_ok(proc, SAVE) == one
    now = status(proc)
    checkpoint = {k: now["checkpoint"][k] for k in ("step", "source", "by_status")}
    assert checkpoint == {"step": 12, "source": "events", "by_status": {"pending": 4, "running": 4, "finished": 4}}
    assert now["trainer_step"] == 12
    assert split_record(now["records"][-1])[1] == RESUME_EVIDENCE  # a save is not part of the start
    assert_series(
        proc,
        {
            "tqmon_checkpoint_step": 12,
            'tqmon_checkpoint_prompt_groups{status="pending"}': 4,
            'tqmon_checkpoint_prompt_groups{status="failure"}': 0,
            "tqmon_trainer_global_step": 12,
            'tqmon_window_prompt_groups{partition="train",status="pending"}': None,
        },
    )

    assert post_ok(proc, WINDOW) == one
    now = status(proc)
    assert [(w["partition"], w["source"], w["by_status"]) for w in now["windows"]] == [
        ("train", "events", {"pending": 5, "running": 4, "finished": 2})
    ]
    assert now["window_status"] == "under_filled"
    assert now["plugin"] == {"window_reader": "unobserved", "state": None, "reason": None, "changed_at": None}

    assert post_ok(proc, PLUGIN) == one
    now = status(proc)
    assert now["plugin"] == {
        "window_reader": "unobserved",
        "state": "refused",
        "reason": "ReplayBufferAsync has no attribute _materialize_batch",
        "changed_at": T0 + 121,
    }
    assert len(now["windows"]) == 1  # a window not from the plugin stays

    # The whole sequence, event by event, gives the same record and series as one batch does (next test).
    assert (now["resumes_total"], now["records_total"]) == (1, 1)
    assert split_record(now["records"][0]) == (RESUME_RECORD, RESUME_EVIDENCE)
    assert_series(proc, RESUME_SERIES)


def test_resume_sequence_posted_as_one_batch(tqmon_factory: Factory) -> None:
    proc = tqmon_factory(env=NOT_UTC).start()
    assert post_ok(proc, RESUME) == {"accepted": 10, "applied": 10, "duplicates": 0}
    now = status(proc)
    assert (now["resumes_total"], now["records_total"], now["trainer_step"], now["target_window"]) == (1, 1, 12, 12)
    assert split_record(now["records"][0]) == (RESUME_RECORD, RESUME_EVIDENCE)
    assert now["checkpoint"]["step"] == 12
    assert now["window_status"] == "under_filled"
    assert_series(proc, RESUME_SERIES)


def test_doomed_groups_by_reason_and_under_submission(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    config = {"train_batch_size": 4, "num_warmup_batches": 3, "max_off_policy_threshold": 2, "filter_groups": True}
    groups = [  # resumed from global_step_10: the first sample is at step 11, stale if 11 - g + 1 > 2
        {"status": "failure", "global_steps": 9, "count": 2},  # failure
        {"status": "failure", "global_steps": 10, "count": 1, "filtered": True},  # failure beats filtered
        {"status": "finished", "global_steps": 5, "count": 3},  # stale
        {"status": "finished", "global_steps": 9, "count": 1},  # stale: 3 > 2, just
        {"status": "finished", "global_steps": 4, "count": 1, "filtered": True},  # stale beats filtered
        {"status": "finished", "global_steps": 10, "count": 1, "filtered": True},  # filtered: 2 > 2 is false
        {"status": "running", "global_steps": 3, "count": 1},  # in flight: re-issued, never doomed
        {"status": "pending", "global_steps": 10, "count": 1},
    ]  # R = 11, T = 12, M expected = 1; doomed 3 + 5 + 1 = 9
    batch = [
        {"id": "d/run", "type": "run_started", "run_id": "d", "trainer_mode": "separate_async", "config": config},
        {"id": "d/start", "type": "training_started", "resumed_from_step": 10},
        {"id": "d/restore", "type": "checkpoint_restored", "step": 10, "restored_prompt_groups": 11, "groups": groups},
        {"id": "d/reissue", "type": "inflight_reissued", "step": 11, "reissued_prompt_groups": 2},
        {"id": "d/warmup", "type": "warmup_decided", "restored_prompt_groups": 11, "submitted_prompt_groups": 1},
    ]
    assert post_ok(proc, batch) == {"accepted": 5, "applied": 5, "duplicates": 0}
    record = status(proc)["records"][-1]
    assert record["restored_by_status"] == {"pending": 1, "running": 1, "finished": 6, "failure": 3}
    assert (record["restored"], record["target"], record["expected"], record["submitted"]) == (11, 12, 1, 1)
    assert record["doomed"] == {"failure": 3, "stale": 5, "filtered": 1}
    assert record["under_submitted"] == 9  # max(0, 12 - (11 - 9 + 1))
    assert (record["warmup_state"], record["over_restored"], record["reissued"]) == ("topped_up", 0, 2)
    assert_series(
        proc,
        {
            'tqmon_run_info{run_id="d",trainer_mode="separate_async",verl_version=""}': 1,
            'tqmon_resume_doomed_prompt_groups{reason="failure"}': 3,
            'tqmon_resume_doomed_prompt_groups{reason="stale"}': 5,
            'tqmon_resume_doomed_prompt_groups{reason="filtered"}': 1,
            "tqmon_resume_under_submitted_prompt_groups": 9,
            "tqmon_resume_warmup_expected_prompt_groups": 1,
            "tqmon_resume_warmup_submitted_prompt_groups": 1,
            'tqmon_resume_restored_prompt_groups{status="finished"}': 6,
            'tqmon_resume_warmup_state{state="topped_up"}': 1,
        },
    )


def test_fresh_start_then_an_over_restored_resume(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    config = {"train_batch_size": 4, "num_warmup_batches": 3, "max_off_policy_threshold": None}
    fresh = [
        {"id": "f/run", "type": "run_started", "run_id": "f", "trainer_mode": "colocate_async", "config": config},
        {"id": "f/start", "type": "training_started", "resumed_from_step": None},
        {"id": "f/warmup", "type": "warmup_decided", "restored_prompt_groups": 0, "submitted_prompt_groups": 12},
        {"id": "f/step/1", "type": "step_completed", "global_step": 1},
        {"id": "f/save/5", "type": "checkpoint_saved", "step": 5},
    ]
    assert post_ok(proc, fresh)["applied"] == 5
    now = status(proc)
    assert (now["resumes_total"], now["records_total"], now["trainer_step"]) == (0, 1, 5)
    first = now["records"][0]
    assert (first["resumed"], first["checkpoint_step"], first["restored"], first["expected"]) == (False, 0, 0, 12)
    assert (first["warmup_state"], first["under_submitted"], first["reissued"]) == ("fresh_start", 0, 0)
    assert first["doomed"] == {"failure": 0, "stale": 0, "filtered": 0}
    assert_series(
        proc,
        {
            "tqmon_resumes_total": 0,
            'tqmon_resume_warmup_state{state="fresh_start"}': 1,
            "tqmon_last_resume_checkpoint_step": 0,
            "tqmon_checkpoint_step": 5,
        },
    )

    # R = 14 > T = 12: the warmup skips and the 2 extra groups stay; only the 2 failures are doomed
    # (no stale with threshold null, no filtered without DAPO), so nothing is missing: max(0, 12 - 12).
    resume = [
        {"id": "f/start/5", "type": "training_started", "resumed_from_step": 5},
        {
            "id": "f/restore/5",
            "type": "checkpoint_restored",
            "restored_prompt_groups": 14,
            "by_status": {"pending": 4, "running": 4, "finished": 4, "failure": 2},
        },
        {"id": "f/reissue/6", "type": "inflight_reissued", "step": 6, "reissued_prompt_groups": 8},
        {"id": "f/warmup/6", "type": "warmup_decided", "target_prompt_groups": 12, "submitted_prompt_groups": 0},
    ]
    assert post_ok(proc, resume)["applied"] == 4
    now = status(proc)
    assert (now["resumes_total"], now["records_total"]) == (1, 2)
    assert now["records"][0] == first  # a closed start is history
    second = now["records"][1]
    assert (second["index"], second["resumed"], second["checkpoint_step"], second["restored"]) == (1, True, 5, 14)
    assert (second["expected"], second["submitted"], second["over_restored"]) == (0, 0, 2)
    assert (second["warmup_state"], second["under_submitted"], second["reissued"]) == ("skipped_over_restored", 0, 8)
    assert second["doomed"] == {"failure": 2, "stale": 0, "filtered": 0}
    assert_series(
        proc,
        {
            "tqmon_resumes_total": 1,
            'tqmon_resume_warmup_state{state="skipped_over_restored"}': 1,
            'tqmon_resume_warmup_state{state="fresh_start"}': 0,
            "tqmon_resume_over_restored_prompt_groups": 2,
            "tqmon_resume_warmup_expected_prompt_groups": 0,
            'tqmon_resume_doomed_prompt_groups{reason="stale"}': 0,
            "tqmon_last_resume_checkpoint_step": 5,
        },
    )

    # Paging: the newest `limit` records by default, or from `offset`.
    assert [r["index"] for r in status(proc, limit=1)["records"]] == [1]
    page = status(proc, offset=0, limit=1)
    assert (page["records_offset"], [r["index"] for r in page["records"]]) == (0, [0])


def test_a_late_run_started_configures_the_open_start_only(tqmon_factory: Factory) -> None:
    """The config may arrive after the start's first events: the open record is re-derived with it,
    a closed one is history."""
    proc = tqmon_factory().start()
    assert post_ok(proc, [START, RESTORE])["applied"] == 2
    record = status(proc)["records"][-1]
    assert (record["run_id"], record["target"], record["expected"], record["doomed"]) == (
        "",
        None,
        None,
        {"failure": 1, "filtered": 0},  # filtered by verl's default filter_groups=false, and named
    )
    assert record["assumed_defaults"] == ["filter_groups=false"]

    assert post_ok(proc, RUN)["applied"] == 1
    record = status(proc)["records"][-1]
    assert (record["run_id"], record["target"], record["expected"], record["over_restored"]) == ("run-a", 12, 6, 0)
    assert record["doomed"] == {"failure": 1, "filtered": 0}
    assert_series(proc, {"tqmon_resume_warmup_expected_prompt_groups": 6, "tqmon_window_target_prompt_groups": 12})

    assert post_ok(proc, [REISSUE, WARMUP, STEP])["applied"] == 3
    closed = status(proc)["records"][-1]
    rerun = RUN | {"id": "run-b/run", "run_id": "run-b", "config": {"train_batch_size": 8, "num_warmup_batches": 1}}
    assert post_ok(proc, rerun)["applied"] == 1
    now = status(proc)
    assert (now["run"]["run_id"], now["run"]["config"]["train_batch_size"], now["records"]) == ("run-b", 8, [closed])
    assert closed["run_id"] == "run-a"
    assert closed["target"] == 12


# ---------------------------------------------------------------- idempotency


def test_a_repeated_event_id_is_applied_once(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    assert post_ok(proc, [RUN, START]) == {"accepted": 2, "applied": 2, "duplicates": 0}
    before = state(proc)
    assert before["resumes_total"] == 1

    assert post_ok(proc, START) == {"accepted": 1, "applied": 0, "duplicates": 1}
    # Same id, different body: the first one stands.
    assert post_ok(proc, START | {"resumed_from_step": 99}) == {"accepted": 1, "applied": 0, "duplicates": 1}
    assert state(proc) == before
    assert_series(
        proc,
        {
            "tqmon_resumes_total": 1,
            "tqmon_last_resume_checkpoint_step": 10,
            'tqmon_events_total{outcome="applied",source="events"}': 2,
            'tqmon_events_total{outcome="duplicate",source="events"}': 2,
        },
    )

    # In a batch: a new event, an old id, and the new id again.
    assert post_ok(proc, [RESTORE, RUN, RESTORE]) == {"accepted": 3, "applied": 1, "duplicates": 2}
    now = status(proc)
    assert [e["event_id"] for e in now["records"][-1]["evidence"]] == [START["id"], RESTORE["id"]]
    assert (now["resumes_total"], now["records_total"], now["records"][-1]["restored"]) == (1, 1, 6)
    assert_series(
        proc,
        {
            "tqmon_resumes_total": 1,
            'tqmon_events_total{outcome="applied",source="events"}': 3,
            'tqmon_events_total{outcome="duplicate",source="events"}': 4,
        },
    )


# ---------------------------------------------------------------- auth


def test_token_guards_the_event_api(tqmon_factory: Factory) -> None:
    proc = tqmon_factory(["--token", "s3cret"]).start()
    url = proc.url + "/api/v1/events"
    body = json.dumps(RUN).encode()
    attempts: list[dict[str, str]] = [
        {},  # no header
        {"authorization": "Bearer wrong"},
        {"authorization": "s3cret"},  # no scheme
        {"authorization": "Bearer s3cret2"},  # a prefix match is not a match
        {"authorization": "Basic czNjcmV0"},
    ]
    for count, headers in enumerate(attempts, start=1):
        response = httpx.post(url, content=body, headers={"content-type": "application/json", **headers})
        assert response.status_code == 401, headers
        assert response.json()["reason"] == "unauthorized"
        assert rejected(proc) == {r: float(count if r == "unauthorized" else 0) for r in REJECT_REASONS}
    # A bad body without the token is refused for the token alone, counted once.
    assert post(proc, b"{not json").status_code == 401
    assert rejected(proc)["unauthorized"] == len(attempts) + 1
    assert rejected(proc)["malformed_json"] == 0

    now = status(proc)
    assert (now["run"], now["records_total"]) == (None, 0)
    assert_series(proc, {'tqmon_events_total{outcome="applied",source="events"}': 0})

    assert post_ok(proc, RUN, token="s3cret") == {"accepted": 1, "applied": 1, "duplicates": 0}
    assert status(proc)["run"]["run_id"] == "run-a"
    assert rejected(proc)["unauthorized"] == len(attempts) + 1  # success counts nothing
    # The scheme name is case-insensitive (RFC 9110), the token is not.
    lower = httpx.post(url, json=RUN | {"id": "run/lower"}, headers={"authorization": "bearer s3cret"})
    assert lower.status_code == 200 and lower.json()["applied"] == 1
    # Scrapes and probes need no token.
    assert httpx.get(proc.url + "/metrics").status_code == 200
    assert httpx.get(proc.url + "/healthz").status_code == 200


@pytest.mark.parametrize(
    ("listen", "extra", "env"),
    [
        ("0.0.0.0:{port}", [], {}),
        ("[::]:{port}", [], {}),
        ("0.0.0.0:{port}", ["--token", ""], {}),  # an empty token is no token
        (None, [], {"TQMON_LISTEN": "0.0.0.0:{port}"}),
    ],
    ids=["ipv4-any", "ipv6-any", "empty-token", "env-listen"],
)
def test_non_loopback_listen_without_token_refuses_to_start(
    tmp_path: Path, listen: str | None, extra: list[str], env: dict[str, str]
) -> None:
    port = free_port()
    state_dir = tmp_path / "state"
    command = [sys.executable, "-m", "tqmon.cli", "serve", "--state-dir", str(state_dir), *extra]
    if listen is not None:
        command += ["--listen", listen.format(port=port)]
    environ = clean_env() | {k: v.format(port=port) for k, v in env.items()}
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, env=environ, check=False)
    assert done.returncode != 0
    assert "--token" in done.stderr
    assert "not loopback" in done.stderr
    assert "serving on" not in done.stderr
    assert not state_dir.exists()  # refused before touching anything


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TqmonProcess]:
    """One tqmon with a small body limit and a resume in progress, shared by the bad-input cases."""
    proc = TqmonProcess(tmp_path_factory.mktemp("strict") / "state", ["--max-body-bytes", str(MAX_BODY)])
    try:
        proc.start()
        assert post_ok(proc, [RUN, START, RESTORE])["applied"] == 3
        yield proc
    finally:
        proc.kill(signal.SIGTERM)


def padded(event: dict[str, Any], size: int) -> bytes:
    """``event`` as JSON, padded with whitespace to exactly ``size`` bytes (still valid JSON)."""
    raw = json.dumps(event).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


STEP_50: dict[str, Any] = {"id": "bad/step/50", "type": "step_completed", "global_step": 50}
BAD_CONFIG = RUN | {"id": "bad/run", "config": {"train_batch_size": -1, "num_warmup_batches": 3}}

BAD_INPUTS: list[tuple[str, object, int, str, list[str]]] = [
    ("truncated-json", b'{"id": "x", "type": ', 400, "malformed_json", ["body is not JSON: "]),
    ("not-utf8", b'{"id": "\xff\xfe", "type": "step_completed"}', 400, "malformed_json", ["body is not JSON: "]),
    ("empty-body", b"", 400, "malformed_json", ["body is not JSON: "]),
    (
        "string-for-int",
        RUN | {"id": "bad/1", "config": {"train_batch_size": "four", "num_warmup_batches": 3}},
        422,
        "invalid_event",
        ["config.train_batch_size: ", "valid integer"],
    ),
    ("non-positive-batch", BAD_CONFIG, 422, "invalid_event", ["config.train_batch_size: ", "greater than 0"]),
    (
        "negative-step",
        STEP_50 | {"global_step": -1},
        422,
        "invalid_event",
        ["global_step: ", "greater than or equal to 0"],
    ),
    ("bad-enum", RUN | {"id": "bad/2", "trainer_mode": "async"}, 422, "invalid_event", ["trainer_mode: "]),
    ("bad-time", STEP_50 | {"time": "yesterday"}, 422, "invalid_event", ["time: "]),
    (
        "unknown-type",
        {"id": "bad/3", "type": "run_finished"},
        422,
        "unknown_type",
        ["type: 'run_finished' is not one of"],
    ),
    ("missing-type", {"id": "bad/4", "global_step": 3}, 422, "unknown_type", ["type: None is not one of"]),
    ("not-an-object", 42, 422, "unknown_type", ["type: None"]),
    ("empty-batch", [], 422, "invalid_event", ["body: an empty batch"]),
    ("missing-id", {"type": "step_completed", "global_step": 3}, 422, "invalid_event", ["id: Field required"]),
    ("empty-id", STEP_50 | {"id": ""}, 422, "invalid_event", ["id: ", "at least 1 character"]),
    ("extra-field", STEP_50 | {"gpu": 0}, 422, "invalid_event", ["gpu: Extra inputs are not permitted"]),
    (
        "extra-config-field",
        RUN | {"id": "bad/5", "config": {"train_batch_size": 4, "num_warmup_batches": 3, "warmup": 1}},
        422,
        "invalid_event",
        ["config.warmup: Extra inputs are not permitted"],
    ),
    (
        "by-status-sum",
        RESTORE | {"id": "bad/6", "by_status": {"pending": 2, "finished": 3}},
        422,
        "invalid_event",
        ["body: ", "by_status sums to 5, restored_prompt_groups is 6"],
    ),
    (
        "groups-sum",
        RESTORE | {"id": "bad/7", "by_status": None, "groups": [{"status": "failure", "global_steps": 3, "count": 1}]},
        422,
        "invalid_event",
        ["body: ", "groups sum to 1, restored_prompt_groups is 6"],
    ),
    (
        "unknown-status",
        {"id": "bad/8", "type": "window_observed", "by_status": {"done": 3}},
        422,
        "invalid_event",
        ["by_status.done"],
    ),
    ("batch-bad-item", [STEP_50, BAD_CONFIG], 422, "invalid_event", ["[1].config.train_batch_size: "]),
    (
        "batch-unknown-type",
        [STEP_50, {"id": "bad/9", "type": "nope"}],
        422,
        "unknown_type",
        ["[1].type: 'nope' is not one of"],
    ),
    (
        "too-large",
        padded(STEP_50, MAX_BODY + 1),
        413,
        "too_large",
        [f"body of {MAX_BODY + 1} bytes exceeds {MAX_BODY}"],
    ),
]


def _check_rejected(proc: TqmonProcess, send: Callable[[], httpx.Response], code: int, reason: str) -> str:
    """Send a bad request: it is refused with ``code``/``reason``, counted once and changes nothing."""
    state, counts = status(proc), rejected(proc)
    exposition = proc.metrics()
    response = send()
    assert response.status_code == code, response.text
    problem = response.json()
    assert problem["reason"] == reason
    assert rejected(proc) == {r: (counts[r] or 0) + (r == reason) for r in REJECT_REASONS}
    assert status(proc) == state
    exclude = ("tqmon_events_rejected_total",)
    assert tqmon_series(proc.metrics(), exclude=exclude) == tqmon_series(exposition, exclude=exclude)
    detail: str = problem["detail"]
    return detail


@pytest.mark.parametrize(
    ("body", "code", "reason", "detail"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_is_rejected_and_counted_once(
    strict_server: TqmonProcess, body: object, code: int, reason: str, detail: list[str]
) -> None:
    """``detail``: what the problem's detail starts with (the field path), then what else it says."""
    got = _check_rejected(strict_server, lambda: post(strict_server, body), code, reason)
    assert got.startswith(detail[0]), got
    for part in detail[1:]:
        assert part in got, got


def test_oversized_chunked_body_is_rejected(strict_server: TqmonProcess) -> None:
    """No Content-Length to trust: the limit holds while streaming."""
    body = padded(STEP_50, 3 * MAX_BODY)

    def send() -> httpx.Response:
        chunks = (body[i : i + 512] for i in range(0, len(body), 512))
        return httpx.post(
            strict_server.url + "/api/v1/events", content=chunks, headers={"content-type": "application/json"}
        )

    assert _check_rejected(strict_server, send, 413, "too_large") == f"body exceeds {MAX_BODY} bytes"


def test_a_rejected_batch_stores_nothing(strict_server: TqmonProcess) -> None:
    """The good item of a rejected batch was not applied, nor was its id taken."""
    assert status(strict_server)["trainer_step"] == 10
    _check_rejected(strict_server, lambda: post(strict_server, [STEP_50, BAD_CONFIG]), 422, "invalid_event")
    assert post_ok(strict_server, STEP_50) == {"accepted": 1, "applied": 1, "duplicates": 0}
    assert status(strict_server)["trainer_step"] == 50


def test_a_body_of_exactly_the_limit_is_accepted(strict_server: TqmonProcess) -> None:
    event = {"id": "limit/step/60", "type": "step_completed", "global_step": 60}
    response = post(strict_server, padded(event, MAX_BODY))
    assert response.status_code == 200, response.text
    assert status(strict_server)["trainer_step"] == 60


# ---------------------------------------------------------------- health, landing page, OpenAPI, /metrics


def test_health_readiness_landing_openapi_and_negotiation(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    health = httpx.get(proc.url + "/healthz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})

    ready = httpx.get(proc.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["ready"] is False
    assert "no source has succeeded yet" in ready.json()["problems"]
    assert post(proc, b"{").status_code == 400
    assert httpx.get(proc.url + "/readyz").status_code == 503  # a rejected request is no success

    landing = httpx.get(proc.url + "/")
    assert landing.status_code == 200
    assert landing.headers["content-type"].startswith("text/html")
    assert '<a href="/metrics">' in landing.text
    assert 'data-k="verdict">no trainer start observed yet<' in landing.text  # the status page's banner

    schema = httpx.get(proc.url + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for name in ("RunStarted", "TrainingStarted", "CheckpointRestored", "InflightReissued", "WarmupDecided"):
        assert name in components
    for name in ("StepCompleted", "CheckpointSaved", "WindowObserved", "TrainerConfig", "EventOrBatch", "Problem"):
        assert name in components
    assert components["RunStarted"]["additionalProperties"] is False  # extra="forbid"
    assert set(components["RunStarted"]["required"]) >= {"id", "run_id", "trainer_mode", "config"}
    body = schema["paths"]["/api/v1/events"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/EventOrBatch"}
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs - components.keys() == set()  # every reference resolves
    assert {"RunStarted", "WindowObserved", "GroupCount"} <= refs

    assert post_ok(proc, [RUN, START]) == {"accepted": 2, "applied": 2, "duplicates": 0}
    ready = httpx.get(proc.url + "/readyz")
    assert (ready.status_code, ready.json()) == (200, {"ready": True, "sources": {"events": True}, "problems": []})
    assert 'data-k="verdict">incomplete: warmup decision not seen<' in httpx.get(proc.url + "/").text

    text = httpx.get(proc.url + "/metrics")
    assert text.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# TYPE tqmon_resumes_total counter" in text.text
    assert "# EOF" not in text.text
    assert sample_value(text.text, "tqmon_resumes_total") == 1

    om = httpx.get(proc.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.text.endswith("# EOF\n")
    assert "# TYPE tqmon_resumes counter" in om.text
    assert sample_value(om.text, "tqmon_resumes_total") == 1
    assert sample_value(om.text, "tqmon_last_resume_checkpoint_step") == 10


# ---------------------------------------------------------------- persistence


def test_state_and_counters_survive_kill_9(tqmon_factory: Factory) -> None:
    first = tqmon_factory().start()
    assert post_ok(first, RESUME)["applied"] == 10
    assert post_ok(first, START)["duplicates"] == 1
    assert post(first, b"{").status_code == 400
    assert post(first, BAD_CONFIG).status_code == 422
    assert post(first, [STEP_50, BAD_CONFIG]).status_code == 422
    assert post(first, {"id": "x", "type": "nope"}).status_code == 422
    before = status(first)
    counters = tqmon_series(first.metrics())
    counters = {k: v for k, v in counters.items() if k.startswith(("tqmon_events_", "tqmon_resumes_total"))}
    assert counters['tqmon_events_rejected_total{reason="invalid_event"}'] == "2.0"
    first.kill()  # SIGKILL: no shutdown hook runs

    second = tqmon_factory().start()
    assert second.state_dir == first.state_dir
    after = status(second)
    stable = (
        "run",
        "target_window",
        "trainer_step",
        "trainer_last_event",
        "checkpoint",
        "windows",
        "window_status",
        "plugin",
    )
    assert {k: after[k] for k in stable} == {k: before[k] for k in stable}
    assert (after["resumes_total"], after["records_total"]) == (1, 1)
    assert after["records"] == before["records"]
    assert split_record(after["records"][-1]) == (RESUME_RECORD, RESUME_EVIDENCE)
    exposition = second.metrics()
    assert {k: v for k, v in tqmon_series(exposition).items() if k in counters} == counters
    assert sample_value(exposition, 'tqmon_events_rejected_total{reason="malformed_json"}') == 1
    assert sample_value(exposition, 'tqmon_events_rejected_total{reason="unknown_type"}') == 1

    # Applied ids survive too: a retried event is still a duplicate.
    assert post_ok(second, STEP) == {"accepted": 1, "applied": 0, "duplicates": 1}
    assert sample_value(second.metrics(), "tqmon_resumes_total") == 1


# ---------------------------------------------------------------- docs/events.md


def doc_examples() -> list[Any]:
    blocks = re.findall(r"^```json\n(.*?)^```$", EVENTS_DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [json.loads(block) for block in blocks]


def test_every_json_example_in_the_events_doc_is_accepted(tqmon_factory: Factory) -> None:
    examples = doc_examples()
    events = [e for example in examples for e in (example if isinstance(example, list) else [example])]
    assert {e["type"] for e in events} == EVENT_TYPE_NAMES  # one example per event type at least

    proc = tqmon_factory().start()
    for example in examples:
        response = post(proc, example)
        assert response.status_code == 200, f"{response.text}\n{json.dumps(example, indent=2)}"
        count = len(example) if isinstance(example, list) else 1
        assert response.json() == {"accepted": count, "applied": count, "duplicates": 0}

    # The doc's worked numbers: one resume, T = 12, R = 6, M = 6, doomed failure 1 + stale 1, deficit 2.
    now = status(proc)
    assert (now["resumes_total"], now["records_total"]) == (1, 1)
    record = now["records"][0]
    assert (record["target"], record["restored"], record["expected"], record["submitted"]) == (12, 6, 6, 6)
    assert record["doomed"] == {"failure": 1, "stale": 1, "filtered": 0}
    assert (record["under_submitted"], record["warmup_state"]) == (2, "topped_up")
