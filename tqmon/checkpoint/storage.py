"""DAPO's per-trajectory metric, read from the storage-unit files of a TransferQueue checkpoint.

``tq.save_checkpoint`` writes ``simple_storage/storage_unit_info.json`` (``[{"position", "storage_unit_id"}]``)
and one ``su_{position}_{storage_unit_id}.pkl`` per storage unit: a pickle of ``{"storage_unit_id",
"storage_unit_size", "field_data": {field: {global_index: value}}, "active_keys"}`` (the SSD-offload
variant adds ``"format"`` and ``"ssd_index"``). Global indexes are the controller's ``keys_mapping`` values.
verl 0.9.1's ``ReplayBuffer._dapo_filtered_keys`` reads one field per trajectory: ``rm_scores`` (summed)
for the metric ``"reward"``, else ``extra_fields["reward_extra_info"][metric]``.

A storage unit holds every field of every key (token ids, masks, log-probs...), so it is far bigger than
the controller state, and its unneeded fields may hold any object. It is therefore walked, not unpickled:
:class:`SelectiveWalker` executes the pickle opcodes itself, materialises only the paths a
:class:`Select` spec names (the metric of the wanted trajectories), seeks over every other payload, and
calls nothing but inert stand-ins. Torch tensors are decoded from their bytes: the payload of
``torch.storage._load_from_bytes`` is a legacy ``torch.save`` of one storage, whose small pickles go
through the controller state's pre-scan (:func:`~tqmon.checkpoint.picklescan.scan`) and
:class:`~tqmon.checkpoint.unpickler.RestrictedUnpickler`, and whose raw data is unpacked with ``struct``.
numpy scalars (``np.float64``, ``np.float32``, ...: numpy 1 and 2 pickles) are decoded from their dtype and
bytes the same way. Anything else is refused with :class:`~tqmon.checkpoint.unpickler.CheckpointError`, or,
where a metric value is read, with a reason that leaves its group's verdict unknown: a value under a
selected key is never dropped, since a dropped value would read as a missing metric.

:func:`filter_verdicts` then replays ``ReplayBuffer._dapo_filtered_keys`` on the restored window.
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tqmon.checkpoint.picklescan import PickleRefused, scan
from tqmon.checkpoint.unpickler import CheckpointError, RestrictedUnpickler
from tqmon.composition import Progress, ProgressFactory
from tqmon.events import GroupCount
from tqmon.warmup import is_zero_variance

STORAGE_DIR = "simple_storage"
MANIFEST_FILE = "storage_unit_info.json"
REWARD_METRIC = "reward"  # verl's FILTER_GROUPS_REWARD_METRIC: the summed rm_scores
HYBRID_FORMAT = "transfer_queue_hybrid_storage_v1"
MAX_STORAGE_BYTES = 32 << 30  # refuse a bigger storage checkpoint (the walk is linear in its size)
MAX_MEMO_ENTRIES = 20_000_000  # objects a walk may remember for back-references
MAX_TENSOR_ELEMENTS = 1 << 20  # elements of one decoded tensor (an rm_scores row is a response long)
MAX_SHORT_STR = 256  # strings longer than this are not kept in skipped regions
MAX_PAYLOAD = 64 << 20  # bytes of one string or payload the walk builds (a metric value is far smaller)
MAX_MARKS = 1000  # nesting of mark groups (tuples, batches) the walk follows
CHUNK = 1 << 20

# ---------------------------------------------------------------- torch tensors, from their bytes

# Legacy ``torch.save`` (``_use_new_zipfile_serialization=False``), which ``torch.storage`` pickling uses.
TORCH_MAGIC = 0x1950A86A20F9469CFC6C
TORCH_PROTOCOL = 1001
# Typed-storage class -> (struct code, element size); bfloat16 is decoded from its high half of a float32.
STORAGE_CODES: Mapping[str, tuple[str, int]] = {
    "DoubleStorage": ("d", 8),
    "FloatStorage": ("f", 4),
    "HalfStorage": ("e", 2),
    "BFloat16Storage": ("H", 2),
    "LongStorage": ("q", 8),
    "IntStorage": ("i", 4),
    "ShortStorage": ("h", 2),
    "CharStorage": ("b", 1),
    "ByteStorage": ("B", 1),
    "BoolStorage": ("?", 1),
}


class _StorageRecordUnpickler(RestrictedUnpickler):
    """The small pickles of a legacy ``torch.save``: typed-storage classes as names, one persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in STORAGE_CODES:
            return name
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 6
            and pid[0] == "storage"
            and pid[1] in STORAGE_CODES
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
            and pid[5] is None
        ):
            return pid
        raise CheckpointError("invalid_data", f"torch storage record {pid!r:.80} is not a plain CPU storage")


@dataclass(frozen=True, slots=True)
class DecodedStorage:
    """One torch storage: its element type and raw little-endian data (elements are unpacked on demand)."""

    kind: str  # a key of STORAGE_CODES
    raw: bytes
    count: int

    def at(self, positions: list[int]) -> tuple[float | int | bool, ...]:
        """The elements at ``positions``; only those are unpacked."""
        code, size = STORAGE_CODES[self.kind]
        if positions and positions == list(range(positions[0], positions[0] + len(positions))):
            values: tuple[Any, ...] = struct.unpack_from(f"<{len(positions)}{code}", self.raw, positions[0] * size)
        else:
            values = tuple(struct.unpack_from(f"<{code}", self.raw, p * size)[0] for p in positions)
        if self.kind == "BFloat16Storage":
            values = struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}I", *(v << 16 for v in values)))
        return values


