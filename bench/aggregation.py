"""What the aggregation benchmarks compare tqmon's window aggregation with: verl's bare prompt count, and the
aggregation of another git revision. Light on imports (no Ray, no torch), so ``profile_aggregation.py``
can run it under valgrind."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from tqmon.sources.tq import windows_of
from tqmon.warmup import PARTITIONS

Aggregation = Callable[[dict[str, dict[str, Any]]], object]


def bare_count(reply: dict[str, dict[str, Any]]) -> int:
    """verl's ``_count_tq_prompt_groups`` over every partition of the reply: the least a poll can do."""
    return sum(1 for tags in reply.values() for tag in tags.values() if tag.get("is_prompt", False))


def composition_at(revision: str) -> ModuleType:
    """``tqmon/composition.py`` as git ``revision`` has it, loaded beside this tree's (which it imports)."""
    root = Path(__file__).resolve().parent.parent
    path = f"{revision}:tqmon/composition.py"
    source = subprocess.run(["git", "-C", str(root), "show", path], check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader(f"composition_at_{revision}", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the classes
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def aggregation_of(module: ModuleType) -> Aggregation:
    """``windows_from`` with the given composition module (``tqmon.composition`` or one of ``composition_at``)."""
    compose = module.compose
    return lambda reply: windows_of({p: compose(reply.get(p) or {}) for p in PARTITIONS}, None, time.time())
