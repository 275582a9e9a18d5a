"""Which run a ``--state-dir`` belongs to: its history must never be mixed with another run's.

A state dir is bound, the first time ``serve`` uses it, to the identity of the run it monitors: the run id
(``trainer.project_name/experiment_name`` from ``--trainer-config``), the checkpoint dir and the log and
JSONL files, as absolute paths. A later ``serve`` on the same dir that names another run is refused with a
line saying which run the dir holds; a part of the identity one side does not give is not compared (adding
``--jsonl`` to a restarted tqmon is the same run), and is added to the binding.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from tqmon.store import StateStore

Identity = dict[str, str]  # "run_id", "checkpoint_dir", "log", "jsonl" -> value; absent when not given


class StateDirTaken(ValueError):
    """The state dir holds another run's history; the message names both runs and the way out."""


def run_identity(run_id: str, checkpoint_dir: Path | None, logs: Sequence[str], jsonl: Sequence[str]) -> Identity:
    """What names the monitored run; paths absolute, so a cwd-relative ``--log`` from elsewhere still matches."""
    parts = {
        "run_id": run_id,
        "checkpoint_dir": "" if checkpoint_dir is None else os.path.abspath(checkpoint_dir),
        "log": " ".join(sorted(os.path.abspath(p) for p in logs)),
        "jsonl": " ".join(sorted(os.path.abspath(p) for p in jsonl)),
    }
    return {key: value for key, value in parts.items() if value}


def describe(identity: Mapping[str, str]) -> str:
    return ", ".join(f"{key} {value}" for key, value in identity.items()) or "no run identity"


def bind(store: StateStore, identity: Identity, state_dir: Path) -> None:
    """Bind the store to ``identity``, or refuse if it is bound to another run."""
    bound = store.bound_run()
    if bound is not None:
        differs = [key for key, value in identity.items() if key in bound and bound[key] != value]
        if differs:
            raise StateDirTaken(
                f"--state-dir {state_dir} holds the history of another run ({describe(bound)}); this run differs "
                f"in {', '.join(differs)} ({describe({k: identity[k] for k in differs})}). Give this run its own "
                "--state-dir, or remove that one to start afresh"
            )
    merged = {**(bound or {}), **identity}
    if merged != bound:
        store.bind_run(merged)
