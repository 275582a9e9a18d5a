"""Parity with released verl 0.9.1: tqmon's numbers are the numbers verl's own resume code computes.

verl's real ``PPOTrainerColocateAsync`` is built from verl's own Hydra config with the plugin enabled by the
documented overrides; only what ``init()`` would add on GPUs is stubbed (worker groups, the dataset). The
previous run's window is submitted through verl's ``_add_prompts_to_generate``, moved through the statuses
the agent-loop workers write, and saved by verl's ``_save_checkpoint`` (which calls the plugin's checkpoint
callback). The resume runs verl's ``_load_checkpoint`` in a fresh TransferQueue controller, then what
``fit()`` runs before its loop (re-issue, ``on_train_begin``), the first step's batch and, where the window
can serve one, the replay buffer's first sample. verl logs to the file a live tqmon tails while the plugin
posts to it; every value is then read back from tqmon over HTTP and compared with verl's.

One Ray cluster and one TransferQueue for the module; each case saves and restores its own checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

from tests.conftest import TqmonProcess, sample_value
from tqmon.cli import main
from tqmon.composition import compose
from tqmon.events import StepCompleted
from tqmon.integrations.verl import TqmonAgentLoopManager, plugin
from tqmon.snapshot import RegressionReason

pytestmark = pytest.mark.parity

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported (in the fixture)

B = 4  # data.train_batch_size
TQ_CONFIG = {"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 2000}}}
CALLBACK = "tqmon.integrations.verl.TqmonCheckpointCallback"
MANAGER = "tests.test_verl_parity.RecordingManager"  # TqmonAgentLoopManager with a recording worker
EVICTION_METRICS = {
    "failure": "training/rollout_failure/evicted_samples",
    "stale": "training/off_policy/evicted_samples",
    "filtered": "training/filter_groups/evicted_samples",
}


@dataclass(frozen=True)
class Case:
    """A previous run's window at checkpoint ``step`` (None: a fresh start) and the resumed config."""

    name: str
    step: int | None
    groups: tuple[tuple[str, int, int], ...] = ()  # (status, global_steps, count)
    orphans: int = 0
    overrides: tuple[str, ...] = ()
    sample: bool = True  # the window holds B sampleable groups, so the first sample returns


CASES = [
    Case("fresh_start", None, sample=False),
    Case(
        "healthy_resume",
        10,
        (("pending", 10, 1), ("running", 10, 2), ("finished", 10, 4), ("finished", 9, 1)),
        orphans=3,
        overrides=("trainer.v1.colocate_async.num_warmup_batches=2",),
    ),
    Case(
        "partial_restore",
        10,
        (("running", 10, 1), ("finished", 10, 4), ("failure", 9, 1)),
        overrides=("trainer.v1.colocate_async.num_warmup_batches=3",),
    ),
    Case(
        "over_restore",
        20,
        (("pending", 20, 2), ("finished", 20, 5), ("finished", 18, 3), ("finished", 12, 2), ("failure", 19, 1)),
        orphans=2,
        overrides=("trainer.v1.colocate_async.num_warmup_batches=2", "trainer.v1.sampler.max_off_policy_threshold=4"),
    ),
    Case(
        "terminal_only",
        30,
        (("finished", 30, 4), ("finished", 25, 2), ("failure", 29, 2)),
        overrides=("trainer.v1.sampler.max_off_policy_threshold=3",),
    ),
    Case(
        "fractional_warmup",
        10,
        (("pending", 10, 1), ("finished", 10, 4)),
        overrides=("trainer.v1.colocate_async.num_warmup_batches=1.5",),
    ),
    Case(
        "zero_warmup",
        10,
        (("finished", 10, 4), ("failure", 10, 1)),
        overrides=("trainer.v1.colocate_async.num_warmup_batches=0",),
    ),
    Case("skip_rollout_tq", 10, (("running", 10, 1), ("finished", 10, 4)), overrides=("skip.rollout_tq.enable=true",)),
]


# ---------------------------------------------------------------- verl, as TaskRunnerV1 sets it up


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One local Ray cluster and TransferQueue for the module (2 CPUs: controller + 1 storage unit)."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create(TQ_CONFIG))
    _RecordingWorkers.recorder = recorder_class().remote()
    try:
        yield tq
    finally:
        tq.close()
        ray.shutdown()


def clear_window(tq: Any) -> None:
    """Drop what the previous case left in partition train."""
    keys = list(tq.kv_list("train").get("train", {}))
    if keys:
        tq.kv_clear(keys=keys, partition_id="train")


