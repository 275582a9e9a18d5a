"""Judges what the sources said about one start: where they contradict each other, and whether its window was lost.

Pure like :mod:`tqmon.reconcile`, which calls it from :func:`tqmon.reconcile.derive_record` (the one
derivation serve, inspect and analyze share). Each source's value is a :class:`~tqmon.snapshot.Claim`; two
sources disagree when their values differ beyond what the trainer's own timing explains: counts the
trainer reports once (R, its split, K, T, M) must match exactly, while a live window is a moving target
bounded by what the trainer may have added or evicted between the report and the poll.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tqmon.snapshot import Claim, Disagreement
from tqmon.warmup import PROMPT_STATUSES, doomed_complete

RESTORED_BY_STATUS = tuple(f"restored_{status}" for status in PROMPT_STATUSES)
WINDOW_AFTER_WARMUP = "window_after_warmup"  # the first live window after the decision against R + M
CHECKPOINT_WINDOW = "checkpoint_window"  # the loaded checkpoint's composition against the first live window
EXACT_QUANTITIES = ("restored", *RESTORED_BY_STATUS, "reissued", "target", "submitted")
QUANTITIES = (*EXACT_QUANTITIES, WINDOW_AFTER_WARMUP, CHECKPOINT_WINDOW)  # the ``quantity`` label values
CONFIG_SOURCE = "config"  # the trainer config tqmon was given, as a source of T and M
TQ_DIR_NAME = "transfer_queue"


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range a live window may legitimately take, from a count reported before it."""

    low: int
    high: int | None  # None: the batch the trainer adds per step is unknown, so no upper bound

    def holds(self, total: int) -> bool:
        return total >= self.low and (self.high is None or total <= self.high)

    def describe(self) -> str:
        return f"allowed {self.low}..{'' if self.high is None else self.high}"


def exact(quantity: str, claims: Sequence[Claim]) -> Disagreement | None:
    """Each source's first claim; a disagreement when two sources gave different values."""
    first: dict[str, Claim] = {}
    for claim in claims:
        first.setdefault(claim.source, claim)
    if len({claim.value for claim in first.values()}) <= 1:
        return None
    return Disagreement(quantity, tuple(first.values()), "exact")


def window_bounds(reported: int, doomed: int | None, restored: int, added: int | None) -> Bounds:
    """Where a live window polled after ``reported`` groups were in place can legitimately be.

    The first sample may already have evicted the doomed restored groups (all restored ones when the doomed
    count is unknown), and the first step's ``prepare_step`` adds one generation batch before it samples;
    re-issue keeps the group count. ``added`` is that batch plus anything still to be submitted.
    """
    evictable = restored if doomed is None else min(doomed, restored)
    return Bounds(max(0, reported - evictable), None if added is None else reported + added)


def within(quantity: str, reported: Claim, seen: Claim | None, bounds: Bounds) -> Disagreement | None:
    """A live window outside what the reported count allows."""
    if seen is None or bounds.holds(seen.value):
        return None
    return Disagreement(quantity, (reported, seen), bounds.describe())


def complete_doomed(*candidates: Mapping[str, int] | None) -> int | None:
    """The doomed total from the first breakdown that knows every reason; None if none does."""
    for doomed in candidates:
        if doomed is not None and doomed_complete(doomed):
            return sum(doomed.values())
    return None


def judge(
    claims: Mapping[str, Sequence[Claim]], windows: Mapping[str, tuple[Claim, Claim | None, Bounds]]
) -> tuple[Disagreement, ...]:
    """Every disagreement of a start: exact quantities first, then the live windows, in :data:`QUANTITIES` order."""
    found = [exact(quantity, claims.get(quantity, ())) for quantity in EXACT_QUANTITIES]
    found += [within(quantity, *windows[quantity]) for quantity in QUANTITIES if quantity in windows]
    return tuple(d for d in found if d is not None)


def has_tq_dir(path: str | None) -> bool | None:
    """Whether a checkpoint event's path is a TransferQueue dir (the checkpoint source names the step dir
    when ``transfer_queue/`` is missing); None when the event names no path."""
    if path is None:
        return None
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(TQ_DIR_NAME)


def is_lost_window(
    *, keeps_window: bool, legacy: bool, restore_reported: bool, decided: bool, restored: int | None
) -> bool:
    """An async resume that restored nothing because its checkpoint had no ``transfer_queue/``.

    verl 0.9.1 logs "Restored R training prompt groups" whenever it loads TQ state (even R = 0), before its
    warmup decision; a resume whose decision came without any restore report, and which restored nothing,
    refilled its whole window from scratch. verl 0.9.0 never logs the restore, so it proves nothing there.
    """
    return keeps_window and not legacy and decided and not restore_reported and restored in (None, 0)
