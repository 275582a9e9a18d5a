"""verl's checkpoint dir: where the newest ``global_step_N`` is, and the composition a resume from it restores.

verl (``trainer.default_local_dir``) writes ``latest_checkpointed_iteration.txt`` (N) after
``tq.save_checkpoint(global_step_N/transfer_queue)``, which holds ``metadata.json`` and the TQ controller's
``controller_state.pkl``: every partition's ``keys_mapping`` (key -> index) and ``custom_meta`` (index -> tag).
From the tags of partition ``"train"`` this module derives R by status and age, K and the orphan
trajectories, without Ray, TransferQueue or torch, and without writing anything.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqmon.checkpoint.picklescan import PickleRefused, scan
from tqmon.checkpoint.storage import FilterVerdicts, filter_verdicts, with_verdicts
from tqmon.checkpoint.unpickler import TRUNCATED, CheckpointError, PartitionState, restricted_load
from tqmon.composition import EMPTY, Composition, CompositionError, Progress, ProgressFactory, compose
from tqmon.events import CheckpointSaved
from tqmon.snapshot import CheckpointListing
from tqmon.warmup import LATEST_FILE, STEP_DIR, TQ_DIR, TRAIN

STEP_PATTERN = re.compile(r"global_step_(\d+)")
METADATA_FILE = "metadata.json"
CONTROLLER_FILE = "controller_state.pkl"
# A controller_state.pkl or storage unit at least this big gets progress bars in ``tqmon inspect``
# (~125 bytes per key).
LARGE_CHECKPOINT_BYTES = 4 << 20


class _NoProgress:
    def update(self, n_steps: int) -> None:
        pass


def _no_progress(label: str, total: int) -> AbstractContextManager[Progress]:
    return nullcontext(_NoProgress())


def _large_only(progress: ProgressFactory | None) -> ProgressFactory:
    """``progress`` for a file of at least :data:`LARGE_CHECKPOINT_BYTES`; smaller ones are read before a bar helps."""

    def factory(label: str, total: int) -> AbstractContextManager[Progress]:
        if progress is None or total < LARGE_CHECKPOINT_BYTES:
            return _no_progress(label, total)
        return progress(label, total)

    return factory


class _ProgressReader:
    """A read-only file wrapper that reports bytes read (the unpickler pulls 64 KiB frames)."""

    def __init__(self, raw: io.BufferedReader, progress: Progress) -> None:
        self._raw = raw
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._progress.update(len(data))
        return data

    def readinto(self, buffer: bytearray | memoryview) -> int:
        n = self._raw.readinto(buffer)
        self._progress.update(n)
        return n

    def readline(self, size: int = -1) -> bytes:
        data = self._raw.readline(size)
        self._progress.update(len(data))
        return data


def partition_keys(state: object, partition_id: str = TRAIN) -> list[tuple[str, object, object]]:
    """``(key, global index, tag)`` of one partition of an unpickled controller state, in ``keys_mapping``
    order: the tags as ``kv_list`` builds them, the indexes where the storage units hold each key's fields.

    A partition that does not exist is empty (verl then restores 0 prompt groups).
    """
    if not isinstance(state, dict) or not isinstance(state.get("partitions"), dict):
        raise CheckpointError("invalid_data", "controller state has no 'partitions' dict")
    partition = state["partitions"].get(partition_id)
    if partition is None:
        return []
    if not isinstance(partition, PartitionState):
        raise CheckpointError("invalid_data", f"partition {partition_id!r} is {type(partition).__name__}")
    keys_mapping = partition.state.get("keys_mapping")
    custom_meta = partition.state.get("custom_meta")
    if not isinstance(keys_mapping, dict) or not isinstance(custom_meta, dict):
        raise CheckpointError("invalid_data", f"partition {partition_id!r} lacks keys_mapping/custom_meta dicts")
    keys: list[tuple[str, object, object]] = []
    for key, index in keys_mapping.items():
        if not isinstance(key, str):
            raise CheckpointError("invalid_data", f"partition {partition_id!r} has a non-string key {key!r}")
        keys.append((key, index, custom_meta.get(index, {})))
    return keys


@dataclass(frozen=True, slots=True)
class CheckpointReading:
    """One ``global_step_N``: where it is, and the composition a resume from it restores."""

    root: Path
    step: int
    tq_dir: Path | None  # None: no transfer_queue/ (verl then restores nothing)
    composition: Composition
    user_metadata: Mapping[str, Any] = field(default_factory=dict)
    storage_saved: bool | None = None
    saved_at_ns: int = 0  # mtime of controller_state.pkl (or of global_step_N without a TQ dir)
    size_bytes: int = 0  # of controller_state.pkl
    filter_verdicts: FilterVerdicts | None = None  # DAPO's, read from the storage units when its metric is known
    # Why the verdicts could not be read, or why some groups have none (the composition stands).
    filter_error: CheckpointError | None = None

    @property
    def event_id(self) -> str:
        return f"checkpoint:{self.step}:{self.saved_at_ns}"

    def to_event(self) -> CheckpointSaved:
        """The one event the checkpoint source ingests for this checkpoint: with DAPO's verdicts once every
        finished group has one (a missing metric or a refused value decides nothing)."""
        c = self.composition
        groups = c.group_counts()
        verdicts = self.filter_verdicts if self.filter_verdicts is not None and self.filter_verdicts.decided else None
        return CheckpointSaved(
            id=self.event_id,
            time=datetime.fromtimestamp(self.saved_at_ns / 1e9, UTC),
            step=self.step,
            path=str(self.tq_dir or self.root / STEP_DIR.format(self.step)),
            by_status=c.by_status,
            groups=groups if verdicts is None else with_verdicts(groups, verdicts),
            orphan_trajectories=c.orphan_trajectories,
            filter_metric=None if verdicts is None else verdicts.metric,
        )


class NoCheckpointYet(CheckpointError):
    """No ``latest_checkpointed_iteration.txt``: verl has saved nothing there yet (a state, not a failure)."""


def latest_step(root: Path) -> int:
    """N from ``latest_checkpointed_iteration.txt``, parsed like verl's ``find_latest_ckpt_path``."""
    path = root / LATEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        yet = "" if root.is_dir() else f" ({root} does not exist yet)"
        raise NoCheckpointYet("unavailable", f"no checkpoint saved yet: {path} does not exist{yet}") from None
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None
    try:
        step = int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError("invalid_data", f"{path}: expected a step number, got {raw[:40]!r}") from None
    if step < 0:
        raise CheckpointError("invalid_data", f"{path}: negative step {step}")
    return step


