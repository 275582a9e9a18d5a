"""A compressed long run: tqmon against the simulator for many starts (``python bench/soak.py``).

One local Ray cluster; each iteration runs one simulator scenario on it (a fresh start, a preemption,
a resume: two TransferQueue controllers, so a controller restart each time) into a new run dir. Between
iterations the previous run's log is rotated away (renamed) and the one before is deleted with its
checkpoints, and ``--checkpoint-dir`` (a symlink) moves to the newest run's checkpoints. tqmon is killed
with -9 halfway and restarted; a real Prometheus scrapes it every second throughout. Retention runs with
short settings so that it binds within minutes.

Printed at start and end: RSS, open fds, threads, state dir size, /metrics latency, records kept
against expected, resumes counted against resumes run, and Prometheus' failed scrapes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import TqmonProcess
from tests.test_e2e import Prometheus
from tqmon.sim.scenarios import CHECKPOINT_DIR, LOG_FILE, SCENARIOS

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

STARTS_PER_RUN = 2  # the simulator's fresh start and its resume
MIN_AGE = 15.0  # --retain-min-age: retention binds within the soak


@dataclass(frozen=True)
class Sample:
    rss_mib: float
    fds: int
    threads: int
    state_kib: float
    p50_ms: float
    p99_ms: float
    records: int
    resumes: int


def proc_status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise KeyError(key)


def sample(proc: TqmonProcess, scrapes: int = 60) -> Sample:
    assert proc.proc is not None
    pid = proc.proc.pid
    took = []
    with httpx.Client(timeout=10) as client:
        for _ in range(scrapes):
            started = time.perf_counter()
            assert client.get(proc.url + "/metrics").status_code == 200
            took.append(time.perf_counter() - started)
        status = client.get(proc.url + "/api/v1/status", params={"limit": 1}).json()
    state = sum(p.stat().st_size for p in proc.state_dir.iterdir() if p.is_file())
    return Sample(
        rss_mib=int(proc_status(pid, "VmRSS").split()[0]) / 1024,
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        threads=int(proc_status(pid, "Threads")),
        state_kib=state / 1024,
        p50_ms=statistics.median(took) * 1000,
        p99_ms=statistics.quantiles(took, n=100)[-1] * 1000,
        records=int(status["records_total"]),
        resumes=int(status["resumes_total"]),
    )


def settle(proc: TqmonProcess, starts: int, timeout: float = 60.0) -> None:
    """Wait until tqmon has read every start of the runs so far (its log poll lags the simulator)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(proc.url + "/api/v1/status", params={"limit": 1}, timeout=10).json()
        if status["resumes_total"] >= starts // STARTS_PER_RUN:
            return
        time.sleep(0.5)
    raise RuntimeError(f"tqmon did not see {starts} starts within {timeout:g}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=8, help="simulator runs (2 starts, 1 resume each)")
    parser.add_argument("--scenario", default="doomed-mix", choices=sorted(SCENARIOS))
    parser.add_argument("--steps", type=int, default=40, help="steps before the preemption and after the resume")
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--retain-records", type=int, default=6)
    args = parser.parse_args()

    import ray

    from tqmon.sim.trainer import run_scenario

    root = Path(tempfile.mkdtemp(prefix="tqmon-soak-"))
    context: Any = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    gcs = str(context.address_info["gcs_address"])
    runs = root / "runs"
    runs.mkdir()
    current = root / "checkpoints"  # --checkpoint-dir: a symlink moved to each new run's checkpoints
    (root / "empty").mkdir()
    current.symlink_to(root / "empty")
    scenario = SCENARIOS[args.scenario]
    flags = [
        *("--log", f"{runs}/*/{LOG_FILE}", "--log-interval", "0.2"),
        *("--checkpoint-dir", str(current), "--checkpoint-interval", "0.5"),
        *("--ray-address", gcs, "--tq-min-interval", "0.5", "--tq-max-interval", "1", "--tq-budget", "0.5"),
        *("--retain-records", str(args.retain_records), "--retain-min-age", str(MIN_AGE)),
        *scenario.after.tqmon_flags(),
    ]
    tqmon = TqmonProcess(root / "state", flags)
    tqmon.start()
    prometheus = Prometheus(root / "prometheus", tqmon.port)
    prometheus.wait_ready()
    started = time.time()
    first: Sample | None = None
    killed_at = args.iterations // 2
    try:
        for k in range(args.iterations):
            workdir = runs / f"run-{k:03d}"
            run_scenario(
                scenario,
                workdir,
                step_seconds=args.step_seconds,
                steps_before_preemption=args.steps,
                steps_after_resume=args.steps,
                seed=k,
            )
            current.unlink()
            current.symlink_to(workdir / CHECKPOINT_DIR)  # checkpoint churn: a new dir, new steps
            if k >= 1:  # rotation: the previous run's log is renamed away (it is finished)
                previous = runs / f"run-{k - 1:03d}" / LOG_FILE
                previous.rename(previous.with_name(LOG_FILE + ".1"))
            if k >= 2:  # and the one before is deleted with its checkpoints
                shutil.rmtree(runs / f"run-{k - 2:03d}")
            settle(tqmon, STARTS_PER_RUN * (k + 1))
            if k == 0:
                first = sample(tqmon)
            if k == killed_at:
                tqmon.kill(signal.SIGKILL)
                tqmon.start()
                settle(tqmon, STARTS_PER_RUN * (k + 1))
            print(f"iteration {k + 1}/{args.iterations} done at {time.time() - started:.0f}s", file=sys.stderr)
        time.sleep(MIN_AGE + 6)  # a retention round after the last run's events are old enough
        last = sample(tqmon)
        tqmon.kill(signal.SIGTERM)
        tqmon.start()  # what a restart replays: the retained records only
        restarted = sample(tqmon)
        elapsed = time.time() - started
        scrapes = prometheus.query(f'count_over_time(up{{job="tqmon"}}[{int(elapsed) + 5}s])')
        failed = prometheus.query(f'count_over_time((up{{job="tqmon"}} == 0)[{int(elapsed) + 5}s:1s])')
        worst = prometheus.query(f'max_over_time(scrape_duration_seconds{{job="tqmon"}}[{int(elapsed) + 5}s])')
    finally:
        tqmon.kill(signal.SIGTERM)
        prometheus.stop()
        ray.shutdown()
    assert first is not None
    starts = STARTS_PER_RUN * args.iterations
    print(
        f"\nsoak: {args.iterations} runs of {args.scenario} ({starts} starts, {args.iterations} resumes, "
        f"{2 * args.iterations} TQ controllers, {args.iterations - 1} rotations, 1 kill -9) in {elapsed:.0f}s; "
        f"--retain-records {args.retain_records} --retain-min-age {MIN_AGE:g}"
    )
    rows = [("after run 1", first), ("end", last), ("end, restarted", restarted)]
    print(
        f"{'':16} {'RSS MiB':>8} {'fds':>5} {'threads':>8} {'state KiB':>10} {'/metrics p50 ms':>16} "
        f"{'p99 ms':>7} {'records':>8} {'resumes':>8}"
    )
    for label, s in rows:
        print(
            f"{label:16} {s.rss_mib:>8.1f} {s.fds:>5} {s.threads:>8} {s.state_kib:>10.0f} {s.p50_ms:>16.2f} "
            f"{s.p99_ms:>7.2f} {s.records:>8} {s.resumes:>8}"
        )
    expected_kept = min(args.retain_records, starts)
    print(
        f"records kept after the restart: {restarted.records} (expected {expected_kept} = min(--retain-records, "
        f"starts)); resumes counted: {restarted.resumes} (expected {args.iterations}, each once)"
    )
    total = sum(float(r["value"][1]) for r in scrapes)
    down = sum(float(r["value"][1]) for r in failed)
    print(
        f"prometheus: {total:.0f} scrapes at 1 s, {down:.0f} failed (the kill -9 and the restart), "
        f"slowest scrape {max(float(r['value'][1]) for r in worst) * 1000:.1f} ms"
    )
    subprocess.run(["du", "-sh", str(root / "state")], check=False)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
