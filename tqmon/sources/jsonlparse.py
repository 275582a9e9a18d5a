"""Turns lines of verl's ``file`` logger (``{"step": N, "data": {...}}``) into step events. Pure.

verl writes one line per training step with its metrics, and validation-only lines with the same
shape. A training step is recognised by ``timing_s/step`` (verl times every step). The evictions are
the replay buffer's ``training/<reason>/evicted_samples``: counts of prompt groups (uids), not samples.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from pydantic import ValidationError

from tqmon.events import StepCompleted, describe_validation
from tqmon.sources.logparse import ParsedLine

STEP_SECONDS = "timing_s/step"
GENERATION_SECONDS = "timing_s/gen"
EVICTION_KEYS = {
    "failure": "training/rollout_failure/evicted_samples",
    "stale": "training/off_policy/evicted_samples",
    "filtered": "training/filter_groups/evicted_samples",
}


def parse_jsonl_line(line: str) -> ParsedLine:
    """One raw line; the event id is a hash of the content, so a re-read line is applied once."""
    text = line.strip()
    if not text:
        return ParsedLine("ignored")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return ParsedLine("malformed", error=f"not JSON: {err.msg} at column {err.colno}")
    if not isinstance(record, dict) or not isinstance(record.get("data"), dict) or "step" not in record:
        return ParsedLine("malformed", error='expected {"step": N, "data": {...}} (verl\'s file logger)')
    data: dict[str, Any] = record["data"]
    if STEP_SECONDS not in data:
        return ParsedLine("ignored")  # validation-only metrics, logged at the same step
    try:
        evicted = {reason: _count(data[key], key) for reason, key in EVICTION_KEYS.items() if key in data}
        event = StepCompleted(
            id="jsonl:" + hashlib.sha1(text.encode()).hexdigest()[:20],
            global_step=record["step"],
            evicted_prompt_groups=evicted,
            generation_wait_seconds=_seconds(data.get(GENERATION_SECONDS), GENERATION_SECONDS),
            step_seconds=_seconds(data[STEP_SECONDS], STEP_SECONDS),
        )
    except ValueError as err:  # pydantic's ValidationError is a ValueError too
        message = describe_validation(err) if isinstance(err, ValidationError) else str(err)
        return ParsedLine("malformed", error=f"step {record['step']!r}: {message}")
    return ParsedLine("event", event=event)


def _count(value: Any, key: str) -> int:
    """verl logs these counts as ints, or floats after its metric aggregation (``3.0``)."""
    valid = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not valid or value < 0 or value != int(value):
        raise ValueError(f"{key} is {value!r}, not a count")
    return int(value)


def _seconds(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} is {value!r}, not a duration in seconds")
    return float(value)
