"""One writer per state dir: an exclusive ``fcntl`` lock held for the life of the process.

The kernel drops the lock when the holder dies, so ``kill -9`` never leaves a stale lock behind; the
holder writes its PID into the lock file so a refused second instance can name it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "tqmon.lock"


class StateError(Exception):
    """The state dir cannot be used; the message is one line naming the file and the way out."""


class StateDirLocked(StateError):
    """Another live process holds the state dir."""


class StateLock:
    """Holds ``<state_dir>/tqmon.lock`` exclusively until :meth:`release` or process exit."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirLocked(
                f"state dir {state_dir} is in use by PID {holder} (another tqmon serve); "
                "stop it or give this one another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