def restart_transfer_queue(tq: Any) -> None:
    """A trainer restart: a fresh controller, empty until verl loads the checkpoint."""
    from omegaconf import OmegaConf

    tq.close()
    tq.init(OmegaConf.create(TQ_CONFIG))


def verl_config(root: Path, overrides: tuple[str, ...]) -> Any:
    """verl's own ``ppo_trainer`` config with the plugin enabled exactly as docs/verl.md says."""
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(
            config_name="ppo_trainer",
            overrides=[
                "trainer.v1.trainer_mode=colocate_async",
                f"data.train_batch_size={B}",
                f"trainer.default_local_dir={root / 'ckpt'}",
                f"trainer.experiment_name={root.name}",
                f"skip.rollout_tq.dump_dir={root / 'skip'}",
                f"trainer.checkpoint_callback_class={CALLBACK}",
                f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER}",
                *overrides,
            ],
        )
    with open_dict(config):
        config.data.gen_batch_size = 1  # what verl's _init_dataloader forces in async modes
    return config


class _Prompts:
    """A dataset of tokenised prompts, shaped like verl's RLHFDataset items."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> dict[str, Any]:
        import torch

        return {
            "input_ids": torch.full((4,), index % 100, dtype=torch.int64),
            "attention_mask": torch.ones(4, dtype=torch.int64),
            "raw_prompt": f"prompt {index}",
            "index": index,
        }


class _NoWorkers:
    """The actor worker group: loading and saving model weights is out of scope here."""

    def load_checkpoint(self, **_: Any) -> None:
        return None

    def save_checkpoint(self, *_: Any, **__: Any) -> None:
        return None


def make_trainer(config: Any, trainer_class: type | None = None) -> Any:
    """verl's real trainer (or ``trainer_class``, a subclass), with what ``init()`` would add on GPUs replaced
    by stand-ins."""
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync
    from verl.utils.dataset.rl_dataset import collate_fn

    trainer = (trainer_class or PPOTrainerColocateAsync)(config)
    trainer.train_dataloader = StatefulDataLoader(_Prompts(), batch_size=1, collate_fn=collate_fn)
    trainer.train_dataloader_it = None
    trainer.actor_rollout_wg = _NoWorkers()
    trainer.use_critic = False
    return trainer


def recorder_class() -> Any:
    """A Ray actor standing in for the agent-loop workers: it records what was dispatched to it."""
    import ray

    @ray.remote(num_cpus=0)
    class Recorder:
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def generate_sequences(self, batch: Any) -> None:
            self.sizes.append(len(batch))

        def dispatched(self) -> list[int]:
            """Prompt groups per dispatch since the last call."""
            sizes, self.sizes = self.sizes, []
            return sizes

    return Recorder


class _RecordingWorkers:
    """The module's recording worker instead of GPU agent-loop workers."""

    recorder: ClassVar[Any] = None
    agent_loop_workers: list[Any]

    async def _init_agent_loop_workers(self) -> None:
        self.agent_loop_workers = [self.recorder]


class PlainManager(_RecordingWorkers, AgentLoopManagerTQ):  # type: ignore[misc]
    """verl's own manager: the previous run, which the plugin did not watch."""


class RecordingManager(_RecordingWorkers, TqmonAgentLoopManager):
    """The plugin's manager, verbatim apart from its workers."""


# ---------------------------------------------------------------- the previous run and the resume


def put_trajectories(tq: Any, uids: list[str], g: int) -> None:
    """One trajectory per group, tagged like AgentLoopWorkerTQ._agent_loop_postprocess tags it."""
    import torch
    from tensordict import TensorDict  # type: ignore[import-untyped]

    tag = {"status": "success", "prompt_len": 4, "response_len": 3, "seq_len": 7, "global_steps": g}
    keys = [f"{uid}_0_0" for uid in uids]
    fields = TensorDict({"responses": torch.ones(len(keys), 3, dtype=torch.int64)}, batch_size=[len(keys)])
    tq.kv_batch_put(keys=keys, partition_id="train", tags=[dict(tag) for _ in keys], fields=fields)


def train_uids(tq: Any) -> set[str]:
    return {key for key, tag in tq.kv_list("train").get("train", {}).items() if tag.get("is_prompt", False)}


