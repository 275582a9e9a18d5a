"""The one event schema every source speaks: the HTTP API, the log tailer and later TQ, checkpoints, JSONL.

Each event carries an ``id``; the tracker applies an id once, which makes posting and re-reading
idempotent. Sources that derive events (the log tailer) give them deterministic ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from tqmon.warmup import (
    PROMPT_STATUSES,
    TRAIN,
    DoomReason,
    Partition,
    PromptStatus,
    RestoredGroup,
    SelfHealMode,
    SkipReason,
    TrainerConfig,
    TrainerMode,
)


def _json_number(value: object) -> object:
    """Only a JSON number is a number: pydantic would otherwise read ``true`` as 1 and ``"8"`` as 8."""
    if isinstance(value, bool | str | bytes):
        raise ValueError("must be a JSON number")
    return value


# ``time`` takes unix seconds too, so the OpenAPI document says so (a number is not a schema violation).
TIME_SCHEMA = {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "number"}, {"type": "null"}]}
# Counts and steps are bounded so every value stays exact as a Prometheus float (2**53).
Count = Annotated[int, BeforeValidator(_json_number), Field(ge=0, le=2**53)]
EventId = Annotated[str, Field(min_length=1, max_length=200, description="Unique id; a repeated id is applied once.")]
Status = PromptStatus
PLUGIN_REASON_LENGTH = 2000  # a plugin's explanation (its state, its self-heal), in characters at most


def _type_required(schema: dict[str, Any]) -> None:
    """The API dispatches on ``type``, so the OpenAPI document marks it required though the models default it."""
    required = schema.setdefault("required", [])
    if "type" not in required:
        required.insert(0, "type")


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_required)

    id: EventId
    time: Annotated[datetime | None, WithJsonSchema(TIME_SCHEMA)] = Field(
        None, description="When it happened (ISO 8601 or unix seconds); defaults to when tqmon received it."
    )

    @field_validator("time")
    @classmethod
    def _assume_utc(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    def timestamp(self, default: float) -> float:
        """When it happened; ``default`` (when it was received) for an event that does not say."""
        return default if self.time is None else self.time.timestamp()


class RunStarted(_Event):
    """The trainer process started (fresh or resumed); carries the warmup-relevant config."""

    type: Literal["run_started"] = "run_started"
    run_id: str = Field(min_length=1, max_length=200)
    trainer_mode: TrainerMode
    verl_version: str = Field("", max_length=50)
    config: TrainerConfig


class TrainingStarted(_Event):
    """verl picked its starting point: ``Resuming from …, setting global step to N`` or ``Training from scratch``."""

    type: Literal["training_started"] = "training_started"
    resumed_from_step: Count | None = Field(None, description="N of global_step_N, null for a fresh start")
    checkpoint_path: str | None = None


def status_counts(by_status: Mapping[Any, int] | None, groups: list[GroupCount] | None) -> dict[str, int] | None:
    """Prompt groups by status from a stated split or a composition; None when only a total is known."""
    if by_status is not None:
        return {str(status): count for status, count in by_status.items()}
    if groups is not None:
        counts: dict[str, int] = dict.fromkeys(PROMPT_STATUSES, 0)
        for group in groups:
            counts[group.status] += group.count
        return counts
    return None


def check_breakdowns(by_status: Mapping[Any, int] | None, groups: list[GroupCount] | None) -> None:
    """A stated split by status and a composition, when both are given, must count the same groups."""
    if by_status is not None and groups is not None:
        from_groups = status_counts(None, groups) or {}
        stated = {str(status): count for status, count in by_status.items()}
        if any(stated.get(status, 0) != count for status, count in from_groups.items()):
            raise ValueError(f"by_status {by_status} disagrees with groups, which count {from_groups}")


def restored_groups(groups: list[GroupCount]) -> list[RestoredGroup]:
    """The composition one group at a time, as the warmup model classifies it."""
    return [RestoredGroup(g.status, g.global_steps, g.filtered) for g in groups for _ in range(g.count)]


class GroupCount(BaseModel):
    """Restored prompt groups sharing a status and a submission step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Status
    global_steps: Count
    count: Count
    filtered: bool = Field(False, description="DAPO would reject these finished groups (zero reward variance)")


