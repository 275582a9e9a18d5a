"""The opt-in verl plugin: a checkpoint callback and an agent-loop manager that report to tqmon.

Enabled by configuration only (no fork of verl), see docs/verl.md::

    trainer.checkpoint_callback_class=tqmon.integrations.verl.TqmonCheckpointCallback
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=tqmon.integrations.verl.TqmonAgentLoopManager

Both run in verl's TaskRunner process, next to the trainer and its TransferQueue client. They post to
``$TQMON_URL`` (bearer ``$TQMON_TOKEN``) through a bounded background queue and never raise into verl:
every hook body is guarded, and a failure is logged and counted instead.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import uuid
from types import FrameType
from typing import Any, ClassVar

import transfer_queue as tq
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.ray_utils import auto_await

from tqmon.composition import Composition, compose
from tqmon.events import CheckpointSaved, RunStarted
from tqmon.integrations.poster import EventPoster
from tqmon.integrations.resume import StartReporter, Submission
from tqmon.integrations.window import DEFAULT_INTERVAL, WindowReporter
from tqmon.warmup import TrainerConfig

try:
    from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
except ImportError:  # verl 0.9.0 has no checkpoint callbacks; the agent-loop manager works without them
    CheckpointCallback = object

log = logging.getLogger("tqmon.integrations")

TRAIN = "train"
# The verl 0.9.x functions a submission passes through, by what the submission is. A submission is
# the first kind (in this order) whose function is on the stack: 0.9.0's warmup submits through
# ``_add_batch_to_generate`` under ``on_train_begin``, so the warmup must win over the step batch.
SUBMITTERS: tuple[tuple[Submission, frozenset[str]], ...] = (
    ("validation", frozenset({"_validate"})),
    ("reissue", frozenset({"_reissue_inflight_prompts"})),
    ("warmup", frozenset({"_add_async_warmup_batches", "on_train_begin"})),
    ("refill", frozenset({"wait_for_sampleable", "sample"})),
    ("step", frozenset({"_add_batch_to_generate", "prepare_step"})),
)
STACK_DEPTH = 12  # frames above generate_sequences searched; verl's deepest path is 6


def classify(frame: FrameType | None) -> Submission:
    """What a ``generate_sequences`` call is, from verl's functions on the calling stack."""
    names: set[str] = set()
    for _ in range(STACK_DEPTH):
        if frame is None:
            break
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    for kind, functions in SUBMITTERS:
        if not names.isdisjoint(functions):
            return kind
    return "step"  # a custom trainer's submission: it ends the warmup like a step batch does


def trainer_settings(config: Any) -> tuple[str, TrainerConfig]:
    """The trainer mode and the warmup-relevant settings of a verl config (``events.TrainerConfig``)."""
    v1 = config.trainer.v1
    mode = str(v1.trainer_mode)
    sampler = v1.get("sampler", {})
    filter_groups = config.get("algorithm", {}).get("filter_groups", None)
    return mode, TrainerConfig(
        train_batch_size=int(config.data.train_batch_size),
        gen_batch_size=config.data.get("gen_batch_size", None),
        num_warmup_batches=float(v1.get(mode, {}).get("num_warmup_batches", 0)),
        skip_rollout_tq=bool(config.get("skip", {}).get("rollout_tq", {}).get("enable", False)),
        max_off_policy_threshold=sampler.get("max_off_policy_threshold", 8),
        max_off_policy_strategy=sampler.get("max_off_policy_strategy", "drop"),
        filter_groups=bool(filter_groups is not None and filter_groups.get("enable", False)),
        filter_groups_metric=None if filter_groups is None else filter_groups.get("metric", None),
        rollout_n=config.get("actor_rollout_ref", {}).get("rollout", {}).get("n", None),
    )


def resume_folder(config: Any) -> str | None:
    """The ``global_step_N`` folder verl 0.9.x's ``_load_checkpoint`` resumed from, or None (fresh start)."""
    trainer = config.trainer
    if trainer.resume_mode == "auto":
        return find_latest_ckpt_path(os.path.abspath(trainer.default_local_dir))  # type: ignore[no-any-return]
    if trainer.resume_mode == "resume_path":
        return os.path.abspath(str(trainer.resume_from_path))
    return None


def window() -> Composition:
    """The training partition as verl counts it, read with the trainer's own TransferQueue client."""
    return compose(tq.kv_list(TRAIN).get(TRAIN, {}))


def _verl_version() -> str:
    import verl

    return str(getattr(verl, "__version__", ""))


class _Plugin:
    """Per-process state both hooks share: the poster and the ids of this trainer start."""

    current: ClassVar[_Plugin | None] = None

    def __init__(self, config: Any) -> None:
        self.config = config
        url = os.environ.get("TQMON_URL")
        self.poster = EventPoster(url, os.environ.get("TQMON_TOKEN")) if url else None
        self.run_id = str(config.trainer.get("experiment_name", "") or "verl")
        self.ids = f"{self.run_id}/{uuid.uuid4().hex[:12]}"  # one trainer process is one start
        self.mode, self.settings = trainer_settings(config)
        self.window: WindowReporter | None = None
        if self.poster is None:
            log.warning("tqmon: TQMON_URL is not set; the tqmon verl plugin reports nothing")
            return
        interval = window_interval()
        if interval > 0:
            self.window = WindowReporter(self.poster, self.ids, interval)
        self.poster.post(
            RunStarted(
                id=f"{self.ids}/run",
                run_id=self.run_id,
                trainer_mode=self.mode,
                verl_version=_verl_version(),
                config=self.settings,
            )
        )


