"""The state dir under fire, against real ``tqmon serve`` processes: one writer per dir, a corrupt or
foreign state file, schema versions, a disk that turns read-only, fills up or disappears under a running
tqmon (a real tmpfs in a private mount namespace), and retention."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import TqmonProcess, sample_value
from tqmon.events import parse_event
from tqmon.retention import Retention, RetentionPolicy
from tqmon.snapshot import Tally
from tqmon.store import DB_NAME, SCHEMA_V1, SCHEMA_VERSION, StateStore
from tqmon.tracker import Tracker

Factory = Callable[..., TqmonProcess]


def can_mount_privately() -> bool:
    """util-linux's unshare/nsenter present and allowed to make a mount namespace (root, CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = ["unshare", "--mount", "--propagation", "private", "true"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def step(n: int, prefix: str = "s") -> dict[str, Any]:
    return {"id": f"{prefix}/{n}", "type": "step_completed", "global_step": n}


def post(proc: TqmonProcess, body: object) -> httpx.Response:
    return httpx.post(proc.url + "/api/v1/events", json=body, timeout=10)


def serve_once(state_dir: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``tqmon serve`` expected to exit by itself (refused): its exit code and output."""
    command = [sys.executable, "-m", "tqmon.cli", "serve", "--listen", "127.0.0.1:1", "--state-dir", str(state_dir)]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, check=False)


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# ---------------------------------------------------------------- one writer per state dir


def test_a_second_instance_on_the_same_dir_exits_at_once_naming_the_holder(tqmon_factory: Factory) -> None:
    first = tqmon_factory().start()
    assert first.proc is not None
    started = time.monotonic()
    result = serve_once(first.state_dir)
    assert time.monotonic() - started < 15
    assert result.returncode == 1
    [line] = error_lines(result)
    assert str(first.state_dir) in line and f"PID {first.proc.pid}" in line and "Traceback" not in result.stderr
    assert httpx.get(first.url + "/healthz", timeout=5).status_code == 200  # the holder is untouched


def test_kill_9_leaves_no_stale_lock(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    assert post(proc, step(1)).status_code == 200
    proc.kill(signal.SIGKILL)
    restarted = proc.start()  # the kernel dropped the dead holder's lock
    status = httpx.get(restarted.url + "/api/v1/status", timeout=5).json()
    assert status["trainer_step"] == 1


# ---------------------------------------------------------------- corrupt, foreign, older, newer


def test_a_corrupt_state_file_is_refused_in_one_line_and_recovered_with_recover(
    tqmon_factory: Factory, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    garbage = b"SQLite format 3\x00" + os.urandom(3000)  # a truncated, damaged copy
    (state / DB_NAME).write_bytes(garbage)
    result = serve_once(state)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = error_lines(result)
    assert str(state / DB_NAME) in line and "--recover" in line

    log = tmp_path / "trainer.log"
    log.write_text("INFO:2026-01-01 00:00:00,000:Resuming from /c/global_step_7, setting global step to 7\n")
    proc = tqmon_factory(["--recover", "--log", str(log), "--log-interval", "0.1"]).start()
    aside = [p for p in state.iterdir() if p.name.startswith(f"{DB_NAME}.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == garbage  # moved, never deleted
    deadline = time.monotonic() + 15
    while httpx.get(proc.url + "/api/v1/status", timeout=5).json()["records_total"] != 1:
        assert time.monotonic() < deadline, "the log was not read again after --recover"
        time.sleep(0.1)
    record = httpx.get(proc.url + "/api/v1/status", timeout=5).json()["records"][0]
    assert record["checkpoint_step"] == 7 and record["resumed"] is True


def test_a_foreign_database_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / DB_NAME) as db:
        db.execute("CREATE TABLE grafana_dashboards (id INTEGER)")
    result = serve_once(state)
    assert result.returncode == 1
    [line] = error_lines(result)
    assert "grafana_dashboards" in line and str(state / DB_NAME) in line


def test_a_store_from_before_versioning_is_migrated_and_replayed(tqmon_factory: Factory, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with sqlite3.connect(state / DB_NAME) as db:  # exactly what tqmon 0.1 wrote, before the run binding
        db.executescript(SCHEMA_V1)
        db.execute("DROP TABLE run_binding")
        for n in (4, 5):
            body = f'{{"type":"step_completed","id":"old/{n}","global_step":{n}}}'
            db.execute(
                "INSERT INTO events (id, source, received_at, body) VALUES (?, 'events', 1.0, ?)", (f"old/{n}", body)
            )
        db.execute("INSERT INTO counters VALUES ('tqmon_events_total', 'events|applied', 2)")
    proc = tqmon_factory().start()
    status = httpx.get(proc.url + "/api/v1/status", timeout=5).json()
    assert status["trainer_step"] == 5
    assert sample_value(proc.metrics(), 'tqmon_events_total{outcome="applied",source="events"}') == 2
    assert post(proc, step(6)).json() == {"accepted": 1, "applied": 1, "duplicates": 0}
    proc.kill(signal.SIGTERM)
    with sqlite3.connect(state / DB_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert db.execute("SELECT id, type FROM events ORDER BY seq").fetchall() == [
            ("old/4", "step_completed"),
            ("old/5", "step_completed"),
            ("s/6", "step_completed"),
        ]


def test_a_v1_store_keeps_its_run_binding_through_the_migration(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    bound = {"run_id": "dapo/run_a"}
    with sqlite3.connect(state / DB_NAME) as db:  # a v1 store bound to its run (user_version 0)
        db.executescript(SCHEMA_V1)
        db.execute("INSERT INTO run_binding (id, identity) VALUES (1, ?)", (json.dumps(bound),))
    config = tmp_path / "config.yaml"
    config.write_text(
        "data: {train_batch_size: 8}\ntrainer: {project_name: dapo, experiment_name: run_b, "
        "v1: {trainer_mode: colocate_async, colocate_async: {num_warmup_batches: 3}}}\n"
    )
    result = serve_once(state, "--trainer-config", str(config))
    assert result.returncode == 2  # the migrated store still names run_a: run_b is refused, not mixed in
    [line] = [line for line in error_lines(result) if "--state-dir" in line]  # beside the migration's log line
    assert "holds the history of another run (run_id dapo/run_a)" in line and "differs in run_id" in line
    with sqlite3.connect(state / DB_NAME) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert json.loads(db.execute("SELECT identity FROM run_binding").fetchone()[0]) == bound


def test_a_store_from_a_newer_tqmon_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    StateStore(state).close()
    with sqlite3.connect(state / DB_NAME) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    result = serve_once(state, "--recover")  # --recover never moves a newer tqmon's state aside
    assert result.returncode == 1
    [line] = error_lines(result)
    assert f"schema version {SCHEMA_VERSION + 1}" in line and "newer" in line
    assert not [p for p in state.iterdir() if ".corrupt-" in p.name]


# ---------------------------------------------------------------- the disk fails under a running tqmon


@pytest.fixture
def on_tmpfs(tqmon_factory: Factory) -> Iterator[TqmonProcess]:
    """tqmon whose state dir is a 2 MiB tmpfs in its own mount namespace, so the test can fill it or
    remount it read-only (``nsenter``) without touching the machine's mounts."""
    if not can_mount_privately():
        pytest.skip("needs util-linux unshare/nsenter and the right to create a mount namespace (root)")
    proc = tqmon_factory()
    proc.state_dir.mkdir(parents=True)
    proc.wrap = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs -o size=2m tqmon-state "$0" && exec "$@"',
        str(proc.state_dir),
    ]
    proc.start()
    yield proc


