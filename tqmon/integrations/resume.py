"""What one trainer start reports: its restore, its re-issue and its warmup decision, from measured facts.

Framework-agnostic: the verl glue (``tqmon.integrations.verl``) says what was restored and classifies each
submission; this module decides which events those facts make. The warmup is measured by counting the
prompts submitted while warming up, and decided once the first step batch or refill shows the warmup is
over. A submission through none of verl's pinned functions is ``unknown``: counted as such, it is neither
warmup nor re-issue and ends nothing; and once one came before the decision, the counts cannot be trusted,
so no decision (and no inferred re-issue) is reported at all.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal, Protocol

from tqmon.composition import Composition
from tqmon.events import (
    CheckpointRestored,
    Event,
    GroupCount,
    InflightReissued,
    TrainingStarted,
    WarmupDecided,
)
from tqmon.warmup import SkipReason, TrainerConfig
from tqmon.warmup import skip_reason as warmup_skip_reason

# ``self_heal``: the plugin's own top-up after the warmup; counted, never part of verl's warmup or re-issue.
Submission = Literal["reissue", "warmup", "step", "refill", "validation", "self_heal", "unknown"]


class Sink(Protocol):
    def post(self, event: Event) -> None: ...


def skip_reason(config: TrainerConfig, trainer_mode: str) -> SkipReason:
    """Why a warmup that submitted nothing did so, in the order verl 0.9.1 checks."""
    return warmup_skip_reason(config.warmup_config(trainer_mode))


class StartReporter:
    """Events of one trainer start; ``ids`` prefixes every event id (unique per run and process)."""

    def __init__(self, sink: Sink, ids: str, config: TrainerConfig, trainer_mode: str) -> None:
        self._sink = sink
        self._ids = ids
        self._config = config
        self._mode = trainer_mode
        self.resumed_from: int | None = None
        self.groups: list[GroupCount] | None = None  # what verl restored, as read before its re-issue
        self._restored = 0
        self._cleared = 0  # trajectories of in-flight groups: the re-issue clears them
        self._reissued = False
        self.warmup = 0  # M: the prompts verl's warmup submitted
        self._decided = False
        self.submissions: Counter[Submission] = Counter()  # prompts by kind, for logs and tests

    def started(
        self,
        resumed_from: int | None,
        path: str | None,
        window: Composition | None,
        groups: list[GroupCount] | None = None,
    ) -> None:
        """verl picked its start (``resumed_from`` = N) and, when it restored TransferQueue, ``window``;
        ``groups`` is its composition with DAPO's verdicts where they were judged (else ``window``'s)."""
        self.resumed_from = resumed_from
        self._sink.post(TrainingStarted(id=f"{self._ids}/start", resumed_from_step=resumed_from, checkpoint_path=path))
        if window is None:
            return
        self._restored, self._cleared = window.restored, window.inflight_trajectories
        self.groups = groups if groups is not None else window.group_counts()
        self._sink.post(
            CheckpointRestored(
                id=f"{self._ids}/restore",
                step=resumed_from,
                restored_prompt_groups=window.restored,
                groups=self.groups,
            )
        )

    def submitted(self, kind: Submission, prompts: int) -> bool:
        """One ``generate_sequences`` call of ``prompts`` prompt groups; True when it ended the warmup (and
        ``warmup_decided`` was reported): the moment a self-heal may top the window up."""
        self.submissions[kind] += prompts
        if kind in ("validation", "self_heal", "unknown") or self._decided:
            return False
        if kind == "reissue":
            self._reissue(prompts)
        elif kind == "warmup":
            self.warmup += prompts
        else:
            return self._decide()
        return False

    def _reissue(self, prompts: int) -> None:
        self._reissued = True
        step = None if self.resumed_from is None else self.resumed_from + 1
        self._sink.post(
            InflightReissued(
                id=f"{self._ids}/reissue",
                step=step,
                reissued_prompt_groups=prompts,
                cleared_trajectories=self._cleared,
            )
        )

    def _decide(self) -> bool:
        """The warmup is over: report what it submitted (verl re-issues nothing when nothing was in flight),
        unless an unknown submission came first: it may have been the warmup or the re-issue (False then)."""
        self._decided = True
        if self.submissions["unknown"]:
            return False
        if self.resumed_from is not None and not self._reissued:
            self._reissue(0)
        self._sink.post(
            WarmupDecided(
                id=f"{self._ids}/warmup",
                restored_prompt_groups=self._restored,
                submitted_prompt_groups=self.warmup,
                skip_reason=None if self.warmup else skip_reason(self._config, self._mode),
            )
        )
        return True
