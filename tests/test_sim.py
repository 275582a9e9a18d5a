"""Every ``tqmon.sim`` scenario end to end: the simulated trainer on a real Ray + TransferQueue, then
``tqmon serve`` (a real subprocess) on its log and checkpoint dir, checked through ``/metrics``.

The expected numbers are derived by hand below from each scenario's definition, never with tqmon's own
warmup model. Shared facts (``tqmon/sim/scenarios.py``): B = train_batch_size = 4 and num_warmup_batches = 2
(T = 8) unless a scenario says otherwise, rollout.n = 2 (a finished group has 2 trajectories, a failed one 1,
a running one its early session's 1), a checkpoint every 2 steps, preempted after step 3 (step 3 is lost),
resumed from global_step_2 for one step (two for legacy). Rollout latency: even dataloader indexes end one
tick after submission, odd ones two (running in between); the trainer ticks once per trained step, after
the sample and before the checkpoint, and once per replay-buffer poll that finds too few finished groups.
Each step ends with verl's console line (``step:N - timing_s/step:… - …/evicted_samples:…``).

The common fresh-start trace (indexes; g = the tag's global_steps):
    step 1: warmup 0-7 + batch 8-11 (g1), all pending → poll ticks: even finished, odd running;
            samples 0,2,4,6; the training tick finishes the odd ones.
    step 2: batch 12-15 (g2); samples 1,3,5,7 (oldest g, then index); the tick finishes 12,14.
    global_step_2 holds 8,9,10,11 (g1) and 12,14 (g2) finished, 13,15 (g2) running = R 8, K 2, and the
    trajectories of the step-2 batch 1,3,5,7 (8 orphans; nothing ever clears them after a resume).

A log alone gives R only as a total; tqmon completes the resume record from the composition of the very
checkpoint it resumed from, read by the checkpoint source (global_step_2 here, the latest when tqmon
looks, except for legacy, whose latest is global_step_4: its R stays unknown), so R by status, the doomed
groups and the under-submission are exact.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.conftest import TqmonProcess, sample_value
from tqmon.service import Service, ServiceConfig
from tqmon.sim.cli import sim
from tqmon.sim.scenarios import CHECKPOINT_DIR, LOG_FILE, SCENARIOS, Scenario, TrainerSettings
from tqmon.sim.trainer import CONTROLLER, SimReport, run_scenario
from tqmon.snapshot import RegressionReason, Snapshot, SourceName
from tqmon.sources.tq import (
    ControllerClient,
    PollBudget,
    PollerProcess,
    PollSettings,
    Reading,
    TQSource,
    read_controller,
)
from tqmon.warmup import GivenConfig, TrainerConfig

STATES = (
    "fresh_start",
    "topped_up",
    "skipped_full",
    "skipped_over_restored",
    "disabled",
    "sync_mode",
    "legacy_unconditional",
    "lost_window",
    "unknown",
)
STATUSES = ("pending", "running", "finished", "failure")
REASONS = ("failure", "stale", "filtered")
QUANTITIES = (
    "restored",
    *(f"restored_{status}" for status in STATUSES),
    "reissued",
    "target",
    "submitted",
    "window_after_warmup",
    "checkpoint_window",
)
Series = dict[str, float | None]  # exact series -> value; None: must be absent


def by_status(pending: int, running: int, finished: int, failure: int) -> dict[str, int]:
    return {"pending": pending, "running": running, "finished": finished, "failure": failure}


def doomed(failure: int | None, stale: int | None, filtered: int | None) -> dict[str, int | None]:
    return {"failure": failure, "stale": stale, "filtered": filtered}


@dataclass(frozen=True)
class Expected:
    """The resume, as the simulator knows it and as tqmon should export it; and the latest checkpoint."""

    # the simulator's own view of the resume
    restored: dict[str, int]
    reissued: int
    cleared: int
    target: int | None
    submitted: int
    over: int
    doomed: dict[str, int | None]
    under: int | None
    # tqmon's resume record: R (int = a bare log total, dict = by status, None = unknown) and the rest
    tq_restored: int | dict[str, int] | None
    tq_reissued: int | None
    tq_target: int | None
    tq_expected: int | None
    tq_submitted: int | None
    tq_over: int | None
    tq_doomed: dict[str, int | None]
    tq_under: int | None
    state: str
    # the latest checkpoint
    checkpoint_step: int
    checkpoint: dict[str, int]
    checkpoint_doomed: dict[str, int | None]
    orphans: int
    trajectories: int
    counted: int | None = None  # R as the trainer logged it when it miscounts (None: the true R)
    compared: tuple[str, ...] = ()  # the quantities two reports were compared on: the others have no series
    disagreements: dict[str, int] = field(default_factory=dict)  # quantity -> sources contradicting (else 0)
    lost: int | None = 0  # prompt groups of a lost window, as tqmon can tell (None: unknown)
    # the resume's cost: rollouts wasted = doomed x rollout.n (2), unknown while a doom reason is
    wasted: int | None = 0

    def series(self) -> Series:
        s: Series = {
            "tqmon_resumes_total": 1,
            "tqmon_last_resume_checkpoint_step": 2,
            "tqmon_resume_reissued_prompt_groups": self.tq_reissued,
            "tqmon_resume_warmup_target_prompt_groups": self.tq_target,
            "tqmon_window_target_prompt_groups": self.tq_target,
            "tqmon_resume_warmup_expected_prompt_groups": self.tq_expected,
            "tqmon_resume_warmup_submitted_prompt_groups": self.tq_submitted,
            "tqmon_resume_over_restored_prompt_groups": self.tq_over,
            "tqmon_resume_under_submitted_prompt_groups": self.tq_under,
            "tqmon_checkpoint_step": self.checkpoint_step,
            "tqmon_checkpoint_orphan_trajectories": self.orphans,
            "tqmon_resume_lost_steps": 1,  # step 3 completed (verl's console line), resumed from global_step_2
            "tqmon_resume_wasted_rollouts": self.wasted,
        }
        split = self.tq_restored if isinstance(self.tq_restored, dict) else {}
        unknown = self.tq_restored if isinstance(self.tq_restored, int) else None
        s[_series("tqmon_resume_restored_prompt_groups", "status", "unknown")] = unknown
        for status in STATUSES:
            s[_series("tqmon_resume_restored_prompt_groups", "status", status)] = split.get(status)
            s[_series("tqmon_checkpoint_prompt_groups", "status", status)] = self.checkpoint[status]
        for reason in REASONS:
            s[_series("tqmon_resume_doomed_prompt_groups", "reason", reason)] = self.tq_doomed[reason]
            s[_series("tqmon_checkpoint_doomed_prompt_groups", "reason", reason)] = self.checkpoint_doomed[reason]
        for state in STATES:
            s[_series("tqmon_resume_warmup_state", "state", state)] = float(state == self.state)
        for quantity in QUANTITIES:
            compared = self.disagreements.get(quantity, 0) if quantity in self.compared else None
            s[_series("tqmon_resume_source_disagreements", "quantity", quantity)] = compared
        s["tqmon_resume_lost_prompt_groups"] = self.lost
        for reason in RegressionReason:  # every scenario resumes from its newest checkpoint and steps on once
            s[_series("tqmon_resume_step_regression_steps", "reason", reason)] = 0
        return s


def _series(name: str, label: str, value: str) -> str:
    return f'{name}{{{label}="{value}"}}'


HEALTHY = by_status(0, 2, 6, 0)  # at global_step_2, with 8 orphans and 6*2 + 2 + 8 = 22 trajectories
# What a verl 0.9.1 resume's log lets tqmon compare: R twice (its "Restored" line and its warmup line, which the
# composition of the checkpoint it loaded joins), T and M against the config. K is logged once: no verdict.
LOGGED = ("restored", "target", "submitted")
# A replay buffer line ("pending: …") logged after the warmup decision and before the first step: the live
# window against R + M and against the checkpoint's composition.
WINDOWS = ("window_after_warmup", "checkpoint_window")
NOTHING_DOOMED = doomed(0, 0, 0)  # no failures; stale needs 3 - g + 1 > 8

EXPECTED: dict[str, Expected] = {
    # The common trace. Resume: K 2 (13, 15, clearing their early trajectory each), warmup max(0, 8 - 8) = 0.
    "healthy-resume": Expected(
        compared=LOGGED,
        restored=by_status(0, 2, 6, 0),
        reissued=2,
        cleared=2,
        target=8,
        submitted=0,
        over=0,
        doomed=doomed(0, 0, 0),
        under=0,
        tq_restored=HEALTHY,
        tq_reissued=2,
        tq_target=8,
        tq_expected=0,
        tq_submitted=0,
        tq_over=0,
        tq_doomed=NOTHING_DOOMED,
        tq_under=0,
        state="skipped_full",
        checkpoint_step=2,
        checkpoint=HEALTHY,
        checkpoint_doomed=NOTHING_DOOMED,
        orphans=8,
        trajectories=22,
    ),
    # The common trace; at resume num_warmup_batches is 2.5: T = floor(2.5 * 4) = 10, M = 10 - 8 = 2.
    "partial-restore": Expected(
        compared=LOGGED,
        restored=by_status(0, 2, 6, 0),
        reissued=2,
        cleared=2,
        target=10,
        submitted=2,
        over=0,
        doomed=doomed(0, 0, 0),
        under=0,
        tq_restored=HEALTHY,
        tq_reissued=2,
        tq_target=10,
        tq_expected=2,
        tq_submitted=2,
        tq_over=0,
        tq_doomed=NOTHING_DOOMED,
        tq_under=0,
        state="topped_up",
        checkpoint_step=2,
        checkpoint=HEALTHY,
        checkpoint_doomed=NOTHING_DOOMED,
        orphans=8,
        trajectories=22,
    ),
    # B 8, T 16 before. Step 1: 0-15 + 16-23 pending; a poll tick finishes the 12 even ones, samples 0-14 even;
    # the tick finishes the odd. Step 2: 24-31; samples 1-15 odd; the tick finishes 24,26,28,30.
    # global_step_2: 16-23 (g1) + 4 finished, 25,27,29,31 running: R 16, K 4; 8 groups * 2 orphans.
    # Resume with B 4: T 8, M 0, O 16 - 8 = 8.
    "over-restore": Expected(
        compared=LOGGED,
        restored=by_status(0, 4, 12, 0),
        reissued=4,
        cleared=4,
        target=8,
        submitted=0,
        over=8,
        doomed=doomed(0, 0, 0),
        under=0,
        tq_restored=by_status(0, 4, 12, 0),
        tq_reissued=4,
        tq_target=8,
        tq_expected=0,
        tq_submitted=0,
        tq_over=8,
        tq_doomed=NOTHING_DOOMED,
        tq_under=0,
        state="skipped_over_restored",
        checkpoint_step=2,
        checkpoint=by_status(0, 4, 12, 0),
        checkpoint_doomed=NOTHING_DOOMED,
        orphans=16,
        trajectories=44,  # 12*2 + 4 + 16
    ),
    # Every rollout ends in one tick; index % 6 == 5 fails. Step 1: a poll tick ends 0-11, 5 and 11 fail:
    # evicted, refilled 1:1 by 12,13 (g1); samples 0-3; the tick finishes 12,13. Step 2: 14-17 (g2); samples
    # 4,6,7,8; the tick finishes 14-16 and fails 17. global_step_2: 9,10,12,13 (g1), 14,15,16 finished,
    # 17 failed: R 8, nothing in flight (K 0, no log line). The first sample at 3 evicts 17: under 1.
    # trajectories 7*2 + 1 + 8 orphans.
    "terminal-only": Expected(
        compared=LOGGED,
        restored=by_status(0, 0, 7, 1),
        reissued=0,
        cleared=0,
        target=8,
        submitted=0,
        over=0,
        doomed=doomed(1, 0, 0),
        under=1,
        tq_restored=by_status(0, 0, 7, 1),
        tq_reissued=0,
        tq_target=8,
        tq_expected=0,
        tq_submitted=0,
        tq_over=0,
        tq_doomed=doomed(1, 0, 0),
        tq_under=1,
        state="skipped_full",
        checkpoint_step=2,
        checkpoint=by_status(0, 0, 7, 1),
        checkpoint_doomed=doomed(1, 0, 0),
        orphans=8,
        trajectories=23,
        wasted=2,  # the failed group, x 2
    ),
    # Threshold 2; index % 6 == 4 fails. Step 1: a poll tick ends the even ones, 4 and 10 fail: refilled by
    # 12,13 (g1); samples 0,2,6,8; the tick finishes the odd 1-11 and 12 (13 runs). Step 2: 14-17 (g2);
    # samples 1,3,5,7; the tick finishes 13, 14, fails 16. global_step_2: 9,11,12,13 (g1) and 14 finished,
    # 16 failed, 15,17 running: R 8, K 2. At step 3 the g1 groups span 3 - 1 + 1 = 3 > 2: stale 4, failure 1;
    # under 8 - (8 - 5 + 0) = 5. trajectories 5*2 + 1 + 2 + 8 orphans.
    "doomed-mix": Expected(
        compared=(*LOGGED, *WINDOWS),  # the first sample evicts 5 of the 6 terminal groups and waits, logging
        restored=by_status(0, 2, 5, 1),
        reissued=2,
        cleared=2,
        target=8,
        submitted=0,
        over=0,
        doomed=doomed(1, 4, 0),
        under=5,
        tq_restored=by_status(0, 2, 5, 1),
        tq_reissued=2,
        tq_target=8,
        tq_expected=0,
        tq_submitted=0,
        tq_over=0,
        tq_doomed=doomed(1, 4, 0),
        tq_under=5,
        state="skipped_full",
        checkpoint_step=2,
        checkpoint=by_status(0, 2, 5, 1),
        checkpoint_doomed=doomed(1, 4, 0),
        orphans=8,
        trajectories=21,
        wasted=10,  # 1 failed + 4 stale, x 2
    ),
    # verl 0.9.0: the common trace, then the resume logs no R and submits 2 batches = 8 on top of R 8.
    # Step 3: 13,15 re-issued, warmup 16-23 and batch 24-27 (g3); samples 8-11; the tick ends 16-26 even.
    # Step 4: 28-31 (g4); samples 12,14 (g2), 16,18; the tick finishes the odd g3 ones and 28,30.
    # global_step_4: 20-27 + 13,15 (g3), 28,30 finished, 29,31 running = 16 = 2T; orphans: the 8 restored
    # from global_step_2 plus the step-4 batch's 8; trajectories 14*2 + 2 + 16.
    # Nothing is compared: 0.9.0 logs no R, its warmup line states neither T nor M, and without a restore report
    # no live window counts. Every disagreement series is absent (it read 0, a false agreement, before).
    "legacy-double-warmup": Expected(
        restored=by_status(0, 2, 6, 0),
        reissued=2,
        cleared=2,
        target=8,
        submitted=8,
        over=0,
        doomed=doomed(0, 0, 0),
        under=0,
        tq_restored=by_status(0, 2, 6, 0),  # read from global_step_2, the checkpoint it loaded (latest: 4)
        tq_reissued=2,
        tq_target=8,
        tq_expected=0,
        tq_submitted=8,
        tq_over=0,
        tq_doomed=doomed(0, 0, 0),
        tq_under=0,
        state="legacy_unconditional",
        checkpoint_step=4,
        checkpoint=by_status(0, 2, 14, 0),
        checkpoint_doomed=NOTHING_DOOMED,
        orphans=16,
        trajectories=46,
        lost=None,  # verl 0.9.0 never reports its restore: whether the window survived is unknown
        wasted=0,
    ),
    # The common trace, resumed with num_warmup_batches 5 (T = 20) by a trainer that counts every key of the
    # partition as a restored group: R' = 8 prompts + 22 trajectories = 30 >= 20, so it logs "Restored 30" and
    # "Skipping async warmup: 30 ... 20-prompt", submits nothing, and each step adds 4 and samples 4: the live
    # window holds 8 (12 between a step's submission and its sample) of 20. tqmon believes the log: the
    # checkpoint composition of global_step_2 sums to 8, not 30, so it is not applied (the log's total stands
    # as status="unknown", failure and stale doomed unknown), O = 30 - 20 = 10 and under-submitted
    # max(0, 20 - 30) = 0: the live window (tqmon_window_*, the under-filled alert) shows the deficit, and the
    # judge flags the contradiction: the log's R 30 against global_step_2's 8. The log has no window line
    # after the decision (the first step finds 6 finished groups for its 4 without waiting), so only R disagrees
    # here; with a live TQ (tests/test_alerts_e2e.py) the window of 8 or 12 against R + M = 30 does too.
    "miscounted-restore": Expected(
        compared=LOGGED,
        restored=by_status(0, 2, 6, 0),
        reissued=2,
        cleared=2,
        target=20,
        submitted=0,
        over=0,
        doomed=doomed(0, 0, 0),
        under=12,
        tq_restored=30,
        tq_reissued=2,
        tq_target=20,
        tq_expected=0,
        tq_submitted=0,
        tq_over=10,
        tq_doomed=doomed(None, None, 0),
        tq_under=0,
        state="skipped_over_restored",
        checkpoint_step=2,
        checkpoint=HEALTHY,
        checkpoint_doomed=NOTHING_DOOMED,
        orphans=8,
        trajectories=22,
        counted=30,
        disagreements={"restored": 1},
        wasted=None,
    ),
    # The common trace without transfer_queue/: the resume restores nothing, warms up all 8. The log has no
    # "Restored" line before that warmup: a lost window, confirmed by the checkpoint dir (global_step_2 has no
    # transfer_queue/). Its size is the last window logged before the restart, step 1's poll: warmup 0-7 and
    # batch 8-11, all pending = 12 (the 8 really held at global_step_2 were never logged).
    "no-tq-checkpoint": Expected(
        # R 0 in the warmup line and in global_step_2's (empty) composition; the first sample waits, logging
        compared=(*LOGGED, *WINDOWS),
        restored=by_status(0, 0, 0, 0),
        reissued=0,
        cleared=0,
        target=8,
        submitted=8,
        over=0,
        doomed=doomed(0, 0, 0),
        under=0,
        tq_restored=by_status(0, 0, 0, 0),
        tq_reissued=0,
        tq_target=8,
        tq_expected=8,
        tq_submitted=8,
        tq_over=0,
        tq_doomed=doomed(0, 0, 0),
        tq_under=0,
        state="lost_window",
        checkpoint_step=2,
        checkpoint=by_status(0, 0, 0, 0),
        checkpoint_doomed=doomed(0, 0, 0),
        orphans=0,
        trajectories=0,  # the simulator saw 22 in TQ, but nothing was saved
        lost=12,
    ),
    # No warmup: each step adds 4 and waits (two poll ticks) until all 4 finished, so global_step_2 holds
    # only the step-2 batch's 8 orphan trajectories: R 0. With skip.rollout_tq no window is kept (no T); the
    # config says the warmup submits nothing (verl logs nothing); the first step's line after the resume
    # says the re-issue is over: verl logged none, so K = 0.
    "skip-rollout-tq": Expected(
        compared=("restored", "checkpoint_window"),  # no warmup line; the first step waits, logging its window
        restored=by_status(0, 0, 0, 0),
        reissued=0,
        cleared=0,
        target=None,
        submitted=0,
        over=0,
        doomed=doomed(0, 0, 0),
        under=None,
        tq_restored=by_status(0, 0, 0, 0),
        tq_reissued=0,
        tq_target=None,
        tq_expected=0,
        tq_submitted=0,
        tq_over=None,
        tq_doomed=doomed(0, 0, 0),
        tq_under=None,
        state="disabled",
        checkpoint_step=2,
        checkpoint=by_status(0, 0, 0, 0),
        checkpoint_doomed=doomed(0, 0, 0),
        orphans=8,
        trajectories=8,
    ),
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """One local Ray for every scenario (each scenario's trainer creates and closes its own TQs in it)."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


def serve_args(workdir: Path, scenario: Scenario) -> list[str]:
    """What ``tqmon serve`` watches for a simulator run (a live TQ source would be one more pair here)."""
    sources = ["--log", str(workdir / LOG_FILE), "--checkpoint-dir", str(workdir / CHECKPOINT_DIR)]
    return [*sources, "--log-interval", "0.2", "--checkpoint-interval", "0.2", *scenario.after.tqmon_flags()]


def told(settings: TrainerSettings) -> GivenConfig:
    """The trainer config ``serve_args`` tells tqmon: the scenario's settings that are tqmon's trainer flags."""
    given = {name: getattr(settings, name) for name in TrainerConfig.model_fields if hasattr(settings, name)}
    flags = settings.tqmon_flags()  # an off switch is no flag
    assert all("--" + name.replace("_", "-") in flags or value is False for name, value in given.items()), flags
    return GivenConfig("colocate_async", TrainerConfig(**given), "flags")


class InProcessPoller(PollerProcess):
    """The TQ poller's reading done in this process, which is in the simulator's Ray already: the same
    ``read_controller`` on the same ``ControllerClient``, without a child process to spawn for every run."""

    def __init__(self, address: str, timeout: float) -> None:
        super().__init__(address, timeout)
        self._client = ControllerClient(address, timeout)

    def read(self, kv_timeout: float) -> Reading:
        return read_controller(self._client, kv_timeout)

    def close(self) -> None:
        """Nothing to interrupt: a read in flight ends within its timeout. ``release`` drops the client."""

    def release(self) -> None:
        self._client.close()


@dataclass(frozen=True)
class Watched:
    """A scenario run while an in-process tqmon watched it: its log and checkpoint dir as ``serve_args`` says,
    and the live TQ. The simulator's report, and the snapshots tqmon published (wall time, snapshot): at each
    whole second of the run, once a poll saw the last TQ's final window, and once tqmon has read what the run
    left."""

    workdir: Path
    report: SimReport
    snapshots: tuple[tuple[float, Snapshot], ...]


WATCHED: dict[str, Watched] = {}  # one run per scenario and session, for every test that reads one
SETTLE_SECONDS = 2.0  # after the run: ten polls of the log and the checkpoint dir
TQ_FINAL_WAIT = 10.0  # for a TQ poll after the run (one a second at most), before the simulator closes the TQ


def watched(name: str, tmp_path_factory: pytest.TempPathFactory, cluster: str) -> Watched:
    """The scenario run (seed 7) under a live in-process tqmon; run once a session, in ``cluster``."""
    if name in WATCHED:
        return WATCHED[name]
    base = tmp_path_factory.mktemp(name)
    workdir = base / "run"
    config = ServiceConfig(
        state_dir=base / "state",
        log=(str(workdir / LOG_FILE),),
        checkpoint_dir=workdir / CHECKPOINT_DIR,
        log_interval=0.2,
        checkpoint_interval=0.2,
        trainer=told(SCENARIOS[name].after),
        process_metrics=False,
    )
    service = Service(config)
    poll = PollSettings(min_interval=0.5, max_interval=1.0)
    poller = InProcessPoller(cluster, timeout=5.0)
    tq = TQSource(service.tracker, poller, PollBudget(poll))
    snapshots: list[tuple[float, Snapshot]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0 - time.time() % 1.0):
            snapshots.append((time.time(), service.tracker.snapshot))

    def done(_report: SimReport) -> None:
        """The run is over and its last TQ still up: one snapshot once a poll saw that TQ's final window."""
        ended = time.time()
        while time.time() < ended + TQ_FINAL_WAIT and not any(
            w.source == SourceName.TQ and w.observed_at > ended for w in service.tracker.snapshot.windows
        ):
            time.sleep(0.1)
        snapshots.append((time.time(), service.tracker.snapshot))

    sampler = threading.Thread(target=sample, name="snapshot-sampler", daemon=True)
    service.start()
    tq.start()
    sampler.start()
    try:
        report = run_scenario(SCENARIOS[name], workdir, seed=7, on_done=done)
        time.sleep(SETTLE_SECONDS)
    finally:
        stop.set()
        sampler.join()
        tq.stop()
        poller.release()
        service.stop()
    snapshots.append((time.time(), service.tracker.snapshot))
    WATCHED[name] = Watched(workdir, report, tuple(sorted(snapshots, key=lambda taken: taken[0])))
    return WATCHED[name]


def wait_for_series(tqmon: TqmonProcess, expected: Series, timeout: float = 20.0) -> None:
    """Poll ``/metrics`` until every series has its expected value (None: absent)."""
    deadline = time.monotonic() + timeout
    while True:
        text = tqmon.metrics()
        wrong = {k: (sample_value(text, k), v) for k, v in expected.items() if sample_value(text, k) != v}
        if not wrong:
            return
        if time.monotonic() > deadline:
            pytest.fail("series (got, expected) never matched:\n" + "\n".join(f"{k}: {v}" for k, v in wrong.items()))
        time.sleep(0.2)


def check_report(report: dict[str, Any], expected: Expected) -> None:
    """The simulator's own view of the resume and of its latest checkpoint."""
    fresh, resume = report["starts"]
    assert fresh["resumed_from"] is None and fresh["restored"] == 0
    assert resume["resumed_from"] == 2 and resume["controller_id"] != fresh["controller_id"]
    got = {k: resume[k] for k in ("restored_by_status", "reissued", "cleared_trajectories", "target", "submitted")}
    assert got == {
        "restored_by_status": expected.restored,
        "reissued": expected.reissued,
        "cleared_trajectories": expected.cleared,
        "target": expected.target,
        "submitted": expected.submitted,
    }
    assert resume["restored"] == sum(expected.restored.values())
    assert resume["counted"] == (resume["restored"] if expected.counted is None else expected.counted)
    assert (resume["over_restored"], resume["doomed"], resume["under_submitted"]) == (
        expected.over,
        expected.doomed,
        expected.under,
    )
    last = report["checkpoints"][-1]
    assert (last["step"], last["by_status"]) == (expected.checkpoint_step, expected.checkpoint)
    assert (last["trajectories"], last["orphan_trajectories"]) == (expected.trajectories, expected.orphans)


LOG_HEADER = re.compile(r"^[A-Z]+:(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):(.*)$")
LOOP_LINES = ("Re-issued ", "Added ", "Skipping async warmup")  # the last lines before verl's step loop


def resume_times(log: Path) -> Series:
    """The resume's downtime and time to its first step, read off the log by hand.

    Downtime: from the last timestamped line before ``Resuming from`` to that line. Time to the first step:
    from ``Resuming from`` to the last re-issue or warmup line, plus the first step's ``timing_s/step``
    from verl's console line (no such line: unknown).
    """
    before: list[float] = []
    resumed_at = loop_at = first_step = None
    for line in log.read_text().splitlines():
        header = LOG_HEADER.match(line)
        if header is None:
            if resumed_at is not None and first_step is None and line.startswith("step:"):
                first_step = float(line.split("timing_s/step:")[1].split(" - ")[0])
            continue
        at = datetime.strptime(header[1], "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()
        if header[2].startswith("Resuming from "):
            resumed_at = at
        elif resumed_at is None:
            before.append(at)
        elif first_step is None and header[2].startswith(LOOP_LINES):
            loop_at = at
    assert resumed_at is not None and first_step is not None
    return {
        "tqmon_resume_downtime_seconds": resumed_at - before[-1],
        "tqmon_resume_time_to_first_step_seconds": None if loop_at is None else (loop_at - resumed_at) + first_step,
    }


def check_tqmon(workdir: Path, scenario: Scenario, expected: Expected, tqmon_factory: Any) -> None:
    tqmon = tqmon_factory(serve_args(workdir, scenario)).start()
    wait_for_series(tqmon, expected.series() | resume_times(workdir / LOG_FILE))


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "healthy-resume"])
def test_scenario_end_to_end(
    name: str, cluster: str, tmp_path_factory: pytest.TempPathFactory, tqmon_factory: Any
) -> None:
    """The run (shared with tests/test_alert_agreement.py, which reads what the in-process tqmon saw) is checked
    here by a fresh ``tqmon serve`` that reads the log and checkpoint dir it left."""
    scenario, expected = SCENARIOS[name], EXPECTED[name]
    run = watched(name, tmp_path_factory, cluster)
    check_report(asdict(run.report), expected)
    check_tqmon(run.workdir, scenario, expected, tqmon_factory)