@dataclass(frozen=True, slots=True)
class DecodedTensor:
    """A decoded tensor, reduced to what verl reads of it: its sum (and its one element, for a scalar)."""

    sum: float  # ``float(tensor.sum().item())``, see :func:`tensor_sum`
    scalar: float | int | bool | None  # the element of a one-element tensor, else None


def tensor_sum(kind: str, elements: tuple[float | int | bool, ...]) -> float:
    """``float(tensor.sum().item())``: added in order in float64, then rounded to the tensor's type.

    That is torch's answer for verl's ``rm_scores`` (one non-zero score per row: every order is exact)
    and for short rows; torch's vectorised cascade over long rows of many non-zero floats may differ in
    the last bit, which can only move a group whose scores differ by that bit.
    """
    if kind not in _FLOAT_KINDS:
        return float(sum(int(x) for x in elements))
    total = 0.0
    for x in elements:
        total += x
    return round_to(kind, total)


_FLOAT_KINDS = frozenset({"DoubleStorage", "FloatStorage", "HalfStorage", "BFloat16Storage"})


def round_to(kind: str, value: float) -> float:
    """``value`` as torch converts a double to the storage's float type: via float32, nearest-even each time."""
    if kind == "DoubleStorage" or not math.isfinite(value):
        return value
    try:
        single = float(struct.unpack("<f", struct.pack("<f", value))[0])
        if kind == "HalfStorage":
            return float(struct.unpack("<e", struct.pack("<e", single))[0])
    except OverflowError:
        return math.copysign(math.inf, value)
    if kind == "FloatStorage":
        return single
    (bits,) = struct.unpack("<I", struct.pack("<f", single))  # bfloat16: the high half of a float32
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


# Per record of a legacy ``torch.save`` (magic, protocol, system info, storage, keys), the last one that passed
# the pre-scan: the first three are the same bytes in every tensor, so they are scanned once, not per tensor.
_SCANNED: list[bytes] = [b""] * 5
MAX_SCANNED_RECORD = 4096  # bytes of a record remembered there


def _prescan(data: bytes, stream: io.BytesIO, position: int) -> None:
    """The controller state's pre-scan on the record at the stream's position, which is left where it was: CPython's
    unpickler trusts sizes (a 14-byte record storing into memo slot 2**25 sizes its memo array to 512 MiB)."""
    start = stream.tell()
    known = _SCANNED[position]
    if known and data.startswith(known, start):  # the unpickler reads exactly these bytes, up to their STOP
        return
    try:
        scan(stream, len(data) - start)
    except PickleRefused as err:
        message = f"torch storage record refused before unpickling ({err.reason}): {err}"
        raise CheckpointError("invalid_data", message) from None
    if stream.tell() - start <= MAX_SCANNED_RECORD:
        _SCANNED[position] = data[start : stream.tell()]
    stream.seek(start)


def decode_storage(data: object) -> DecodedStorage:
    """Stands in for ``torch.storage._load_from_bytes``: the legacy ``torch.save`` of one storage."""
    if not isinstance(data, bytes):
        raise CheckpointError("invalid_data", f"torch storage payload is {type(data).__name__}, not bytes")
    stream = io.BytesIO(data)

    def record(position: int) -> Any:
        _prescan(data, stream, position)
        try:
            return _StorageRecordUnpickler(stream).load()
        except CheckpointError:
            raise
        except Exception as err:  # EOFError, UnpicklingError, ... from a payload that is not torch's
            raise CheckpointError("invalid_data", f"torch storage payload: {type(err).__name__}: {err}") from None

    if record(0) != TORCH_MAGIC or record(1) != TORCH_PROTOCOL:
        raise CheckpointError("invalid_data", "torch storage payload is not a legacy torch.save")
    info = record(2)
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise CheckpointError("invalid_data", "torch storage payload is not little-endian")
    pid = record(3)
    keys = record(4)
    if not isinstance(pid, tuple) or keys != [pid[2]]:
        raise CheckpointError("invalid_data", "torch storage payload does not hold exactly one storage")
    size = STORAGE_CODES[pid[1]][1]
    header = stream.read(8)
    if len(header) != 8:
        raise CheckpointError("invalid_data", "torch storage payload is truncated")
    (count,) = struct.unpack("<q", header)
    raw = stream.read()
    if count != pid[4] or len(raw) != count * size:
        raise CheckpointError("invalid_data", f"torch storage holds {len(raw)} bytes, not {count} x {size}")
    return DecodedStorage(pid[1], raw, count)


def rebuild_tensor(storage: object, offset: object, size: object, stride: object, *rest: object) -> DecodedTensor:
    """Stands in for ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, grad, hooks[, meta])``."""
    if not isinstance(storage, DecodedStorage) or len(rest) not in (2, 3):
        raise CheckpointError("invalid_data", "torch tensor record does not have the shape of _rebuild_tensor_v2")
    if (
        not isinstance(offset, int)
        or not isinstance(size, tuple)
        or not isinstance(stride, tuple)
        or len(size) != len(stride)
        or not all(isinstance(d, int) and d >= 0 for d in (offset, *size, *stride))
    ):
        raise CheckpointError("invalid_data", f"torch tensor geometry {offset!r}, {size!r}, {stride!r} is invalid")
    if math.prod(size) > MAX_TENSOR_ELEMENTS:
        raise CheckpointError("too_large", f"torch tensor of size {size} in the metric's field: over the cap")
    positions = [offset]
    for dim, step in zip(size, stride, strict=True):
        positions = [p + i * step for p in positions for i in range(dim)]
    if positions and max(positions) >= storage.count:
        raise CheckpointError("invalid_data", "torch tensor reaches past the end of its storage")
    elements = storage.at(positions)
    return DecodedTensor(tensor_sum(storage.kind, elements), elements[0] if len(elements) == 1 else None)


