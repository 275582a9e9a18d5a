"""``--checkpoint-dir``: what the next resume from verl's newest checkpoint will restore, before it happens.

verl (``trainer.default_local_dir``) writes ``latest_checkpointed_iteration.txt`` (N) after
``tq.save_checkpoint(global_step_N/transfer_queue)``, which holds ``metadata.json`` and the TQ controller's
``controller_state.pkl``: every partition's ``keys_mapping`` (key -> index) and ``custom_meta`` (index -> tag).
From the tags of partition ``"train"`` this module derives R by status and age, K, the doomed groups and
the orphan trajectories, without Ray, TransferQueue or torch.

``controller_state.pkl`` is a pickle. It is read with :class:`RestrictedUnpickler`, which resolves only the
globals a TQ 0.1.11 controller state contains, each to an inert stand-in (TQ's dataclasses become
attribute bags, tensors become their shape, dtypes their name): no TQ or torch code is imported or run,
and any other global is refused with :class:`CheckpointError`. Nothing here writes to the checkpoint dir.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import pickle
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from tqmon.composition import EMPTY, Composition, CompositionError, Progress, compose
from tqmon.events import CheckpointSaved
from tqmon.picklescan import PickleRefused, scan
from tqmon.tracker import Tracker, checkpoint_doomed
from tqmon.warmup import (
    DOOM_REASONS,
    WarmupConfig,
    WarmupState,
    decide_warmup,
    under_submitted,
)

SOURCE = "checkpoint"
LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = "global_step_{}"
TQ_DIR = "transfer_queue"
METADATA_FILE = "metadata.json"
CONTROLLER_FILE = "controller_state.pkl"
TRAIN = "train"
# A controller_state.pkl at least this big gets progress bars in ``tqmon inspect`` (~125 bytes per key).
LARGE_CHECKPOINT_BYTES = 4 << 20
log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint tqmon cannot read; ``reason`` is the ``tqmon_source_errors_total`` label."""

    def __init__(self, reason: str, message: str, refusal: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.refusal = refusal  # a refused pickle: the tqmon_checkpoint_pickle_refusals_total reason


# ---------------------------------------------------------------- restricted unpickling


class _Stub:
    """An instance of an allowed TQ dataclass, rebuilt as a bag of its pickled attributes."""

    __slots__ = ("state",)
    qualname: ClassVar[str] = ""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ state)
            merged: dict[str, Any] = {}
            for part in state:
                if part is not None and not isinstance(part, dict):
                    raise CheckpointError("invalid_data", f"{self.qualname} state is not a dict")
                merged.update(part or {})
            state = merged
        if not isinstance(state, dict):
            raise CheckpointError("invalid_data", f"{self.qualname} state is {type(state).__name__}, not a dict")
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname} {sorted(self.state)}>"


class PartitionState(_Stub):
    """``transfer_queue.controller.DataPartitionStatus``: keys_mapping, custom_meta, ..."""

    __slots__ = ()
    qualname = "transfer_queue.controller.DataPartitionStatus"


class FieldMetaState(_Stub):
    """``transfer_queue.controller.FieldMeta`` (dtype, shape of one column); only carried along."""

    __slots__ = ()
    qualname = "transfer_queue.controller.FieldMeta"


@dataclass(frozen=True, slots=True)
class OpaqueStorage:
    """The bytes of a pickled torch storage, never interpreted (torch would ``torch.load`` them)."""

    nbytes: int


@dataclass(frozen=True, slots=True)
class OpaqueTensor:
    """A pickled torch tensor (the production/consumption status bitmaps), reduced to its shape."""

    shape: tuple[int, ...]


def _storage_from_bytes(data: object) -> OpaqueStorage:
    if not isinstance(data, bytes):
        raise CheckpointError("invalid_data", f"torch storage payload is {type(data).__name__}, not bytes")
    return OpaqueStorage(len(data))


