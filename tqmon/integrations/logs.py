"""A logger that cannot flood a trainer's log: the plugin's failures and drops can repeat on every step."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """Warnings of one kind at most once per ``every`` seconds.

    The first occurrence is logged in full (with its traceback, if given); after that at most one line per
    ``every`` seconds, without the traceback, saying how often it happened in all.
    """

    def __init__(self, logger: logging.Logger, every: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._logger = logger
        self._every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self.count = 0  # occurrences, logged or not

    def warning(self, message: str, exc_info: BaseException | None = None) -> bool:
        """Log ``message`` unless a line of this kind went out less than ``every`` seconds ago; True if it did."""
        with self._lock:
            self.count += 1
            now = self._clock()
            if self._last is not None and now - self._last < self._every:
                return False
            first, self._last, count = self._last is None, now, self.count
        if first:
            self._logger.warning(message, exc_info=exc_info)
        else:
            self._logger.warning("%s (%d times so far; at most one line every %g s)", message, count, self._every)
        return True
