"""Which verl release the trainer runs, and how tqmon knows: the input that picks the warmup a prediction assumes.

verl 0.9.0 warms up unconditionally (``num_warmup_batches`` whole batches on top of the restore), 0.9.1 tops the
restore up to T. The sources are believed in this order: the verl plugin's ``run_started`` (verl's own
``__version__``), the trainer log's own lines (0.9.0's ``Added {n} warmup batches``, 0.9.1's restore count and
warmup lines), ``--verl-version``, and the verl installed next to tqmon. With none of them the version is
unknown, and a prediction shows both warmups side by side. Pure, but :func:`installed`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

from tqmon.events import CheckpointRestored, Event, WarmupDecided
from tqmon.warmup import CURRENT, LEGACY, SEMANTICS, Semantics, version_semantics

VersionSource = Literal["run_started", "log", "flag", "installed"]
VERSION_SOURCES: tuple[VersionSource, ...] = get_args(VersionSource)  # most believed first
FLAG = "--verl-version (TQMON_VERL_VERSION)"


@dataclass(frozen=True, slots=True)
class VerlVersion:
    """The verl release predictions assume, and where it came from; ``semantics`` None: unknown."""

    version: str  # as the source said it; the log tells only the side of 0.9.1 ("<0.9.1", ">=0.9.1")
    source: VersionSource | None  # None: no source named a release
    semantics: Semantics | None
    detail: str = ""  # what said so: the flag, the package, the log line

    @property
    def predicted(self) -> tuple[Semantics, ...]:
        """The warmups a prediction shows: the one this release runs, or every one while it is unknown."""
        return SEMANTICS if self.semantics is None else (self.semantics,)

    def describe(self) -> str:
        """ "verl 0.9.1 (from run_started: ...)", or what an unknown version means."""
        if self.source is None:
            return "verl version unknown: no source named a release, so both warmups are predicted"
        return f"verl {self.version} (from {self.source}{': ' + self.detail if self.detail else ''})"


UNKNOWN = VerlVersion("", None, None)


def named(version: str, source: VersionSource, detail: str = "") -> VerlVersion | None:
    """A source's version string, if it names a release (else it decides nothing)."""
    semantics = version_semantics(version)
    return None if semantics is None else VerlVersion(version.strip(), source, semantics, detail)


def choose(candidates: Iterable[VerlVersion | None]) -> VerlVersion:
    """The candidate of the most believed source (:data:`VERSION_SOURCES` order); :data:`UNKNOWN` without one."""
    known = [c for c in candidates if c is not None and c.source is not None and c.semantics is not None]
    return min(known, key=lambda c: VERSION_SOURCES.index(c.source), default=UNKNOWN)


def betrayed_by(event: Event) -> VerlVersion | None:
    """What one of verl's own log lines tells of the release: 0.9.0's ``Added {n} warmup batches``, or a line
    only 0.9.1 writes (``Restored {R} training prompt groups``, its top-up and skip lines); None for the rest."""
    if isinstance(event, WarmupDecided) and event.legacy_warmup_batches is not None:
        line = f"'Added {event.legacy_warmup_batches} warmup batches to the agent loop manager'"
        return VerlVersion("<0.9.1", "log", LEGACY, f"verl 0.9.0's line {line}")
    if isinstance(event, WarmupDecided) and event.submitted_prompt_groups is not None:
        said = f"T {event.target_prompt_groups}, R {event.restored_prompt_groups}, M {event.submitted_prompt_groups}"
        return VerlVersion(">=0.9.1", "log", CURRENT, f"verl 0.9.1's warmup line ({said})")
    if isinstance(event, CheckpointRestored):
        line = f"'Restored {event.restored_prompt_groups} training prompt groups from TransferQueue'"
        return VerlVersion(">=0.9.1", "log", CURRENT, f"verl 0.9.1's line {line}")
    return None


def installed() -> VerlVersion | None:
    """The verl installed next to tqmon, read from its package metadata (verl is not imported); None without."""
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None
    return named(str(version or ""), "installed", "the verl package next to tqmon")