def _rebuild_tensor(storage: object, offset: object, size: object, *rest: object) -> OpaqueTensor:
    """Stands in for ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, grad, hooks[, meta])``."""
    if not isinstance(storage, OpaqueStorage) or not isinstance(size, tuple) or len(rest) not in (3, 4):
        raise CheckpointError("invalid_data", "torch tensor record does not have the shape of _rebuild_tensor_v2")
    if not all(isinstance(dim, int) for dim in size):
        raise CheckpointError("invalid_data", f"torch tensor size {size!r} is not a tuple of ints")
    return OpaqueTensor(size)


# Canonical torch dtype names (what ``pickle.dumps(torch.<dtype>)`` references): FieldMeta.dtype.
# fmt: off
TORCH_DTYPES = frozenset({
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32", "complex64",
    "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64",
    "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "uint1", "uint16", "uint2", "uint3",
    "uint32", "uint4", "uint5", "uint6", "uint64", "uint7", "uint8",
})
# fmt: on


class _Reconstructor:
    """An allowed callable a hostile ``BUILD`` opcode cannot re-configure (no ``__dict__``, no setattr)."""

    __slots__ = ("_fn", "_name")
    _fn: Callable[..., object]
    _name: str

    def __init__(self, fn: Callable[..., object], name: str) -> None:
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_name", name)

    def __call__(self, *args: object) -> object:
        return self._fn(*args)

    def __setattr__(self, name: str, value: object) -> None:
        raise CheckpointError("invalid_data", f"refused to modify {self._name}")

    def __delattr__(self, name: str) -> None:
        raise CheckpointError("invalid_data", f"refused to modify {self._name}")


# Every global a TransferQueue 0.1.11 controller_state.pkl references (found with pickletools on real
# ``tq.save_checkpoint`` output), mapped to an inert stand-in. Nothing else resolves. The stand-ins resist
# ``BUILD`` too: the classes' ``__setstate__`` needs an instance, functions are wrapped, str/OrderedDict are immutable.
ALLOWED_GLOBALS: Mapping[tuple[str, str], object] = {
    ("transfer_queue.controller", "DataPartitionStatus"): PartitionState,
    ("transfer_queue.controller", "FieldMeta"): FieldMetaState,
    ("torch._utils", "_rebuild_tensor_v2"): _Reconstructor(_rebuild_tensor, "torch._utils._rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"): _Reconstructor(_storage_from_bytes, "torch.storage._load_from_bytes"),
    ("collections", "OrderedDict"): collections.OrderedDict,  # a tensor's (empty) backward hooks
    **{("torch", name): f"torch.{name}" for name in TORCH_DTYPES},
}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only :data:`ALLOWED_GLOBALS`; any other global raises :class:`CheckpointError`."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise CheckpointError(
                "invalid_data",
                f"refused global {module}.{name}: not part of a TransferQueue controller state "
                "(the file is corrupt or hostile; nothing was executed)",
                refusal="forbidden_global",
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("invalid_data", "refused persistent id: not part of a TransferQueue controller state")


TRUNCATED = "truncated pickle (ended before its STOP opcode)"


def restricted_load(handle: io.BufferedReader | _ProgressReader) -> Any:
    """Unpickle with :class:`RestrictedUnpickler`; every failure is a :class:`CheckpointError`."""
    try:
        return RestrictedUnpickler(handle).load()
    except CheckpointError:
        raise
    except EOFError:
        raise CheckpointError("invalid_data", TRUNCATED, refusal="truncated") from None
    except pickle.UnpicklingError as err:
        if "truncated" in str(err):
            raise CheckpointError("invalid_data", TRUNCATED, refusal="truncated") from None
        raise CheckpointError("invalid_data", f"not a valid pickle: {err}", refusal="malformed") from None
    except Exception as err:  # TypeError/ValueError/... from malformed opcodes or stand-ins fed garbage
        message = f"not a valid pickle: {type(err).__name__}: {err}"
        raise CheckpointError("invalid_data", message, refusal="malformed") from None


# ---------------------------------------------------------------- progress


ProgressFactory = Callable[[str, int], AbstractContextManager[Progress]]


class _NoProgress:
    def update(self, n_steps: int) -> None:
        pass


