"""Shared fixtures: tqmon as a real subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

# Keep Ray, TransferQueue and everything else on 127.0.0.1 (see README, "Tests").
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TqmonProcess:
    """``tqmon serve`` in a subprocess; ``restart`` keeps the port and the state dir."""

    def __init__(self, state_dir: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.state_dir = state_dir
        self.args = args
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir.parent / f"tqmon-{self.port}.out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.wrap: list[str] = []  # a command tqmon runs under (e.g. a private mount namespace)

    def start(self, timeout: float = 20.0) -> TqmonProcess:
        command = [sys.executable, "-m", "tqmon.cli", "serve", "--listen", f"127.0.0.1:{self.port}"]
        command = [*self.wrap, *command, "--state-dir", str(self.state_dir), *self.args]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tqmon exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"tqmon did not come up: {self.log_path.read_text()[-2000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text


@pytest.fixture
def tqmon_factory(tmp_path: Path) -> Iterator[type[TqmonProcess]]:
    started: list[TqmonProcess] = []

    class Factory(TqmonProcess):
        def __init__(self, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
            super().__init__(tmp_path / "state", args or [], env)
            started.append(self)

    yield Factory
    for proc in started:
        proc.kill(signal.SIGTERM)


def sample_value(exposition: str, series: str) -> float | None:
    """Value of one exact series line (``name{a="b"}``) in a text exposition, or None."""
    for line in exposition.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return None
