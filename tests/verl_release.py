"""verl's replay buffer as a verl release that renamed something would ship it: verl 0.9.1's real source with
exact edits applied, loaded under verl's own module name (its classes are verl's to the plugin) but kept out
of ``sys.modules``, so the installed verl stays as it is for every other test."""

from __future__ import annotations

import inspect
from types import ModuleType

# Each edit is (old, new); every occurrence is replaced and at least one must exist.
RENAMED_METHOD = (("_materialize_batch", "_materialize_prompt_batch"),)
RENAMED_ATTRIBUTE = (("self.prompt_global_steps", "self.prompt_steps"),)
RENAMED_PARAMETER = (  # _materialize_batch's selected_prompt_uids is prompt_uids, and verl passes it by keyword
    (
        "self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict[str, dict]",
        "self, partition_id: str, prompt_uids: list[str], partition_snapshot: dict[str, dict]",
    ),
    (
        "tq.kv_clear(partition_id=partition_id, keys=selected_prompt_uids)",
        "tq.kv_clear(partition_id=partition_id, keys=prompt_uids)",
    ),
    ("        selected = set(selected_prompt_uids)\n", "        selected = set(prompt_uids)\n"),
    (
        "self._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)",
        "self._materialize_batch(partition_id, prompt_uids=selected_prompt_uids, "
        "partition_snapshot=partition_snapshot)",
    ),
)


def replay_buffer_module(edits: tuple[tuple[str, str], ...]) -> ModuleType:
    """``verl.trainer.ppo.v1.replay_buffer`` with ``edits`` applied to its source."""
    from verl.trainer.ppo.v1 import replay_buffer

    source = inspect.getsource(replay_buffer)
    for old, new in edits:
        assert old in source, f"verl's replay_buffer.py no longer contains {old!r}"
        source = source.replace(old, new)
    module = ModuleType(replay_buffer.__name__)
    module.__file__ = replay_buffer.__file__
    exec(compile(source, f"{replay_buffer.__file__} (edited)", "exec"), module.__dict__)
    return module


def replay_buffer(edits: tuple[tuple[str, str], ...], **kwargs: object) -> object:
    """A ``ReplayBufferAsync`` of the edited release, built with the arguments verl's trainer gives it."""
    settings: dict[str, object] = {
        "trainer_mode": "colocate_async",
        "trainer_config": {},
        "max_off_policy_threshold": 8,
        "max_off_policy_strategy": "drop",
        "sampler_kwargs": {},
    }
    buffer: object = replay_buffer_module(edits).ReplayBufferAsync(**(settings | kwargs))
    return buffer
