"""The sources: each one watches one thing the trainer leaves behind and reports it to the tracker."""

from __future__ import annotations

import enum


class SourceName(enum.StrEnum):
    """Every source tqmon has; the values of the ``source`` label. A new source adds its name here."""

    TQ = "tq"
    CHECKPOINT = "checkpoint"
    LOG = "log"
    JSONL = "jsonl"
    EVENTS = "events"
