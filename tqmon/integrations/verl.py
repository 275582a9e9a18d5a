"""The opt-in verl plugin: a checkpoint callback and an agent-loop manager that report to tqmon.

Enabled by configuration only (no fork of verl), see docs/verl.md::

    trainer.checkpoint_callback_class=tqmon.integrations.verl.TqmonCheckpointCallback
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=tqmon.integrations.verl.TqmonAgentLoopManager

Both run in verl's TaskRunner process, next to the trainer and its TransferQueue client. They post to
``$TQMON_URL`` (bearer ``$TQMON_TOKEN``) through a bounded background queue and never raise into verl:
every hook calls verl's own method first with exactly its arguments, and tqmon's part runs after it,
guarded. What the hooks rely on in verl is pinned (``tqmon.integrations.pins``): a verl that differs is
refused with one line naming the difference, and the sidecar is told (``plugin_state_changed``).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, ClassVar

import transfer_queue as tq
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.ray_utils import auto_await

from tqmon.checkpoint.storage import REWARD_METRIC
from tqmon.composition import Composition, compose
from tqmon.events import PLUGIN_REASON_LENGTH, CheckpointSaved, GroupCount, PluginStateChanged, PluginWindow, RunStarted
from tqmon.hydra_config import trainer_settings
from tqmon.integrations import pins
from tqmon.integrations.logs import RateLimitedLog
from tqmon.integrations.poster import EventPoster
from tqmon.integrations.resume import StartReporter, Submission
from tqmon.integrations.selfheal import decide, self_heal_settings
from tqmon.integrations.window import DEFAULT_INTERVAL, WindowReporter
from tqmon.warmup import TQ_DIR, TRAIN, SelfHealMode, is_zero_variance

try:
    from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
except ImportError:  # verl 0.9.0 has no checkpoint callbacks; the agent-loop manager works without them
    CheckpointCallback = object

log = logging.getLogger("tqmon.integrations")

# The verl functions a submission passes through, by what the submission is (pinned: pins.SUBMITTERS).
SUBMITTERS: tuple[tuple[Submission, frozenset[str]], ...] = tuple(
    (kind, frozenset(pin.name for pin in functions)) for kind, functions in pins.SUBMITTERS
)
STACK_DEPTH = 12  # frames above generate_sequences searched; verl's deepest path is 6
HOOK = "__tqmon_hook_of__"  # set on tqmon's wrapper of a verl method: the method it calls

Report = Callable[[PluginWindow, str], None]  # tells the sidecar how the window is reported now


def classify(frame: FrameType | None) -> Submission:
    """What a ``generate_sequences`` call is, from verl's functions on the calling stack; ``unknown`` when none
    of the pinned ones is there (a renamed verl function, a custom trainer): it ends no warmup count."""
    names: set[str] = set()
    for _ in range(STACK_DEPTH):
        if frame is None:
            break
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    for kind, functions in SUBMITTERS:
        if not names.isdisjoint(functions):
            return kind
    return "unknown"


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


def dapo_filtered(tags: Mapping[str, Any], metric: str) -> set[str]:
    """The finished groups DAPO rejects at the first sample: ``ReplayBuffer._dapo_filtered_keys`` reads one
    field per trajectory (``rm_scores`` summed for ``reward``, else ``extra_fields``' ``reward_extra_info``);
    the verdict is :func:`tqmon.warmup.is_zero_variance`. A group lacking the metric is not judged filtered."""
    finished = {key for key, tag in tags.items() if tag.get("is_prompt", False) and tag.get("status") == "finished"}
    keys = [key for key, tag in tags.items() if not tag.get("is_prompt", False) and key.split("_")[0] in finished]
    if not keys:
        return set()
    field = "rm_scores" if metric == REWARD_METRIC else "extra_fields"
    data = tq.kv_batch_get(keys=keys, partition_id=TRAIN, select_fields=[field])
    values: dict[str, list[float]] = defaultdict(list)
    for key, value in zip(keys, list(data[field]), strict=True):
        if field == "rm_scores":
            values[key.split("_")[0]].append(float(value.sum().item()))
            continue
        extra = getattr(value, "data", value)
        info = extra.get("reward_extra_info", {}) if isinstance(extra, dict) else {}
        if metric in info:
            values[key.split("_")[0]].append(float(info[metric]))
    return {uid for uid, metrics in values.items() if is_zero_variance(metrics)}


def judged_groups(tags: Mapping[str, Any], filtered: set[str]) -> list[GroupCount]:
    """The restored prompt groups by status, ``global_steps`` and DAPO's verdict."""
    counts = Counter(
        (tag["status"], tag["global_steps"], key in filtered)
        for key, tag in tags.items()
        if tag.get("is_prompt", False)
    )
    return [
        GroupCount(status=status, global_steps=steps, count=n, filtered=judged)
        for (status, steps, judged), n in sorted(counts.items(), key=lambda item: (item[0][1], item[0][0], item[0][2]))
    ]


def _verl_version() -> str:
    import verl

    return str(getattr(verl, "__version__", ""))


def _is_verl(obj: object) -> bool:
    """``obj`` is (or derives from) a class of verl's, however verl names it."""
    return any(cls.__module__.split(".", 1)[0] == "verl" for cls in type(obj).__mro__)


KV_LIST_INSTEAD = "tqmon reads the window with kv_list instead (tqmon serve --ray-address)"


def refusal(what: str, found: list[str], instead: str = KV_LIST_INSTEAD) -> str:
    """The one line a hook that does not match the pinned verl logs: what is off, why, and what happens."""
    return (
        f"tqmon: {what}: {'; '.join(found)}. This verl ({_verl_version() or 'version unknown'}) is not the verl "
        f"{pins.VERL_VERSION} tqmon's hooks are pinned to; verl runs untouched and {instead}"
    )


def heal_refusal(trainer_mode: str) -> str | None:
    """The one line that turns a requested self-heal off: sync mode has no prefetch window, and a verl other
    than the pinned one may warm up differently (0.9.0 over-fills by R); None where it may run."""
    if trainer_mode == "sync":
        return "tqmon: self-heal refused: trainer_mode sync has no prefetch window to top up; verl runs untouched"
    version = _verl_version()
    if version != pins.VERL_VERSION:
        return refusal("self-heal refused", ["its warmup is not known to be 0.9.1's"], "the self-heal is off")
    return None


def _no_report(window: PluginWindow, reason: str) -> None:
    """A watch without a sidecar to tell (``watch_replay_buffer`` called directly)."""


class _Plugin:
    """Per-process state both hooks share: the poster and the ids of this trainer start."""

    current: ClassVar[_Plugin | None] = None

    def __init__(self, config: Any) -> None:
        self.config = config
        url = os.environ.get("TQMON_URL")
        self.poster = EventPoster(url, os.environ.get("TQMON_TOKEN")) if url else None
        self.run_id = str(config.trainer.get("experiment_name", "") or "verl")
        self.ids = f"{self.run_id}/{uuid.uuid4().hex[:12]}"  # one trainer process is one start
        self.mode, self.settings = trainer_settings(config, "verl's trainer config")
        self.window: WindowReporter | None = None
        self._states = 0  # plugin_state_changed events posted
        self._lock = threading.Lock()
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
        if self.window is None:
            self.report("off", "TQMON_WINDOW_REPORT_INTERVAL=0: the plugin does not report the window")

    def report(self, window: PluginWindow, reason: str) -> None:
        """Tell tqmon how the window is reported now (``plugin_state_changed``); never raises."""
        if self.poster is None:
            return
        with self._lock:
            number, self._states = self._states, self._states + 1
        try:
            reason = reason[:PLUGIN_REASON_LENGTH]
            self.poster.post(PluginStateChanged(id=f"{self.ids}/plugin/{number}", window=window, reason=reason))
        except Exception:
            log.exception("tqmon: could not report the plugin's state %r", window)


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


class BufferWatch:
    """tqmon's hooks on one verl replay buffer: its view is reported after each sync and each batch it takes.

    Only this instance's two pinned methods are wrapped, and only when the buffer matches every pin
    (:data:`pins.REPLAY_BUFFER_PINS`); otherwise nothing is wrapped and the refusal is logged once and
    reported. A wrapper calls verl's method first with exactly the arguments it was given, returns its result
    or lets its exception through untouched, then does tqmon's part, guarded. The first failure of that part
    (or of the reporter's thread) restores verl's methods, stops the reporter, is logged once with its
    traceback (later ones at most once a minute, counted) and is reported as ``failed``.
    """

    def __init__(self, buffer: Any, reporter: WindowReporter, report: Report = _no_report) -> None:
        self.buffer = buffer
        self.reporter = reporter
        self.state: PluginWindow | None = None
        self._report = report
        self._lock = threading.Lock()
        self._hooked: list[str] = []
        self.failures = RateLimitedLog(log)

    def install(self) -> bool:
        """Wrap the buffer's methods if it matches the pins; False (and one line) if it does not."""
        kind = type(self.buffer).__name__
        found = pins.differences(self.buffer, pins.REPLAY_BUFFER_PINS)
        if found:
            reason = refusal(f"not watching the replay buffer ({kind})", found)
            log.warning(reason)
            self._set("refused", reason)
            return False
        self.reporter.on_error = lambda err: self.fail("the window reporter's thread", err)
        try:
            self.hook(pins.SYNC.name, lambda _: self.reporter.synced(self.buffer))
            self.hook(pins.MATERIALIZE.name, self.after_materialize)
        except Exception as err:  # half-hooked: take off what was put on
            self.fail("installing the hooks", err)
            return False
        self._set("reporting", f"watching {kind}'s syncs and batches (verl {_verl_version() or 'version unknown'})")
        return True

    def hook(self, name: str, after: Callable[[dict[str, Any]], None]) -> None:
        """Wrap this instance's ``name``: verl's method runs first, unchanged; ``after`` gets the arguments
        bound by name inside the guard, so arguments verl accepts can never make the wrapper raise."""
        original = getattr(self.buffer, name)
        signature = inspect.signature(original)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                after(signature.bind(*args, **kwargs).arguments)
            except Exception as err:
                self.fail(name, err)
            return result

        # verl's name, so a lookup by name finds it, but tqmon's qualname and module, and no __wrapped__: a
        # traceback through the wrapper points at tqmon, and inspect shows the wrapper's own signature.
        hooked.__name__ = name
        hooked.__doc__ = f"tqmon's hook on verl's {name}: verl's method runs first, with these arguments."
        setattr(hooked, HOOK, original)
        setattr(self.buffer, name, hooked)
        self._hooked.append(name)

    def after_materialize(self, arguments: dict[str, Any]) -> None:
        """After verl took a batch: the view without its prompt keys (they left TransferQueue)."""
        self.reporter.sampled(self.buffer, arguments["partition_id"], arguments["selected_prompt_uids"])

    def fail(self, where: str, err: Exception) -> None:
        """tqmon's part failed: verl's methods come back, nothing more is posted, the sidecar is told."""
        with self._lock:
            first = self.state != "failed"
            if first:
                self.state = "failed"
                for name in self._hooked:
                    if getattr(vars(self.buffer).get(name), HOOK, None) is not None:
                        delattr(self.buffer, name)
                self._hooked.clear()
                self.reporter.stop()
        reason = f"{where}: {type(err).__name__}: {err}"
        self.failures.warning(
            f"tqmon: the replay-buffer hook failed in {reason}; verl's methods are restored and {KV_LIST_INSTEAD}",
            exc_info=err,
        )
        if first:
            self._report("failed", reason)

    def _set(self, state: PluginWindow, reason: str) -> None:
        self.state = state
        self._report(state, reason)


def watch_replay_buffer(buffer: Any, reporter: WindowReporter, report: Report = _no_report) -> bool:
    """Report ``buffer``'s view after each of its syncs and after each batch it takes (:class:`BufferWatch`);
    False, with one line and ``report("refused", why)``, where it differs from the pinned verl."""
    if getattr(getattr(buffer, pins.SYNC.name, None), HOOK, None) is not None:
        return True  # already watched
    return BufferWatch(buffer, reporter, report).install()


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
        self._plugin: _Plugin | None = None
        self._window: WindowReporter | None = None  # until the trainer's replay buffer is watched
        self._prompts = inspect.signature(super().generate_sequences)  # verl's, to bind its arguments by name
        self._failures = RateLimitedLog(log)
        self._heal: tuple[SelfHealMode, int | None] = ("off", None)
        self._healing = False  # the self-heal's own submission is under way
        try:
            state = plugin(self.config)
            self._heal = self_heal_settings(self.config)
            if self._heal[0] != "off" and (why := heal_refusal(state.mode)) is not None:
                log.warning(why)
                self._heal = ("off", None)
            if state.poster is not None:
                self._plugin, self._window = state, state.window
                found = pins.difference(pins.GENERATE, AgentLoopManagerTQ)
                if found is None:
                    self._tqmon = StartReporter(state.poster, state.ids, state.settings, state.mode)
                else:
                    instead = "tqmon reads the resume from verl's log lines only"
                    log.warning(refusal("submissions are not reported", [found], instead))
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
            restored = folder is not None and os.path.exists(os.path.join(folder, TQ_DIR))
            step = int(folder.rsplit("global_step_", 1)[-1]) if folder is not None else None
            sync = self.config.trainer.v1.trainer_mode == "sync"
            tags = tq.kv_list(TRAIN).get(TRAIN, {}) if restored and not sync else None
            composition = compose(tags) if tags is not None else None
            groups = None
            metric = self._plugin.settings.dapo_metric if self._plugin is not None else None
            if tags is not None and metric is not None:
                try:
                    groups = judged_groups(tags, dapo_filtered(tags, metric))
                except Exception as err:  # the verdicts stay unknown: the doomed count is a lower bound
                    log.warning("tqmon: could not judge the restored groups for DAPO: %s: %s", type(err).__name__, err)
            self._tqmon.started(step, folder, composition, groups)
        except Exception:
            log.exception("tqmon: could not report the restored window")

    def generate_sequences(self, *args: Any, **kwargs: Any) -> Any:
        """verl's dispatch first, with exactly its arguments; then, guarded, what the submission was and (at
        the trainer's first submission) the watch on its replay buffer."""
        result = super().generate_sequences(*args, **kwargs)
        caller = sys._getframe(1)
        if self._tqmon is not None:
            try:
                prompts = self._prompts.bind(*args, **kwargs).arguments["prompts"]
                kind: Submission = "self_heal" if self._healing else classify(caller)
                if self._tqmon.submitted(kind, len(prompts)):
                    self._self_heal(caller)
            except Exception as err:
                self._failures.warning(f"tqmon: could not report a submission: {type(err).__name__}: {err}", err)
        if self._window is not None:
            self._watch(caller)
        return result

    def _self_heal(self, caller: FrameType) -> None:
        """Right after verl's warmup decision of a resumed start (the first step batch's dispatch, before the
        first sample): top the window up through the trainer's own ``_add_prompts_to_generate``."""
        mode, cap = self._heal
        reporter, state = self._tqmon, self._plugin
        if mode == "off" or reporter is None or state is None or state.poster is None:
            return
        if reporter.groups is None or reporter.resumed_from is None:
            return  # a fresh start, or a resume without TransferQueue state: verl's warmup fills T
        trainer = caller.f_locals.get("self")
        found = pins.difference(pins.ADD_PROMPTS, trainer)
        if found is not None:
            log.warning(refusal("the self-heal submits nothing", [found], "verl's warmup is left as it decided"))
            return
        before = reporter.submissions["self_heal"]
        self._healing = True
        try:
            decide(
                state.poster,
                f"{state.ids}/self_heal",
                mode,
                cap,
                state.settings.warmup_config(state.mode),
                reporter.groups,
                reporter.resumed_from,
                reporter.warmup,
                getattr(trainer, pins.ADD_PROMPTS.name),
                lambda: reporter.submissions["self_heal"] - before,
                self._failures,
            )
        finally:
            self._healing = False

    def _watch(self, caller: FrameType) -> None:
        """The trainer submits through its own methods (``fit`` hands it this manager), so the caller's ``self``
        is the trainer: watch its replay buffer from this first submission on (before its first sample)."""
        reporter, state = self._window, self._plugin
        if reporter is None or state is None:
            return
        try:
            trainer = caller.f_locals.get("self")
            if not (hasattr(trainer, pins.TRAINER_BUFFER.name) or _is_verl(trainer)):
                return  # not the trainer calling: try again at the next submission
            self._window = None
            found = pins.difference(pins.TRAINER_BUFFER, trainer)
            if found is not None:
                reason = refusal("not watching the replay buffer", [found])
                log.warning(reason)
                state.report("refused", reason)
                return
            unknown = pins.differences(trainer, pins.TRAINER_SUBMITTERS)
            if unknown:
                instead = "submissions through them are counted as unknown"
                log.warning(refusal("verl functions submissions are classified by differ", unknown, instead))
            watch_replay_buffer(getattr(trainer, pins.TRAINER_BUFFER.name), reporter, state.report)
        except Exception as err:
            self._window = None
            log.exception("tqmon: could not watch the replay buffer")
            state.report("failed", f"watching the replay buffer: {type(err).__name__}: {err}")