class CheckpointRestored(_Event):
    """TransferQueue state was loaded: R prompt groups restored from global_step_N."""

    type: Literal["checkpoint_restored"] = "checkpoint_restored"
    step: Count | None = Field(None, description="checkpoint step N; null attaches to the open resume")
    restored_prompt_groups: Count
    by_status: dict[Status, Count] | None = None
    groups: list[GroupCount] | None = Field(None, description="composition by status and global_steps")

    @model_validator(mode="after")
    def _breakdowns_sum_to_total(self) -> CheckpointRestored:
        total = self.restored_prompt_groups
        if self.by_status is not None and sum(self.by_status.values()) != total:
            raise ValueError(f"by_status sums to {sum(self.by_status.values())}, restored_prompt_groups is {total}")
        if self.groups is not None and sum(g.count for g in self.groups) != total:
            raise ValueError(f"groups sum to {sum(g.count for g in self.groups)}, restored_prompt_groups is {total}")
        return self

    def status_counts(self) -> dict[str, int] | None:
        """R by status, from ``by_status`` or the ``groups`` composition; None if only the total is known."""
        return status_counts(self.by_status, self.groups)


class InflightReissued(_Event):
    """``_reissue_inflight_prompts``: K pending/running groups re-issued for step N+1."""

    type: Literal["inflight_reissued"] = "inflight_reissued"
    step: Count | None = Field(None, description="the resumed step N+1")
    reissued_prompt_groups: Count
    cleared_trajectories: Count = 0
    partition: Partition = TRAIN


class WarmupDecided(_Event):
    """The warmup top-up's decision; give ``submitted_prompt_groups`` or a ``skip_reason``."""

    type: Literal["warmup_decided"] = "warmup_decided"
    target_prompt_groups: Count | None = None
    restored_prompt_groups: Count | None = None
    submitted_prompt_groups: Count | None = None
    skip_reason: SkipReason | None = None
    legacy_warmup_batches: Count | None = Field(
        None, description="verl 0.9.0 'Added {n} warmup batches': n whole batches on top of the restore"
    )


class SelfHealDecided(_Event):
    """The verl plugin's self-heal after the warmup of a resumed start (``TQMON_SELF_HEAL``): its inputs, the
    deficit ``max(0, T - (R - doomed + M))`` they give, and the fresh groups it submitted through verl's own
    ``_add_prompts_to_generate`` (0 in ``dry-run``, or when it could not)."""

    type: Literal["self_heal_decided"] = "self_heal_decided"
    mode: SelfHealMode
    target_prompt_groups: Count = Field(description="T")
    restored_prompt_groups: Count = Field(description="R")
    doomed_prompt_groups: dict[DoomReason, Count] = Field(description="doomed by reason; only the known reasons")
    warmup_prompt_groups: Count = Field(description="M: what verl's warmup submitted")
    deficit_prompt_groups: Count = Field(description="max(0, T - (R - doomed + M)), unknown reasons as 0")
    deficit_exact: bool = Field(description="every doom reason known; false: the deficit is a lower bound")
    max_top_up: Count
    planned_prompt_groups: Count = Field(description="what this mode would submit")
    submitted_prompt_groups: Count = Field(description="what was submitted: the window's extra groups")
    reason: str = Field("", max_length=PLUGIN_REASON_LENGTH, description="why, in the plugin's words")


class StepCompleted(_Event):
    """One trainer step finished."""

    type: Literal["step_completed"] = "step_completed"
    global_step: Count
    evicted_prompt_groups: dict[DoomReason, Count] = Field(default_factory=dict)
    generation_wait_seconds: NonNegativeFloat | None = Field(None, description="verl timing_s/gen")
    step_seconds: NonNegativeFloat | None = Field(None, description="verl timing_s/step: the step's duration")


class CheckpointSaved(_Event):
    """``Saving checkpoint to …/global_step_N``, optionally with the window composition saved."""

    type: Literal["checkpoint_saved"] = "checkpoint_saved"
    step: Count
    path: str | None = None
    by_status: dict[Status, Count] | None = None
    groups: list[GroupCount] | None = Field(
        None, description="prompt groups of partition train by status and global_steps (what a resume restores)"
    )
    orphan_trajectories: Count | None = Field(
        None, description="trajectory keys in partition train whose uid has no prompt key"
    )
    filter_metric: str | None = Field(
        None,
        max_length=200,
        description="the DAPO metric every finished group's `filtered` verdict was decided with; null: no verdicts",
    )

    @model_validator(mode="after")
    def _breakdowns_agree(self) -> CheckpointSaved:
        check_breakdowns(self.by_status, self.groups)
        return self

    def status_counts(self) -> dict[str, int] | None:
        """Saved prompt groups by status, from ``by_status`` or the ``groups`` composition; None if unknown."""
        return status_counts(self.by_status, self.groups)