def step_dirs(root: Path, step: int, *, chosen: bool = False) -> tuple[Path, Path | None]:
    """``global_step_N`` and the TQ dir a resume loads (TQ rolls back to ``transfer_queue.old`` after a crash).

    ``chosen``: the user asked for step N (``inspect --step``), the latest file did not name it."""
    step_dir = root / STEP_DIR.format(step)
    if not step_dir.is_dir():
        if chosen:
            saved = ", ".join(map(str, saved_steps(root))) or "none"
            raise CheckpointError(
                "read_error", f"step {step} was asked for, but {step_dir} does not exist (saved: {saved})"
            )
        raise CheckpointError(
            "read_error", f"{root / LATEST_FILE} says {step}, but {step_dir} does not exist (verl would start fresh)"
        )
    for name in (TQ_DIR, TQ_DIR + ".old"):
        if (step_dir / name).is_dir():
            return step_dir, step_dir / name
    return step_dir, None


def signature(root: Path, step: int | None = None) -> tuple[object, ...]:
    """Cheap fingerprint of what a read would see: changes when the latest file or the TQ files change.

    ``step``: of ``global_step_N`` itself (the latest file plays no part)."""
    parts: list[object] = []
    for path in [root / LATEST_FILE] if step is None else []:
        try:
            st = path.stat()
            parts.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            parts.append((path.name, None))
    try:
        step_dir, tq_dir = step_dirs(root, latest_step(root) if step is None else step)
    except CheckpointError:
        return tuple(parts)
    targets = [step_dir] if tq_dir is None else [tq_dir / METADATA_FILE, tq_dir / CONTROLLER_FILE]
    for path in targets:
        try:
            st = path.stat()
            parts.append((str(path), st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            parts.append((str(path), None))
    return tuple(parts)


def read_metadata(tq_dir: Path, step: int) -> tuple[bool | None, dict[str, Any]]:
    """``metadata.json``: ``{"storage_saved": bool, "user_metadata": {"global_steps": N}}``."""
    path = tq_dir / METADATA_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError("read_error", f"{path} does not exist (tq.load_checkpoint would fail)") from None
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError("invalid_data", f"{path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError("invalid_data", f"{path}: expected a JSON object, got {type(meta).__name__}")
    storage_saved = meta.get("storage_saved")
    user = meta.get("user_metadata", {})
    if storage_saved is not None and not isinstance(storage_saved, bool):
        raise CheckpointError("invalid_data", f"{path}: storage_saved is {storage_saved!r}, not a boolean")
    if not isinstance(user, dict):
        raise CheckpointError("invalid_data", f"{path}: user_metadata is {type(user).__name__}, not an object")
    saved_step = user.get("global_steps")
    if saved_step is not None and saved_step != step:
        raise CheckpointError("invalid_data", f"{path}: user_metadata.global_steps is {saved_step!r}, not {step}")
    return storage_saved, user


def read_checkpoint(
    root: Path, step: int | None = None, *, progress: ProgressFactory | None = None, filter_metric: str | None = None
) -> CheckpointReading:
    """Read ``global_step_N`` (default: the latest) without writing anything; raises :class:`CheckpointError`.

    ``progress`` is called for the read and the classification of a checkpoint of at least
    :data:`LARGE_CHECKPOINT_BYTES`, and for each storage unit of that size. ``filter_metric`` (DAPO's
    ``algorithm.filter_groups.metric``) also reads the storage units for the verdicts; a failure there is
    kept as ``filter_error`` and the composition stands.
    """
    chosen = step is not None
    if step is None:
        step = latest_step(root)
    step_dir, tq_dir = step_dirs(root, step, chosen=chosen)
    if tq_dir is None:
        # verl restores TQ only if global_step_N/transfer_queue exists (it never does in sync mode).
        saved_at = _stat(step_dir).st_mtime_ns
        return CheckpointReading(root, step, None, EMPTY, saved_at_ns=saved_at)
    storage_saved, user = read_metadata(tq_dir, step)
    path = tq_dir / CONTROLLER_FILE
    try:
        with open(path, "rb") as handle:
            st = os.fstat(handle.fileno())
            large = progress is not None and st.st_size >= LARGE_CHECKPOINT_BYTES
            factory = progress if large and progress is not None else _no_progress
            scan(handle, st.st_size)  # sizes, memo and nesting checked before anything is built
            handle.seek(0)
            with factory(f"reading {CONTROLLER_FILE}", st.st_size) as bar:
                state = restricted_load(_ProgressReader(handle, bar) if large else handle)
    except PickleRefused as err:
        what = TRUNCATED if err.reason == "truncated" else f"refused before unpickling ({err.reason})"
        raise CheckpointError("invalid_data", f"{path}: {what}: {err}", refusal=err.reason) from None
    except FileNotFoundError:
        raise CheckpointError("read_error", f"{path} does not exist (tq.load_checkpoint would fail)") from None
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None
    except CheckpointError as err:
        raise CheckpointError(err.reason, f"{path}: {err}", err.refusal) from None
    try:
        keys = partition_keys(state)
        tags = {key: tag for key, _, tag in keys}
        with factory(f"classifying {len(tags)} keys", len(tags)) as bar:
            composition = compose(tags, bar)
    except CheckpointError as err:
        raise CheckpointError(err.reason, f"{path}: {err}") from None
    except CompositionError as err:
        raise CheckpointError("invalid_data", f"{path}: {err}") from None
    verdicts, filter_error = None, None
    if filter_metric is not None:
        try:
            verdicts = filter_verdicts(keys, tq_dir, filter_metric, progress=_large_only(progress))
        except CheckpointError as err:
            filter_error = err
        else:
            if verdicts.refused:  # counted and shown as an unreadable unit is; the verdicts still tell the rest
                refused = f"{verdicts.refused} finished group(s) refused: {verdicts.refusal}"
                filter_error = CheckpointError("invalid_data", refused)
    return CheckpointReading(
        root, step, tq_dir, composition, user, storage_saved, st.st_mtime_ns, st.st_size, verdicts, filter_error
    )


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None


def checkpoint_dirs_below(path: Path, depth: int = 3, limit: int = 5) -> list[Path]:
    """Dirs under ``path`` (at most ``depth`` levels) that hold a ``latest_checkpointed_iteration.txt``:
    what the user probably meant by a run dir (verl's default is ``checkpoints/<project>/<experiment>``).

    Does not descend into ``global_step_N`` dirs (big, and never nested checkpoint roots)."""
    found: list[Path] = []
    level = [path]
    for _ in range(depth):
        below: list[Path] = []
        for parent in level:
            try:
                children = sorted(e.path for e in os.scandir(parent) if e.is_dir() and not e.name.startswith("."))
            except OSError:
                continue
            for child in map(Path, children):
                if (child / LATEST_FILE).is_file():
                    found.append(child)
                elif not STEP_PATTERN.fullmatch(child.name):
                    below.append(child)
        if len(found) >= limit:
            break
        level = below
    return found[:limit]


def saved_steps(root: Path) -> list[int]:
    """N of every ``global_step_N`` dir in ``root``, ascending."""
    try:
        names = [entry.name for entry in os.scandir(root) if entry.is_dir()]
    except OSError:
        return []
    return sorted(int(match[1]) for name in names if (match := STEP_PATTERN.fullmatch(name)))


def listing(root: Path) -> CheckpointListing:
    """Every ``global_step_N`` with its folder's mtime, and what the latest file names: cheap (one scandir and a
    few stats), so the checkpoint source lists the dir every poll even when verl never wrote the latest file."""
    steps: list[tuple[int, float]] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        entries = []
    for entry in entries:
        match = STEP_PATTERN.fullmatch(entry.name)
        try:
            if match is not None and entry.is_dir():
                steps.append((int(match[1]), entry.stat().st_mtime))
        except OSError:
            continue  # deleted while listed
    latest: int | None = None
    latest_at: float | None = None
    error: str | None = None
    try:
        latest = latest_step(root)
        latest_at = (root / LATEST_FILE).stat().st_mtime
    except NoCheckpointYet:
        latest = None
    except CheckpointError as err:
        error = str(err)
    except OSError as err:  # removed between the read and the stat
        latest, error = None, f"{root / LATEST_FILE}: {err.strerror or err}"
    return CheckpointListing(tuple(sorted(steps)), latest, latest_at, error)


def resolve(path: Path) -> tuple[Path, int | None]:
    """The checkpoint root and step for ``tqmon inspect``'s argument.

    Accepts ``default_local_dir`` (the latest step), a ``global_step_N`` dir, or its ``transfer_queue`` dir.
    """
    if path.name in (TQ_DIR, TQ_DIR + ".old"):
        path = path.parent
    match = STEP_PATTERN.fullmatch(path.name)
    if match is not None and not (path / LATEST_FILE).exists():
        return path.parent, int(match[1])
    return path, None
