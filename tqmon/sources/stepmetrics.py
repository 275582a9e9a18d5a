"""One verl training step's metrics (``Tracking.log(data, step)``) as a step event. Pure.

verl hands the same dict to every logger backend: the ``file`` backend writes it as JSONL, the ``console``
backend prints it as ``step:N - key:value - …``. A training step is recognised by ``timing_s/step`` (verl
times every step; validation-only metrics share the shape). The evictions are the replay buffer's
``training/<reason>/evicted_samples``: counts of prompt groups (uids), not samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tqmon.events import StepCompleted

STEP_SECONDS = "timing_s/step"
GENERATION_SECONDS = "timing_s/gen"
EVICTION_KEYS = {
    "failure": "training/rollout_failure/evicted_samples",
    "stale": "training/off_policy/evicted_samples",
    "filtered": "training/filter_groups/evicted_samples",
}


def is_training_step(data: Mapping[str, Any]) -> bool:
    return STEP_SECONDS in data


def step_completed(event_id: str, step: Any, data: Mapping[str, Any]) -> StepCompleted:
    """The step event of a training step's metrics; raises ``ValueError`` (pydantic's too) naming a bad value."""
    evicted = {reason: _count(data[key], key) for reason, key in EVICTION_KEYS.items() if key in data}
    return StepCompleted(
        id=event_id,
        global_step=step,
        evicted_prompt_groups=evicted,
        generation_wait_seconds=_seconds(data.get(GENERATION_SECONDS), GENERATION_SECONDS),
        step_seconds=_seconds(data[STEP_SECONDS], STEP_SECONDS),
    )


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
