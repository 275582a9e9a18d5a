"""The shipped Dockerfile, built unmodified with podman and run: metrics from a real verl log on a read-only
mount, non-root, the image's own healthcheck, a read-only root filesystem, state that outlives the container,
and a graceful SIGTERM. The base image is a debootstrap stand-in for ``python:3.11-slim`` (tests/podman.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tqmon
from tests.conftest import free_port, sample_value
from tests.podman import LIMITS, build, ensure_base_image, missing_tools, podman

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parent.parent
DEMO_LOG = ROOT / "tqmon" / "data" / "demo-resume.log"
TAG = "localhost/tqmon:test"
TOKEN = "image-test-token"


@pytest.fixture(scope="module")
def image() -> str:
    missing = missing_tools()
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: run `make test`, which installs them (system-deps)")
    ensure_base_image()
    build(TAG, ROOT)
    return TAG


class Container:
    """One ``podman run -d`` of the image on a loopback port of the host network."""

    def __init__(self, image: str, volume: str, *args: str, read_only: bool = True, mounts: tuple[str, ...] = ()):
        self.name = f"tqmon-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        run = ["run", "--detach", "--name", self.name, *LIMITS, "--health-interval", "disable"]
        run += ["--read-only"] if read_only else []
        run += ["--env", f"TQMON_LISTEN=127.0.0.1:{self.port}", "--env", f"TQMON_TOKEN={TOKEN}"]
        run += ["--volume", f"{volume}:/state"]
        for mount in mounts:
            run += ["--volume", mount]
        podman(*run, image, "--log-interval", "0.2", *args)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"container never became healthy:\n{self.logs()}")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def status(self) -> dict[str, object]:
        body: dict[str, object] = httpx.get(self.url + "/api/v1/status", timeout=5).json()
        return body

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def remove(self) -> None:
        podman("rm", "--force", "--volumes", "--time", "0", self.name, check=False)


@pytest.fixture
def volume() -> Iterator[str]:
    name = f"tqmon-test-state-{uuid.uuid4().hex[:8]}"
    podman("volume", "create", name)
    yield name
    podman("volume", "rm", "--force", name, check=False)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for container in started:
        container.remove()


def wait_for(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_image_metadata(image: str) -> None:
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "tqmon"
    assert labels["org.opencontainers.image.version"] == tqmon.__version__
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels["org.opencontainers.image.description"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["tqmon", "serve"]
    assert config["Env"].count("TQMON_STATE_DIR=/state") == 1
    docker_config = json.loads(podman("image", "inspect", "--format", "{{json .HealthCheck}}", image).stdout)
    assert docker_config["Test"] == ["CMD", "python", "-m", "tqmon.healthcheck"]


def test_default_variant_has_no_ray_or_torch(image: str) -> None:
    probe = "import importlib.util as u; print([m for m in ('ray', 'torch', 'transfer_queue') if u.find_spec(m)])"
    result = podman("run", "--rm", *LIMITS, "--entrypoint", "python", image, "-c", probe)
    assert result.stdout.strip() == "[]"


def demo_log_mount(tmp_path: Path) -> str:
    """A read-only mount holding the demo verl log as /logs/trainer.log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "trainer.log").write_bytes(DEMO_LOG.read_bytes())
    return f"{logs}:/logs:ro"


def test_container_reads_a_verl_log_read_only_as_non_root(
    image: str, volume: str, containers: list[Container], tmp_path: Path
) -> None:
    container = Container(image, volume, "--log", "/logs/trainer.log", mounts=(demo_log_mount(tmp_path),))
    containers.append(container)
    container.wait_healthy()
    wait_for(lambda: sample_value(container.metrics(), "tqmon_resumes_total") == 2.0, "two resumes from the log")
    metrics = container.metrics()
    # The demo log's last start: resumed from global_step_60 with R=96 restored into a T=64 window.
    assert sample_value(metrics, "tqmon_last_resume_checkpoint_step") == 60.0
    assert sample_value(metrics, "tqmon_resume_warmup_target_prompt_groups") == 64.0
    assert sample_value(metrics, "tqmon_resume_over_restored_prompt_groups") == 32.0
    assert sample_value(metrics, "tqmon_resume_reissued_prompt_groups") == 18.0
    assert sample_value(metrics, 'tqmon_resume_warmup_state{state="skipped_over_restored"}') == 1.0
    assert sample_value(metrics, 'tqmon_log_lines_total{outcome="malformed"}') == 0.0

    ids = podman("exec", container.name, "id", "-u").stdout.strip()
    assert ids == "10001"
    health = podman("healthcheck", "run", container.name, check=False)
    assert health.returncode == 0, health.stdout + health.stderr
    # --read-only: the root filesystem refuses writes; /state (the volume) and /tmp take them.
    denied = podman("exec", container.name, "touch", "/usr/local/lib/probe", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    podman("exec", container.name, "touch", "/state/probe", "/tmp/probe")


def test_healthcheck_fails_when_tqmon_does_not_answer(image: str) -> None:
    result = podman(
        "run", "--rm", *LIMITS, "--env", "TQMON_LISTEN=127.0.0.1:1", "--entrypoint", "python", image,
        "-m", "tqmon.healthcheck", check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "unhealthy: http://127.0.0.1:1/healthz" in result.stderr


def test_a_new_container_on_the_same_volume_keeps_the_history(
    image: str, volume: str, containers: list[Container], tmp_path: Path
) -> None:
    first = Container(image, volume, "--log", "/logs/trainer.log", mounts=(demo_log_mount(tmp_path),))
    containers.append(first)
    first.wait_healthy()
    wait_for(lambda: first.status()["records_total"] == 3, "three start records")

    started = time.monotonic()
    podman("kill", "--signal", "TERM", first.name)
    exit_code = podman("wait", first.name, timeout=15).stdout.strip()
    stopped_after = time.monotonic() - started
    assert stopped_after < 10.0
    assert exit_code == "0", first.logs()
    assert "Application shutdown complete" in first.logs()

    # The replacement follows no log at all: everything it reports comes from the volume.
    second = Container(image, volume)
    containers.append(second)
    second.wait_healthy()
    assert sample_value(second.metrics(), "tqmon_resumes_total") == 2.0
    status = second.status()
    assert status["records_total"] == 3
    records = status["records"]
    assert isinstance(records, list)
    assert [(r["resumed"], r["checkpoint_step"], r["restored"]) for r in records] == [
        (False, 0, 0),
        (True, 40, 96),
        (True, 60, 96),
    ]
