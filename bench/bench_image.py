"""The container image: size of each variant, and the running container's memory, idle and while it tails a
100k-line verl log (what the Kubernetes requests and limits in mixin/kubernetes.py rest on).

Run with ``make bench`` (or ``.venv/bin/python bench/bench_image.py [--tq]``) as root with podman, runc and
debootstrap installed; it builds the Dockerfile on the ``python:3.11-slim`` stand-in of tests/podman.py.
``--tq`` also builds the ``TQMON_EXTRAS=tq`` variant (minutes, and a CPU torch index it can reach, see
docs/deploy.md); ``--tq-image TAG`` measures an already built one instead. The -tq container joins a Ray
head running in a second container of the same image, on the host network with a shared ``/tmp/ray``
(as the KubeRay overlays share the head pod's), and its memory is that of all its processes (tqmon and
its TQ poller, a Ray driver).
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


def start(tag: str, mounts: list[str], args: list[str], run_options: tuple[str, ...] = ()) -> tuple[str, str]:
    name = f"tqmon-bench-{uuid.uuid4().hex[:8]}"
    port = free_port()
    volume_args = [arg for mount in mounts for arg in ("--volume", mount)]
    podman(
        "run", "--detach", "--name", name, *LIMITS, "--read-only", "--health-interval", "disable",
        "--env", f"TQMON_LISTEN=127.0.0.1:{port}", "--env", "TQMON_TOKEN=bench", *volume_args, *run_options,
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


def tqmon_rss_kib(container: str) -> int:
    """Sum of VmRSS over tqmon's process and its descendants (the TQ poller, a Ray driver). The container
    shares the Ray head's PID namespace, so it sees the head's processes too: those are left out."""
    script = (
        "import glob, os\n"
        "status = {}\n"
        "for path in glob.glob('/proc/[0-9]*/status'):\n"
        "    try:\n"
        "        fields = dict(l.split(':', 1) for l in open(path) if ':' in l)\n"
        "        cmd = open(path.replace('status', 'cmdline'), 'rb').read().replace(b'\\0', b' ')\n"
        "    except OSError:\n"
        "        continue\n"
        "    rss = int(fields.get('VmRSS', '0 kB').split()[0])\n"
        "    status[int(fields['Pid'])] = (int(fields['PPid']), rss, b'tqmon serve' in cmd)\n"
        "ours = {pid for pid, (_, _, is_tqmon) in status.items() if is_tqmon}\n"
        "while True:\n"
        "    more = {pid for pid, (ppid, _, _) in status.items() if ppid in ours} - ours\n"
        "    if not more:\n"
        "        break\n"
        "    ours |= more\n"
        "print(sum(status[pid][1] for pid in ours), len(ours))\n"
    )
    total, processes = podman("exec", container, "python", "-c", script).stdout.split()
    if int(processes) < 2:
        raise RuntimeError(f"expected tqmon and its TQ poller, found {processes} process(es)")
    return int(total)


def tq_memory(tag: str) -> list[str]:
    """RSS of the -tq container watching a Ray head in another container, after its poller has joined."""
    with tempfile.TemporaryDirectory(prefix="tqr", dir="/tmp") as ray_tmp:
        Path(ray_tmp).chmod(0o777)  # the head and tqmon run as UID 10001
        gcs = free_port()
        head = f"tqmon-bench-ray-{uuid.uuid4().hex[:8]}"
        ray_args = ["start", "--head", "--block", f"--port={gcs}", "--num-cpus=1", "--node-ip-address=127.0.0.1"]
        ray_args += ["--include-dashboard=false", "--temp-dir=/tmp/ray", f"--ray-client-server-port={free_port()}"]
        ray_args += [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"]
        podman(
            "run", "--detach", "--name", head, *LIMITS, "--health-interval", "disable", "--shm-size", "512m",
            "--env", "RAY_USAGE_STATS_ENABLED=0", "--env", "RAY_AUTH_MODE=disabled",
            "--volume", f"{ray_tmp}:/tmp/ray", "--entrypoint", "ray", tag, *ray_args,
        )  # fmt: skip
        volume = f"tqmon-bench-{uuid.uuid4().hex[:8]}"
        podman("volume", "create", volume)
        name = ""
        try:
            # --pid: a Ray driver finds the raylet by scanning processes (the overlays' shareProcessNamespace).
            name, url = start(
                tag,
                [f"{volume}:/state", f"{ray_tmp}:/tmp/ray"],
                ["--ray-address", f"127.0.0.1:{gcs}"],
                ("--pid", f"container:{head}"),
            )
            started = time.monotonic()
            # The poller imports Ray and TQ, joins the cluster and looks for the controller (none runs here):
            # that answer proves it is a connected Ray driver.
            while (error := tq_error(url)) is None or "no TransferQueueController actor" not in error:
                if time.monotonic() - started > 180:
                    raise RuntimeError(f"the TQ poller did not join the Ray head: {error}")
                time.sleep(1)
            time.sleep(10)
            rss = tqmon_rss_kib(name)
            return ["-tq, poller joined a Ray head", f"{time.monotonic() - started:.1f}", mib(rss), "", ""]
        finally:
            for container in (name, head):
                if container:
                    podman("rm", "--force", "--volumes", "--time", "0", container, check=False)
            podman("volume", "rm", "--force", volume, check=False)


def tq_error(url: str) -> str | None:
    sources = httpx.get(url + "/api/v1/status", timeout=5).json()["sources"]
    return next((s["last_error"] for s in sources if s["source"] == "tq"), None)


def lines_read(url: str) -> int:
    total = 0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("tqmon_log_lines_total{"):
            total += int(float(line.rpartition(" ")[2]))
    return total


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f}"


def main() -> None:
    args = sys.argv[1:]
    tq_tag = args[args.index("--tq-image") + 1] if "--tq-image" in args else TQ_TAG if "--tq" in args else None
    ensure_base_image()
    seconds = build(TAG, ROOT)
    rows = [["default", f"{image_size(TAG) / 1e6:.0f}", f"{seconds:.0f}"]]
    if tq_tag == TQ_TAG:
        seconds = build(TQ_TAG, ROOT, "--build-arg", "TQMON_EXTRAS=tq")
        rows.append(["tq (TQMON_EXTRAS=tq)", f"{image_size(TQ_TAG) / 1e6:.0f}", f"{seconds:.0f}"])
    elif tq_tag is not None:
        rows.append([f"tq ({tq_tag}, prebuilt)", f"{image_size(tq_tag) / 1e6:.0f}", "-"])
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
                podman("rm", "--force", "--volumes", "--time", "0", name, check=False)
                podman("volume", "rm", "--force", volume, check=False)
    if tq_tag is not None:
        memory.append(tq_memory(tq_tag))
    print(
        table(
            "Container memory (MiB; --read-only, state on a volume; default: PID 1; -tq: tqmon and its TQ poller)",
            ["scenario", "seconds", "RSS end", "RSS max sampled", "VmHWM (peak)"],
            memory,
        )
    )


if __name__ == "__main__":
    main()
