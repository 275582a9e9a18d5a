"""uvicorn's limits, chosen on purpose (docs/reliability.md, "HTTP limits"), and a request-head timeout.

uvicorn times out idle keep-alive connections but not a client that never finishes its request head:
a slowloris holds its connection (and an fd) for ever. :class:`GuardedH11Protocol` closes any connection
whose request head is not complete :data:`HEAD_TIMEOUT_SECONDS` after it opened or after its last response.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_SECONDS = 10.0  # a request head must arrive whole within this
BODY_TIMEOUT_SECONDS = 10.0  # an event API body must arrive whole within this (server.py)
BACKLOG = 1024  # pending accepts the kernel queues while the loop is busy (server.bind listens with it)
UVICORN_LIMITS: dict[str, Any] = {
    # Connections plus in-flight requests; beyond it uvicorn answers 503 at once instead of queueing.
    # Far above a sidecar's real load (one scraper, one trainer), low enough to bound memory.
    "limit_concurrency": 1024,
    "timeout_keep_alive": 5,  # idle keep-alive connections close after this
    "h11_max_incomplete_event_size": 16 * 1024,  # largest request head (h11 answers 400 beyond it)
    "timeout_graceful_shutdown": 5,  # SIGTERM: in-flight requests get this long
}


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on the request head (slowloris).

    It overrides four methods of uvicorn's internal ``H11Protocol``, each passing on whatever uvicorn passes.
    pyproject.toml pins uvicorn below its next minor, and tests/test_http_abuse.py fails if a release renames
    or re-signs one (the override would silently never run) or if the guard stops closing a slowloris.
    """

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, *args: Any, **kwargs: Any) -> None:
        super().connection_made(*args, **kwargs)
        self._arm_head_deadline()

    def connection_lost(self, *args: Any, **kwargs: Any) -> None:
        self._disarm_head_deadline()
        super().connection_lost(*args, **kwargs)

    def handle_events(self, *args: Any, **kwargs: Any) -> None:
        super().handle_events(*args, **kwargs)
        if self.conn.their_state is not h11.IDLE:  # the head arrived (or the connection is done)
            self._disarm_head_deadline()

    def on_response_complete(self, *args: Any, **kwargs: Any) -> None:
        super().on_response_complete(*args, **kwargs)
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request on this keep-alive connection gets its own deadline

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_SECONDS, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
