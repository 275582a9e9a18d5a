"""What a resume cost, in ml-goodput-measurement's badput terms: progress lost, downtime, time to the first step,
rollouts wasted. Pure: derived from what the reconciler observed, with no clock and no I/O.

Every number is ``None`` when what it needs was not observed; never a 0 standing in for "unknown".
Times are the trainer's own (a log line's timestamp, a pushed event's time): a line without a timestamp
(verl's console and JSONL step lines) read long after it was written says nothing about when.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tqmon.warmup import doomed_complete


@dataclass(frozen=True, slots=True)
class ResumeCost:
    """The cost of one resume; all ``None`` for a fresh start (nothing was lost)."""

    steps_lost: int | None = None  # last step completed before the stop - checkpoint step N
    downtime_seconds: float | None = None  # last trainer line before the stop -> the resume's first line
    time_to_first_step_seconds: float | None = None  # the resume's first line -> its first step completed
    wasted_rollouts: int | None = None  # doomed restored groups x rollout.n: regenerated after the first sample
    lost_prompt_groups: int | None = None  # a lost window's groups (state lost_window); 0: none lost; None: unknown


@dataclass(frozen=True, slots=True)
class CostInputs:
    """What the sources said that a resume's cost is computed from."""

    checkpoint_step: int | None  # N
    started_at: float | None  # the resume's first line, when it carried its time
    last_step_before: int | None  # the last step the trainer completed before the stop; None if none was seen
    last_activity_before: float | None  # the last timed trainer line before the stop
    loop_started_at: float | None  # the last timed line before verl's step loop: the warmup decision or re-issue
    first_step_seconds: float | None  # the first step's own duration (verl timing_s/step)
    doomed: Mapping[str, int] | None  # doomed restored groups by the reasons known
    rollout_n: int | None  # actor_rollout_ref.rollout.n


def resume_cost(inputs: CostInputs, *, resumed: bool, lost_prompt_groups: int | None = None) -> ResumeCost:
    """The cost of a start; a fresh start costs nothing that can be counted here."""
    if not resumed:
        return ResumeCost()
    return ResumeCost(
        steps_lost=steps_lost(inputs.last_step_before, inputs.checkpoint_step),
        downtime_seconds=elapsed(inputs.last_activity_before, inputs.started_at),
        time_to_first_step_seconds=time_to_first_step(
            inputs.started_at, inputs.loop_started_at, inputs.first_step_seconds
        ),
        wasted_rollouts=wasted_rollouts(inputs.doomed, inputs.rollout_n),
        lost_prompt_groups=lost_prompt_groups,
    )


def steps_lost(last_step_before: int | None, checkpoint_step: int | None) -> int | None:
    """Steps trained after checkpoint N and before the stop: trained again after the resume.

    A last step below N means the steps seen are not this run's last ones (an older checkpoint, a step
    source that stopped early): unknown rather than a negative or a made-up 0.
    """
    if last_step_before is None or checkpoint_step is None or last_step_before < checkpoint_step:
        return None
    return last_step_before - checkpoint_step


def elapsed(since: float | None, until: float | None) -> float | None:
    """``until - since`` when both are known and in order (clocks of two sources can disagree)."""
    if since is None or until is None or until < since:
        return None
    return until - since


def time_to_first_step(
    started_at: float | None, loop_started_at: float | None, first_step_seconds: float | None
) -> float | None:
    """Startup after the first line, restore, re-issue and warmup, then the first step itself.

    verl times each step from the top of its loop (``timing_s/step``), right after the warmup decision
    (or the re-issue, when the warmup logs nothing): the first step completes that long after that line.
    """
    until_loop = elapsed(started_at, loop_started_at)
    if until_loop is None or first_step_seconds is None:
        return None
    return until_loop + first_step_seconds


def wasted_rollouts(doomed: Mapping[str, int] | None, rollout_n: int | None) -> int | None:
    """Rollouts of the doomed restored groups (n per group), evicted and regenerated after the first sample.

    Needs every doom reason: with one unknown the total would be a guess.
    """
    if doomed is None or rollout_n is None or not doomed_complete(doomed):
        return None
    return sum(doomed.values()) * rollout_n
