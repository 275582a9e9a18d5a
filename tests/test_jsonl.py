"""``--jsonl``: verl's file-logger metrics: step times, generation wait, the first step's evictions after a start."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import sample_value
from tqmon.events import StepCompleted
from tqmon.sources.jsonlparse import parse_jsonl_line


def step_line(step: int, *, gen: float = 6.5, took: float = 40.0, **evicted: float) -> str:
    """A line as verl's FileLogger writes it (orjson, one object per line), with the keys verl 0.9.1 logs."""
    data: dict[str, Any] = {
        "training/global_step": step,
        "timing_s/gen": gen,
        "timing_s/step": took,
        "actor/pg_loss": -0.0134,
        "training/off_policy/evicted_samples_staleness/mean": 9.0,
    }
    keys = {"failure": "rollout_failure", "stale": "off_policy", "filtered": "filter_groups"}
    data |= {f"training/{keys[reason]}/evicted_samples": n for reason, n in evicted.items()}
    return json.dumps({"step": step, "data": data}, separators=(",", ":"))


def test_a_training_step_line_becomes_a_step_event() -> None:
    parsed = parse_jsonl_line(step_line(41, gen=31.25, took=55.5, failure=3.0, stale=2))
    assert parsed.outcome == "event"
    event = parsed.event
    assert isinstance(event, StepCompleted)
    assert event.global_step == 41
    assert event.evicted_prompt_groups == {"failure": 3, "stale": 2}  # 3.0 after verl's aggregation is a count
    assert (event.generation_wait_seconds, event.step_seconds) == (31.25, 55.5)
    assert event.id == parse_jsonl_line(step_line(41, gen=31.25, took=55.5, failure=3.0, stale=2)).event.id  # type: ignore[union-attr]
    assert event.id != parse_jsonl_line(step_line(41, gen=31.0, took=55.5, failure=3.0, stale=2)).event.id  # type: ignore[union-attr]


def test_validation_only_and_blank_lines_are_ignored() -> None:
    validation = json.dumps({"step": 40, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.41}})
    assert parse_jsonl_line(validation).outcome == "ignored"
    assert parse_jsonl_line("   ").outcome == "ignored"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"step": 41, "data": {"timing_s/step": 4', "not JSON"),
        ("[1, 2]", '{"step": N, "data": {...}}'),
        ('{"data": {"timing_s/step": 4.0}}', '{"step": N, "data": {...}}'),
        ('{"step": -1, "data": {"timing_s/step": 4.0}}', "step -1: global_step"),
        ('{"step": 41, "data": {"timing_s/step": "slow"}}', "timing_s/step is 'slow'"),
        ('{"step": 41, "data": {"timing_s/step": 4.0, "timing_s/gen": -2}}', "timing_s/gen is -2"),
        (step_line(41, failure=2.5), "evicted_samples is 2.5, not a count"),
        (step_line(41, stale=float("inf")).replace("Infinity", "1e999"), "evicted_samples is inf, not a count"),
    ],
)
def test_a_malformed_line_is_named(line: str, message: str) -> None:
    parsed = parse_jsonl_line(line)
    assert parsed.outcome == "malformed" and parsed.event is None
    assert parsed.error is not None and message in parsed.error


RESUME_LOG = """\
INFO:{now},000:Resuming from /ckpt/global_step_40, setting global step to 40
INFO:{now},005:Restored {restored} training prompt groups from TransferQueue
INFO:{now},006:Re-issued 5 in-flight prompts for step 41; cleared 1 old trajectories from partition train
INFO:{now},007:Added {added} warmup prompts after restoring {restored} of 24 target prompt groups
"""


def resume_log(restored: int, added: int) -> str:
    """verl's resume lines, stamped now (a restart sign is matched to a start by time)."""
    return RESUME_LOG.format(now=time.strftime("%Y-%m-%d %H:%M:%S"), restored=restored, added=added)


def wait_metrics(proc: Any, series: str, expected: float, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    text: str = ""
    while time.monotonic() < deadline:
        text = proc.metrics()
        if sample_value(text, series) == expected:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{series} never became {expected}:\n{text}")


def test_first_step_after_a_resume_is_measured_and_a_truncation_is_a_restart(tmp_path: Path, tqmon_factory) -> None:
    log, jsonl = tmp_path / "trainer.log", tmp_path / "metrics.jsonl"
    log.write_text(resume_log(20, 4))
    jsonl.write_text("")
    flags = ["--train-batch-size", "8", "--num-warmup-batches", "3", "--max-off-policy-threshold", "4"]
    proc = tqmon_factory(["--log", str(log), "--jsonl", str(jsonl), "--log-interval", "0.2", *flags]).start()
    wait_metrics(proc, "tqmon_resume_warmup_submitted_prompt_groups", 4)

    with jsonl.open("a") as out:
        out.write(json.dumps({"step": 40, "data": {"val-core/reward/mean@1": 0.4}}) + "\n")  # validation: ignored
        out.write(step_line(41, gen=31.5, took=50.0, failure=3, stale=2, filtered=0) + "\n")
        out.write(step_line(42, gen=5.0, took=30.0, failure=1) + "\n")
        out.write("{not json\n")
    text = wait_metrics(proc, "tqmon_trainer_global_step", 42)
    # The first step sealed the resume: its evictions and wait, not step 42's.
    assert sample_value(text, 'tqmon_resume_first_step_evicted_prompt_groups{reason="failure"}') == 3
    assert sample_value(text, 'tqmon_resume_first_step_evicted_prompt_groups{reason="stale"}') == 2
    assert sample_value(text, 'tqmon_resume_first_step_evicted_prompt_groups{reason="filtered"}') == 0
    assert sample_value(text, "tqmon_resume_first_step_generation_wait_seconds") == 31.5
    assert sample_value(text, "tqmon_trainer_step_duration_seconds") == 40.0  # mean of 50 and 30
    assert sample_value(text, 'tqmon_source_errors_total{reason="malformed_line",source="jsonl"}') == 1
    assert sample_value(text, 'tqmon_events_total{outcome="applied",source="jsonl"}') == 2
    assert sample_value(text, 'tqmon_source_up{source="jsonl"}') == 1

    # The trainer restarts: verl truncates the file, the log shows a new resume, step 41 runs again.
    jsonl.write_text("")
    time.sleep(0.6)
    with log.open("a") as out:
        out.write(resume_log(18, 6))
    wait_metrics(proc, "tqmon_resume_warmup_submitted_prompt_groups", 6)
    jsonl.write_text(step_line(41, gen=12.0, took=20.0, failure=1) + "\n")
    text = wait_metrics(proc, "tqmon_resume_first_step_generation_wait_seconds", 12.0)
    assert sample_value(text, 'tqmon_resume_first_step_evicted_prompt_groups{reason="failure"}') == 1
    assert sample_value(text, "tqmon_trainer_global_step") == 41
    record = httpx.get(proc.url + "/api/v1/status").json()["records"][-1]
    kinds = [(e["source"], e["event_type"]) for e in record["evidence"]]
    assert ("jsonl", "file_truncated") in kinds
    assert kinds[-1] == ("jsonl", "step_completed")