# ---------------------------------------------------------------- the selective walk


class _Skipped:
    """What a skipped region leaves on the stack: never interpreted, never called."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"<skipped {self.kind}>"


SKIP, SKIP_DICT, SKIP_LIST, SKIP_SET = (_Skipped(k) for k in ("value", "dict", "list", "set"))
_SKIP_CONTAINERS = (SKIP_DICT, SKIP_LIST, SKIP_SET)


@dataclass(frozen=True, slots=True)
class Global:
    """A global a kept region referenced but that has no stand-in; refused only if a kept value needs it."""

    module: str
    name: str


@dataclass(frozen=True, slots=True)
class Refused:
    """What the walk would not build (a call of a :class:`Global`, an object only a skipped region holds):
    an error if it reaches a value that is read."""

    what: str


KEEP = "keep"  # materialise everything under this slot
Mode = Any  # SKIP | KEEP | Select


@dataclass(frozen=True, slots=True)
class Select:
    """A dict of which only some items matter: ``child(key)`` is the mode of the value under ``key``."""

    child: Callable[[object], Mode]


def _stronger(a: Mode, b: Mode) -> Mode:
    """The richer of two plausible modes (building too much is safe; skipping a needed value is not)."""
    if a is KEEP or b is KEEP:
        return KEEP
    if isinstance(a, Select) and isinstance(b, Select) and a is not b:
        return Select(lambda key: _stronger(a.child(key), b.child(key)))
    return a if isinstance(a, Select) else b


def _children(container: object, mode: Mode, key: object = None) -> Mode:
    if mode is KEEP:
        return KEEP
    if isinstance(mode, Select) and isinstance(container, dict) and isinstance(key, str | int):
        return mode.child(key)
    return SKIP


# ---------------------------------------------------------------- numpy scalars, from their bytes

# Type codes of the numpy scalars decoded (``dtype.str`` without its byte order) -> struct code. verl reads
# ``float(value)``: exact for each of these (float16/float32 widen exactly, integers round as numpy does, a
# complex gives its real part).
NUMPY_CODES: Mapping[str, str] = {
    "f8": "d", "f4": "f", "f2": "e", "c16": "dd", "c8": "ff",
    "i8": "q", "i4": "i", "i2": "h", "i1": "b",
    "u8": "Q", "u4": "I", "u2": "H", "u1": "B",
    "b1": "?",
}  # fmt: skip


class NumpyDtype:
    """``numpy.dtype(code, align, copy)`` as a pickle rebuilds it: the type code, then the byte order ``BUILD`` sets."""

    __slots__ = ("byteorder", "code")

    def __init__(self, code: str) -> None:
        self.code = code
        self.byteorder: str | None = None  # "<", ">" or "|" once BUILD set a plain state; "?" for any other

    def build(self, state: object) -> None:
        """numpy's ``dtype.__setstate__``: ``(version, byteorder, subarray, names, fields, ...)``."""
        if self.byteorder is not None:
            raise CheckpointError("invalid_data", f"numpy dtype {self.code!r} rebuilt twice")
        self.byteorder = "?"
        if isinstance(state, tuple) and len(state) in (8, 9) and state[1] in ("<", ">", "|"):
            self.byteorder = state[1] if state[2:5] == (None, None, None) else "?"  # no subarray, no fields

    def __repr__(self) -> str:
        return f"<numpy dtype {self.code!r}>"


def numpy_dtype(*args: object) -> NumpyDtype | Refused:
    """Stands in for ``numpy.dtype``, called as numpy's ``dtype.__reduce__`` pickles it: ``(code, align, copy)``."""
    if len(args) != 3 or not isinstance(args[0], str):
        return Refused(f"numpy.dtype{args!r:.80}")
    return NumpyDtype(args[0])


def numpy_scalar(dtype: object, data: object = None) -> float | int | bool | Refused:
    """Stands in for ``numpy.core.multiarray.scalar(dtype, bytes)`` (numpy 1; ``numpy._core`` in numpy 2): the
    scalar's value as a Python number, which ``float()`` reads as it reads the numpy scalar."""
    if not isinstance(dtype, NumpyDtype):
        return Refused(f"a numpy scalar of {type(dtype).__name__}")
    code = NUMPY_CODES.get(dtype.code)
    if code is None or dtype.byteorder not in ("<", ">", "|"):
        return Refused(f"a numpy scalar of dtype {dtype.code!r} (tqmon decodes numpy's bool, int, float and complex)")
    if not isinstance(data, bytes) or len(data) != struct.calcsize(code):
        return Refused(f"a numpy {dtype.code!r} scalar whose data is not {struct.calcsize(code)} bytes")
    value: float | int | bool = struct.unpack((">" if dtype.byteorder == ">" else "<") + code, data)[0]
    return value