def _no_progress(label: str, total: int) -> AbstractContextManager[Progress]:
    return nullcontext(_NoProgress())


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


def partition_tags(state: object, partition_id: str = TRAIN) -> dict[str, Any]:
    """``{key: tag}`` of one partition of an unpickled controller state, exactly as ``kv_list`` builds it.

    A partition that does not exist is empty (verl then restores 0 prompt groups).
    """
    if not isinstance(state, dict) or not isinstance(state.get("partitions"), dict):
        raise CheckpointError("invalid_data", "controller state has no 'partitions' dict")
    partition = state["partitions"].get(partition_id)
    if partition is None:
        return {}
    if not isinstance(partition, PartitionState):
        raise CheckpointError("invalid_data", f"partition {partition_id!r} is {type(partition).__name__}")
    keys_mapping = partition.state.get("keys_mapping")
    custom_meta = partition.state.get("custom_meta")
    if not isinstance(keys_mapping, dict) or not isinstance(custom_meta, dict):
        raise CheckpointError("invalid_data", f"partition {partition_id!r} lacks keys_mapping/custom_meta dicts")
    tags: dict[str, Any] = {}
    for key, index in keys_mapping.items():
        if not isinstance(key, str):
            raise CheckpointError("invalid_data", f"partition {partition_id!r} has a non-string key {key!r}")
        tags[key] = custom_meta.get(index, {})
    return tags


# ---------------------------------------------------------------- the checkpoint dir


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

    @property
    def event_id(self) -> str:
        return f"checkpoint:{self.step}:{self.saved_at_ns}"

    def to_event(self) -> CheckpointSaved:
        """The one event the checkpoint source ingests for this checkpoint."""
        c = self.composition
        return CheckpointSaved(
            id=self.event_id,
            time=datetime.fromtimestamp(self.saved_at_ns / 1e9, UTC),
            step=self.step,
            path=str(self.tq_dir or self.root / STEP_DIR.format(self.step)),
            by_status=c.by_status,
            groups=c.group_counts(),
            orphan_trajectories=c.orphan_trajectories,
        )


def latest_step(root: Path) -> int:
    """N from ``latest_checkpointed_iteration.txt``, parsed like verl's ``find_latest_ckpt_path``."""
    path = root / LATEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if not root.is_dir():
            raise CheckpointError("unavailable", f"checkpoint dir {root} does not exist") from None
        raise CheckpointError("unavailable", f"{path} does not exist: no checkpoint saved yet") from None
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None
    try:
        step = int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError("invalid_data", f"{path}: expected a step number, got {raw[:40]!r}") from None
    if step < 0:
        raise CheckpointError("invalid_data", f"{path}: negative step {step}")
    return step


def step_dirs(root: Path, step: int) -> tuple[Path, Path | None]:
    """``global_step_N`` and the TQ dir a resume loads (TQ rolls back to ``transfer_queue.old`` after a crash)."""
    step_dir = root / STEP_DIR.format(step)
    if not step_dir.is_dir():
        raise CheckpointError(
            "read_error", f"{root / LATEST_FILE} says {step}, but {step_dir} does not exist (verl would start fresh)"
        )
    for name in (TQ_DIR, TQ_DIR + ".old"):
        if (step_dir / name).is_dir():
            return step_dir, step_dir / name
    return step_dir, None


