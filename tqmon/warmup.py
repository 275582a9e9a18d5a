"""verl 0.9.1's trainer settings and its async warmup and first-sample eviction arithmetic, as pure functions.

Everything here mirrors ``PPOTrainer._add_async_warmup_batches`` and ``ReplayBufferAsync`` of
verl 0.9.1 line for line, so tqmon's expected numbers are verl's numbers; verl 0.9.0's unconditional warmup is
modelled beside it (``legacy_*``). No I/O, no clock.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

TrainerMode = Literal["colocate_async", "separate_async", "sync"]
TRAINER_MODES = frozenset(get_args(TrainerMode))
ASYNC_MODES = TRAINER_MODES - {"sync"}
OffPolicyStrategy = Literal["drop", "wait"]
PromptStatus = Literal["pending", "running", "finished", "failure"]
PROMPT_STATUSES: tuple[PromptStatus, ...] = get_args(PromptStatus)
INFLIGHT_STATUSES = frozenset({"pending", "running"})
DoomReason = Literal["failure", "stale", "filtered"]
DOOM_REASONS: tuple[DoomReason, ...] = get_args(DoomReason)
Partition = Literal["train", "val"]  # the TransferQueue partitions verl uses: training and validation
PARTITIONS: tuple[Partition, ...] = get_args(Partition)
TRAIN: Partition = "train"  # the partition of the prefetch window; the only one the warmup fills
TQ_DIR = "transfer_queue"  # the folder of a checkpoint that holds TransferQueue's state
STEP_DIR = "global_step_{}"  # a checkpoint's folder under trainer.default_local_dir
LATEST_FILE = "latest_checkpointed_iteration.txt"  # names the step resume_mode=auto resumes from
SkipReason = Literal["window_full", "sync_mode", "skip_rollout_tq", "non_positive_warmup"]
# The warmup a verl release runs at a resume: 0.9.1's top-up of max(0, T - R), or 0.9.0's num_warmup_batches whole
# batches on top of the restore. Newest first: the order a prediction shows both in when the version is unknown.
Semantics = Literal["verl-0.9.1", "verl-0.9.0"]
SEMANTICS: tuple[Semantics, ...] = get_args(Semantics)
CURRENT: Semantics = "verl-0.9.1"
LEGACY: Semantics = "verl-0.9.0"
SelfHealMode = Literal["off", "dry-run", "on"]  # the plugin's self-heal: off (default), record only, submit
SELF_HEAL_MODES: tuple[SelfHealMode, ...] = get_args(SelfHealMode)


def _not_bool(value: object) -> object:
    """``true`` is not a number, though pydantic would read it as 1. (A string may be: Hydra's ``oc.env``
    interpolation resolves to one, and verl casts it by the field's type as pydantic does.)"""
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


NOT_BOOL = BeforeValidator(_not_bool)  # on every numeric trainer setting
MAX_SETTING = 2**53  # bounds the sizes so T (and every count derived from them) stays finite and exact


class WarmupState(enum.StrEnum):
    """What the warmup top-up did at one (re)start; the values of ``tqmon_resume_warmup_state``."""

    FRESH_START = "fresh_start"
    TOPPED_UP = "topped_up"
    SKIPPED_FULL = "skipped_full"
    SKIPPED_OVER_RESTORED = "skipped_over_restored"
    DISABLED = "disabled"
    SYNC_MODE = "sync_mode"
    LEGACY_UNCONDITIONAL = "legacy_unconditional"
    LOST_WINDOW = "lost_window"  # resumed (async) from a checkpoint without transfer_queue/: the window was refilled
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Verl:
    """Where a trainer setting lives in verl's Hydra config (``<mode>``: the trainer mode), and its flag's help."""

    path: str
    help: str


class TrainerConfig(BaseModel):
    """The verl settings that decide the warmup and the first sample's evictions.

    Each is declared here once, with its verl path and default: the event schema (``run_started``'s
    config), the Hydra reader and the CLI flags are derived from these fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    train_batch_size: Annotated[
        int,
        Field(gt=0, le=MAX_SETTING, description="data.train_batch_size"),
        NOT_BOOL,
        Verl("data.train_batch_size", "data.train_batch_size (B); needed for T."),
    ]
    gen_batch_size: Annotated[
        int | None,
        Field(gt=0, le=MAX_SETTING, description="data.gen_batch_size (async modes force 1)"),
        NOT_BOOL,
        Verl("data.gen_batch_size", "data.gen_batch_size (the async modes and DAPO force 1)."),
    ] = None
    num_warmup_batches: Annotated[
        float,
        Field(
            le=MAX_SETTING, allow_inf_nan=False, description="trainer.v1.<mode>.num_warmup_batches (may be fractional)"
        ),
        NOT_BOOL,
        Verl(
            "trainer.v1.<mode>.num_warmup_batches",
            "trainer.v1.<mode>.num_warmup_batches (may be fractional); needed for T.",
        ),
    ]
    skip_rollout_tq: Annotated[
        bool,
        Field(strict=True, description="skip.rollout_tq.enable"),  # 0 or "yes" is not a boolean
        Verl("skip.rollout_tq.enable", "skip.rollout_tq.enable (disables the warmup)."),
    ] = False
    max_off_policy_threshold: Annotated[
        int | None,
        Field(description="trainer.v1.sampler.max_off_policy_threshold"),
        NOT_BOOL,
        Verl("trainer.v1.sampler.max_off_policy_threshold", "trainer.v1.sampler.max_off_policy_threshold, or 'null'."),
    ] = 8
    max_off_policy_strategy: Annotated[
        OffPolicyStrategy,
        Field(description="trainer.v1.sampler.max_off_policy_strategy"),
        Verl(
            "trainer.v1.sampler.max_off_policy_strategy",
            "trainer.v1.sampler.max_off_policy_strategy (only 'drop' evicts stale groups).",
        ),
    ] = "drop"
    filter_groups: Annotated[
        bool,
        Field(strict=True, description="algorithm.filter_groups.enable"),
        Verl("algorithm.filter_groups.enable", "algorithm.filter_groups.enable (DAPO)."),
    ] = False
    filter_groups_metric: Annotated[
        str | None,
        Field(max_length=200, description="algorithm.filter_groups.metric (the checkpoint predicts DAPO with it)"),
        Verl(
            "algorithm.filter_groups.metric",
            "algorithm.filter_groups.metric: with --filter-groups, the checkpoint's storage units predict "
            "the groups DAPO filters ('reward' reads rm_scores).",
        ),
    ] = None
    rollout_n: Annotated[
        int | None,
        Field(gt=0, le=MAX_SETTING, description="actor_rollout_ref.rollout.n"),
        NOT_BOOL,
        Verl(
            "actor_rollout_ref.rollout.n",
            "actor_rollout_ref.rollout.n: trajectories per prompt group; needed for the rollouts a resume wasted.",
        ),
    ] = None

    @property
    def dapo_metric(self) -> str | None:
        """The metric to read from a checkpoint's storage units: only when DAPO is on and its metric is known."""
        return self.filter_groups_metric if self.filter_groups else None

    def warmup_config(self, trainer_mode: str) -> WarmupConfig:
        return WarmupConfig(trainer_mode=trainer_mode, **self.model_dump())


def verl_setting(name: str) -> Verl:
    """The verl path and help of one :class:`TrainerConfig` field."""
    return next(item for item in TrainerConfig.model_fields[name].metadata if isinstance(item, Verl))


class WarmupConfig(TrainerConfig):
    """The trainer settings with the trainer mode (``trainer.v1.trainer_mode``): all the warmup depends on."""

    trainer_mode: TrainerMode

    @property
    def effective_gen_batch_size(self) -> int:
        """verl's ``_create_dataloader`` forces 1 in async modes (and with DAPO); else the user value or B."""
        if self.trainer_mode in ASYNC_MODES or self.filter_groups:
            return 1
        return self.gen_batch_size or self.train_batch_size


@dataclass(frozen=True, slots=True)
class GivenConfig:
    """A trainer config tqmon was given before any ``run_started`` (which overrides it), and from where."""

    trainer_mode: str
    config: TrainerConfig
    origin: str  # "flags" or "file:<path>"
    run_id: str = ""  # "<trainer.project_name>/<trainer.experiment_name>" from a config file

    @property
    def warmup(self) -> WarmupConfig:
        return self.config.warmup_config(self.trainer_mode)


def target_window(config: WarmupConfig) -> int:
    """T = floor(nwb * B / gbs) * gbs: the post-warmup prefetch window in prompt groups."""
    if config.num_warmup_batches <= 0:
        return 0
    gbs = config.effective_gen_batch_size
    return math.floor(config.num_warmup_batches * config.train_batch_size / gbs) * gbs


# verl 0.9.1's defaults for the settings that decide evictions (ppo_trainer.yaml: max_off_policy_threshold 8,
# max_off_policy_strategy drop, algorithm.filter_groups.enable False). T's settings are placeholders that the
# doom classification never reads.
VERL_EVICTION_DEFAULTS = WarmupConfig(trainer_mode="colocate_async", train_batch_size=1, num_warmup_batches=0)
EVICTION_SETTINGS = ("max_off_policy_threshold", "max_off_policy_strategy", "filter_groups")


def eviction_rules(config: WarmupConfig | None, per_group: bool) -> tuple[WarmupConfig, tuple[str, ...]]:
    """The config that decides which restored groups are doomed, and the verl defaults it assumed (named
    ``setting=value``): without the trainer config, verl's defaults make filtered computable, and stale too
    when the groups' steps (``per_group``) are known."""
    if config is not None:
        return config, ()
    defaults = VERL_EVICTION_DEFAULTS.model_dump()
    used = EVICTION_SETTINGS if per_group else ("filter_groups",)
    return VERL_EVICTION_DEFAULTS, tuple(f"{name}={_setting(defaults[name])}" for name in used)


def _setting(value: object) -> str:
    """A setting's value as verl's YAML writes it (``false``, ``null``, ``drop``)."""
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def restores_tq(config: WarmupConfig | None) -> bool:
    """verl loads TransferQueue state on a resume in the async modes only (sync mode keeps no window)."""
    return config is None or config.trainer_mode != "sync"


def window_target(config: WarmupConfig | None) -> int | None:
    """T, or None where verl defines none: its warmup returns before computing one when ``skip.rollout_tq``
    is on (it replays cached rollouts) or ``num_warmup_batches <= 0``. Sync mode keeps no window, and
    verl's warmup counts its T as 0 there."""
    if config is None:
        return None
    if not restores_tq(config):
        return 0
    if config.skip_rollout_tq or config.num_warmup_batches <= 0:
        return None
    return target_window(config)


@dataclass(frozen=True, slots=True)
class WarmupDecision:
    """What verl 0.9.1 does in ``on_train_begin`` for a given restore."""

    target: int  # T
    restored: int  # R
    submitted: int  # M actually submitted (0 when skipped or disabled)
    over_restored: int  # O = max(0, R - T)
    state: WarmupState
    logged: bool  # whether verl writes a warmup log line for this decision


def decide_warmup(config: WarmupConfig, restored: int, *, resumed: bool) -> WarmupDecision:
    """Reproduce ``_add_async_warmup_batches`` for ``restored`` prompt groups (R is 0 in sync mode)."""
    if restored < 0:
        raise ValueError(f"restored prompt groups must be >= 0, got {restored}")
    target = target_window(config)
    if config.trainer_mode == "sync":
        return WarmupDecision(0, 0, 0, 0, WarmupState.SYNC_MODE, logged=False)
    over = max(0, restored - target)
    if config.skip_rollout_tq or config.num_warmup_batches <= 0:
        return WarmupDecision(target, restored, 0, over, WarmupState.DISABLED, logged=False)
    missing = max(0, target - restored)
    if missing == 0:
        state = WarmupState.SKIPPED_OVER_RESTORED if over > 0 else WarmupState.SKIPPED_FULL
    else:
        state = WarmupState.TOPPED_UP if resumed else WarmupState.FRESH_START
    return WarmupDecision(target, restored, missing, over, state, logged=True)


def skip_reason(config: WarmupConfig) -> SkipReason:
    """Why a warmup that submits nothing does so, in the order verl 0.9.1 checks (the ``skip_reason`` values)."""
    if config.trainer_mode == "sync":
        return "sync_mode"
    if config.skip_rollout_tq:
        return "skip_rollout_tq"
    if config.num_warmup_batches <= 0:
        return "non_positive_warmup"
    return "window_full"


def legacy_submitted(config: WarmupConfig, warmup_batches: int) -> int:
    """Prompts verl 0.9.0 submitted for ``Added {n} warmup batches``: n whole train batches, always."""
    return warmup_batches * config.train_batch_size


class LegacyWarmupFails(ValueError):
    """verl 0.9.0's warmup cannot run with this config: the trainer stops there (the message says why)."""


def legacy_warmup_batches(config: WarmupConfig) -> int | None:
    """n of verl 0.9.0's ``on_train_begin``: ``for _ in range(num_warmup_batches)`` submits one train batch each,
    whatever was restored. None where it runs no such loop and decides as 0.9.1 does (sync mode, whose trainer
    has no async warmup, and ``skip.rollout_tq``, which returns first); ``range`` of 0 or less submits nothing.

    Raises :class:`LegacyWarmupFails` for a fractional ``num_warmup_batches``: ``range`` refuses a float."""
    if config.trainer_mode == "sync" or config.skip_rollout_tq:
        return None
    batches = config.num_warmup_batches
    if not batches.is_integer():
        raise LegacyWarmupFails(
            f"verl 0.9.0 loops range(num_warmup_batches): {batches:g} is not a whole number, so its warmup raises "
            "TypeError and the trainer stops"
        )
    return max(0, int(batches))


def is_legacy_unconditional(restored: int, target: int, submitted: int) -> bool:
    """A top-up that ignored a non-empty restore: the verl 0.9.0 signature (the window grows by T)."""
    return restored > 0 and target > 0 and submitted == target and submitted > max(0, target - restored)


def release(verl_version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a verl version string ("0.9.1", "0.9.0rc1"); None when it names no release."""
    match = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)", verl_version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def version_semantics(verl_version: str) -> Semantics | None:
    """The warmup a verl release runs: a release before 0.9.1 ignored the restore; None when the string names
    no release ("" included), so the semantics stay unknown rather than assumed."""
    parsed = release(verl_version)
    if parsed is None:
        return None
    return LEGACY if parsed < (0, 9, 1) else CURRENT


def is_legacy_growth(previous_restored: int, restored: int, target: int) -> bool:
    """Consecutive resumes whose R grew by exactly T: each 0.9.0 resume stacked another full window."""
    return target > 0 and previous_restored > 0 and restored - previous_restored == target


@dataclass(frozen=True, slots=True)
class RestoredGroup:
    """One restored prompt group, as much of it as doom classification needs."""

    status: str
    global_steps: int
    filtered: bool = False  # DAPO would reject it (zero metric variance): a plugin's or the storage units' verdict


def is_stale(config: WarmupConfig, group_global_steps: int, sample_step: int) -> bool:
    """``ReplayBufferAsync._stale_terminal_keys`` for one finished group sampled at ``sample_step``."""
    if config.max_off_policy_threshold is None or config.max_off_policy_strategy != "drop":
        return False
    return sample_step - group_global_steps + 1 > config.max_off_policy_threshold


def doom_reason(config: WarmupConfig, group: RestoredGroup, sample_step: int) -> str | None:
    """Why the first sample at ``sample_step`` evicts this group: failure > stale > filtered, or None."""
    if group.status == "failure":
        return "failure"
    if group.status != "finished":
        return None  # in-flight groups are re-issued, not evicted
    if is_stale(config, group.global_steps, sample_step):
        return "stale"
    if config.filter_groups and group.filtered:
        return "filtered"
    return None


def classify_doomed(config: WarmupConfig, groups: Iterable[RestoredGroup], checkpoint_step: int) -> dict[str, int]:
    """Doomed restored groups by reason for a resume from ``global_step_{checkpoint_step}``.

    Each group counts once; the first sample after the resume happens at step N+1.
    """
    counts: dict[str, int] = dict.fromkeys(DOOM_REASONS, 0)
    for group in groups:
        reason = doom_reason(config, group, checkpoint_step + 1)
        if reason is not None:
            counts[reason] += 1
    return counts


def known_doomed(
    config: WarmupConfig | None,
    statuses: Mapping[str, int] | None,
    groups: Sequence[RestoredGroup] | None,
    checkpoint_step: int,
    *,
    filter_verdicts: bool = False,
) -> dict[str, int] | None:
    """Doomed groups by the reasons what was observed can decide; None when it decides none.

    With the composition and the config all three are decided, except ``filtered`` under DAPO when no
    group carries a verdict: ``filter_verdicts`` says every finished group's ``filtered`` flag was decided
    from its metric (the checkpoint's storage units), so ``False`` means kept, not unknown. Without it
    only a plugin's ``filtered=True`` decides. With the statuses alone: ``failure``, plus the reasons the
    config rules out.
    """
    if groups is not None and config is not None:
        doomed = classify_doomed(config, groups, checkpoint_step)
        if config.filter_groups and not filter_verdicts and not any(group.filtered for group in groups):
            del doomed["filtered"]
        return doomed
    known: dict[str, int] = {}
    if statuses is not None:
        known["failure"] = statuses.get("failure", 0)
    if config is not None:
        if config.max_off_policy_threshold is None or config.max_off_policy_strategy != "drop":
            known["stale"] = 0
        if not config.filter_groups:
            known["filtered"] = 0
    return known or None


def pairwise_sum(values: Sequence[float]) -> float:
    """``numpy.add.reduce`` of a float64 array: numpy's pairwise summation, bit for bit (numpy 2.x)."""

    def block(lo: int, n: int) -> float:
        if n < 8:
            total = 0.0
            for i in range(lo, lo + n):
                total += values[i]
            return total
        if n <= 128:
            r = [float(v) for v in values[lo : lo + 8]]
            i = 8
            while i < n - n % 8:
                for j in range(8):
                    r[j] += values[lo + i + j]
                i += 8
            total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
            for k in range(lo + i, lo + n):
                total += values[k]
            return total
        half = n // 2
        half -= half % 8
        return block(lo, half) + block(lo + half, n - half)

    return block(0, len(values))


def is_zero_variance(values: Sequence[float]) -> bool:
    """verl 0.9.1's DAPO test for one finished group: ``len(values) > 1 and float(np.std(values)) == 0.0``.

    ``np.std`` is zero exactly when every squared deviation from numpy's mean is zero, so the mean must be
    numpy's: three trajectories of 0.1 have a mean of 0.10000000000000002 and are *not* filtered.
    A NaN or an infinity makes the deviation NaN: never filtered.
    """
    if len(values) < 2:
        return False
    mean = pairwise_sum(values) / len(values)
    return all((v - mean) * (v - mean) == 0.0 for v in values)


def unknown_doom_reasons(doomed: Mapping[str, int] | None) -> list[DoomReason]:
    """The doom reasons not known (each counts as 0), in verl's order; all of them when none is known."""
    return [reason for reason in DOOM_REASONS if reason not in (doomed or {})]


def doomed_complete(doomed: Mapping[str, int] | None) -> bool:
    """Every doom reason is known, so the deficit computed from them is exact: the one place that decides
    (the record's ``under_submitted_lower_bound``, which the views read, comes from here)."""
    return doomed is not None and not unknown_doom_reasons(doomed)


def under_submitted(target: int, restored: int, doomed: int, submitted: int) -> int:
    """max(0, T - (R - doomed + M)): useful work missing from the window right after warmup."""
    if doomed > restored:
        raise ValueError(f"doomed ({doomed}) cannot exceed restored ({restored})")
    return max(0, target - (restored - doomed + submitted))


@dataclass(frozen=True, slots=True)
class TopUp:
    """The self-heal's decision for one resume: the deficit and how many groups close it."""

    deficit: int  # max(0, T - (R - doomed + M)), unknown doom reasons counted as 0
    exact: bool  # every doom reason known: the deficit is exact, not a lower bound
    planned: int  # groups to submit: the deficit, capped, in whole gen_batch_size chunks
    reason: str  # why ``planned`` is what it is, in a sentence


def plan_top_up(
    config: WarmupConfig, restored: int, doomed: Mapping[str, int] | None, submitted: int, cap: int
) -> TopUp:
    """How many fresh groups make the window T again after verl's warmup submitted ``submitted`` (M).

    The deficit is :func:`under_submitted` of the doomed groups :func:`known_doomed` decided, never a second
    formula. A lower bound (a doom reason unknown) is submitted as far as it is known; the cap and verl's
    dataloader granularity (whole ``gen_batch_size`` fetches) only ever lower the number.
    """
    target = target_window(config)
    if config.trainer_mode == "sync" or config.skip_rollout_tq or config.num_warmup_batches <= 0:
        return TopUp(0, doomed_complete(doomed), 0, f"the warmup is off ({skip_reason(config)}): nothing to top up")
    lost = sum((doomed or {}).values())
    deficit = under_submitted(target, restored, min(lost, restored), submitted)
    exact = doomed_complete(doomed)
    chunk = config.effective_gen_batch_size
    planned = min(deficit, cap) // chunk * chunk
    unknown = "" if exact else f" (a lower bound: doomed {', '.join(unknown_doom_reasons(doomed))} not known)"
    parts = [f"deficit {deficit}{unknown}"]
    if deficit > cap:
        parts.append(f"capped at max_top_up {cap}")
    if planned < min(deficit, cap):
        parts.append(f"rounded down to whole gen_batch_size {chunk} fetches")
    return TopUp(deficit, exact, planned, "; ".join(parts))
