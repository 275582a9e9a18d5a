"""The HTTP server under abuse, over real sockets against ``tqmon serve``: slowloris heads (on new and on
keep-alive connections), a slow body, hundreds of idle connections and a flood of small posts from one client.
``/metrics`` and ``/healthz`` keep answering within their normal latency, and the abusive connections are closed
by the server after their deadline, not before. The slowloris deadline is ``GuardedH11Protocol``'s, which
overrides methods of uvicorn's internal ``H11Protocol``: those are checked against the installed uvicorn too."""

from __future__ import annotations

import inspect
import re
import select
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx
from uvicorn.protocols.http.h11_impl import H11Protocol

from tests.conftest import TqmonProcess
from tqmon.httpserver import BODY_TIMEOUT_SECONDS, HEAD_TIMEOUT_SECONDS, GuardedH11Protocol

Factory = Callable[..., TqmonProcess]
IDLE_CONNECTIONS = 400
# Latency bound under abuse: 5x the idle p95 just measured, or this floor on a loaded 2-core box; starving
# the event loop (the failure this guards) costs seconds.
FLOOR_SECONDS = 0.5
SLOWLORIS = 100
# The H11Protocol methods GuardedH11Protocol overrides, and their parameters in the uvicorn pyproject.toml pins.
HOOKS = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "handle_events": ["self"],
    "on_response_complete": ["self"],
}


def latencies(proc: TqmonProcess, seconds: float) -> list[float]:
    """Wall times of /metrics and /healthz requests, each on a fresh connection, for ``seconds``."""
    took: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for path in ("/metrics", "/healthz"):
            started = time.monotonic()
            response = httpx.get(proc.url + path, timeout=10)
            took.append(time.monotonic() - started)
            assert response.status_code == 200, (path, response.status_code)
        time.sleep(0.02)
    return took


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def connect(proc: TqmonProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proc.port), timeout=30)
    sock.settimeout(30)
    return sock


def open_and_silent(sock: socket.socket) -> bool:
    """True while the server has neither closed the connection nor written to it (nothing to read yet)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)  # readable: data or EOF
    return not poller.poll(0)


def one_response(sock: socket.socket) -> bytes:
    """Read one whole response (head and ``Content-Length`` body) and return its head."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length is not None, head
    while len(body) < int(length[1]):
        body += sock.recv(65536)
    return head


def test_the_slowloris_guard_overrides_methods_uvicorn_still_has() -> None:
    """A uvicorn that renamed or re-signed one of these would never call the override: the guard disarmed,
    with every request still answered. The test below checks the deadline over real HTTP."""
    overrides = {name for name, value in vars(GuardedH11Protocol).items() if callable(value) and name[0] != "_"}
    assert overrides == set(HOOKS)
    for name, parameters in HOOKS.items():
        assert name in vars(H11Protocol), f"uvicorn's H11Protocol no longer defines {name}"
        assert list(inspect.signature(vars(H11Protocol)[name]).parameters) == parameters, name


def closed_by_server(sock: socket.socket) -> bool:
    """True when the server closed the connection (EOF), whatever it wrote first (a 408 is fine)."""
    try:
        while data := sock.recv(65536):
            del data
    except (ConnectionResetError, TimeoutError):
        return False
    return True


def test_slowloris_idle_and_slow_body_connections_do_not_slow_metrics_and_are_closed(
    tqmon_factory: Factory,
) -> None:
    proc = tqmon_factory().start()
    baseline = latencies(proc, 1.0)

    idle = [connect(proc) for _ in range(IDLE_CONNECTIONS)]
    slow_heads = [connect(proc) for _ in range(SLOWLORIS)]
    for sock in slow_heads:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    # A keep-alive connection whose second head never finishes: uvicorn's keep-alive timeout stops at its first
    # byte, so only the deadline GuardedH11Protocol re-arms after each response closes it.
    keep_alive = connect(proc)
    keep_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert one_response(keep_alive).startswith(b"HTTP/1.1 200")
    keep_alive.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    slow_heads.append(keep_alive)
    slow_body = connect(proc)
    slow_body.sendall(
        b"POST /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 200\r\n\r\n{"type":'
    )
    opened = time.monotonic()
    under_abuse: list[float] = []
    while time.monotonic() - opened < HEAD_TIMEOUT_SECONDS - 2:
        assert all(open_and_silent(sock) for sock in slow_heads)  # not closed before the deadline
        for sock in slow_heads:  # one more header line each second: a slowloris never finishes its head
            sock.sendall(b"X-Slow: 1\r\n")
        under_abuse += latencies(proc, 1.0)

    assert p95(under_abuse) < max(5 * p95(baseline), FLOOR_SECONDS), (p95(baseline), p95(under_abuse))
    assert max(under_abuse) < 2.0

    time.sleep(max(0.0, max(HEAD_TIMEOUT_SECONDS, BODY_TIMEOUT_SECONDS) + 1.5 - (time.monotonic() - opened)))
    assert all(closed_by_server(sock) for sock in slow_heads)
    assert all(closed_by_server(sock) for sock in idle)
    reply = slow_body.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408") and b'"too_slow"' in reply
    assert closed_by_server(slow_body)
    for sock in [*idle, *slow_heads, slow_body]:
        sock.close()
    assert 'tqmon_events_rejected_total{reason="too_slow"} 1.0' in proc.metrics()


def test_a_flood_of_small_posts_from_one_client_does_not_slow_metrics(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    baseline = latencies(proc, 1.0)
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    stop = threading.Event()

    def flood(worker: int) -> None:
        with httpx.Client(base_url=proc.url, timeout=10) as client:  # keep-alive: as fast as one client can
            n = 0
            while not stop.is_set():
                body = {"type": "step_completed", "id": f"flood/{worker}/{n}", "global_step": n}
                try:
                    statuses[client.post("/api/v1/events", json=body).status_code] += 1
                except httpx.HTTPError as err:  # counted, so the assertion below names it
                    statuses[-1] += 1
                    errors.append(repr(err))
                n += 1

    workers = [threading.Thread(target=flood, args=(w,)) for w in range(4)]
    for worker in workers:
        worker.start()
    try:
        under_flood = latencies(proc, 4.0)
    finally:
        stop.set()
        for worker in workers:
            worker.join()

    assert set(statuses) == {200} and sum(statuses.values()) > 100, (statuses, errors[:3])
    assert p95(under_flood) < max(5 * p95(baseline), FLOOR_SECONDS), (p95(baseline), p95(under_flood))
    applied = 'tqmon_events_total{outcome="applied",source="events"}'
    assert f"{applied} {float(sum(statuses.values()))}" in proc.metrics()  # every 200 is an applied event