def signature(root: Path) -> tuple[object, ...]:
    """Cheap fingerprint of what a read would see: changes when the latest file or the TQ files change."""
    parts: list[object] = []
    for path in [root / LATEST_FILE]:
        try:
            st = path.stat()
            parts.append((path.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            parts.append((path.name, None))
    try:
        step = latest_step(root)
        step_dir, tq_dir = step_dirs(root, step)
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
    root: Path, step: int | None = None, *, progress: ProgressFactory | None = None
) -> CheckpointReading:
    """Read ``global_step_N`` (default: the latest) without writing anything; raises :class:`CheckpointError`.

    ``progress`` is called for the read and the classification of a checkpoint of at least
    :data:`LARGE_CHECKPOINT_BYTES`.
    """
    if step is None:
        step = latest_step(root)
    step_dir, tq_dir = step_dirs(root, step)
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
        message = f"{path}: {what}: {err}"
        raise CheckpointError("invalid_data", message, refusal=err.reason) from None
    except FileNotFoundError:
        raise CheckpointError("read_error", f"{path} does not exist (tq.load_checkpoint would fail)") from None
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None
    except CheckpointError as err:
        raise CheckpointError(err.reason, f"{path}: {err}", err.refusal) from None
    try:
        tags = partition_tags(state)
        with factory(f"classifying {len(tags)} keys", len(tags)) as bar:
            composition = compose(tags, bar)
    except CheckpointError as err:
        raise CheckpointError(err.reason, f"{path}: {err}") from None
    except CompositionError as err:
        raise CheckpointError("invalid_data", f"{path}: {err}") from None
    return CheckpointReading(root, step, tq_dir, composition, user, storage_saved, st.st_mtime_ns, st.st_size)


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as err:
        raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None


def resolve(path: Path) -> tuple[Path, int | None]:
    """The checkpoint root and step for ``tqmon inspect``'s argument.

    Accepts ``default_local_dir`` (the latest step), a ``global_step_N`` dir, or its ``transfer_queue`` dir.
    """
    if path.name in (TQ_DIR, TQ_DIR + ".old"):
        path = path.parent
    match = re.fullmatch(r"global_step_(\d+)", path.name)
    if match is not None and not (path / LATEST_FILE).exists():
        return path.parent, int(match[1])
    return path, None


# ---------------------------------------------------------------- the preflight


@dataclass(frozen=True, slots=True)
class Preflight:
    """What a resume from one checkpoint will do, as far as the checkpoint and the config tell."""

    reading: CheckpointReading
    config: WarmupConfig | None
    restored: int  # R as verl will count it (0 in sync mode: verl restores no TQ state there)
    doomed: Mapping[str, int]  # only the reasons that are known
    reissued: int = 0  # K
    cleared_trajectories: int = 0  # old trajectories of the K groups, cleared at the re-issue
    target: int | None = None
    submitted: int | None = None  # M
    over_restored: int | None = None
    warmup_state: WarmupState | None = None
    useful: int | None = None  # R - doomed + M
    under_submitted: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def sample_step(self) -> int:
        return self.reading.step + 1

    @property
    def doomed_complete(self) -> bool:
        return set(self.doomed) == set(DOOM_REASONS)

    def to_json(self) -> dict[str, Any]:
        c = self.reading.composition
        return {
            "checkpoint_dir": str(self.reading.root),
            "step": self.reading.step,
            "path": None if self.reading.tq_dir is None else str(self.reading.tq_dir),
            "sample_step": self.sample_step,
            "restored": self.restored,
            "by_status": c.by_status,
            "by_age": {str(age): n for age, n in c.by_age(self.sample_step).items()},
            "groups": [g.model_dump() for g in c.group_counts()],
            "reissued": self.reissued,
            "cleared_trajectories": self.cleared_trajectories,
            "trajectories": c.trajectories,
            "orphan_trajectories": c.orphan_trajectories,
            "doomed": dict(self.doomed),
            "doomed_complete": self.doomed_complete,
            "config": None if self.config is None else _config_json(self.config),
            "target": self.target,
            "warmup_submitted": self.submitted,
            "warmup_state": None if self.warmup_state is None else self.warmup_state.value,
            "over_restored": self.over_restored,
            "useful_after_warmup": self.useful,
            "under_submitted": self.under_submitted,
            "under_submitted_is_lower_bound": self.under_submitted is not None and not self.doomed_complete,
            "controller_state_bytes": self.reading.size_bytes,
            "saved_at": self.reading.saved_at_ns / 1e9,
            "notes": list(self.notes),
        }


def _config_json(config: WarmupConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in WarmupConfig.__slots__}


def predicted_doomed(reading: CheckpointReading, config: WarmupConfig | None) -> dict[str, int]:
    """Doomed groups by the reasons that are known: the tracker's rule, so ``inspect`` and the metrics agree."""
    return checkpoint_doomed(reading.to_event(), config) or {}


def preflight(reading: CheckpointReading, config: WarmupConfig | None) -> Preflight:
    """Predict the resume from ``reading``: R, K, doomed, and with the config T, M, O and the deficit."""
    composition = reading.composition
    notes: list[str] = []
    if config is None:
        notes.append(
            "T, M, O and the under-submission need the trainer config: "
            "--train-batch-size and --num-warmup-batches (stale and filtered also need it)"
        )
        doomed = predicted_doomed(reading, None)
        return Preflight(
            reading,
            None,
            composition.restored,
            doomed,
            composition.reissued,
            composition.inflight_trajectories,
            notes=tuple(notes),
        )
    if config.trainer_mode == "sync":
        notes.append("sync mode: verl neither restores nor re-issues TransferQueue state; nothing of it comes back")
        decision = decide_warmup(config, 0, resumed=True)
        return Preflight(
            reading,
            config,
            restored=0,
            doomed=dict.fromkeys(DOOM_REASONS, 0),
            target=decision.target,
            submitted=decision.submitted,
            over_restored=decision.over_restored,
            warmup_state=decision.state,
            useful=0,
            under_submitted=under_submitted(decision.target, 0, 0, decision.submitted),
            notes=tuple(notes),
        )
    restored = composition.restored
    doomed = predicted_doomed(reading, config)
    decision = decide_warmup(config, restored, resumed=True)
    lost = sum(doomed.values())
    if "filtered" not in doomed:
        notes.append("filter_groups is on: groups DAPO filters are not in the checkpoint, the deficit is a minimum")
    return Preflight(
        reading,
        config,
        restored=restored,
        doomed=doomed,
        reissued=composition.reissued,
        cleared_trajectories=composition.inflight_trajectories,
        target=decision.target,
        submitted=decision.submitted,
        over_restored=decision.over_restored,
        warmup_state=decision.state,
        useful=restored - lost + decision.submitted,
        under_submitted=under_submitted(decision.target, restored, lost, decision.submitted),
        notes=tuple(notes),
    )


def render(result: Preflight) -> str:
    """The human preflight: a headline sentence, then the details."""
    reading, c = result.reading, result.reading.composition
    statuses = c.by_status
    finished_doom = [f"{result.doomed[r]} {r}" for r in ("stale", "filtered") if result.doomed.get(r)]
    finished = f"{statuses['finished']} finished" + (f" ({', '.join(finished_doom)})" if finished_doom else "")
    head = (
        f"resuming from step {reading.step} will restore {result.restored} prompt groups: "
        f"{statuses['pending']} pending, {statuses['running']} running, {finished}, {statuses['failure']} failed"
    )
    if result.warmup_state is WarmupState.SYNC_MODE:
        head = (
            f"resuming from step {reading.step} in sync mode restores no TransferQueue state "
            f"(the checkpoint holds {c.restored} prompt groups); sync mode has no warmup"
        )
    elif result.target is not None and result.submitted is not None and result.useful is not None:
        bound = "" if result.doomed_complete else "at most "
        head += f"; warmup will submit {result.submitted}; useful window right after warmup {bound}{result.useful}"
        head += f" of {result.target}"
        if result.under_submitted:
            minimum = "" if result.doomed_complete else "at least "
            head += f" — under-submitted by {minimum}{result.under_submitted}"
        elif result.over_restored:
            head += f" — over-restored by {result.over_restored} (kept all run)"
        else:
            head += " — ok"
    else:
        head += "; warmup and under-submission: need the trainer config (see note)"

    rows: list[tuple[str, str]] = []
    if reading.tq_dir is None:
        rows.append(("checkpoint", f"{reading.root / STEP_DIR.format(reading.step)} (no {TQ_DIR}/: nothing restored)"))
    else:
        saved = datetime.fromtimestamp(reading.saved_at_ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        rows.append(("checkpoint", f"{reading.tq_dir} ({_size(reading.size_bytes)}, saved {saved})"))
    held = "" if result.restored == c.restored else f" (the checkpoint holds {c.restored}, by status and age below)"
    rows.append(("restored R", f"{result.restored} prompt groups{held}"))
    rows.append(("  by status", " · ".join(f"{s} {n}" for s, n in statuses.items())))
    ages = c.by_age(result.sample_step)
    if ages:
        rows.append((f"  by age at {result.sample_step}", " · ".join(f"{age}: {n}" for age, n in ages.items())))
    rows.append(
        (
            "re-issued K",
            f"{result.reissued} (pending + running, re-stamped step {result.sample_step}); "
            f"clears {result.cleared_trajectories} old trajectories",
        )
    )
    doomed = " · ".join(f"{r} {result.doomed[r]}" if r in result.doomed else f"{r} ?" for r in DOOM_REASONS)
    rule = ""
    if result.config is not None:
        threshold = result.config.max_off_policy_threshold
        rule = f"; off-policy threshold {'null' if threshold is None else threshold}, "
        rule += result.config.max_off_policy_strategy
    rows.append(("doomed", f"{doomed} (first sample at step {result.sample_step}{rule})"))
    orphans = f"{c.orphan_trajectories} orphaned: no prompt key, nothing clears them"
    rows.append(("trajectories", f"{c.trajectories} ({orphans})"))
    if result.config is not None and result.target is not None:
        cfg = result.config
        rows.append(
            (
                "target T",
                f"{result.target} ({cfg.trainer_mode}, train_batch_size {cfg.train_batch_size}, "
                f"num_warmup_batches {cfg.num_warmup_batches:g}, gen_batch_size {cfg.effective_gen_batch_size})",
            )
        )
        state = "" if result.warmup_state is None else f" ({result.warmup_state.value})"
        rows.append(("warmup M", f"{result.submitted}{state}"))
        rows.append(("over-restored O", str(result.over_restored)))
        if result.useful is not None:
            lost = sum(result.doomed.values())
            rows.append(
                (
                    "useful window",
                    f"{result.useful} of {result.target} (R {result.restored} - doomed {lost} + M {result.submitted})",
                )
            )
        if result.under_submitted is not None:
            rows.append(("under-submitted", str(result.under_submitted)))
    width = max(len(label) for label, _ in rows)
    lines = [head, ""] + [f"{label.ljust(width)}  {value}" for label, value in rows]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


# ---------------------------------------------------------------- the source


class CheckpointSource:
    """Polls the checkpoint dir every ``interval`` seconds; ingests one event per new checkpoint."""

    def __init__(self, checkpoint_dir: Path, tracker: Tracker, *, interval: float = 10.0) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.tracker = tracker
        self.interval = interval
        self._seen: tuple[object, ...] | None = None  # signature of the last read
        self._error: CheckpointError | None = None  # its error, re-reported until the files change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tqmon-checkpoint", daemon=True)
        tracker.register_source(SOURCE, stale_after=max(30.0, 10 * interval))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def poll(self) -> None:
        """One look at the checkpoint dir; never raises (the rest of the service must keep serving)."""
        started = time.monotonic()
        try:
            current = signature(self.checkpoint_dir)
            if current != self._seen:
                self._seen, self._error = current, None
                try:
                    reading = read_checkpoint(self.checkpoint_dir)
                except CheckpointError as err:
                    self._error = err
                    if err.refusal is not None:  # counted once per file version, like the read
                        self.tracker.count("tqmon_checkpoint_pickle_refusals_total", (err.refusal,))
                else:
                    self.tracker.ingest([reading.to_event()], SOURCE)
        except Exception as err:  # a bug must not kill the thread: report it as this source's failure
            log.exception("checkpoint poll failed")
            self._seen, self._error = None, CheckpointError("read_error", f"{type(err).__name__}: {err}")
        duration = time.monotonic() - started
        if self._error is not None:
            self.tracker.source_failed(SOURCE, self._error.reason, str(self._error), duration=duration)
        else:
            self.tracker.source_succeeded(SOURCE, duration)