def in_namespace(proc: TqmonProcess, *command: str, check: bool = True) -> None:
    assert proc.proc is not None
    subprocess.run(["nsenter", "-t", str(proc.proc.pid), "-m", "--", *command], check=check, capture_output=True)


def on_disk(proc: TqmonProcess, query: str) -> list[list[Any]]:
    """Rows of the state file as another process sees it in tqmon's mount namespace."""
    assert proc.proc is not None
    script = (
        "import json, sqlite3, sys; print(json.dumps(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchall()))"
    )
    command = ["nsenter", "-t", str(proc.proc.pid), "-m", "--", sys.executable, "-c", script]
    result = subprocess.run(
        [*command, str(proc.state_dir / DB_NAME), query], capture_output=True, text=True, check=True
    )
    rows: list[list[Any]] = json.loads(result.stdout)
    return rows


def readyz(proc: TqmonProcess) -> tuple[int, dict[str, Any]]:
    response = httpx.get(proc.url + "/readyz", timeout=5)
    return response.status_code, response.json()


def assert_refused_while_broken(proc: TqmonProcess, reason: str, first: int) -> None:
    """Events get 503 (never a 2xx for what is not on disk), /metrics and /readyz say why."""
    refused = post(proc, [step(first), step(first + 1)])
    assert refused.status_code == 503 and refused.json()["reason"] == "state_unavailable"
    assert reason in refused.json()["detail"]
    code, body = readyz(proc)
    assert code == 503 and any(p.startswith("state: ") and reason in p for p in body["problems"]), body
    metrics = proc.metrics()
    assert sample_value(metrics, "tqmon_state_writable") == 0
    assert (sample_value(metrics, f'tqmon_state_write_failures_total{{reason="{reason}"}}') or 0) >= 1
    assert sample_value(metrics, 'tqmon_events_rejected_total{reason="state_unavailable"}') == 1
    # What tqmon held before the failure is still served from memory.
    assert httpx.get(proc.url + "/api/v1/status", timeout=5).json()["trainer_step"] == first - 1


