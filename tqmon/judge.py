"""Judges what the sources said about one start: where they contradict each other, and whether its window was lost.

Pure like :mod:`tqmon.derivation`, which calls it from :func:`tqmon.derivation.derive_record` (the one
derivation serve, inspect and analyze share). Each source's value is a :class:`~tqmon.snapshot.Claim`; two
claims disagree when their values differ beyond what the trainer's own timing explains: counts the
trainer reports once (R, its split, K, T, M) must match exactly, whichever sources (or the same one twice)
gave them, while a live window is a moving target bounded by what the trainer may have added or evicted
between the report and the poll. A quantity is compared only once two claims were given for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tqmon.snapshot import Claim, Disagreement
from tqmon.warmup import PROMPT_STATUSES, TQ_DIR, doomed_complete

RESTORED_BY_STATUS = tuple(f"restored_{status}" for status in PROMPT_STATUSES)
WINDOW_AFTER_WARMUP = "window_after_warmup"  # the first live window after the decision against R + M
CHECKPOINT_WINDOW = "checkpoint_window"  # the loaded checkpoint's composition against the first live window
EXACT_QUANTITIES = ("restored", *RESTORED_BY_STATUS, "reissued", "target", "submitted")
QUANTITIES = (*EXACT_QUANTITIES, WINDOW_AFTER_WARMUP, CHECKPOINT_WINDOW)  # the ``quantity`` label values
CONFIG_SOURCE = "config"  # the trainer config tqmon was given, as a source of T and M


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
    """A disagreement when the claims give different values: two sources, or one source contradicting itself.

    Each source counts once per value it gave, by its first claim of that value, so a source repeating
    itself adds nothing and one stating two values shows both.
    """
    first: dict[tuple[str, int], Claim] = {}
    for claim in claims:
        first.setdefault((claim.source, claim.value), claim)
    if len({value for _, value in first}) <= 1:
        return None
    return Disagreement(quantity, tuple(first.values()), "exact")


def terminal_groups(statuses: Mapping[str, int] | None) -> int | None:
    """The finished and failed groups of a split by status; None without a split.

    The only groups the first sample can evict: verl's replay buffer evicts terminal groups alone, and
    re-issues the pending and running ones, which keeps them in the window.
    """
    if statuses is None:
        return None
    return statuses.get("finished", 0) + statuses.get("failure", 0)


def window_bounds(
    reported: int, doomed: int | None, restored: int, added: int | None, terminal: int | None = None
) -> Bounds:
    """Where a live window polled after ``reported`` groups were in place can legitimately be.

    The first sample may already have evicted the doomed restored groups; when their count is unknown, every
    ``terminal`` one (finished or failed) of a known split, else every restored one. The first step's
    ``prepare_step`` adds one generation batch before it samples; re-issue keeps the group count. ``added``
    is that batch plus anything still to be submitted.
    """
    evictable = next(n for n in (doomed, terminal, restored) if n is not None)
    return Bounds(max(0, reported - min(evictable, restored)), None if added is None else reported + added)


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


@dataclass(frozen=True, slots=True)
class Judgement:
    """What the judge compared for a start, and what it found."""

    compared: tuple[str, ...]  # the quantities at least two claims were given for, in QUANTITIES order
    disagreements: tuple[Disagreement, ...]


def judge(
    claims: Mapping[str, Sequence[Claim]], windows: Mapping[str, tuple[Claim, Claim | None, Bounds]]
) -> Judgement:
    """Every comparison of a start: exact quantities first, then the live windows, in :data:`QUANTITIES` order.

    A quantity one claim alone was given for (or a window not seen yet) is not compared: it has no verdict,
    which is not the same as agreement.
    """
    found = [exact(quantity, claims.get(quantity, ())) for quantity in EXACT_QUANTITIES]
    found += [within(quantity, *windows[quantity]) for quantity in QUANTITIES if quantity in windows]
    compared = {quantity for quantity in EXACT_QUANTITIES if len(claims.get(quantity, ())) > 1}
    compared |= {quantity for quantity, (_, seen, _) in windows.items() if seen is not None}
    return Judgement(in_order(compared), tuple(d for d in found if d is not None))


def in_order(quantities: Iterable[str]) -> tuple[str, ...]:
    """Quantities in :data:`QUANTITIES` order, each once."""
    wanted = set(quantities)
    return tuple(quantity for quantity in QUANTITIES if quantity in wanted)


def has_tq_dir(path: str | None) -> bool | None:
    """Whether a checkpoint event's path is a TransferQueue dir (the checkpoint source names the step dir
    when ``transfer_queue/`` is missing); None when the event names no path."""
    if path is None:
        return None
    return path.rstrip("/").rsplit("/", 1)[-1].startswith(TQ_DIR)


def is_lost_window(
    *, keeps_window: bool, legacy: bool, restore_reported: bool, decided: bool, restored: int | None
) -> bool:
    """An async resume that restored nothing because its checkpoint had no ``transfer_queue/``.

    verl 0.9.1 logs "Restored R training prompt groups" whenever it loads TQ state (even R = 0), before its
    warmup decision; a resume whose decision came without any restore report, and which restored nothing,
    refilled its whole window from scratch. verl 0.9.0 never logs the restore, so it proves nothing there.
    """
    return keeps_window and not legacy and decided and not restore_reported and restored in (None, 0)