WindowObserver = Literal["replay_buffer"]


class WindowObserved(_Event):
    """The live window of one partition: a count by status (the replay buffer's ``pending: a, …`` line), or
    the verl plugin's full view of the replay buffer after one of its syncs (``observer: replay_buffer``).

    The newest per source and partition wins. With an ``observer`` it is live data, applied without being
    stored, so a plugin posting every second does not grow the state dir (a repeated id is applied again).
    """

    type: Literal["window_observed"] = "window_observed"
    partition: Partition = TRAIN
    by_status: dict[Status, Count]
    groups: list[GroupCount] | None = Field(
        None, description="prompt groups by status and global_steps; tqmon derives the age histogram from it"
    )
    trajectories: Count | None = Field(None, description="trajectory keys of the partition")
    orphan_trajectories: Count | None = Field(None, description="trajectory keys whose uid has no prompt key")
    observer: WindowObserver | None = Field(
        None,
        description="what saw it; `replay_buffer` (the verl plugin) makes it tqmon source `replay_buffer`, "
        "and the TQ poll backs off to a cross-check while that source is fresh",
    )

    @model_validator(mode="after")
    def _groups_agree(self) -> WindowObserved:
        check_breakdowns(self.by_status, self.groups)
        return self

    def source_name(self, received_through: str) -> str:
        """The tqmon source this window counts for: its observer, else the door it came through."""
        return self.observer or received_through


PluginWindow = Literal["reporting", "off", "refused", "failed"]


class PluginStateChanged(_Event):
    """How the verl plugin reports the live window now. ``reporting``: it watches the replay buffer's syncs.
    ``off``: turned off (``TQMON_WINDOW_REPORT_INTERVAL=0``). ``refused``: verl's code differs from the pinned
    hooks, so nothing was wrapped. ``failed``: tqmon's part failed once and verl's methods were restored.

    Anything but ``reporting`` drops the plugin's window at once and wakes the TQ poll (``--ray-address``).
    """

    type: Literal["plugin_state_changed"] = "plugin_state_changed"
    window: PluginWindow
    reason: str = Field("", max_length=PLUGIN_REASON_LENGTH, description="why, in the plugin's words")


Event = Annotated[
    RunStarted
    | TrainingStarted
    | CheckpointRestored
    | InflightReissued
    | WarmupDecided
    | SelfHealDecided
    | StepCompleted
    | CheckpointSaved
    | WindowObserved
    | PluginStateChanged,
    Field(discriminator="type"),
]
EVENT_TYPES: tuple[type[_Event], ...] = (
    RunStarted,
    TrainingStarted,
    CheckpointRestored,
    InflightReissued,
    WarmupDecided,
    SelfHealDecided,
    StepCompleted,
    CheckpointSaved,
    WindowObserved,
    PluginStateChanged,
)
EVENT_TYPE_NAMES = frozenset(cls.model_fields["type"].default for cls in EVENT_TYPES)
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def describe_validation(err: ValidationError, *, batch: bool = False) -> str:
    """First few errors as ``[0].config.train_batch_size: Input should be greater than 0`` (a batch)
    or ``config.train_batch_size: …`` (a single event)."""
    parts = []
    for item in err.errors()[:5]:
        path = list(item["loc"])
        # list[Event] locates an error as (index, discriminator tag, field, ...): drop the tag, and the
        # index of a single event, so the path is the one in the posted JSON.
        if len(path) >= 2 and path[1] in EVENT_TYPE_NAMES:
            del path[1]
        if not batch and path and isinstance(path[0], int):
            del path[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        parts.append(f"{loc or 'body'}: {item['msg']}")
    return "; ".join(parts)


def parse_event(raw: object) -> Event:
    """Validate one decoded JSON object as an event (raises ``pydantic.ValidationError``)."""
    return EVENT_ADAPTER.validate_python(raw)


def dump_event(event: Event) -> str:
    return event.model_dump_json(exclude_none=True)


def load_event(text: str) -> Event:
    return EVENT_ADAPTER.validate_json(text)