def window_interval() -> float:
    """``$TQMON_WINDOW_REPORT_INTERVAL``: seconds between window posts at most (default 1; 0 turns them off)."""
    raw = os.environ.get("TQMON_WINDOW_REPORT_INTERVAL", "")
    try:
        interval = float(raw) if raw else DEFAULT_INTERVAL
    except ValueError:
        interval = -1.0
    if interval < 0:
        log.warning("tqmon: TQMON_WINDOW_REPORT_INTERVAL=%r is not a number >= 0; using %g s", raw, DEFAULT_INTERVAL)
        return DEFAULT_INTERVAL
    return interval


def watch_replay_buffer(buffer: Any, reporter: WindowReporter) -> bool:
    """Report ``buffer``'s view after each of its syncs and after each batch it takes; False if it is not a verl
    0.9 replay buffer (a custom sampler without those methods). Wraps this instance's two methods only:
    verl's calls, arguments, results and exceptions pass through unchanged."""
    if not all(hasattr(buffer, name) for name in ("_sync_metadata_from_transfer_queue", "_materialize_batch")):
        return False
    if "_sync_metadata_from_transfer_queue" in vars(buffer):
        return True  # already watched
    sync, materialize = buffer._sync_metadata_from_transfer_queue, buffer._materialize_batch

    @functools.wraps(sync)
    def synced(*args: Any, **kwargs: Any) -> Any:
        result = sync(*args, **kwargs)
        reporter.synced(buffer)
        return result

    @functools.wraps(materialize)
    def sampled(partition_id: str, selected_prompt_uids: list[str], *args: Any, **kwargs: Any) -> Any:
        batch = materialize(partition_id, selected_prompt_uids, *args, **kwargs)
        reporter.sampled(buffer, partition_id, selected_prompt_uids)
        return batch

    buffer._sync_metadata_from_transfer_queue, buffer._materialize_batch = synced, sampled
    return True


def plugin(config: Any) -> _Plugin:
    """The plugin state of this trainer, created (and ``run_started`` posted) by whichever hook comes first.

    verl hands both hooks the same config object, so one trainer start shares one state.
    """
    current = _Plugin.current
    if current is None or current.config is not config:
        current = _Plugin.current = _Plugin(config)
    return current


class TqmonCheckpointCallback(CheckpointCallback):  # type: ignore[misc]
    """``trainer.checkpoint_callback_class``: reports every save with the window it saved."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._plugin: _Plugin | None = None
        try:
            self._plugin = plugin(config)
        except Exception:
            log.exception("tqmon: plugin setup failed; checkpoint saves are not reported")

    def on_save(self, trainer: Any, global_step: int, checkpoint_dir: str, async_save: bool = False, **_: Any) -> None:
        state = self._plugin
        if state is None or state.poster is None:
            return
        try:
            # Read right after verl's tq.save_checkpoint. Sync mode saves no TransferQueue state.
            saved = window() if state.mode != "sync" else None
            state.poster.post(
                CheckpointSaved(
                    id=f"{state.ids}/save/{global_step}",
                    step=global_step,
                    path=checkpoint_dir,
                    groups=saved.group_counts() if saved else None,
                    orphan_trajectories=saved.orphan_trajectories if saved else None,
                )
            )
        except Exception:
            log.exception("tqmon: could not report the checkpoint at step %s", global_step)


class TqmonAgentLoopManager(AgentLoopManagerTQ):  # type: ignore[misc]
    """``+actor_rollout_ref.rollout.agent.agent_loop_manager_class``: reports the restore and every submission.

    ``create()`` runs after verl's TransferQueue restore and before its re-issue, so the partition read
    there is exactly what verl restored.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tqmon: StartReporter | None = None
        self._window: WindowReporter | None = None  # until the trainer's replay buffer is watched
        try:
            state = plugin(self.config)
            if state.poster is not None:
                self._tqmon = StartReporter(state.poster, state.ids, state.settings, state.mode)
                self._window = state.window
        except Exception:
            log.exception("tqmon: plugin setup failed; submissions are not reported")

    @classmethod
    @auto_await  # type: ignore[untyped-decorator]
    async def create(cls, *args: Any, **kwargs: Any) -> TqmonAgentLoopManager:
        instance: TqmonAgentLoopManager = await super().create(*args, **kwargs)
        instance._report_start()
        return instance

    def _report_start(self) -> None:
        if self._tqmon is None:
            return
        try:
            folder = resume_folder(self.config)
            restored = folder is not None and os.path.exists(os.path.join(folder, "transfer_queue"))
            step = int(folder.rsplit("global_step_", 1)[-1]) if folder is not None else None
            sync = self.config.trainer.v1.trainer_mode == "sync"
            self._tqmon.started(step, folder, window() if restored and not sync else None)
        except Exception:
            log.exception("tqmon: could not report the restored window")

    def generate_sequences(self, prompts: Any) -> Any:
        if self._tqmon is not None:
            try:
                self._tqmon.submitted(classify(sys._getframe(1)), len(prompts))
            except Exception:
                log.exception("tqmon: could not classify a submission")
        if self._window is not None:
            self._watch(sys._getframe(1))
        return super().generate_sequences(prompts)

    def _watch(self, caller: FrameType) -> None:
        """The trainer submits through its own methods (``fit`` hands it this manager), so the caller's ``self``
        is the trainer: watch its replay buffer from this first submission on (before its first sample)."""
        reporter = self._window
        try:
            buffer = getattr(caller.f_locals.get("self"), "replay_buffer", None)
            if buffer is None or reporter is None:
                return  # not the trainer calling: try again at the next submission
            self._window = None
            if not watch_replay_buffer(buffer, reporter):
                log.warning("tqmon: %s is not a verl replay buffer; the window is not reported", type(buffer).__name__)
        except Exception:
            self._window = None
            log.exception("tqmon: could not watch the replay buffer")
