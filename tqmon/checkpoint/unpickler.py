"""A restricted unpickler for TransferQueue's ``controller_state.pkl``: nothing of the pickle is ever run.

It resolves only the globals a TQ 0.1.11 controller state contains, each to an inert stand-in (TQ's
dataclasses become attribute bags, tensors become their shape, dtypes their name): no TQ or torch code is
imported or run, and any other global is refused with :class:`CheckpointError`.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class CheckpointError(Exception):
    """A checkpoint tqmon cannot read; ``reason`` is the source error reason it is counted under, ``refusal``
    the pickle refusal reason (``catalog.PICKLE_REFUSAL_REASONS``) when the pickle itself was refused."""

    def __init__(self, reason: str, message: str, refusal: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.refusal = refusal


class Readable(Protocol):
    """What the unpickler reads from: a file, or one that reports progress."""

    def read(self, size: int = -1, /) -> bytes: ...

    def readline(self, size: int = -1, /) -> bytes: ...


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


def restricted_load(handle: Readable) -> Any:
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
