"""What a TransferQueue partition holds, in verl's terms: prompt groups by status and step, trajectories, orphans.

One pure function serves the live poller (a ``kv_list`` reply) and the checkpoint reader (the tags of a
saved controller state), so a window and a checkpoint are always classified the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from tqmon.catalog import AGE_BUCKETS
from tqmon.events import GroupCount
from tqmon.snapshot import WindowView
from tqmon.warmup import INFLIGHT_STATUSES, PROMPT_STATUSES

PROGRESS_EVERY = 10_000  # keys between progress updates


class CompositionError(ValueError):
    """A tag verl could not have written; the message names the key."""


class Progress(Protocol):
    def update(self, n_steps: int) -> None: ...


# Opens one progress bar for a long stage of a read: (label, total).
ProgressFactory = Callable[[str, int], AbstractContextManager[Progress]]


@dataclass(frozen=True, slots=True)
class Composition:
    """One partition as verl 0.9.1 sees it (``_count_tq_prompt_groups``, the re-issue and the sampler)."""

    groups: Mapping[tuple[str, int], int]  # (status, global_steps) -> prompt groups
    trajectories: int  # non-prompt keys
    orphan_trajectories: int  # trajectory keys whose uid has no prompt key
    inflight_trajectories: int  # trajectories of pending/running groups: cleared at the re-issue
    keys: int = 0  # every key of the partition

    @property
    def restored(self) -> int:
        """R: every prompt group, any status and any ``global_steps``."""
        return sum(self.groups.values())

    @property
    def by_status(self) -> dict[str, int]:
        counts: dict[str, int] = dict.fromkeys(PROMPT_STATUSES, 0)
        for (status, _), count in self.groups.items():
            counts[status] += count
        return counts

    @property
    def reissued(self) -> int:
        """K: the pending and running groups verl re-issues at step N+1."""
        return sum(count for (status, _), count in self.groups.items() if status in INFLIGHT_STATUSES)

    @property
    def newest_step(self) -> int | None:
        return max((steps for _, steps in self.groups), default=None)

    def by_age(self, sample_step: int) -> dict[int, int]:
        """Prompt groups by ``sample_step - global_steps`` (never below 0), youngest first."""
        ages: Counter[int] = Counter()
        for (_, global_steps), count in self.groups.items():
            ages[max(0, sample_step - global_steps)] += count
        return dict(sorted(ages.items()))

    def age_histogram(self, sample_step: int, bounds: Iterable[float]) -> tuple[tuple[tuple[float, int], ...], float]:
        """Cumulative ``(le, count)`` buckets ending with ``+Inf``, and the sum of ages."""
        ages = self.by_age(sample_step)
        buckets = [(le, sum(n for age, n in ages.items() if age <= le)) for le in bounds]
        buckets.append((float("inf"), sum(ages.values())))
        return tuple(buckets), float(sum(age * n for age, n in ages.items()))

    def group_counts(self) -> list[GroupCount]:
        return [
            GroupCount(status=status, global_steps=steps, count=count)
            for (status, steps), count in sorted(self.groups.items(), key=lambda item: (item[0][1], item[0][0]))
        ]


EMPTY = Composition({}, 0, 0, 0)


def window_view(
    partition: str,
    source: str,
    c: Composition,
    trainer_step: int | None,
    observed_at: float,
    max_age: float | None = None,
    *,
    with_trajectories: bool = True,
) -> WindowView:
    """One partition's live window, the same for every source that sees prompt groups by step (the TQ poll,
    the verl plugin). Ages are the trainer step minus each group's ``global_steps``; without a trainer step
    from another source, the newest tag stands in for it."""
    step = trainer_step if trainer_step is not None else c.newest_step
    buckets, age_sum = c.age_histogram(step, AGE_BUCKETS) if step is not None else (None, None)
    return WindowView(
        partition,
        source,
        observed_at,
        c.by_status,
        trajectories=c.trajectories if with_trajectories else None,
        orphan_trajectories=c.orphan_trajectories if with_trajectories else None,
        age_buckets=buckets,
        age_sum=age_sum,
        max_age=max_age,
    )


def from_group_counts(groups: Iterable[GroupCount], trajectories: int = 0, orphans: int = 0) -> Composition:
    """The composition a source stated (an event's ``groups``) rather than one classified from tags."""
    counts: Counter[tuple[str, int]] = Counter()
    for group in groups:
        counts[(group.status, group.global_steps)] += group.count
    return Composition(dict(counts), trajectories, orphans, 0)


def compose(tags: Mapping[str, Any], progress: Progress | None = None) -> Composition:
    """Classify ``{key: tag}`` of one partition like verl 0.9.1, in one pass over the keys.

    A key is a prompt group iff ``tag.get("is_prompt", False)``; a trajectory key is ``{uid}_{session}_{i}``
    and belongs to prompt ``uid``. Validation runs on the distinct ``(status, global_steps)`` pairs, not
    per key, so it adds nothing per key to the two passes (``bench/README.md`` has their cost against verl's
    own count).
    """
    groups: dict[tuple[Any, Any], int] = {}
    prompts: dict[str, bool] = {}
    trajectory_keys: list[str] = []
    items = iter(tags.items())
    try:
        if progress is None:
            _fold(items, groups, prompts, trajectory_keys)
        else:
            while chunk := list(islice(items, PROGRESS_EVERY)):
                _fold(chunk, groups, prompts, trajectory_keys)
                progress.update(len(chunk))
    except AttributeError:
        key = next(k for k, tag in tags.items() if not isinstance(tag, Mapping))
        raise CompositionError(f"tag of key {key!r} is {type(tags[key]).__name__}, not a dict") from None
    for status, steps in groups:
        if status not in PROMPT_STATUSES:
            key = next(k for k, t in tags.items() if t.get("is_prompt", False) and t.get("status") == status)
            raise CompositionError(f"prompt key {key!r} has status {status!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            key = next(k for k, t in tags.items() if t.get("is_prompt", False) and t.get("global_steps") == steps)
            raise CompositionError(f"prompt key {key!r} has global_steps {steps!r}")
    orphans, inflight = attribute(prompts, trajectory_keys)
    return Composition(groups, len(trajectory_keys), orphans, inflight, len(tags))


def classify_keys(tags: Mapping[str, Any]) -> tuple[dict[tuple[Any, Any], int], dict[str, bool], list[str]]:
    """The first pass of :func:`compose` alone, unvalidated: prompt groups by (status, steps), each prompt key
    with whether its group is in flight, and the trajectory keys."""
    groups: dict[tuple[Any, Any], int] = {}
    prompts: dict[str, bool] = {}
    trajectory_keys: list[str] = []
    _fold(tags.items(), groups, prompts, trajectory_keys)
    return groups, prompts, trajectory_keys


def attribute(prompts: Mapping[str, bool], trajectory_keys: Iterable[str]) -> tuple[int, int]:
    """The second pass: (orphan, in-flight) trajectories, each trajectory key looked up by its uid in
    ``prompts`` (prompt key -> its group is pending or running, as :func:`classify_keys` made it).

    Still most of a poll's aggregation cost: the uid is a new string per trajectory key, hashed for the
    lookup (``bench/README.md`` has the profile). Looking the uid up in the first pass's own map, not in the
    reply, saves the two tag reads per trajectory key the owner's tag would cost.
    """
    orphans = inflight = 0
    find = prompts.get
    for key in trajectory_keys:
        owner = find(key.partition("_")[0])
        if owner is None:
            orphans += 1
        elif owner:
            inflight += 1
    return orphans, inflight


def _fold(
    items: Iterable[tuple[str, Any]],
    groups: dict[tuple[Any, Any], int],
    prompts: dict[str, bool],
    trajectory_keys: list[str],
) -> None:
    """The hot loop: as few operations per key as the classification allows."""
    append = trajectory_keys.append
    for key, tag in items:
        if tag.get("is_prompt", False):
            status = tag.get("status")
            group = (status, tag.get("global_steps"))
            groups[group] = groups.get(group, 0) + 1
            prompts[key] = status in INFLIGHT_STATUSES
        else:
            append(key)
