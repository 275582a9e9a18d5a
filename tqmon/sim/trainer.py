"""The simulated verl 0.9.1 V1 async trainer: one scenario = a fresh start, a preemption and a resume.

It owns the cluster side like a real trainer: ``tq.init`` at each start, ``tq.close`` at the preemption
(the next start creates a new controller actor, with a new id, in the same Ray cluster). Each start
follows ``PPOTrainer``: ``_load_checkpoint`` (restore, count prompt groups), then ``fit``: step N+1,
``_reissue_inflight_prompts``, ``_add_async_warmup_batches`` (or verl 0.9.0's unconditional warmup), then
steps that submit ``train_batch_size`` prompts, sample as many finished groups, train, save a checkpoint
every ``save_freq`` steps (before the batch's trajectories are cleared) and clear the batch. verl's own
log lines go to ``<workdir>/trainer.log``; the simulator's view of each start comes back as a report.

Requires a connected Ray (``ray.init``); the CLI does that.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transfer_queue as tq

from tqmon.sim.replay import STATUSES, ReplayBuffer, Sample, Window, log_window
from tqmon.sim.rollout import PARTITION, Rollout, prompt_fields
from tqmon.sim.scenarios import CHECKPOINT_DIR, LOG_FILE, Scenario, TrainerSettings

LOG_FORMAT = "%(levelname)s:%(asctime)s:%(message)s"  # verl's
CONSOLE_FORMAT = "%(message)s"  # verl's console logger backend prints, into the same output
EVICTION_METRICS = {
    "failure": "training/rollout_failure/evicted_samples",
    "stale": "training/off_policy/evicted_samples",
    "filtered": "training/filter_groups/evicted_samples",
}
LATEST_FILE = "latest_checkpointed_iteration.txt"
CONTROLLER = ("TransferQueueController", "transfer_queue")  # the named actor and its namespace
TQ_CONFIG = {"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 100_000}}}


class Stopped(Exception):
    """A stop was requested (SIGTERM/SIGINT) before the run finished."""


@dataclass
class CheckpointReport:
    """What a resume from this checkpoint restores (nothing without transfer_queue/)."""

    step: int
    by_status: dict[str, int]
    trajectories: int
    orphan_trajectories: int  # trajectories without a prompt key (the batch trained at this step, ...)


@dataclass
class StartReport:
    """What one trainer start did, as the simulator knows it (the truth tqmon should reconstruct)."""

    resumed_from: int | None  # N of global_step_N, None on a fresh start
    controller_id: str  # the TQ controller actor of this start
    restored: int  # R
    restored_by_status: dict[str, int]
    counted: int  # R as the trainer counted, logged and warmed up with: R unless it miscounts (count_every_key)
    reissued: int  # K
    cleared_trajectories: int
    target: int | None  # T, None when the warmup is disabled (verl never computes it then)
    submitted: int  # M
    over_restored: int  # O = max(0, R - T)
    doomed: dict[str, int]  # evicted by the first sample after the start: restored groups only
    under_submitted: int | None  # max(0, T - (R - doomed + M))


@dataclass
class SimReport:
    scenario: str
    starts: list[StartReport] = field(default_factory=list)
    checkpoints: list[CheckpointReport] = field(default_factory=list)
    last_step: int = 0  # the last step trained

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def uid_for(seed: int, index: int) -> str:
    """uuid4-shaped hex (never a ``_``) whose order is the dataloader order, so ties sort reproducibly."""
    prefix = random.Random(seed).getrandbits(64)
    return uuid.UUID(int=(prefix << 64) | index, version=4).hex


@contextmanager
def verl_log(path: Path, fmt: str = LOG_FORMAT) -> Iterator[logging.Logger]:
    """A logger writing verl's format to ``path`` only (one per run, so runs in one process never mix)."""
    logger = logging.getLogger(f"tqmon.sim.verl.{uuid.uuid4().hex}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        handler.close()


def controller_id() -> str:
    import ray

    return str(ray.get_actor(*CONTROLLER)._actor_id.hex())


def close_tq(timeout: float = 30.0) -> None:
    """``tq.close()``, then wait until the controller's name is free so the next ``tq.init`` creates a new one."""
    import ray

    tq.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(*CONTROLLER)
        except ValueError:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the TransferQueue controller was still registered {timeout:g}s after tq.close()")


class TrainerProcess:
    """One trainer process's life: the rollout and replay buffer it builds and the steps it trains."""

    def __init__(
        self,
        scenario: Scenario,
        settings: TrainerSettings,
        workdir: Path,
        log: logging.Logger,
        *,
        seed: int,
        pause: Callable[[], None],
        console: logging.Logger | None = None,
        top_up: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.checkpoint_dir = workdir / CHECKPOINT_DIR
        self.log = log
        self.console = console  # verl's console logger: a step's metrics, printed without a timestamp
        self.seed = seed
        self.pause = pause  # one step's (or one poll's) worth of wall time; raises Stopped
        self.top_up = top_up  # set (SIGUSR1): fill the window up to T at the next step
        self.rollout = Rollout(scenario.rollout, settings.rollout_n, seed)
        self.replay = ReplayBuffer(settings, refill=self._add_prompts, wait=self._wait)
        self.global_steps = 0
        self.next_index = 0  # the dataloader position, saved in data.pt
        self.checkpoints: list[CheckpointReport] = []

    # ---------------------------------------------------------------- submission

    def _add_prompts(self, n: int) -> None:
        """``_add_prompts_to_generate``: register prompts pending at this step (with their data), dispatch."""
        indexes = list(range(self.next_index, self.next_index + n))
        self.next_index += n
        uids = [uid_for(self.seed, i) for i in indexes]
        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps} for _ in uids]
        tq.kv_batch_put(keys=uids, partition_id=PARTITION, tags=tags, fields=prompt_fields(indexes))
        self.rollout.generate(uids, indexes, self.global_steps)

    def _top_up_window(self) -> None:
        """Submit what the live window lacks of T, through the trainer's own submission path.

        What a correct warmup would have submitted, done late, as an operator would once the under-filled
        alert fired: the demo asks for it (SIGUSR1) to show that alert resolve.
        """
        if not self.settings.warmup_enabled:  # no T without the warmup: nothing to fill up to
            return
        target = self.settings.target_window
        missing = max(0, target - len(Window.read().prompts))
        if missing:
            self._add_prompts(missing)
        print(f"topped up the window by {missing} prompt groups to its target of {target}", file=sys.stderr, flush=True)

    def _wait(self, window: Window) -> None:
        log_window(self.log, window)
        self.pause()
        self.rollout.tick(self.global_steps)

    # ---------------------------------------------------------------- checkpoints

    def load_checkpoint(self) -> tuple[int | None, int]:
        """``_load_checkpoint`` with ``resume_mode=auto``: (N or None, restored prompt groups R as counted)."""
        latest = self.checkpoint_dir / LATEST_FILE
        if not latest.exists():
            self.log.info("Training from scratch")
            return None, 0
        self.global_steps = int(latest.read_text())
        folder = self.checkpoint_dir / f"global_step_{self.global_steps}"
        self.log.info(f"Resuming from {folder}, setting global step to {self.global_steps}")
        self.next_index = int(torch.load(folder / "data.pt")["next_index"])
        tq_path = folder / "transfer_queue"
        restored = 0
        if tq_path.exists():
            self.log.info(f"Loading TransferQueue state from {tq_path}")
            tq.load_checkpoint(tq_path)
            window = Window.read()
            restored = len(window.prompts)  # _count_tq_prompt_groups
            if self.settings.count_every_key:
                restored += sum(len(keys) for keys in window.trajectories.values())
            if self.settings.verl_version != "0.9.0":  # 0.9.0 neither counts nor logs it
                self.log.info(f"Restored {restored} training prompt groups from TransferQueue")
        return self.global_steps, restored

    def _save_checkpoint(self) -> None:
        """``_save_checkpoint``: data.pt, then TQ state, then the latest file last (what makes it resumable)."""
        folder = self.checkpoint_dir / f"global_step_{self.global_steps}"
        self.log.info(f"Saving checkpoint to {folder}")
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"next_index": self.next_index}, folder / "data.pt")
        saved = CheckpointReport(self.global_steps, dict.fromkeys(STATUSES, 0), 0, 0)
        if self.settings.save_tq_state:
            tq.save_checkpoint(folder / "transfer_queue", metadata={"global_steps": self.global_steps})
            window = Window.read()
            saved.by_status = window.by_status()
            saved.trajectories = sum(len(keys) for keys in window.trajectories.values())
            saved.orphan_trajectories = sum(
                len(keys) for uid, keys in window.trajectories.items() if uid not in window.prompts
            )
        (self.checkpoint_dir / LATEST_FILE).write_text(str(self.global_steps))
        self.checkpoints.append(saved)

    # ---------------------------------------------------------------- fit

    def _reissue_inflight_prompts(self) -> tuple[int, int]:
        """Restart restored pending/running groups as pending at this step, clearing their old trajectories."""
        window = Window.read()
        inflight = window.with_status("pending", "running")
        if not inflight:
            return 0, 0
        indexes = [int(i) for i in tq.kv_batch_get(keys=inflight, partition_id=PARTITION)["index"].tolist()]
        old = window.trajectory_keys(inflight)
        if old:
            tq.kv_clear(keys=old, partition_id=PARTITION)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps} for _ in inflight]
        tq.kv_batch_put(keys=inflight, partition_id=PARTITION, tags=tags)
        self.rollout.generate(inflight, indexes, self.global_steps)
        self.log.info(
            f"Re-issued {len(inflight)} in-flight prompts for step {self.global_steps}; "
            f"cleared {len(old)} old trajectories from partition {PARTITION}"
        )
        return len(inflight), len(old)

    def _warmup(self, restored: int) -> tuple[int | None, int]:
        """``on_train_begin``: (T, prompts submitted)."""
        s = self.settings
        if s.verl_version == "0.9.0":
            if s.skip_rollout_tq:
                return None, 0
            batches = int(s.num_warmup_batches)
            for _ in range(batches):
                self._add_prompts(s.train_batch_size)
            self.log.info(f"Added {batches} warmup batches to the agent loop manager")
            return s.target_window, batches * s.train_batch_size
        if not s.warmup_enabled:
            return None, 0
        target = s.target_window
        missing = max(0, target - restored)
        if missing == 0:
            self.log.info(
                f"Skipping async warmup: {restored} restored prompt groups already fill the "
                f"{target}-prompt prefetch window"
            )
            return target, 0
        self._add_prompts(missing)
        self.log.info(f"Added {missing} warmup prompts after restoring {restored} of {target} target prompt groups")
        return target, missing

    def _step(self) -> Sample:
        b = self.settings.train_batch_size
        started = time.monotonic()
        if self.top_up is not None and self.top_up.is_set():
            self.top_up.clear()
            self._top_up_window()
        self._add_prompts(b)  # prepare_step
        sample = self.replay.sample(self.global_steps, b)
        generated = time.monotonic()
        self.pause()  # training; the rollout keeps generating meanwhile
        self.rollout.tick(self.global_steps)
        if self.global_steps % self.settings.save_freq == 0:
            self._save_checkpoint()
        took = time.monotonic() - started
        if sample.trajectory_keys:
            tq.kv_clear(keys=sample.trajectory_keys, partition_id=PARTITION)
        self._log_metrics(sample, generated - started, took)
        self.global_steps += 1
        return sample

    def _log_metrics(self, sample: Sample, gen_seconds: float, step_seconds: float) -> None:
        """``Tracking.log`` to the console backend: ``concat_dict_to_str`` of the step's metrics."""
        if self.console is None:
            return
        metrics: dict[str, float] = {
            "training/global_step": self.global_steps,
            "timing_s/gen": gen_seconds,
            "timing_s/step": step_seconds,
        }
        metrics |= {key: sample.evictions[reason] for reason, key in EVICTION_METRICS.items()}
        self.console.info(" - ".join([f"step:{self.global_steps}", *(f"{k}:{v!r}" for k, v in metrics.items())]))

    def start(self, steps: int) -> StartReport:
        """Load, then ``fit`` for ``steps`` steps (at least one: the first sample decides the doomed groups)."""
        if steps < 1:
            raise ValueError("a start trains at least one step")
        tq.init(tq_config())
        resumed_from, counted = self.load_checkpoint()
        by_status = Window.read().by_status()
        restored = sum(by_status.values())
        self.global_steps += 1
        reissued, cleared = self._reissue_inflight_prompts()
        target, submitted = self._warmup(counted)
        doomed = self._step().first_evictions
        for _ in range(steps - 1):
            self._step()
        over = max(0, restored - (target or 0))
        under = None if target is None else max(0, target - (restored - sum(doomed.values()) + submitted))
        return StartReport(
            resumed_from=resumed_from,
            controller_id=controller_id(),
            restored=restored,
            restored_by_status=by_status,
            counted=counted,
            reissued=reissued,
            cleared_trajectories=cleared,
            target=target,
            submitted=submitted,
            over_restored=over,
            doomed=doomed,
            under_submitted=under,
        )


