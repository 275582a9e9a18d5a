"""A pre-flight walk over a pickle's opcodes, before the restricted unpickler builds anything.

The restricted unpickler runs no code, but CPython's unpickler still trusts the stream's sizes and
shapes: a ``BINBYTES8``/``FRAME`` length allocates before it reads, a ``LONG_BINPUT`` index sizes the
memo array (2**27 touches 2 GiB), and tuples nested a few hundred thousand deep crash the process
(``hash`` recurses in C) as soon as one is used as a dict key. This walk reads no argument longer
than the rest of the file, keeps memo indices dense and bounds container nesting, so such a file is
refused with a reason before it is unpickled.
"""

from __future__ import annotations

import pickletools
from typing import BinaryIO, cast

MAX_DEPTH = 100  # a TransferQueue controller state nests about 8 deep
TRUNCATION_SLACK = 16 << 20  # a length at most this far past the end reads as a truncated file
MARK = -1  # a mark on the simulated stack

# Opcodes that build a new container from what they pop, and those that add what they pop to one.
_BUILDS = frozenset(
    {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "FROZENSET", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"}
)
_ADDS = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})


class PickleRefused(ValueError):
    """A pickle refused before unpickling; ``reason`` is one of ``catalog.PICKLE_REFUSAL_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _BoundedReader:
    """Refuses a read longer than what is left of the file, instead of allocating it.

    It has no ``tell``: ``pickletools.genops`` would call it for every opcode, for a position the walk never uses.
    """

    def __init__(self, stream: BinaryIO, size: int) -> None:
        self._stream = stream
        self._size = size

    def left(self) -> int:
        return max(0, self._size - self._stream.tell())

    def read(self, n: int | None = -1) -> bytes:
        if n is not None and n > self._size - self._stream.tell():
            raise self.too_long("an opcode", n)
        return self._stream.read(-1 if n is None else n)

    def too_long(self, what: str, n: int) -> PickleRefused:
        """Far past the end is a crafted (or garbled) length; a little past it is a file cut short."""
        reason = "oversized_length" if n - self.left() > TRUNCATION_SLACK else "truncated"
        return PickleRefused(reason, f"{what} claims {n} bytes where {self.left()} are left")

    def readline(self, limit: int | None = -1) -> bytes:
        return self._stream.readline(limit if limit is not None else -1)


def scan(stream: BinaryIO, size: int) -> None:
    """Walk the pickle in ``stream`` (``size`` bytes from its current position); raise :class:`PickleRefused`."""
    reader = _BoundedReader(stream, stream.tell() + size)
    stack: list[int] = []  # nesting depth of each simulated stack item, MARK for marks
    memo: dict[int, int] = {}
    try:
        for opcode, arg, _pos in pickletools.genops(cast(BinaryIO, reader)):
            if opcode.name == "FRAME" and _index(opcode, arg) > reader.left():
                raise reader.too_long("a FRAME", _index(opcode, arg))
            _step(opcode, arg, stack, memo)
    except PickleRefused:
        raise
    except ValueError as err:
        truncated = ("not enough data", "no newline", "exhausted")
        reason = "truncated" if any(sign in str(err) for sign in truncated) else "malformed"
        raise PickleRefused(reason, f"not a valid pickle: {err}") from None
    except (IndexError, TypeError, KeyError) as err:
        raise PickleRefused("malformed", f"not a valid pickle: {type(err).__name__}: {err}") from None


def _step(opcode: pickletools.OpcodeInfo, arg: object, stack: list[int], memo: dict[int, int]) -> None:
    name = opcode.name
    if name in _PUTS or name == "MEMOIZE":
        index = len(memo) if name == "MEMOIZE" else _index(opcode, arg)
        if index > len(memo):  # a pickler numbers its memo densely; a gap only sizes the memo array
            raise PickleRefused("memo_index", f"{name} {index} leaves a gap in a memo of {len(memo)}")
        memo[index] = stack[-1]
        return
    if name in _GETS:
        index = _index(opcode, arg)
        if index not in memo:
            raise PickleRefused("memo_index", f"{name} {index} reads a memo entry never written")
        stack.append(memo[index])
        return
    if name == "MARK":
        stack.append(MARK)
        return
    popped = _pop(opcode, stack)
    if not opcode.stack_after:
        return
    items = [d for d in popped if d != MARK]
    if name in _ADDS:  # popped: the container first, then what goes into it
        depth = max([items[0], *(1 + d for d in items[1:])])
    elif name in _BUILDS:
        depth = 1 + max(items, default=0)
    else:
        depth = max(items, default=0)
    if depth > MAX_DEPTH:
        raise PickleRefused("too_deep", f"containers nested more than {MAX_DEPTH} deep")
    stack.extend([depth] * len(opcode.stack_after))


def _index(opcode: pickletools.OpcodeInfo, arg: object) -> int:
    if not isinstance(arg, int):
        raise PickleRefused("malformed", f"{opcode.name} argument {arg!r} is not an integer")
    return arg


def _pop(opcode: pickletools.OpcodeInfo, stack: list[int]) -> list[int]:
    """Pop what ``opcode`` consumes: everything above the topmost mark if it takes one, then the rest."""
    before = opcode.stack_before
    popped: list[int] = []
    if pickletools.markobject in before:
        while stack and stack[-1] != MARK:
            popped.append(stack.pop())
        if not stack:
            raise PickleRefused("malformed", f"{opcode.name} without a MARK")
        stack.pop()
        popped.reverse()
        rest = before.index(pickletools.markobject)
    else:
        rest = len(before)
    if rest > len(stack):
        raise PickleRefused("malformed", f"{opcode.name} on a stack of {len(stack)}")
    taken = stack[len(stack) - rest :] if rest else []
    del stack[len(stack) - rest :]
    return [*taken, *popped]
