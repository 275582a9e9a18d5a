"""The simulated ``ReplayBufferAsync.sample`` of verl 0.9.1, reading and clearing a real TransferQueue.

Each poll reads ``kv_list``, evicts failed, stale (``drop`` strategy) and DAPO-filtered terminal groups
and refills them 1:1; once ``batch_size`` finished groups are sampleable it takes the oldest (by
``global_steps``) and clears their prompt keys. Their trajectories stay until the trainer clears them
after the step, so a checkpoint saved in between holds them as orphans, like verl's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transfer_queue as tq

from tqmon.sim.rollout import PARTITION
from tqmon.sim.scenarios import TrainerSettings

DOOM_REASONS = ("failure", "stale", "filtered")
STATUSES = ("pending", "running", "finished", "failure")


@dataclass(frozen=True, slots=True)
class Window:
    """One ``kv_list`` of the train partition, split like verl's ``_sync_metadata_from_transfer_queue``."""

    prompts: dict[str, dict[str, Any]]  # uid -> tag
    trajectories: dict[str, list[str]]  # uid -> its trajectory keys

    @classmethod
    def read(cls) -> Window:
        items: dict[str, dict[str, Any]] = tq.kv_list(PARTITION).get(PARTITION, {})
        prompts = {key: tag for key, tag in items.items() if tag.get("is_prompt", False)}
        trajectories: dict[str, list[str]] = {}
        for key, tag in items.items():
            if not tag.get("is_prompt", False):
                trajectories.setdefault(key.split("_", 1)[0], []).append(key)
        return cls(prompts, trajectories)

    def with_status(self, *statuses: str) -> list[str]:
        return sorted(uid for uid, tag in self.prompts.items() if tag["status"] in statuses)

    def by_status(self) -> dict[str, int]:
        return {status: len(self.with_status(status)) for status in STATUSES}

    def trajectory_keys(self, uids: list[str]) -> list[str]:
        return [key for uid in uids for key in self.trajectories.get(uid, [])]


@dataclass
class Sample:
    uids: list[str]  # the sampled prompt groups
    trajectory_keys: list[str]  # what the trainer trains on, then clears
    first_evictions: dict[str, int]  # evicted by the first poll: at a resume, the doomed restored groups
    evictions: dict[str, int]  # evicted by every poll of the sample: what verl logs as the step's evicted_samples


class ReplayBuffer:
    def __init__(
        self,
        settings: TrainerSettings,
        refill: Callable[[int], None],
        wait: Callable[[Window], None],
    ) -> None:
        self.settings = settings
        self.refill = refill  # submits exactly n fresh prompts
        self.wait = wait  # one poll interval: the rollout makes progress meanwhile
        self._zero_variance: dict[str, bool] = {}  # finished groups never change: classify once

    def sample(self, step: int, batch_size: int) -> Sample:
        first: dict[str, int] | None = None
        total = dict.fromkeys(DOOM_REASONS, 0)
        while True:
            window = Window.read()
            evicted = self._eviction_reasons(window, step)
            counts = {reason: sum(r == reason for r in evicted.values()) for reason in DOOM_REASONS}
            total = {reason: total[reason] + counts[reason] for reason in DOOM_REASONS}
            if first is None:
                first = counts
            if evicted:
                uids = sorted(evicted)
                tq.kv_clear(keys=[*uids, *window.trajectory_keys(uids)], partition_id=PARTITION)
                self.refill(len(uids))
                continue
            finished = window.with_status("finished")
            if len(finished) >= batch_size:
                # oldest first; the uid breaks ties (the simulator's uids sort in dataloader order)
                chosen = sorted(finished, key=lambda uid: (window.prompts[uid]["global_steps"], uid))[:batch_size]
                tq.kv_clear(keys=chosen, partition_id=PARTITION)
                return Sample(chosen, window.trajectory_keys(chosen), first, total)
            self.wait(window)

    def _eviction_reasons(self, window: Window, step: int) -> dict[str, str]:
        """uid -> why it goes, each group once (failure > stale > filtered), like ``_terminal_eviction_reasons``."""
        reasons = dict.fromkeys(window.with_status("failure"), "failure")
        finished = window.with_status("finished")
        threshold = self.settings.max_off_policy_threshold
        if threshold is not None and self.settings.max_off_policy_strategy == "drop":
            reasons |= {u: "stale" for u in finished if step - window.prompts[u]["global_steps"] + 1 > threshold}
        if self.settings.filter_groups:
            reasons |= {u: "filtered" for u in finished if u not in reasons and self._filtered(window, u)}
        return reasons

    def _filtered(self, window: Window, uid: str) -> bool:
        """DAPO with metric "reward": every trajectory of the group has the same summed ``rm_scores``."""
        if uid not in self._zero_variance:
            keys = window.trajectory_keys([uid])
            rewards = tq.kv_batch_get(keys=keys, partition_id=PARTITION, select_fields=["rm_scores"])["rm_scores"]
            totals = rewards.float().sum(dim=-1)
            self._zero_variance[uid] = len(keys) > 1 and float(torch.std(totals, unbiased=False)) == 0.0
        return self._zero_variance[uid]


def log_window(log: logging.Logger, window: Window) -> None:
    """verl's ``_wait_for_next_poll`` debug line (verl rate-limits it to once a minute; the simulator does not)."""
    c = window.by_status()
    log.info(f"pending: {c['pending']}, running: {c['running']}, finished: {c['finished']}, failure: {c['failure']}")