def wait_writable(proc: TqmonProcess) -> None:
    deadline = time.monotonic() + 10
    while sample_value(proc.metrics(), "tqmon_state_writable") != 1:
        assert time.monotonic() < deadline, "state writes did not resume"
        time.sleep(0.2)


def test_a_full_state_dir_refuses_events_and_resumes_when_space_returns(on_tmpfs: TqmonProcess) -> None:
    proc = on_tmpfs
    assert post(proc, step(1)).status_code == 200
    # dd stops at ENOSPC (and says so): the tmpfs is then full.
    in_namespace(proc, "dd", "if=/dev/zero", f"of={proc.state_dir}/filler", "bs=64k", check=False)
    assert_refused_while_broken(proc, "no_space", 2)
    in_namespace(proc, "rm", f"{proc.state_dir}/filler")
    wait_writable(proc)  # probed while idle: no event needed to notice
    assert readyz(proc)[0] == 200
    assert post(proc, [step(2), step(3)]).json() == {"accepted": 2, "applied": 2, "duplicates": 0}
    assert on_disk(proc, "SELECT id FROM events ORDER BY seq") == [["s/1"], ["s/2"], ["s/3"]]
    # The refusal counted while the disk was full reached the disk once it came back.
    rejected = f"SELECT value FROM counters WHERE name = '{Tally.EVENTS_REJECTED}' AND labels = 'state_unavailable'"
    assert on_disk(proc, rejected) == [[1]]


def test_a_read_only_state_dir_refuses_events_and_resumes_with_its_history(on_tmpfs: TqmonProcess) -> None:
    proc = on_tmpfs
    assert post(proc, step(1)).status_code == 200
    # Linux refuses to remount a filesystem read-only while tqmon holds files open for writing, so the
    # state tmpfs is detached and a read-only one takes its place: the path now refuses writes (EROFS).
    in_namespace(proc, "umount", "-l", str(proc.state_dir))
    in_namespace(proc, "mount", "-t", "tmpfs", "-o", "ro,size=2m", "tqmon-ro", str(proc.state_dir))
    assert_refused_while_broken(proc, "read_only", 2)
    in_namespace(proc, "mount", "-o", "remount,rw", str(proc.state_dir))
    wait_writable(proc)
    assert post(proc, step(2)).status_code == 200
    assert on_disk(proc, "SELECT id FROM events ORDER BY seq") == [["s/1"], ["s/2"]]