def tq_config() -> Any:
    """One storage unit: TQ needs a Ray CPU for the controller and one per unit (2-core boxes have 4)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(TQ_CONFIG)


def sleep(seconds: float) -> bool:
    """The default pacing: just wait, never stop."""
    time.sleep(seconds)
    return False


def check_workdir(workdir: Path) -> None:
    """A scenario starts from scratch: a workdir holding a previous run would make the first start a resume."""
    leftovers = [p for p in (workdir / LOG_FILE, workdir / CHECKPOINT_DIR) if p.exists()]
    if leftovers:
        names = ", ".join(p.name for p in leftovers)
        raise FileExistsError(f"{workdir} already holds a run ({names}); use a fresh one")


def run_scenario(
    scenario: Scenario,
    workdir: Path,
    *,
    step_seconds: float = 0.0,
    steps_before_preemption: int | None = None,
    steps_after_resume: int | None = None,
    seed: int = 0,
    should_stop: Callable[[float], bool] = sleep,
    on_done: Callable[[SimReport], None] | None = None,
    top_up: threading.Event | None = None,
) -> SimReport:
    """Run ``scenario`` in ``workdir``; ``on_done`` sees the report while the last TQ is still alive.

    ``should_stop(seconds)`` waits that long and says whether to stop (the CLI's signal handler); once
    ``top_up`` is set, the next step first fills the live window up to T (the CLI's SIGUSR1).
    """
    check_workdir(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    before = scenario.steps_before_preemption if steps_before_preemption is None else steps_before_preemption
    after = scenario.steps_after_resume if steps_after_resume is None else steps_after_resume

    def pause() -> None:
        if should_stop(step_seconds):
            raise Stopped

    report = SimReport(scenario.name)

    def start(settings: TrainerSettings, steps: int) -> None:
        process = TrainerProcess(
            scenario, settings, workdir, log, seed=seed, pause=pause, console=console, top_up=top_up
        )
        try:
            report.starts.append(process.start(steps))
        finally:
            report.checkpoints += process.checkpoints
            report.last_step = max(report.last_step, process.global_steps - 1)

    with verl_log(workdir / LOG_FILE) as log, verl_log(workdir / LOG_FILE, CONSOLE_FORMAT) as console:
        try:
            start(scenario.before, before)
            close_tq()  # preempted: the trainer and its TQ are gone, the Ray cluster stays
            start(scenario.after, after)
            if on_done is not None:
                on_done(report)
        finally:
            close_tq()
    return report
