"""The KubeRay overlays and the VM script point tqmon at ``<ray temp dir>/session_latest/logs/job-driver-*.log``.
Prove that glob on a real local Ray: deploy/vm/ray-head-with-tqmon.sh starts a Ray head and tqmon next to it,
a job sent with ``ray job submit`` has a ``TaskRunnerV1`` actor log verl 0.9.1's resume lines, and tqmon,
given only the session's log glob, records the resume from the driver log (where Ray forwards the actor's
output behind its ``(TaskRunnerV1 pid=…)`` prefix). The script's file_sd target comes and goes with tqmon."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mixin.kubernetes import RAY_DRIVER_LOGS, RAY_LOGS
from tests.conftest import free_port

pytestmark = pytest.mark.e2e

RAY = Path(sys.executable).parent / "ray"
SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "vm" / "ray-head-with-tqmon.sh"
# No usage reporting; no token auth (Ray turns it on when it finds a token in ~/.ray from an earlier run).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
SUBMISSION_ID = "verl-resume-test"
RESUME_LINES = [
    "Resuming from /ckpt/gsm8k/global_step_40, setting global step to 40",
    "Loading TransferQueue state from /ckpt/gsm8k/global_step_40/transfer_queue",
    "Restored 88 training prompt groups from TransferQueue",
    "Re-issued 16 in-flight prompts for step 41; cleared 40 old trajectories from partition train",
    "Added 8 warmup prompts after restoring 88 of 96 target prompt groups",
]
JOB = textwrap.dedent(
    """
    import logging, time, ray

    @ray.remote(num_cpus=0)
    class TaskRunnerV1:
        def fit(self, lines):
            logging.basicConfig(format="%(levelname)s:%(asctime)s:%(message)s", level=logging.INFO)
            for line in lines:
                logging.getLogger("verl").info(line)
            return len(lines)

    ray.init()
    print("logged", ray.get(TaskRunnerV1.remote().fit.remote({lines!r})))
    time.sleep(3)  # let Ray forward the actor's output to this driver before it exits
    """
)


@dataclass
class RayHead:
    temp_dir: Path
    dashboard: str
    tqmon: str
    file_sd: Path


@pytest.fixture
def ray_head_with_tqmon(tmp_path: Path) -> Iterator[RayHead]:
    """deploy/vm/ray-head-with-tqmon.sh on loopback, Ray in a short temp dir (Unix socket paths are capped).
    Stopped with SIGTERM as an operator would, then its own process group is killed, never with ``ray stop``
    (which ends every Ray on the machine)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="tqr", dir="/tmp"))
    file_sd = tmp_path / "file_sd"
    file_sd.mkdir()
    dashboard, tqmon_port = free_port(), free_port()
    ray_args = ["--num-cpus=4", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1"]
    ray_args += [f"--dashboard-port={dashboard}", f"--ray-client-server-port={free_port()}"]
    ray_args += [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"]
    env = {
        **os.environ,
        **RAY_ENV,
        "PATH": f"{RAY.parent}:{os.environ['PATH']}",
        "RAY_PORT": str(free_port()),
        "RAY_TEMP_DIR": str(temp_dir),
        "TQMON_HOST": "127.0.0.1",
        "TQMON_PORT": str(tqmon_port),
        "TQMON_STATE_DIR": str(tmp_path / "state"),
        "TQMON_LOG_INTERVAL": "0.2",
        "TQMON_TOKEN": "ray-job-test",
        "TQMON_LIVE_TQ": "0",  # no TransferQueue in this job; the live source is proven in test_tq_source.py
        "TQMON_FILE_SD_LABEL": "run=ray-job-test",
        "FILE_SD_DIR": str(file_sd),
    }
    out = (tmp_path / "ray-head.out").open("wb")
    proc = subprocess.Popen(
        [str(SCRIPT), *ray_args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    head = RayHead(temp_dir, f"http://127.0.0.1:{dashboard}", f"http://127.0.0.1:{tqmon_port}", file_sd)
    try:
        deadline = time.monotonic() + 120
        while not (up(head.dashboard + "/api/version") and up(head.tqmon + "/healthz")):
            assert proc.poll() is None, (tmp_path / "ray-head.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head or tqmon did not come up"
            time.sleep(0.5)
        yield head
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert list(file_sd.iterdir()) == []  # tqmon withdrew its file_sd target on the way out
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        out.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_tqmon_records_a_resume_from_a_ray_job_driver_log(ray_head_with_tqmon: RayHead, tmp_path: Path) -> None:
    head = ray_head_with_tqmon
    # The script follows the same driver-log glob as the KubeRay overlays' sidecar.
    assert "$RAY_TEMP_DIR" + RAY_DRIVER_LOGS.removeprefix(RAY_LOGS) in SCRIPT.read_text()
    (target,) = json.loads(next(head.file_sd.iterdir()).read_text())
    assert target == {"targets": [head.tqmon.removeprefix("http://")], "labels": {"run": "ray-job-test"}}
    job = tmp_path / "job.py"
    job.write_text(JOB.format(lines=RESUME_LINES))
    submit = subprocess.run(
        [str(RAY), "job", "submit", "--address", head.dashboard, "--submission-id", SUBMISSION_ID,
         "--", sys.executable, str(job)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **RAY_ENV}, check=False,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    driver_log = head.temp_dir / "session_latest" / "logs" / f"job-driver-{SUBMISSION_ID}.log"
    assert "(TaskRunnerV1 pid=" in driver_log.read_text()

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = httpx.get(head.tqmon + "/api/v1/status", timeout=5).json()
        if body["resumes_total"] == 1:
            break
        time.sleep(0.2)
    assert body["resumes_total"] == 1, body
    (record,) = body["records"]
    assert {k: record[k] for k in ("resumed", "checkpoint_step", "restored", "reissued", "target")} == {
        "resumed": True,
        "checkpoint_step": 40,
        "restored": 88,
        "reissued": 16,
        "target": 96,
    }
    assert (record["expected"], record["submitted"], record["warmup_state"]) == (8, 8, "topped_up")
