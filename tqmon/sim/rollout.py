"""The simulated rollout (verl's ``AgentLoopManagerTQ``/``AgentLoopWorkerTQ``) writing to a real TransferQueue.

Time is counted in ticks, one per trained step (plus one per poll while the replay buffer waits), so a
run is deterministic. A prompt submitted at tick t is ``running`` from t+1 and terminal at t+latency.
Like verl's ``_run_prompt``: the status tag goes pending → running → finished | failure, each session
puts its trajectory ``{uid}_{session}_0`` as it ends (the first session of a long rollout ends early, so
running groups have partial trajectories), and the terminal status is written after every session.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import transfer_queue as tq

from tqmon.sim.scenarios import RolloutPlan

PARTITION = "train"
PROMPT_LEN, RESPONSE_LEN = 4, 3


def trajectory_tag(global_steps: int, started: int | None, finished: int) -> dict[str, Any]:
    """What verl's agent loop tags a finished trajectory with (the benchmark and the tests use it too)."""
    return {
        "status": "success",
        "prompt_len": PROMPT_LEN,
        "response_len": RESPONSE_LEN,
        "seq_len": PROMPT_LEN + RESPONSE_LEN,
        "global_steps": global_steps,
        "min_global_steps": started,
        "max_global_steps": finished,
    }


def tensordict(n: int, columns: dict[str, torch.Tensor]) -> Any:
    """A TensorDict of ``n`` rows (imported here: tensordict has no type hints)."""
    from tensordict import TensorDict  # type: ignore[import-untyped]

    return TensorDict(columns, batch_size=[n])


def prompt_fields(indexes: list[int]) -> Any:
    """The prompt data verl persists with each prompt key, so a resume can re-issue it."""
    n = len(indexes)
    return tensordict(
        n,
        {
            "input_ids": torch.ones(n, PROMPT_LEN, dtype=torch.int64),
            "attention_mask": torch.ones(n, PROMPT_LEN, dtype=torch.int64),
            "index": torch.tensor(indexes, dtype=torch.int64),
        },
    )


@dataclass
class _Job:
    uid: str
    index: int
    global_steps: int  # the prompt tag's global_steps
    submitted_at: int  # tick
    started_step: int | None = None  # trainer step when it started running (min_global_steps)
    sessions_done: int = 0


class Rollout:
    """Runs the prompts it is given; forgets them once terminal (the replay buffer reads TQ, not this)."""

    def __init__(self, plan: RolloutPlan, rollout_n: int, seed: int) -> None:
        self.plan = plan
        self.rollout_n = rollout_n
        self.seed = seed
        self.clock = 0
        self._jobs: dict[str, _Job] = {}

    def generate(self, uids: list[str], indexes: list[int], global_steps: int) -> None:
        for uid, index in zip(uids, indexes, strict=True):
            self._jobs[uid] = _Job(uid, index, global_steps, self.clock)

    def tick(self, step: int) -> None:
        """One tick of generation under the weights of trainer step ``step``."""
        self.clock += 1
        starting = [j for j in self._jobs.values() if j.started_step is None]
        for job in starting:
            job.started_step = step
        self._set_status(starting, "running")
        early = [j for j in starting if self.plan.latency(j.index) > 1]
        self._put_trajectories([(j, 0) for j in early], step)
        for job in early:
            job.sessions_done = 1

        ending = [j for j in self._jobs.values() if self.clock - j.submitted_at >= self.plan.latency(j.index)]
        self._put_trajectories([(j, s) for j in ending for s in range(j.sessions_done, self._successes(j))], step)
        for status in ("finished", "failure"):
            self._set_status([j for j in ending if self._status(j) == status], status)
        for job in ending:
            del self._jobs[job.uid]

    def _status(self, job: _Job) -> str:
        return "failure" if self.plan.failures.hits(job.index) else "finished"

    def _successes(self, job: _Job) -> int:
        """Sessions that produce a trajectory: all, or all but the last (erroring) one of a failed group."""
        return self.rollout_n - 1 if self._status(job) == "failure" else self.rollout_n

    @staticmethod
    def _set_status(jobs: list[_Job], status: str) -> None:
        """A status update merges into the stored tag (``is_prompt`` and ``global_steps`` stay)."""
        if jobs:
            tq.kv_batch_put(keys=[j.uid for j in jobs], partition_id=PARTITION, tags=[{"status": status}] * len(jobs))

    def _reward(self, job: _Job, session: int) -> float:
        """Seeded per (prompt, session); a zero-variance group gets its session-0 reward everywhere."""
        if self.plan.zero_variance.hits(job.index):
            session = 0
        return float(random.Random(f"{self.seed}:{job.index}:{session}").randint(0, 4)) / 4

    def _put_trajectories(self, pairs: list[tuple[_Job, int]], step: int) -> None:
        if not pairs:
            return
        n = len(pairs)
        rm_scores = torch.zeros(n, RESPONSE_LEN, dtype=torch.bfloat16)
        rm_scores[:, -1] = torch.tensor([self._reward(job, session) for job, session in pairs])
        fields = tensordict(
            n,
            {
                "responses": torch.ones(n, RESPONSE_LEN, dtype=torch.int64),
                "response_mask": torch.ones(n, RESPONSE_LEN, dtype=torch.bool),
                "rm_scores": rm_scores,
            },
        )
        tags = [trajectory_tag(job.global_steps, job.started_step, step) for job, _session in pairs]
        keys = [f"{job.uid}_{session}_0" for job, session in pairs]
        tq.kv_batch_put(keys=keys, partition_id=PARTITION, tags=tags, fields=fields)