NO_HOOKS: frozenset[object] = frozenset()  # a tensor record's empty OrderedDict of backward hooks; never read

STAND_INS: Mapping[tuple[str, str], Callable[..., object]] = {
    ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor,
    ("torch.storage", "_load_from_bytes"): decode_storage,
    ("collections", "OrderedDict"): lambda *args: NO_HOOKS if not args else Refused("a non-empty OrderedDict"),
    ("numpy", "dtype"): numpy_dtype,
    ("numpy.core.multiarray", "scalar"): numpy_scalar,  # numpy 1
    ("numpy._core.multiarray", "scalar"): numpy_scalar,  # numpy 2
}


def _built_anywhere(obj: object) -> bool:
    """numpy dtypes and scalars are built even in a skipped region, with their arguments (a dtype's state too): a
    pickle writes each once and refers back to it, often from a field that is read (every scalar of a type to its
    dtype, every dict holding the same scalar to it). They are a few bytes each."""
    return obj is numpy_dtype or obj is numpy_scalar or (isinstance(obj, NumpyDtype) and obj.byteorder is None)


class SelectiveWalker:
    """Executes a pickle's opcodes, building only what ``spec`` selects; see the module docstring.

    Each stack slot remembers the mode it was built in. The mode of a new object is the richest of the
    readings the pickle grammar allows at that point (the value of a dict item, an item of a mark group,
    the arguments of a callable), so an ambiguity can only make the walk build more, never skip a value
    that is needed. Objects always land where the opcodes put them: the modes decide only what is built.
    """

    def __init__(
        self, handle: BinaryIO, spec: Select, *, max_memo: int = MAX_MEMO_ENTRIES, progress: Progress | None = None
    ) -> None:
        self._handle = handle
        self._progress = progress  # told the bytes taken from the file (read or seeked over)
        self._spec = spec
        self._max_memo = max_memo
        self._buf = b""
        self._pos = 0
        self.stack: list[object] = []
        self.modes: list[Mode] = []
        self.marks: list[int] = []
        self._group_modes: list[Mode | None] = []  # per open mark: the mode of its items, once computed
        self.memo: dict[int, object] = {}
        self._memo_next = 0

    # -- reading

    def _read(self, n: int) -> bytes:
        end = self._pos + n
        if end <= len(self._buf):
            data = self._buf[self._pos : end]
            self._pos = end
            return data
        rest = self._buf[self._pos :]
        more = self._handle.read(max(CHUNK, n - len(rest)))
        if self._progress is not None:
            self._progress.update(len(more))
        self._buf, self._pos = rest + more, 0
        if len(self._buf) < n:
            raise CheckpointError("invalid_data", "truncated pickle (ended before its STOP opcode)")
        return self._read(n)

    def _skip(self, n: int) -> None:
        available = len(self._buf) - self._pos
        if n <= available:
            self._pos += n
            return
        self._handle.seek(n - available, io.SEEK_CUR)
        if self._progress is not None:
            self._progress.update(n - available)
        self._buf, self._pos = b"", 0

    def _payload(self, n: int, mode: Mode) -> object:
        if mode is SKIP:
            self._skip(n)
            return SKIP
        if n > MAX_PAYLOAD:
            raise CheckpointError("too_large", f"a payload of {n} bytes where the metric is read: over the cap")
        return self._read(n)

    # -- modes

    def _mode_at(self, p: int, marks: int) -> Mode:
        """The mode of an object about to land at slot ``p``, with ``marks`` marks open."""
        stack, modes = self.stack, self.modes
        if p == 0:
            return self._spec
        mode: Mode = SKIP
        if marks and (m := self.marks[marks - 1]) <= p:
            if m == 0:
                return SKIP
            receiver, received = stack[m - 1], modes[m - 1]
            if isinstance(receiver, dict) or receiver is SKIP_DICT:
                if (p - m) % 2:
                    mode = _children(receiver, received, stack[p - 1])
            elif isinstance(receiver, list | set) or receiver in (SKIP_LIST, SKIP_SET):
                mode = KEEP if received is KEEP else SKIP
            else:  # a tuple or an argument list: it lands at m, or is called with what is at m - 1
                group = self._group_modes[marks - 1]  # fixed while the mark is open: nothing below it moves
                if group is None:
                    group = self._group_modes[marks - 1] = _stronger(received, self._mode_at(m, marks - 1))
                mode = group
        if p >= 2 and (not marks or self.marks[marks - 1] < p - 1):
            owner = stack[p - 2]
            if isinstance(owner, dict):
                mode = _stronger(mode, _children(owner, modes[p - 2], stack[p - 1]))
        below = stack[p - 1]
        if isinstance(below, list) and (not marks or self.marks[marks - 1] < p):
            mode = _stronger(mode, KEEP if modes[p - 1] is KEEP else SKIP)
        if isinstance(below, Global) or callable(below):  # an argument of a callable
            if below is numpy_dtype or below is numpy_scalar:
                return KEEP  # see _built_anywhere
            mode = _stronger(mode, modes[p - 1])
        elif isinstance(below, NumpyDtype) and (below.byteorder is None or (p >= 2 and stack[p - 2] is numpy_scalar)):
            return KEEP  # a dtype's state, or a scalar's bytes after its dtype
        return mode

    def _next_mode(self) -> Mode:
        return self._mode_at(len(self.stack), len(self.marks))

    def _push(self, obj: object, mode: Mode) -> None:
        self.stack.append(obj)
        self.modes.append(mode)

    def _pop_mark(self) -> tuple[list[object], list[Mode]]:
        if not self.marks:
            raise CheckpointError("invalid_data", "pickle pops a mark it never pushed")
        m = self.marks.pop()
        self._group_modes.pop()
        items, modes = self.stack[m:], self.modes[m:]
        del self.stack[m:], self.modes[m:]
        return items, modes

    def _pop(self, n: int) -> list[object]:
        if len(self.stack) - n < (self.marks[-1] if self.marks else 0):
            raise CheckpointError("invalid_data", "pickle stack underflow")
        items = self.stack[-n:] if n else []
        if n:
            del self.stack[-n:], self.modes[-n:]
        return items

    def _memoize(self, obj: object, mode: Mode) -> None:
        """Remember what a later BINGET may need: names, scalars (numpy's and their short bytes too) and refusals
        anywhere, and the containers of built regions.

        A tensor record's pieces (its payload, storage, geometry tuples) are referenced only inside the record,
        so they are not kept; a later reference to anything not kept becomes :class:`Refused` where it is built.
        """
        index = self._memo_next
        self._memo_next += 1
        if not (
            obj is None
            or isinstance(obj, bool | int | float | Global | NumpyDtype | Refused)
            or (isinstance(obj, str | bytes) and len(obj) <= MAX_SHORT_STR)
            or callable(obj)
            or (mode is not SKIP and isinstance(obj, dict | list | set))
        ):
            return
        if len(self.memo) >= self._max_memo:
            raise CheckpointError("too_large", f"more than {self._max_memo} objects to remember: refused")
        self.memo[index] = obj

    # -- the operations

    def _set_items(self, target: object, mode: Mode, pairs: list[object]) -> None:
        """Set the items on a built dict; a value skipped under a key ``mode`` selects is kept as :class:`Refused`
        (an error where it is read), never dropped: a dropped value would read as a missing one."""
        if len(pairs) % 2:
            raise CheckpointError("invalid_data", "odd number of dict items")
        if isinstance(target, dict):
            for i in range(0, len(pairs), 2):
                key, value = pairs[i], pairs[i + 1]
                if isinstance(value, _Skipped):
                    if _children(target, mode, key) is SKIP:
                        continue
                    value = Refused(f"the value under {key!r:.80}, which the walk could not build")
                try:
                    target[key] = value
                except TypeError:
                    raise CheckpointError("invalid_data", f"unhashable dict key {type(key).__name__}") from None
        elif target is not SKIP_DICT:
            raise CheckpointError("invalid_data", f"dict items set on {type(target).__name__}")

    def _call(self, fn: object, args: object, mode: Mode) -> object:
        """``fn(*args)`` where its result is needed (or is numpy's: see :func:`_built_anywhere`); a needed result
        whose arguments were not built is :class:`Refused`, never skipped."""
        if (mode is SKIP and not _built_anywhere(fn)) or isinstance(fn, _Skipped):
            return SKIP
        if isinstance(fn, Global):
            return Refused(f"global {fn.module}.{fn.name}")
        if not callable(fn) or not isinstance(args, tuple | _Skipped):
            raise CheckpointError("invalid_data", "REDUCE of something that is not a stand-in")
        if isinstance(args, _Skipped) or any(isinstance(arg, _Skipped) for arg in args):
            return Refused(f"a call of {getattr(fn, '__name__', 'a stand-in')} whose arguments were not built")
        refused = next((arg for arg in args if isinstance(arg, Refused)), None)
        return fn(*args) if refused is None else refused

    def _global(self, module: str, name: str) -> object:
        return STAND_INS.get((module, name)) or Global(module, name)

    def load(self) -> object:
        """Run to STOP; the root object, as far as ``spec`` selected it."""
        read = self._read
        while True:
            op = read(1)[0]
            if op == 0x95:  # FRAME: a hint only
                read(8)
            elif op == 0x94:  # MEMOIZE
                if not self.stack:
                    raise CheckpointError("invalid_data", "MEMOIZE on an empty stack")
                self._memoize(self.stack[-1], self.modes[-1])
            elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
                index = read(1)[0] if op == 0x68 else struct.unpack("<I", read(4))[0]
                mode = self._next_mode()
                if index >= self._memo_next:
                    raise CheckpointError("invalid_data", f"memo index {index} was never stored")
                unread = SKIP if mode is SKIP else Refused(f"object #{index}, which only a skipped field holds")
                self._push(self.memo.get(index, unread), mode)
            elif op == 0x28:  # MARK
                if len(self.marks) >= MAX_MARKS:
                    raise CheckpointError("invalid_data", f"pickle nests more than {MAX_MARKS} mark groups")
                self.marks.append(len(self.stack))
                self._group_modes.append(None)
            elif op in (0x4B, 0x4D, 0x4A):  # BININT1, BININT2, BININT
                fmt, n = {0x4B: ("<B", 1), 0x4D: ("<H", 2), 0x4A: ("<i", 4)}[op]
                self._push(struct.unpack(fmt, read(n))[0], self._next_mode())
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                n = read(1)[0] if op == 0x8A else struct.unpack("<i", read(4))[0]
                if not 0 <= n <= 1 << 16:
                    raise CheckpointError("invalid_data", f"an integer of {n} bytes")
                self._push(int.from_bytes(read(n), "little", signed=True), self._next_mode())
            elif op == 0x47:  # BINFLOAT
                self._push(struct.unpack(">d", read(8))[0], self._next_mode())
            elif op in (0x88, 0x89, 0x4E):  # NEWTRUE, NEWFALSE, NONE
                self._push({0x88: True, 0x89: False, 0x4E: None}[op], self._next_mode())
            elif op in (0x8C, 0x58, 0x8D):  # SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                fmt, width = {0x8C: ("<B", 1), 0x58: ("<I", 4), 0x8D: ("<Q", 8)}[op]
                n = struct.unpack(fmt, read(width))[0]
                mode = self._next_mode()
                if mode is SKIP and n > MAX_SHORT_STR:
                    self._skip(n)
                    self._push(SKIP, mode)
                elif n > MAX_PAYLOAD:
                    raise CheckpointError("too_large", f"a string of {n} bytes where the metric is read: over the cap")
                else:
                    try:
                        self._push(read(n).decode("utf-8", "surrogatepass"), mode)
                    except UnicodeDecodeError:
                        raise CheckpointError("invalid_data", "string is not UTF-8") from None
            elif op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                size = {0x43: ("<B", 1), 0x42: ("<I", 4), 0x8E: ("<Q", 8), 0x96: ("<Q", 8)}[op]
                n = struct.unpack(size[0], read(size[1]))[0]
                mode = self._next_mode()
                self._push(self._payload(n, mode), mode)
            elif op in (0x7D, 0x5D, 0x8F, 0x29):  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET, EMPTY_TUPLE
                mode = self._next_mode()
                if op == 0x29:
                    self._push((), mode)
                elif mode is SKIP:
                    self._push({0x7D: SKIP_DICT, 0x5D: SKIP_LIST, 0x8F: SKIP_SET}[op], mode)
                else:
                    self._push({0x7D: dict, 0x5D: list, 0x8F: set}[op](), mode)
            elif op in (0x85, 0x86, 0x87, 0x74, 0x91):  # TUPLE1/2/3, TUPLE, FROZENSET
                if op in {0x74, 0x91}:
                    items, _ = self._pop_mark()
                else:
                    items = self._pop(op - 0x84)
                mode = self._next_mode()
                if mode is SKIP or any(isinstance(i, _Skipped) for i in items):
                    self._push(SKIP, mode)
                else:
                    self._push(tuple(items) if op != 0x91 else frozenset(items), mode)
            elif op == 0x6C:  # LIST
                items, _ = self._pop_mark()
                mode = self._next_mode()
                self._push(SKIP_LIST if mode is SKIP else list(items), mode)
            elif op == 0x73:  # SETITEM
                pairs = self._pop(2)
                self._set_items(self._top(), self.modes[-1], pairs)
            elif op == 0x75:  # SETITEMS
                pairs = self._pop_mark()[0]
                self._set_items(self._top(), self.modes[-1], pairs)
            elif op in (0x61, 0x65, 0x90):  # APPEND, APPENDS, ADDITEMS
                items = self._pop(1) if op == 0x61 else self._pop_mark()[0]
                target = self._top()
                kept = [i for i in items if not isinstance(i, _Skipped)]
                if isinstance(target, list):
                    target.extend(kept)
                elif isinstance(target, set):
                    target.update(kept)
                elif target not in _SKIP_CONTAINERS:
                    raise CheckpointError("invalid_data", f"items appended to {type(target).__name__}")
            elif op == 0x93:  # STACK_GLOBAL
                module, name = self._pop(2)
                if not isinstance(module, str) or not isinstance(name, str):
                    raise CheckpointError("invalid_data", "STACK_GLOBAL of something that is not two strings")
                self._push(self._global(module, name), self._next_mode())
            elif op == 0x63:  # GLOBAL
                module = self._line()
                name = self._line()
                self._push(self._global(module, name), self._next_mode())
            elif op in (0x52, 0x81):  # REDUCE, NEWOBJ: the result takes the callable's slot
                mode = self.modes[-2] if len(self.modes) >= 2 else SKIP
                fn, args = self._pop(2)
                self._push(self._call(fn, args, mode), mode)
            elif op == 0x92:  # NEWOBJ_EX: cls(*args, **kwargs), never needed for a metric
                mode = self.modes[-3] if len(self.modes) >= 3 else SKIP
                cls, _, _ = self._pop(3)
                self._push(SKIP if mode is SKIP else Refused(f"an instance of {cls!r:.80}"), mode)
            elif op == 0x62:  # BUILD
                state = self._pop(1)[0]
                target = self._top()
                if isinstance(target, NumpyDtype):
                    target.build(state)
                elif not isinstance(target, _Skipped | Refused) and not isinstance(state, _Skipped):
                    raise CheckpointError("invalid_data", f"refused BUILD on {type(target).__name__}")
            elif op == 0x30:  # POP
                if self.marks and self.marks[-1] == len(self.stack):
                    self.marks.pop()
                    self._group_modes.pop()
                else:
                    self._pop(1)
            elif op == 0x31:  # POP_MARK
                self._pop_mark()
            elif op == 0x32:  # DUP
                self._push(self._top(), self.modes[-1])
            elif op == 0x80:  # PROTO
                read(1)
            elif op == 0x2E:  # STOP
                if len(self.stack) != 1 or self.marks:
                    raise CheckpointError("invalid_data", "pickle stopped with a malformed stack")
                return self.stack[0]
            else:
                raise CheckpointError("invalid_data", f"refused pickle opcode {bytes([op])!r} (not in a storage unit)")

    def _top(self) -> object:
        if not self.stack:
            raise CheckpointError("invalid_data", "pickle stack underflow")
        return self.stack[-1]

    def _line(self) -> str:
        out = bytearray()
        while (c := self._read(1)) != b"\n":
            out += c
            if len(out) > 1000:
                raise CheckpointError("invalid_data", "GLOBAL name too long")
        return out.decode("ascii", "replace")


