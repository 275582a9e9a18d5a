"""Turns lines of verl's ``file`` logger (``{"step": N, "data": {...}}``) into step events. Pure.

verl writes one line per training step with its metrics, and validation-only lines with the same
shape (:mod:`tqmon.sources.stepmetrics` reads the metrics).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from tqmon.events import describe_validation
from tqmon.sources.logparse import ParsedLine
from tqmon.sources.stepmetrics import is_training_step, step_completed


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
    if not is_training_step(data):
        return ParsedLine("ignored")  # validation-only metrics, logged at the same step
    try:
        event = step_completed("jsonl:" + hashlib.sha1(text.encode()).hexdigest()[:20], record["step"], data)
    except ValueError as err:  # pydantic's ValidationError is a ValueError too
        message = describe_validation(err) if isinstance(err, ValidationError) else str(err)
        return ParsedLine("malformed", error=f"step {record['step']!r}: {message}")
    return ParsedLine("event", event=event)
