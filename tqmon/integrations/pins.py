"""The verl internals the plugin touches, pinned to the verl release its hooks were written against.

A pin names a verl class (by import path), one of its attributes and, for a method, its parameters as an
instance sees them, annotations left out (a changed type hint is not a rename). The plugin checks the pins
on the live objects before it wraps or reads anything and refuses, with one line naming the difference,
where verl differs; ``tests/test_verl_plugin.py`` checks every pin against the installed verl, so an upgrade
that renames one fails tqmon's tests instead of a user's run. docs/verl.md has the table.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tqmon.integrations.resume import Submission
from tqmon.warmup import PROMPT_STATUSES

VERL_VERSION = "0.9.1"  # the verl release every pin below was read from

_V1 = "verl.trainer.ppo.v1"
REPLAY_BUFFER = f"{_V1}.replay_buffer.ReplayBuffer"
REPLAY_BUFFER_ASYNC = f"{_V1}.replay_buffer.ReplayBufferAsync"
TRAINER = f"{_V1}.trainer_base.PPOTrainer"
AGENT_LOOP_MANAGER = f"{_V1}.agent_loop_tq.AgentLoopManagerTQ"
CHECKPOINT_CALLBACK = "verl.trainer.ppo.checkpoint_callback.CheckpointCallback"


@dataclass(frozen=True, slots=True)
class Pin:
    """One attribute of a verl class the plugin relies on."""

    owner: str  # import path of the verl class that has it
    name: str
    parameters: str | None = None  # a method's parameters as an instance sees them; None: an instance attribute

    def __str__(self) -> str:
        return f"{self.owner.rpartition('.')[2]}.{self.name}{self.parameters or ''}"


def parameters(method: Callable[..., Any]) -> str:
    """A callable's parameters as a pin states them: names, kinds and defaults, without annotations."""
    signature = inspect.signature(method)
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=plain, return_annotation=inspect.Signature.empty))


def difference(pin: Pin, owner: object) -> str | None:
    """How ``owner`` (an instance of the pinned class or of a subclass, or such a class) differs from ``pin``,
    as one phrase naming the attribute; None where it matches."""
    kind = owner if isinstance(owner, type) else type(owner)
    if not hasattr(owner, pin.name):
        return f"{kind.__name__} has no attribute {pin.name}"
    if pin.parameters is None:
        return None
    method = getattr(owner, pin.name)
    found = parameters(method)
    if isinstance(owner, type) and inspect.isfunction(method):  # looked up on the class: self is not bound yet
        found = parameters(method.__get__(object()))
    if found != pin.parameters:
        return f"{kind.__name__}.{pin.name}{found} differs from the pinned {pin.name}{pin.parameters}"
    return None


def differences(owner: object, pins: Iterable[Pin]) -> list[str]:
    """Every pin ``owner`` differs from, one phrase each (see :func:`difference`)."""
    return [found for pin in pins if (found := difference(pin, owner)) is not None]


def resolve(pin: Pin) -> type:
    """The pinned class in the installed verl (an ImportError or AttributeError where it moved)."""
    module, _, name = pin.owner.rpartition(".")
    owner: type = getattr(importlib.import_module(module), name)
    return owner


# The replay buffer: the two methods the plugin wraps and the sets it reads after them.
SYNC = Pin(REPLAY_BUFFER, "_sync_metadata_from_transfer_queue", "()")
MATERIALIZE = Pin(REPLAY_BUFFER, "_materialize_batch", "(partition_id, selected_prompt_uids, partition_snapshot)")
BUFFER_SETS = tuple(
    Pin(REPLAY_BUFFER, name) for name in ("partitions", "prompt_global_steps", *(f"{s}_keys" for s in PROMPT_STATUSES))
)
REPLAY_BUFFER_PINS = (SYNC, MATERIALIZE, *BUFFER_SETS)

# The trainer: where the plugin finds the replay buffer (the ``self`` of generate_sequences' caller).
TRAINER_BUFFER = Pin(TRAINER, "replay_buffer")

# The self-heal submits its top-up through the trainer's own submission path, the one the warmup uses.
ADD_PROMPTS = Pin(TRAINER, "_add_prompts_to_generate", "(num_prompts)")

# The methods the plugin's classes override; verl calls them.
GENERATE = Pin(AGENT_LOOP_MANAGER, "generate_sequences", "(prompts)")
CREATE = Pin(AGENT_LOOP_MANAGER, "create", "(*args, **kwargs)")
ON_SAVE = Pin(CHECKPOINT_CALLBACK, "on_save", "(trainer, global_step, checkpoint_dir, async_save=False, **kwargs)")

# What a submission is, by the verl function it passes through (the first kind, in this order, whose function
# is on the calling stack). verl 0.9.0's warmup submits through _add_batch_to_generate under on_train_begin,
# so the warmup must win over the step batch.
SUBMITTERS: tuple[tuple[Submission, tuple[Pin, ...]], ...] = (
    ("validation", (Pin(TRAINER, "_validate", "()"),)),
    ("reissue", (Pin(TRAINER, "_reissue_inflight_prompts", "(partition_id='train')"),)),
    (
        "warmup",
        (Pin(TRAINER, "_add_async_warmup_batches", "(num_warmup_batches)"), Pin(TRAINER, "on_train_begin", "()")),
    ),
    (
        "refill",
        (
            Pin(REPLAY_BUFFER_ASYNC, "wait_for_sampleable", "(global_steps, partition_id, target_count)"),
            Pin(REPLAY_BUFFER, "sample", "(global_steps, partition_id, batch_size)"),
        ),
    ),
    ("step", (Pin(TRAINER, "_add_batch_to_generate", "()"), Pin(TRAINER, "prepare_step", "()"))),
)
TRAINER_SUBMITTERS = tuple(pin for _, pins in SUBMITTERS for pin in pins if pin.owner == TRAINER)

ALL: tuple[Pin, ...] = (
    *REPLAY_BUFFER_PINS,
    TRAINER_BUFFER,
    ADD_PROMPTS,
    GENERATE,
    CREATE,
    ON_SAVE,
    *(pin for _, pins in SUBMITTERS for pin in pins),
)
