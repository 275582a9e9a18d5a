"""verl 0.9.1's async warmup and first-sample eviction arithmetic, as pure functions.

Everything here mirrors ``PPOTrainer._add_async_warmup_batches`` and ``ReplayBufferAsync`` of
verl 0.9.1 line for line, so tqmon's expected numbers are verl's numbers. No I/O, no clock.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ASYNC_MODES = frozenset({"colocate_async", "separate_async"})
TRAINER_MODES = frozenset({"sync", *ASYNC_MODES})
OFF_POLICY_STRATEGIES = frozenset({"drop", "wait"})
PROMPT_STATUSES = ("pending", "running", "finished", "failure")
INFLIGHT_STATUSES = frozenset({"pending", "running"})
DOOM_REASONS = ("failure", "stale", "filtered")


class WarmupState(enum.StrEnum):
    """What the warmup top-up did at one (re)start; the values of ``tqmon_resume_warmup_state``."""

    FRESH_START = "fresh_start"
    TOPPED_UP = "topped_up"
    SKIPPED_FULL = "skipped_full"
    SKIPPED_OVER_RESTORED = "skipped_over_restored"
    DISABLED = "disabled"
    SYNC_MODE = "sync_mode"
    LEGACY_UNCONDITIONAL = "legacy_unconditional"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class WarmupConfig:
    """The trainer settings that decide the warmup (verl config paths in the comments)."""

    trainer_mode: str  # trainer.v1.trainer_mode
    train_batch_size: int  # data.train_batch_size
    num_warmup_batches: float  # trainer.v1.<mode>.num_warmup_batches
    gen_batch_size: int | None = None  # data.gen_batch_size (forced to 1 in async modes)
    skip_rollout_tq: bool = False  # skip.rollout_tq.enable
    max_off_policy_threshold: int | None = 8  # trainer.v1.sampler.max_off_policy_threshold
    max_off_policy_strategy: str = "drop"  # trainer.v1.sampler.max_off_policy_strategy
    filter_groups: bool = False  # algorithm.filter_groups.enable
    filter_groups_metric: str | None = None  # algorithm.filter_groups.metric ("reward": the summed rm_scores)

    def __post_init__(self) -> None:
        if self.trainer_mode not in TRAINER_MODES:
            raise ValueError(f"trainer_mode must be one of {sorted(TRAINER_MODES)}, got {self.trainer_mode!r}")
        if self.train_batch_size <= 0:
            raise ValueError(f"train_batch_size must be positive, got {self.train_batch_size}")
        if self.gen_batch_size is not None and self.gen_batch_size <= 0:
            raise ValueError(f"gen_batch_size must be positive or null, got {self.gen_batch_size}")
        if self.max_off_policy_strategy not in OFF_POLICY_STRATEGIES:
            raise ValueError(
                f"max_off_policy_strategy must be one of {sorted(OFF_POLICY_STRATEGIES)}, "
                f"got {self.max_off_policy_strategy!r}"
            )

    @property
    def effective_gen_batch_size(self) -> int:
        """verl's ``_create_dataloader`` forces 1 in async modes (and with DAPO); else the user value or B."""
        if self.trainer_mode in ASYNC_MODES or self.filter_groups:
            return 1
        return self.gen_batch_size or self.train_batch_size


def target_window(config: WarmupConfig) -> int:
    """T = floor(nwb * B / gbs) * gbs: the post-warmup prefetch window in prompt groups."""
    if config.num_warmup_batches <= 0:
        return 0
    gbs = config.effective_gen_batch_size
    return math.floor(config.num_warmup_batches * config.train_batch_size / gbs) * gbs


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


def legacy_submitted(config: WarmupConfig, warmup_batches: int) -> int:
    """Prompts verl 0.9.0 submitted for ``Added {n} warmup batches``: n whole train batches, always."""
    return warmup_batches * config.train_batch_size


def is_legacy_unconditional(restored: int, target: int, submitted: int) -> bool:
    """A top-up that ignored a non-empty restore: the verl 0.9.0 signature (the window grows by T)."""
    return restored > 0 and target > 0 and submitted == target and submitted > max(0, target - restored)


def is_legacy_version(verl_version: str) -> bool:
    """A verl release before 0.9.1, whose warmup ignored the restore ("" or unparsable: not known to be)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", verl_version)
    return match is not None and tuple(map(int, match.groups())) < (0, 9, 1)


def is_legacy_growth(previous_restored: int, restored: int, target: int) -> bool:
    """Consecutive resumes whose R grew by exactly T: each 0.9.0 resume stacked another full window."""
    return target > 0 and previous_restored > 0 and restored - previous_restored == target


@dataclass(frozen=True, slots=True)
class RestoredGroup:
    """One restored prompt group, as much of it as doom classification needs."""

    status: str
    global_steps: int
    filtered: bool = False  # DAPO would reject it (zero reward variance); only a plugin can know


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
    counts = dict.fromkeys(DOOM_REASONS, 0)
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


def under_submitted(target: int, restored: int, doomed: int, submitted: int) -> int:
    """max(0, T - (R - doomed + M)): useful work missing from the window right after warmup."""
    if doomed > restored:
        raise ValueError(f"doomed ({doomed}) cannot exceed restored ({restored})")
    return max(0, target - (restored - doomed + submitted))