# ---------------------------------------------------------------- the metric of wanted trajectories


@dataclass(frozen=True, slots=True)
class MetricValues:
    """The filter metric of each wanted trajectory, by global index; what could not be read, and why."""

    values: Mapping[int, float]
    missing: frozenset[int]  # wanted indexes without the metric (verl raises at the first sample)
    refused: Mapping[int, str]  # wanted indexes whose metric value tqmon cannot decode, and why
    files: int
    bytes_read: int


def metric_spec(metric: str, wanted: frozenset[int]) -> Select:
    """What to build of a storage unit: the metric's field for the wanted indexes, and the format markers."""
    if metric == REWARD_METRIC:
        per_index: Mode = KEEP
        field = "rm_scores"
    else:
        info = Select(lambda name: KEEP if name == metric else SKIP)
        per_index = Select(lambda key: info if key == "reward_extra_info" else SKIP)
        field = "extra_fields"
    column = Select(lambda index: per_index if index in wanted else SKIP)
    field_data = Select(lambda name: column if name == field else SKIP)
    offloaded = Select(lambda name: Select(lambda _: SKIP) if name == field else SKIP)
    top = {"field_data": field_data, "format": KEEP, "storage_unit_id": KEEP, "ssd_index": offloaded}
    return Select(lambda key: top.get(key, SKIP) if isinstance(key, str) else SKIP)


