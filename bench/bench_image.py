"""The container image: size of each variant, and the running container's memory, idle and while it tails a
100k-line verl log (what the Kubernetes requests and limits in mixin/kubernetes.py rest on).

Run with ``make bench`` (or ``.venv/bin/python bench/bench_image.py [--tq]``) as root with podman, runc and
debootstrap installed; it builds the Dockerfile on the ``python:3.11-slim`` stand-in of tests/podman.py.
``--tq`` also builds the ``TQMON_EXTRAS=tq`` variant (minutes, and a CPU torch it can reach: pass
``--build-arg``-style settings through PIP_* variables, see docs/deploy.md).
"""

from __future__ import annotations

import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from bench_service import free_port, table, write_log

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.podman: this machine's podman flags and the base image stand-in

from tests.podman import LIMITS, build, ensure_base_image, image_size, podman, rss_kib  # noqa: E402

TAG = "localhost/tqmon:bench"
TQ_TAG = "localhost/tqmon:bench-tq"
LOG_LINES = 100_000
IDLE_SECONDS = 10.0


def start(tag: str, mounts: list[str], args: list[str]) -> tuple[str, str]:
    name = f"tqmon-bench-{uuid.uuid4().hex[:8]}"
    port = free_port()
    volume_args = [arg for mount in mounts for arg in ("--volume", mount)]
    podman(
        "run", "--detach", "--name", name, *LIMITS, "--read-only", "--health-interval", "disable",
        "--env", f"TQMON_LISTEN=127.0.0.1:{port}", "--env", "TQMON_TOKEN=bench", *volume_args,
        tag, "--log-interval", "0.2", *args,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return name, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{name} did not come up: {podman('logs', name, check=False).stderr[-2000:]}")


def lines_read(url: str) -> int:
    total = 0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("tqmon_log_lines_total{"):
            total += int(float(line.rpartition(" ")[2]))
    return total


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def main() -> None:
    with_tq = "--tq" in sys.argv[1:]
    ensure_base_image()
    seconds = build(TAG, ROOT)
    rows = [["default", f"{image_size(TAG) / 1e6:.0f}", f"{seconds:.0f}"]]
    if with_tq:
        seconds = build(TQ_TAG, ROOT, "--build-arg", "TQMON_EXTRAS=tq")
        rows.append(["tq (TQMON_EXTRAS=tq)", f"{image_size(TQ_TAG) / 1e6:.0f}", f"{seconds:.0f}"])
    print(
        table(
            "Image variants (podman, vfs storage; base: the debootstrap stand-in)", ["variant", "MB", "build s"], rows
        )
    )

    memory = []
    with tempfile.TemporaryDirectory(prefix="tqmon-bench-image-") as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        log = logs / "trainer.log"
        lines = write_log(log, LOG_LINES)
        for scenario in ("idle", "tailing"):
            volume = f"tqmon-bench-{uuid.uuid4().hex[:8]}"
            podman("volume", "create", volume)
            mounts = [f"{volume}:/state"]
            args = []
            if scenario == "tailing":
                mounts.append(f"{logs}:/logs:ro")
                args = ["--log", "/logs/trainer.log"]
            name, url = start(TAG, mounts, args)
            try:
                started = time.monotonic()
                samples = [rss_kib(name)]
                if scenario == "idle":
                    time.sleep(IDLE_SECONDS)
                else:
                    while lines_read(url) < lines and time.monotonic() - started < 600:
                        samples.append(rss_kib(name))
                        time.sleep(0.2)
                    if lines_read(url) != lines:
                        raise RuntimeError(f"tailing read {lines_read(url)} of {lines} lines")
                seconds = time.monotonic() - started
                samples.append(rss_kib(name))
                memory.append(
                    [
                        scenario if scenario == "idle" else f"tailing {lines:,} lines",
                        f"{seconds:.1f}",
                        mib(samples[-1]),
                        mib(max(samples)),
                        mib(rss_kib(name, "VmHWM")),
                    ]
                )
            finally:
                podman("rm", "--force", "--time", "0", name, check=False)
                podman("volume", "rm", "--force", volume, check=False)
    print(
        table(
            "Default-variant container, PID 1 memory (MiB; --read-only, state on a volume)",
            ["scenario", "seconds", "RSS end", "RSS max sampled", "VmHWM (peak)"],
            memory,
        )
    )


if __name__ == "__main__":
    main()