def test_a_deleted_state_dir_is_recreated_with_everything_it_held(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    assert post(proc, [step(1), step(2)]).status_code == 200
    shutil.rmtree(proc.state_dir)
    assert post(proc, step(3)).status_code == 200  # written to a recreated file, not to the unlinked one
    assert (proc.state_dir / DB_NAME).exists() and (proc.state_dir / "tqmon.lock").exists()
    # The recreated dir is locked again: no second writer slips in.
    assert serve_once(proc.state_dir).returncode == 1
    proc.kill(signal.SIGKILL)
    restarted = proc.start()
    assert httpx.get(restarted.url + "/api/v1/status", timeout=5).json()["trainer_step"] == 3
    assert post(restarted, [step(1), step(2), step(3)]).json()["duplicates"] == 3


# ---------------------------------------------------------------- retention


def resume_events(n: int, at: float) -> list[dict[str, Any]]:
    """One resume from global_step_n (its log-equivalent events) and its first step."""
    return [
        {"id": f"start/{n}", "type": "training_started", "time": at, "resumed_from_step": n},
        {"id": f"restore/{n}", "type": "checkpoint_restored", "time": at + 1, "step": n, "restored_prompt_groups": 4},
        {"id": f"warmup/{n}", "type": "warmup_decided", "time": at + 2, "submitted_prompt_groups": 8},
        {"id": f"first/{n}", "type": "step_completed", "time": at + 3, "global_step": n + 1},
    ]


def test_retention_bounds_the_store_and_keeps_what_the_fold_needs(tmp_path: Path) -> None:
    now = [1_000_000.0]
    store = StateStore(tmp_path / "state")
    tracker = Tracker(store, clock=lambda: now[0])
    run = {"id": "run", "type": "run_started", "run_id": "r", "trainer_mode": "colocate_async"}
    tracker.ingest([parse_event(run | {"config": {"train_batch_size": 4, "num_warmup_batches": 3}})], "events")
    for resume in range(12):  # 12 resumes, 200 steps after each
        base = 1000 * resume
        at = now[0]
        tracker.ingest([parse_event(e) for e in resume_events(base, at)], "events")
        tracker.ingest([parse_event(step(base + k, "bulk")) for k in range(2, 202)], "events")
        now[0] += 7200.0
    assert store.stored_events() == 1 + 12 * (4 + 200)
    records_before = tracker.snapshot.records
    assert tracker.snapshot.resumes_total == 12

    retention = Retention(tracker, store, RetentionPolicy(records=5, days=365), clock=lambda: now[0])
    deleted = retention.prune()
    # Kept: the 5 retained records' 4 events each; what their cost reads from before each start: the last step
    # (a bulk step) and the latest trainer time (the previous start's first step, timed 3 s after its start:
    # evidence of a kept record but for the oldest); the 10 newest steps; the run config.
    assert store.stored_events() == 5 * 4 + 5 + 1 + 10 + 1
    assert deleted == 1 + 12 * 204 - (5 * 4 + 5 + 1 + 10 + 1)
    assert retention.prune() == 0  # idempotent, and the dropped resumes are not counted twice
    store.close()

    store = StateStore(tmp_path / "state")
    restarted = Tracker(store, clock=lambda: now[0])
    restarted.replay()
    kept = restarted.snapshot.records
    assert [r.checkpoint_step for r in kept] == [r.checkpoint_step for r in records_before[-5:]]
    assert [(r.restored, r.submitted, r.first_step_evictions, r.cost) for r in kept] == [
        (r.restored, r.submitted, r.first_step_evictions, r.cost) for r in records_before[-5:]
    ]
    assert [r.cost.downtime_seconds for r in kept] == [7197.0] * 5  # the latest trainer time before each, kept
    assert restarted.snapshot.resumes_total == 12  # a counter never goes down because history was pruned
    assert restarted.snapshot.trainer_step == tracker.snapshot.trainer_step == 11_201
    assert restarted.snapshot.run is not None and restarted.snapshot.run.run_id == "r"
    store.close()


def test_retention_by_age_keeps_the_latest_start_and_young_events(tmp_path: Path) -> None:
    now = [5_000_000.0]
    store = StateStore(None)
    tracker = Tracker(store, clock=lambda: now[0])
    tracker.ingest([parse_event(e) for e in resume_events(10, now[0])], "events")
    now[0] += 40 * 86400.0
    tracker.ingest([parse_event(e) for e in resume_events(20, now[0])], "events")
    # The steps after it (22 on: steps no newer than the resumed-from 20 would be counted twice, a regression
    # whose evidence retention keeps).
    tracker.ingest([parse_event(step(22 + k, "young")) for k in range(30)], "events")
    retention = Retention(tracker, store, RetentionPolicy(records=100, days=30), clock=lambda: now[0])
    # The 40-day-old start but its first step (the last step before the latest start: its cost reads it);
    # everything younger than an hour stays.
    assert retention.prune() == 3
    now[0] += 2 * 86400.0
    assert retention.prune() == 20  # now the bulk steps, but never the latest start's evidence
    assert store.stored_events() == 4 + 10 + 1


def test_dead_cursors_of_rotated_away_files_are_pruned(tmp_path: Path) -> None:
    store = StateStore(None)
    gone, alive = tmp_path / "gone.log", tmp_path / "alive.log"
    alive.write_text("")
    cursors = [(f"log:{gone}", {"offset": 1}), (f"log:{alive}", {"offset": 2}), ("tq:controller", {"epochs": 3})]
    store.commit((), cursors=cursors)
    Retention(Tracker(store), store, RetentionPolicy()).prune()
    assert sorted(store.cursor_keys()) == sorted([f"log:{alive}", "tq:controller"])