def metric_value(metric: str, value: object) -> float | None:
    """verl's per-trajectory metric from the value of its field; None when the trajectory lacks it."""
    if isinstance(value, Refused):
        raise CheckpointError("invalid_data", f"refused {value.what} in the DAPO metric's field")
    if metric == REWARD_METRIC:
        if not isinstance(value, DecodedTensor):
            raise CheckpointError("invalid_data", f"rm_scores value is {type(value).__name__}, not a tensor")
        return value.sum
    info = value.get("reward_extra_info", {}) if isinstance(value, dict) else {}
    if not isinstance(info, dict) or metric not in info:
        return None
    raw = info[metric]
    if isinstance(raw, Refused):
        raise CheckpointError("invalid_data", f"refused {raw.what} in the DAPO metric's field")
    if isinstance(raw, DecodedTensor) and raw.scalar is not None:
        raw = raw.scalar
    if isinstance(raw, bool | int | float):
        return float(raw)
    raise CheckpointError("invalid_data", f"metric {metric!r} is {type(raw).__name__}, not a number")


def storage_unit_files(tq_dir: Path) -> list[Path]:
    """The storage-unit files ``tq.load_checkpoint`` would load, from TQ's manifest."""
    manifest = tq_dir / STORAGE_DIR / MANIFEST_FILE
    try:
        entries = json.loads(manifest.read_bytes())
    except FileNotFoundError:
        raise CheckpointError("read_error", f"{manifest} does not exist: the checkpoint has no storage units") from None
    except OSError as err:
        raise CheckpointError("read_error", f"{manifest}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError("invalid_data", f"{manifest}: not valid JSON ({err})") from None
    if not isinstance(entries, list):
        raise CheckpointError("invalid_data", f"{manifest}: expected a list")
    files = []
    for entry in entries:
        position = entry.get("position") if isinstance(entry, dict) else None
        unit = entry.get("storage_unit_id") if isinstance(entry, dict) else None
        if not isinstance(position, int) or not isinstance(unit, str) or not re.fullmatch(r"[\w.-]+", unit):
            raise CheckpointError("invalid_data", f"{manifest}: malformed entry {entry!r:.80}")
        files.append(tq_dir / STORAGE_DIR / f"su_{position}_{unit}.pkl")
    return files


def read_metric_values(
    tq_dir: Path,
    metric: str,
    wanted: Iterable[int],
    *,
    max_bytes: int = MAX_STORAGE_BYTES,
    progress: ProgressFactory | None = None,
) -> MetricValues:
    """The metric of the trajectories at the ``wanted`` global indexes, from every storage unit.

    ``progress`` is asked for one bar per file (the caller decides which files are worth one)."""
    wanted_set = frozenset(wanted)
    files = storage_unit_files(tq_dir)
    try:
        sizes = {path: path.stat().st_size for path in files}
    except OSError as err:
        raise CheckpointError("read_error", f"{err.filename}: {err.strerror or err}") from None
    total = sum(sizes.values())
    if total > max_bytes:
        raise CheckpointError("too_large", f"storage units of {tq_dir} hold {total} bytes, over the {max_bytes} cap")
    spec = metric_spec(metric, wanted_set)
    field = "rm_scores" if metric == REWARD_METRIC else "extra_fields"
    values: dict[int, float] = {}
    missing: set[int] = set()
    refused: dict[int, str] = {}
    for path in files:
        try:
            bar = progress(f"reading {path.name}", sizes[path]) if progress is not None else nullcontext()
            with open(path, "rb") as handle, bar as reported:
                root = SelectiveWalker(handle, spec, progress=reported).load()
        except OSError as err:
            raise CheckpointError("read_error", f"{path}: {err.strerror or err}") from None
        except CheckpointError as err:
            raise CheckpointError(err.reason, f"{path}: {err}") from None
        except Exception as err:  # a stand-in or an operation fed garbage (TypeError, ValueError, ...)
            raise CheckpointError("invalid_data", f"{path}: not a storage unit: {type(err).__name__}: {err}") from None
        if not isinstance(root, dict) or not isinstance(root.get("field_data"), dict):
            raise CheckpointError("invalid_data", f"{path}: not a TransferQueue storage unit (no field_data)")
        if root.get("format", HYBRID_FORMAT) != HYBRID_FORMAT:
            raise CheckpointError("invalid_data", f"{path}: unknown storage format {root.get('format')!r}")
        if field in (root.get("ssd_index") or {}):
            raise CheckpointError("invalid_data", f"{path}: {field} is offloaded to SSD blobs (not read by tqmon)")
        column = root["field_data"].get(field, {})
        for index, value in column.items():
            if index in wanted_set:
                try:
                    number = metric_value(metric, value)
                except CheckpointError as err:
                    refused[index] = f"{path.name}, global index {index}: {err}"
                    continue
                if number is None:
                    missing.add(index)
                else:
                    values[index] = number
    missing |= wanted_set - values.keys() - refused.keys() - missing
    return MetricValues(values, frozenset(missing), refused, len(files), total)


# ---------------------------------------------------------------- DAPO verdicts of a checkpoint


@dataclass(frozen=True, slots=True)
class FilterVerdicts:
    """What verl's first sample after a resume will make of the checkpoint's finished groups under DAPO."""

    metric: str
    filtered: Mapping[int, int]  # zero-variance finished groups by global_steps (verl's filter_groups eviction)
    finished: int  # finished groups judged
    missing: int  # finished groups lacking the metric on some trajectory, or with none: verl 0.9.1 raises
    refused: int  # other finished groups with a metric value tqmon cannot decode: their verdict is unknown
    refusal: str | None  # why, for the first of them
    trajectories: int  # trajectories whose metric was read
    storage_bytes: int  # size of the storage-unit files walked

    @property
    def decided(self) -> bool:
        """Every finished group has a verdict (with a missing metric verl raises instead of filtering)."""
        return self.missing == 0 and self.refused == 0


def filter_verdicts(
    keys: Iterable[tuple[str, object, object]],
    tq_dir: Path,
    metric: str,
    *,
    max_bytes: int = MAX_STORAGE_BYTES,
    progress: ProgressFactory | None = None,
) -> FilterVerdicts:
    """``ReplayBuffer._dapo_filtered_keys`` on the restored window, from its ``(key, global index, tag)``s in
    ``kv_list`` order and the storage units.

    Finished prompt keys are the groups; a trajectory belongs to ``key.split("_")[0]``; each group's values
    are taken in ``kv_list`` order, as verl zips ``kv_batch_get``'s rows with its keys.
    """
    finished: dict[str, int] = {}
    trajectories: list[tuple[str, int]] = []
    for key, index, tag in keys:
        if not isinstance(tag, Mapping):
            raise CheckpointError("invalid_data", f"tag of key {key!r} is {type(tag).__name__}, not a dict")
        if tag.get("is_prompt", False):
            if tag.get("status") == "finished":
                finished[key] = tag.get("global_steps", 0)
        elif not isinstance(index, int):
            raise CheckpointError("invalid_data", f"key {key!r} has global index {index!r}")
        else:
            trajectories.append((key, index))
    members: dict[str, list[int]] = {uid: [] for uid in finished}
    for key, index in trajectories:
        group = members.get(key.split("_")[0])
        if group is not None:
            group.append(index)
    wanted = [index for indexes in members.values() for index in indexes]
    read = read_metric_values(tq_dir, metric, wanted, max_bytes=max_bytes, progress=progress) if wanted else None
    filtered: dict[int, int] = {}
    missing = 0
    refusals: list[str] = []
    for uid, indexes in members.items():
        if not indexes or (read is not None and any(i in read.missing for i in indexes)):
            missing += 1
        elif read is not None and (why := [read.refused[i] for i in indexes if i in read.refused]):
            refusals.append(why[0])
        elif read is not None and is_zero_variance([read.values[i] for i in indexes]):
            steps = finished[uid]
            filtered[steps] = filtered.get(steps, 0) + 1
    return FilterVerdicts(
        metric,
        filtered,
        len(finished),
        missing,
        len(refusals),
        refusals[0] if refusals else None,
        len(wanted),
        0 if read is None else read.bytes_read,
    )


def with_verdicts(groups: list[GroupCount], verdicts: FilterVerdicts) -> list[GroupCount]:
    """The composition with each finished (global_steps) row split into kept and ``filtered=True`` groups."""
    split: list[GroupCount] = []
    for group in groups:
        zero = verdicts.filtered.get(group.global_steps, 0) if group.status == "finished" else 0
        if zero > group.count:
            raise CheckpointError("invalid_data", f"{zero} filtered of {group.count} finished at {group.global_steps}")
        if group.count - zero:
            split.append(group.model_copy(update={"count": group.count - zero}))
        if zero:
            split.append(group.model_copy(update={"count": zero, "filtered": True}))
    return split