def test_cli_runs_healthy_resume_and_holds_the_tq_until_sigterm(
    cluster: str, tmp_path: Path, tqmon_factory: Any
) -> None:
    """``python -m tqmon.sim`` joins the cluster, resumes with a new controller and keeps it for the sidecar."""
    import ray

    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "tqmon.sim", "--workdir", str(workdir), "--ray-address", cluster]
    env = {**os.environ, "TQMON_SIM_SCENARIO": "healthy-resume", "TQMON_SIM_STEP_SECONDS": "0", "TQMON_SIM_HOLD": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())  # printed once the run is done, before holding
        check_report(report, EXPECTED["healthy-resume"])
        assert report["tqmon_flags"] == SCENARIOS["healthy-resume"].after.tqmon_flags()
        check_tqmon(workdir, SCENARIOS["healthy-resume"], EXPECTED["healthy-resume"], tqmon_factory)
        held = ray.get_actor(*CONTROLLER)
        assert held._actor_id.hex() == report["starts"][1]["controller_id"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(ValueError):
            ray.get_actor(*CONTROLLER)  # the simulator closed its TQ on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_workdir_of_a_previous_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / LOG_FILE).write_text("")
    result = CliRunner().invoke(sim, ["--workdir", str(tmp_path)])
    assert result.exit_code == 2 and "already holds a run (trainer.log); use a fresh one" in result.output


def test_every_scenario_is_listed_with_its_tqmon_flags() -> None:
    result = CliRunner().invoke(sim, ["--list-scenarios"], catch_exceptions=False)
    assert result.exit_code == 0
    assert "partial-restore: num_warmup_batches raised from 2 to 2.5" in result.output
    assert "--num-warmup-batches 2.5 --max-off-policy-threshold 8" in result.output
    assert set(EXPECTED) == set(SCENARIOS) and all(f"{name}: " in result.output for name in SCENARIOS)
