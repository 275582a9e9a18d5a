"""Named simulator scenarios, as data: the trainer config, the rollout's behaviour and what changes at resume.

Every scenario runs a fresh start, is preempted after ``steps_before_preemption`` steps (the steps after the
last checkpoint are lost) and resumes from the latest checkpoint for ``steps_after_resume`` steps. The
rollout's behaviour is a cycled pattern over the dataloader index, not random draws, so that the expected
numbers of a scenario can be derived by hand (tests/test_sim.py does it for each one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

VERL_VERSIONS = ("0.9.1", "0.9.0")
LOG_FILE = "trainer.log"  # in the workdir: verl's log lines
CHECKPOINT_DIR = "checkpoints"  # in the workdir: verl's trainer.default_local_dir


@dataclass(frozen=True, slots=True)
class Every:
    """Dataloader indexes ``i`` with ``i % period == phase``; ``period == 0`` selects none."""

    period: int = 0
    phase: int = 0

    def hits(self, index: int) -> bool:
        return self.period > 0 and index % self.period == self.phase


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """How each prompt's rollout goes, by dataloader index (so a re-issued prompt behaves as before)."""

    latencies: tuple[int, ...] = (1, 2)  # rollout ticks until terminal, cycled; one tick per trained step
    failures: Every = field(default_factory=Every)  # the last session errors: the group ends in "failure"
    zero_variance: Every = field(default_factory=Every)  # all sessions get the same reward: DAPO filters it

    def latency(self, index: int) -> int:
        return self.latencies[index % len(self.latencies)]


@dataclass(frozen=True, slots=True)
class TrainerSettings:
    """The verl knobs the simulated trainer honours (verl's config path in the comments)."""

    train_batch_size: int = 4  # data.train_batch_size (B); gen_batch_size is 1 in the async modes
    num_warmup_batches: float = 2  # trainer.v1.colocate_async.num_warmup_batches
    max_off_policy_threshold: int | None = 8  # trainer.v1.sampler.max_off_policy_threshold
    max_off_policy_strategy: str = "drop"  # trainer.v1.sampler.max_off_policy_strategy
    filter_groups: bool = False  # algorithm.filter_groups.enable (DAPO, metric "reward")
    skip_rollout_tq: bool = False  # skip.rollout_tq.enable
    rollout_n: int = 2  # actor_rollout_ref.rollout.n: sessions (trajectories) per prompt group
    save_freq: int = 2  # trainer.save_freq
    save_tq_state: bool = True  # False: checkpoints without transfer_queue/ (a verl that did not save it)
    verl_version: str = "0.9.1"  # "0.9.0": unconditional warmup of whole batches, no "Restored" line
    count_every_key: bool = False  # not a knob but a trainer bug: R counts trajectory keys as prompt groups too

    def __post_init__(self) -> None:
        if self.verl_version not in VERL_VERSIONS:
            raise ValueError(f"verl_version must be one of {VERL_VERSIONS}, got {self.verl_version!r}")
        if self.verl_version == "0.9.0" and self.num_warmup_batches != int(self.num_warmup_batches):
            raise ValueError("verl 0.9.0 loops range(num_warmup_batches): it must be a whole number")
        if min(self.train_batch_size, self.rollout_n, self.save_freq) < 1:
            raise ValueError("train_batch_size, rollout_n and save_freq must be positive")

    @property
    def warmup_enabled(self) -> bool:
        return not self.skip_rollout_tq and self.num_warmup_batches > 0

    @property
    def target_window(self) -> int:
        """verl 0.9.1's target ``floor(nwb * B / gbs) * gbs`` with gbs = 1 (forced in the async modes)."""
        return math.floor(self.num_warmup_batches * self.train_batch_size)

    def tqmon_flags(self) -> list[str]:
        """The ``tqmon serve``/``inspect`` trainer-config flags that describe this trainer."""
        threshold = self.max_off_policy_threshold
        flags = [
            "--trainer-mode",
            "colocate_async",
            "--train-batch-size",
            str(self.train_batch_size),
            "--num-warmup-batches",
            f"{self.num_warmup_batches:g}",
            "--max-off-policy-threshold",
            "null" if threshold is None else str(threshold),
            "--max-off-policy-strategy",
            self.max_off_policy_strategy,
            "--rollout-n",
            str(self.rollout_n),
        ]
        flags += ["--skip-rollout-tq"] if self.skip_rollout_tq else []
        return flags + (["--filter-groups"] if self.filter_groups else [])


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    before: TrainerSettings  # the run that is preempted
    after: TrainerSettings  # the config in force at the resume (and what tqmon should be told)
    rollout: RolloutPlan = field(default_factory=RolloutPlan)
    steps_before_preemption: int = 3
    steps_after_resume: int = 1


HEALTHY = TrainerSettings()
LEGACY = replace(HEALTHY, verl_version="0.9.0")
SKIP = replace(HEALTHY, skip_rollout_tq=True)
DOOMED = replace(HEALTHY, max_off_policy_threshold=2)
NO_TQ = replace(HEALTHY, save_tq_state=False)
MISCOUNTED = replace(HEALTHY, num_warmup_batches=5, count_every_key=True)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("healthy-resume", "the checkpoint holds exactly the window: nothing to top up", HEALTHY, HEALTHY),
        Scenario(
            "partial-restore",
            "num_warmup_batches raised from 2 to 2.5 at resume: the restore fills 8 of 10, warmup adds 2",
            HEALTHY,
            replace(HEALTHY, num_warmup_batches=2.5),
        ),
        Scenario(
            "over-restore",
            "train_batch_size lowered from 8 to 4 at resume: 16 groups restored into an 8-prompt window",
            replace(HEALTHY, train_batch_size=8),
            HEALTHY,
        ),
        Scenario(
            "terminal-only",
            "every rollout ends within a step: only finished and failed groups are restored, nothing re-issued",
            HEALTHY,
            HEALTHY,
            RolloutPlan(latencies=(1,), failures=Every(6, 5)),
        ),
        Scenario(
            "doomed-mix",
            "max_off_policy_threshold 2 and failing rollouts: restored failures and stale groups are evicted at once",
            DOOMED,
            DOOMED,
            RolloutPlan(failures=Every(6, 4)),
        ),
        Scenario(
            "legacy-double-warmup",
            "verl 0.9.0: the warmup submits num_warmup_batches whole batches on top of the restore",
            LEGACY,
            LEGACY,
            steps_after_resume=2,
        ),
        Scenario(
            "miscounted-restore",
            "a trainer bug counts trajectory keys as restored groups (30 for a 20-prompt window, really 8):"
            " the warmup adds nothing and the live window stays under-filled",
            HEALTHY,
            MISCOUNTED,
        ),
        Scenario(
            "no-tq-checkpoint",
            "checkpoints without transfer_queue/: the resume restores nothing and warms up the whole window",
            NO_TQ,
            NO_TQ,
        ),
        Scenario(
            "skip-rollout-tq",
            "skip.rollout_tq.enable: no warmup, so no prefetch window survives a step",
            SKIP,
            SKIP,
        ),
    )
}