def submit_window(tq: Any, trainer: Any, groups: tuple[tuple[str, int, int], ...], orphans: int, step: int) -> None:
    """Submit ``groups`` (status, global_steps, count) through verl's own submission path and move them through
    the statuses the agent-loop workers write; ``orphans`` trajectories without a prompt key, tagged ``step``."""
    for status, g, count in groups:
        before = train_uids(tq)
        trainer.global_steps = g
        trainer._add_prompts_to_generate(count)
        uids = sorted(train_uids(tq) - before)
        assert len(uids) == count
        if status != "pending":  # the worker marks a prompt running, then finished or failure
            tq.kv_batch_put(keys=uids, partition_id="train", tags=[{"status": "running"} for _ in uids])
        if status in ("finished", "failure"):
            tq.kv_batch_put(keys=uids, partition_id="train", tags=[{"status": status} for _ in uids])
        if status in ("running", "finished"):
            put_trajectories(tq, uids, g)
    if orphans:  # trajectories of the batch trained at step N, whose prompt keys the sample cleared
        put_trajectories(tq, [uuid.uuid4().hex for _ in range(orphans)], step)


def save_previous_run(tq: Any, root: Path, case: Case) -> dict[str, Any]:
    """Build the case's window through verl's own submission path and save it with verl's ``_save_checkpoint``."""
    assert case.step is not None
    config = verl_config(root, ())
    trainer = make_trainer(config)
    trainer.agent_loop_manager = PlainManager.create(config=config, llm_client=None)
    submit_window(tq, trainer, case.groups, case.orphans, case.step)
    trainer.global_steps = case.step
    trainer._save_checkpoint()
    saved = compose(tq.kv_list("train").get("train", {}))
    assert saved.restored == sum(count for _, _, count in case.groups)
    return {"by_status": saved.by_status, "orphans": saved.orphan_trajectories}


@dataclass
class Resumed:
    """What verl computed and did at the resume."""

    restored: int
    reissued: int
    warmup_submitted: int
    target: int | None  # from verl's own warmup log line; None when verl logs none
    logged: str  # verl's warmup log line, or ""
    dispatched: list[int]
    evicted: dict[str, int] = field(default_factory=dict)
    trainer: Any = None  # verl's trainer after the first sample (or the first step's batch)


def resume(tq: Any, root: Path, case: Case, trainer_class: type | None = None) -> Resumed:
    """What ``TaskRunnerV1.run`` and ``fit()`` do up to the first sample, with verl's own methods (those of
    ``trainer_class``, a subclass, where it overrides them)."""
    import ray
    from verl.trainer.ppo.v1.trainer_base import _count_tq_prompt_groups
    from verl.utils.import_utils import load_class_from_fqn
    from verl.utils.skip import SkipManager

    ray.get(_RecordingWorkers.recorder.dispatched.remote())  # forget the previous run's dispatches
    config = verl_config(root, case.overrides)
    trainer = make_trainer(config, trainer_class)
    trainer._load_checkpoint()
    # TaskRunnerV1.init_agent_loop_manager, verbatim
    manager_cls = load_class_from_fqn(
        config.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    manager = manager_cls.create(config=config, llm_client=None)
    trainer.agent_loop_manager = manager
    SkipManager.init(config)
    trainer.global_steps += 1
    SkipManager.set_step(trainer.global_steps)
    reissued = trainer._reissue_inflight_prompts()
    window_before = _count_tq_prompt_groups()
    trainer.on_train_begin()
    warmup_submitted = _count_tq_prompt_groups() - window_before
    trainer.prepare_step()
    evicted: dict[str, int] = {}
    if case.sample:
        _, metrics = trainer.replay_buffer.sample(global_steps=trainer.global_steps, partition_id="train", batch_size=B)
        evicted = {reason: int(metrics.get(key, 0)) for reason, key in EVICTION_METRICS.items()}
    text = (root / "verl.log").read_text()
    line = re.search(r"(Skipping async warmup|Added \d+ warmup prompts)[^\n]*", text)
    target = re.search(r"(\d+)(?:-prompt prefetch window| target prompt groups)", line.group(0)) if line else None
    poster = plugin(config).poster
    assert poster is not None and poster.flush(10), "the plugin did not deliver its events"
    return Resumed(
        restored=trainer._restored_tq_prompt_count,
        reissued=reissued,
        warmup_submitted=warmup_submitted,
        target=int(target.group(1)) if target else None,
        logged=line.group(0) if line else "",
        dispatched=ray.get(manager.agent_loop_workers[0].dispatched.remote()),
        evicted=evicted,
        trainer=trainer,
    )


@pytest.fixture
def verl_log(tmp_path: Path) -> Iterator[Path]:
    """verl's loggers write the file tqmon tails, in verl's format (configure_verl_logging, to a file)."""
    path = tmp_path / "verl.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(asctime)s:%(message)s"))
    verl_logger = logging.getLogger("verl")
    saved = verl_logger.handlers, verl_logger.level, verl_logger.propagate
    verl_logger.handlers, verl_logger.propagate = [handler], False
    verl_logger.setLevel(logging.INFO)
    try:
        yield path
    finally:
        verl_logger.handlers, verl_logger.level, verl_logger.propagate = saved
        handler.close()


# ---------------------------------------------------------------- reading tqmon


def settled(tqmon: TqmonProcess, want: set[tuple[str, str]], timeout: float = 20.0) -> dict[str, Any]:
    """The last resume record once its evidence holds every (source, event type) in ``want``."""
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()
        records = status.get("records") or []
        seen = {(e["source"], e["event_type"]) for e in records[-1]["evidence"]} if records else set()
        if want <= seen:
            return status
        time.sleep(0.1)
    raise AssertionError(f"tqmon never saw {want}: {status}")


def gauge(metrics: str, name: str, **labels: str) -> float | None:
    inner = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return sample_value(metrics, f"{name}{{{inner}}}" if inner else name)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_tqmon_matches_verl(
    case: Case,
    cluster: Any,
    tmp_path: Path,
    verl_log: Path,
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tq = cluster
    tqmon = tqmon_factory(["--log", str(verl_log), "--log-interval", "0.1"]).start()
    monkeypatch.setenv("TQMON_URL", tqmon.url)
    clear_window(tq)
    saved = None
    if case.step is not None:
        saved = save_previous_run(tq, tmp_path, case)
        restart_transfer_queue(tq)  # the trainer restarts: verl restores into a fresh controller
    verl = resume(tq, tmp_path, case)

    want = {("events", "warmup_decided"), ("events", "training_started"), ("log", "training_started")}
    if case.step is not None:
        want |= {("events", "checkpoint_restored"), ("log", "checkpoint_restored"), ("events", "inflight_reissued")}
    if verl.reissued:
        want.add(("log", "inflight_reissued"))
    if verl.logged:
        want.add(("log", "warmup_decided"))
    status = settled(tqmon, want)
    metrics = tqmon.metrics()
    record = status["records"][-1]

    # One start, seen through both doors (verl's log and the plugin), is one resume record.
    assert status["records_total"] == 1
    assert record["resumed"] is (case.step is not None)
    assert record["checkpoint_step"] == (case.step or 0)
    assert record["semantics"] == "verl-0.9.1"

    # R, K and the warmup's measured M: verl's count, verl's re-issue and the window growth on_train_begin caused.
    assert sum(record["restored_by_status"].values()) == verl.restored
    assert gauge(metrics, "tqmon_resume_reissued_prompt_groups") == verl.reissued
    assert gauge(metrics, "tqmon_resume_warmup_submitted_prompt_groups") == verl.warmup_submitted
    assert gauge(metrics, "tqmon_resume_warmup_expected_prompt_groups") == verl.warmup_submitted
    # What the workers received: the re-issue, the warmup, then the step's batch (and the first sample's refills).
    head = [n for n in (verl.reissued, verl.warmup_submitted) if n]
    assert verl.dispatched[: len(head) + 1] == [*head, B]

    # T and O where verl states T (its warmup log line); the silent cases are disabled with nothing submitted.
    if verl.target is not None:
        assert gauge(metrics, "tqmon_resume_warmup_target_prompt_groups") == verl.target
        assert gauge(metrics, "tqmon_resume_over_restored_prompt_groups") == max(0, verl.restored - verl.target)
    state = warmup_state(case, verl)
    assert gauge(metrics, "tqmon_resume_warmup_state", state=state) == 1, (state, record)
    # verl's own log, its plugin, the checkpoint it saved and the config it reported agree on every quantity.
    assert record["disagreements"] == [], record["disagreements"]
    assert gauge(metrics, "tqmon_resume_source_disagreements", quantity="restored") == 0
    # Only what two reports were given for has a verdict: R (the plugin's and the log's), K when verl logged its
    # re-issue (the plugin always reports one), R's split on a resume (the plugin's restore against the checkpoint
    # it saved); a fresh start splits nothing, so its split has no series rather than a 0 that reads as agreement.
    assert "restored" in record["compared"]
    assert ("reissued" in record["compared"]) is bool(verl.reissued)
    split = gauge(metrics, "tqmon_resume_source_disagreements", quantity="restored_pending")
    assert split == (None if case.step is None else 0)
    # No window lost: 0 after a resume (verl reported its restore); a fresh start has no cost, so no series.
    assert gauge(metrics, "tqmon_resume_lost_prompt_groups") == (0 if record["resumed"] else None)
    # verl resumed from the checkpoint it saved last (or started a run with none) and counted each step once.
    assert record["step_regressions"] == []
    assert [gauge(metrics, "tqmon_resume_step_regression_steps", reason=r) for r in RegressionReason] == [0] * 5
    if not verl.logged:  # the warmup is off: verl defines no T, so nothing is over-restored or missing
        assert (record["target"], record["over_restored"], record["under_submitted"]) == (None, None, None)
        for name in ("target", "over_restored", "under_submitted"):
            assert gauge(metrics, f"tqmon_resume_{'warmup_' if name == 'target' else ''}{name}_prompt_groups") is None

    # `tqmon inspect` on the checkpoint verl resumed from, given verl's config file, predicted this very record.
    if case.step is not None:
        predicted = inspect_prediction(tmp_path, case)
        assert {key: predicted[key] for key in PREDICTED} == {key: record[value] for key, value in PREDICTED.items()}
        assert predicted["warmup_state"] == state

    # The doomed groups tqmon predicted are the groups verl's replay buffer evicted at the first sample.
    if case.sample:
        for reason, count in verl.evicted.items():
            assert gauge(metrics, "tqmon_resume_doomed_prompt_groups", reason=reason) == count, (reason, verl.evicted)
        refills = sum(verl.dispatched[len(head) + 1 :])
        assert refills == sum(verl.evicted.values())

    # The checkpoint callback reported the saved window.
    if saved is not None:
        assert gauge(metrics, "tqmon_checkpoint_step") == case.step
        for status_name, count in saved["by_status"].items():
            assert gauge(metrics, "tqmon_checkpoint_prompt_groups", status=status_name) == count
        assert gauge(metrics, "tqmon_checkpoint_orphan_trajectories") == saved["orphans"]


# inspect's JSON key -> the serve record's field it must equal
PREDICTED = {
    "restored": "restored",
    "target": "target",
    "warmup_submitted": "submitted",
    "over_restored": "over_restored",
    "doomed": "doomed",
    "under_submitted": "under_submitted",
    "warmup_state": "warmup_state",
}


def inspect_prediction(root: Path, case: Case, *args: str) -> dict[str, Any]:
    """``tqmon inspect --json`` on the case's checkpoint dir with verl's composed config saved as a file."""
    from omegaconf import OmegaConf

    config_file = root / "config.yaml"
    OmegaConf.save(verl_config(root, case.overrides), config_file)
    result = CliRunner().invoke(
        main,
        ["inspect", str(root / "ckpt"), "--trainer-config", str(config_file), "--json", *args],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    predicted: dict[str, Any] = json.loads(result.stdout)
    return predicted


def warmup_state(case: Case, verl: Resumed) -> str:
    """verl's warmup outcome in tqmon's vocabulary, from what verl logged and submitted."""
    if not verl.logged:
        return "disabled"  # verl returns silently: skip.rollout_tq or num_warmup_batches <= 0
    if verl.logged.startswith("Skipping"):
        assert verl.target is not None
        return "skipped_over_restored" if verl.restored > verl.target else "skipped_full"
    assert verl.warmup_submitted > 0
    return "topped_up" if case.step is not None else "fresh_start"


# ---------------------------------------------------------------- a verl 0.9.0 resume

# R = 9 of T = 2 x 4 = 8: verl 0.9.1 would skip its warmup; 0.9.0 submits 2 whole batches on top, 17 in all.
LEGACY_CASE = Case(
    "legacy_0_9_0",
    10,
    (("pending", 10, 1), ("running", 10, 2), ("finished", 10, 4), ("finished", 9, 1), ("failure", 9, 1)),
    overrides=("trainer.v1.colocate_async.num_warmup_batches=2",),
)


def verl_0_9_0_trainer() -> type:
    """verl's real trainer with verl 0.9.0's warmup, which ignored the restore: ``num_warmup_batches`` times
    verl's own ``_add_batch_to_generate`` (one train batch each) in ``on_train_begin``, then its log line."""
    from verl.trainer.ppo.v1 import PPOTrainerColocateAsync

    logger = logging.getLogger("verl.trainer.ppo.v1.trainer_colocate_async")  # where 0.9.0 logged its line

    class Verl090(PPOTrainerColocateAsync):  # type: ignore[misc]
        def on_train_begin(self) -> None:
            if self.config.skip.rollout_tq.enable:
                return
            batches = self.config.trainer.v1.colocate_async.num_warmup_batches
            for _ in range(batches):
                self._add_batch_to_generate()
            logger.info(f"Added {batches} warmup batches to the agent loop manager")

    return Verl090


def test_inspect_predicted_a_verl_0_9_0_resume(
    cluster: Any,
    tmp_path: Path,
    verl_log: Path,
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Told the version, ``tqmon inspect`` predicts 0.9.0's M and over-fill where it used to predict 0.9.1's skip;
    the resume's own log line tells inspect and serve the release, and serve derives the predicted record."""
    tq = cluster
    tqmon = tqmon_factory(["--log", str(verl_log), "--log-interval", "0.1"]).start()
    monkeypatch.setenv("TQMON_URL", tqmon.url)
    clear_window(tq)
    save_previous_run(tq, tmp_path, LEGACY_CASE)
    predicted = inspect_prediction(tmp_path, LEGACY_CASE, "--verl-version", "0.9.0")
    installed = inspect_prediction(tmp_path, LEGACY_CASE)  # the verl next to tqmon is 0.9.1: its skip
    restart_transfer_queue(tq)
    verl = resume(tq, tmp_path, LEGACY_CASE, verl_0_9_0_trainer())

    # verl 0.9.0 submitted two whole batches on top of R = 9: the window holds 17 of T = 8.
    assert (verl.restored, verl.warmup_submitted, verl.dispatched[:4]) == (9, 8, [3, B, B, B])  # K, 2 batches, step
    assert (predicted["verl_version"]["source"], predicted["warmup_state"]) == ("flag", "legacy_unconditional")
    assert (predicted["target"], predicted["warmup_submitted"]) == (8, verl.warmup_submitted)
    assert predicted["over_filled"] == verl.restored + verl.warmup_submitted - predicted["target"] == 9
    assert (installed["verl_version"]["source"], installed["warmup_submitted"]) == ("installed", 0)
    assert installed["warmup_state"] == "skipped_over_restored"  # what the old preflight said of any version

    # The resume's own line tells the release, over --verl-version.
    from_log = inspect_prediction(tmp_path, LEGACY_CASE, "--log", str(verl_log), "--verl-version", "0.9.1")
    assert (from_log["verl_version"]["semantics"], from_log["verl_version"]["source"]) == ("verl-0.9.0", "log")
    assert {key: from_log[key] for key in PREDICTED} == {key: predicted[key] for key in PREDICTED}
    # serve heard the same line and derived the record inspect predicted.
    want = {("log", "warmup_decided"), ("events", "warmup_decided"), ("events", "checkpoint_restored")}
    record = settled(tqmon, want)["records"][-1]
    assert (record["semantics"], record["over_filled"]) == ("verl-0.9.0", predicted["over_filled"])
    assert {key: predicted[key] for key in PREDICTED} == {key: record[value] for key, value in PREDICTED.items()}


# ---------------------------------------------------------------- the window from the replay buffer's own sync

WINDOW = (("pending", 5, 2), ("running", 5, 1), ("finished", 5, 4), ("finished", 3, 2), ("failure", 4, 1))
COMPARED = ("by_status", "age_buckets", "age_sum", "trajectories", "orphan_trajectories")


def same_moment(tqmon: TqmonProcess, config: Any, timeout: float = 30.0) -> dict[str, dict[str, dict[str, Any]]]:
    """Both windows of every partition once the plugin's newest post arrived and a kv_list poll followed it
    by a second (TransferQueue does not change meanwhile): ``{partition: {source: window}}``."""
    state = plugin(config)
    assert state.window is not None and state.poster is not None
    assert state.window.flush(10) and state.poster.flush(10), "the plugin did not deliver its window"
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()
        seen: dict[str, dict[str, dict[str, Any]]] = {}
        for window in status["window_observations"]:
            seen.setdefault(window["partition"], {})[window["source"]] = window
        if all(
            {"replay_buffer", "tq"} <= set(seen.get(p, {}))
            and seen[p]["tq"]["observed_at"] > seen[p]["replay_buffer"]["observed_at"] + 1.0
            for p in ("train", "val")
        ):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"no kv_list poll after the plugin's window: {status}")


def test_the_plugin_window_equals_the_kv_list_poll_at_the_same_moment(
    cluster: Any, tmp_path: Path, tqmon_factory: Callable[..., TqmonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    tq = cluster
    clear_window(tq)
    # The TQ poll at a 1 s cross-check while the plugin feeds the window, so the test need not wait 10 minutes.
    fast = [
        "--tq-cross-check-interval",
        "1",
        "--tq-min-interval",
        "0.2",
        "--tq-max-interval",
        "0.2",
        "--tq-budget",
        "1",
    ]
    tqmon = tqmon_factory(["--ray-address", ray.get_runtime_context().gcs_address, *fast]).start()
    monkeypatch.setenv("TQMON_URL", tqmon.url)
    config = verl_config(tmp_path, ())
    trainer = make_trainer(config)
    trainer.agent_loop_manager = RecordingManager.create(config=config, llm_client=None)
    submit_window(tq, trainer, WINDOW, orphans=2, step=5)  # the first submission makes the plugin watch the buffer
    trainer.global_steps = 6
    poster = plugin(config).poster
    assert poster is not None
    poster.post(StepCompleted(id=f"{tmp_path.name}/step/6", global_step=6))  # the step tqmon ages against

    # A sync as verl makes one (get_sampleable_count), then what the first sample leaves: the failure group
    # evicted and refilled, B finished groups taken (their trajectories stay until the step clears them).
    sampleable = trainer.replay_buffer.get_sampleable_count(trainer.global_steps, "train")
    before = same_moment(tqmon, config)
    batch, _ = trainer.replay_buffer.sample(global_steps=trainer.global_steps, partition_id="train", batch_size=B)
    after = same_moment(tqmon, config)

    for seen in (before, after):
        for partition, windows in seen.items():
            plugin_view = {key: windows["replay_buffer"][key] for key in COMPARED}
            poll_view = {key: windows["tq"][key] for key in COMPARED}
            assert plugin_view == poll_view, partition
    train_before, train_after = before["train"]["replay_buffer"], after["train"]["replay_buffer"]
    assert sampleable == 6 and train_before["by_status"] == {"pending": 2, "running": 1, "finished": 6, "failure": 1}
    assert (train_before["trajectories"], train_before["orphan_trajectories"]) == (9, 2)
    assert train_before["age_sum"] == 3 * 1 + 4 * 1 + 2 * 3 + 1 * 2  # trainer step 6 against steps 5, 3, 4
    assert train_after["by_status"] == {"pending": 3, "running": 1, "finished": 2, "failure": 0}
    assert train_after["orphan_trajectories"] == 2 + len(batch.keys)
    status = httpx.get(tqmon.url + "/api/v1/status", timeout=5).json()
    assert status["tq"]["cross_check"] is True
    assert gauge(tqmon.metrics(), "tqmon_source_up", source="replay_buffer") == 1


# ---------------------------------------------------------------- DAPO: filtered groups, predicted from the checkpoint

DAPO_STEP = 20
DAPO_THRESHOLD = 3  # stale at the first sample (step 21): finished groups with global_steps <= 18
DAPO_OVERRIDES = (
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    f"trainer.v1.sampler.max_off_policy_threshold={DAPO_THRESHOLD}",
    "trainer.v1.colocate_async.num_warmup_batches=3",
)
# (status, global_steps, the metric of each of the group's trajectories); one prompt group per row. Reward
# functions may return numpy scalars: verl takes float() of each.
DAPO_WINDOW: tuple[tuple[str, int, tuple[float | np.floating[Any], ...]], ...] = (
    ("finished", 20, (1.0, 0.0, 1.0)),  # kept
    ("finished", 20, (np.float64(0.1), np.float32(0.1))),  # kept: the float32 reads 0.10000000149011612
    ("finished", 20, (np.float32(1.0), np.float64(1.0))),  # zero variance: filtered
    ("finished", 19, (0.0, 0.0, 0.0)),  # zero variance: filtered
    ("finished", 19, (0.1, 0.1, 0.1)),  # np.std is 1.4e-17, not 0: verl keeps it
    ("finished", 19, (1.0,)),  # one trajectory: verl never filters it
    ("finished", 15, (1.0, 1.0, 1.0)),  # stale and zero variance: verl counts it under both
    ("finished", 12, (0.0, 0.0)),  # stale and zero variance
    ("finished", 15, (0.0, 1.0)),  # stale only
    ("failure", 19, ()),
    ("pending", 20, ()),
)
# Hand-derived: verl's metrics count the 2 stale zero-variance groups twice; the union evicts 7 groups.
DAPO_VERL_METRICS = {"failure": 1, "stale": 3, "filtered": 4}
DAPO_DOOMED = {"failure": 1, "stale": 3, "filtered": 2}  # precedence failure > stale > filtered


def put_dapo_trajectories(tq: Any, uid: str, g: int, metric: tuple[float | np.floating[Any], ...]) -> None:
    """A finished group's trajectories with the fields the agent-loop worker puts, built as it builds them."""
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = []
    for session, value in enumerate(metric):
        rm_scores = torch.zeros(3 + session, dtype=torch.float32)
        rm_scores[-1] = float(value)
        rows.append(
            {
                "responses": torch.ones(3 + session, dtype=torch.int64),
                "rm_scores": rm_scores,
                "extra_fields": {"reward_extra_info": {"acc": value}, "min_global_steps": g, "max_global_steps": g},
            }
        )
    tag = {"status": "success", "prompt_len": 4, "response_len": 3, "seq_len": 7, "global_steps": g}
    keys = [f"{uid}_{session}_0" for session in range(len(metric))]
    fields = list_of_dict_to_tensordict(rows)
    tq.kv_batch_put(keys=keys, partition_id="train", tags=[dict(tag) for _ in keys], fields=fields)


def save_dapo_run(tq: Any, root: Path) -> None:
    """The DAPO window, submitted through verl's own path and saved by verl's ``_save_checkpoint``."""
    config = verl_config(root, ())
    trainer = make_trainer(config)
    trainer.agent_loop_manager = PlainManager.create(config=config, llm_client=None)
    for status, g, metric in DAPO_WINDOW:
        before = train_uids(tq)
        trainer.global_steps = g
        trainer._add_prompts_to_generate(1)
        (uid,) = train_uids(tq) - before
        if status != "pending":
            tq.kv_put(key=uid, partition_id="train", tag={"status": "running"})
            if metric:
                put_dapo_trajectories(tq, uid, g, metric)
            tq.kv_put(key=uid, partition_id="train", tag={"status": status})
    trainer.global_steps = DAPO_STEP
    trainer._save_checkpoint()


def test_dapo_filtered_groups_predicted_from_the_checkpoint_match_verls_first_sample(
    cluster: Any,
    tmp_path: Path,
    verl_log: Path,
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    tq = cluster
    clear_window(tq)
    save_dapo_run(tq, tmp_path)
    hydra = tmp_path / "config.yaml"  # what Hydra saves as <run dir>/.hydra/config.yaml
    OmegaConf.save(verl_config(tmp_path, DAPO_OVERRIDES), hydra)
    ckpt = tmp_path / "ckpt"

    # Before the resume: the preflight and the checkpoint source read the storage units.
    inspect = subprocess.run(
        [sys.executable, "-m", "tqmon.cli", "inspect", str(ckpt), "--json", "--trainer-config", str(hydra)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    predicted = json.loads(inspect.stdout)
    args = ["--log", str(verl_log), "--log-interval", "0.1", "--checkpoint-dir", str(ckpt)]
    tqmon = tqmon_factory([*args, "--checkpoint-interval", "0.2", "--trainer-config", str(hydra)]).start()
    monkeypatch.setenv("TQMON_URL", tqmon.url)
    deadline = time.monotonic() + 20
    while gauge(tqmon.metrics(), "tqmon_checkpoint_doomed_prompt_groups", reason="filtered") is None:
        assert time.monotonic() < deadline, tqmon.metrics()
        time.sleep(0.2)
    metrics = tqmon.metrics()

    restart_transfer_queue(tq)
    case = Case("dapo", DAPO_STEP, overrides=DAPO_OVERRIDES)
    verl = resume(tq, tmp_path, case)

    # verl's own first-step eviction metrics, and the refills of the union it evicted.
    assert verl.evicted == DAPO_VERL_METRICS
    head = [n for n in (verl.reissued, verl.warmup_submitted) if n]
    assert verl.dispatched[: len(head) + 1] == [*head, B]
    assert sum(verl.dispatched[len(head) + 1 :]) == sum(DAPO_DOOMED.values())

    # The prediction, before verl ran: each group once (failure > stale > filtered), and verl's own counts.
    assert predicted["doomed"] == DAPO_DOOMED
    assert predicted["doomed_complete"] is True
    assert predicted["dapo"]["zero_variance"] == verl.evicted["filtered"]
    assert predicted["doomed"]["stale"] == verl.evicted["stale"]
    assert predicted["doomed"]["failure"] == verl.evicted["failure"]
    assert predicted["dapo"]["zero_variance_stale"] == verl.evicted["filtered"] - predicted["doomed"]["filtered"]
    assert predicted["dapo"]["missing_metric"] == 0
    for reason, count in DAPO_DOOMED.items():
        assert gauge(metrics, "tqmon_checkpoint_doomed_prompt_groups", reason=reason) == count
    assert gauge(metrics, "tqmon_source_errors_total", reason="invalid_data", source="checkpoint") == 0
