"""Faults of the fault matrix (docs/reliability.md) not covered elsewhere: a hung TransferQueue controller
(SIGSTOP of its actor process on a real local Ray cluster), a checkpoint dir whose read stalls, and a
trainer clock skewed against tqmon's."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import TqmonProcess, sample_value
from tests.test_fuzz import REAL_PICKLE, checkpoint_dir
from tests.test_tq_source import FAST, cluster, fill_window, tq_init, wait_for
from tqmon.sources.logfile import LogSource
from tqmon.store import StateStore
from tqmon.tracker import Tracker

Factory = Callable[..., TqmonProcess]
TQ_TIMEOUT = float(FAST[FAST.index("--tq-timeout") + 1])
__all__ = ["cluster"]  # the module-scoped Ray cluster fixture, shared with tests/test_tq_source.py


def controller_pid() -> int:
    import ray

    handle = ray.get_actor("TransferQueueController", namespace="transfer_queue")
    pid: Any = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
    return int(pid)


def shows(series: str, expected: float, exposition: str) -> bool:
    return sample_value(exposition, series) == expected


def max_latency(url: str, seconds: float) -> float:
    worst = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.1)
    return worst


def test_a_hung_controller_times_out_boundedly_and_recovers_on_sigcont(cluster: str, tqmon_factory: Factory) -> None:
    tq = tq_init()
    try:
        fill_window(tq)
        proc = tqmon_factory([*FAST, "--ray-address", cluster]).start()
        pending = 'tqmon_window_prompt_groups{partition="train",status="pending"}'
        wait_for(proc, lambda text: sample_value(text, pending) == 2, timeout=60)
        pid = controller_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            down = wait_for(proc, lambda text: sample_value(text, 'tqmon_source_up{source="tq"}') == 0, timeout=30)
            took_down = time.monotonic() - stopped
            assert sample_value(down, pending) is None  # a hung controller's last window is not served as live
            worst = max_latency(proc.url, 6.0)  # tqmon keeps serving while its poller waits
            timeouts = sample_value(proc.metrics(), 'tqmon_source_errors_total{reason="timeout",source="tq"}') or 0
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        wait_for(proc, lambda text: sample_value(text, 'tqmon_source_up{source="tq"}') == 1, timeout=60)
        back = wait_for(proc, lambda text: sample_value(text, pending) == 2, timeout=30)
        took_back = time.monotonic() - resumed
        # Bounded: down within the poll's own timeouts (lookup + kv_list + the poll interval), never hanging.
        assert took_down < 4 * TQ_TIMEOUT + 5, took_down
        assert worst < 1.0, worst
        # One call in flight at most: each failed poll waited its timeout, so the count stays near
        # (time stopped) / (timeout), not (time stopped) / (fastest interval).
        assert 1 <= timeouts <= (time.monotonic() - stopped) / TQ_TIMEOUT + 2, timeouts
        assert took_back < 20, took_back
        assert sample_value(back, 'tqmon_window_prompt_groups{partition="train",status="failure"}') == 1
    finally:
        tq.close()


def test_a_stalled_checkpoint_read_stops_only_the_checkpoint_source(tmp_path: Path, tqmon_factory: Factory) -> None:
    """controller_state.pkl on storage that stalls: a FIFO blocks its reader until someone writes it."""
    root = checkpoint_dir(tmp_path / "ckpt", b"")
    pkl = root / "global_step_2" / "transfer_queue" / "controller_state.pkl"
    pkl.unlink()
    os.mkfifo(pkl)
    log = tmp_path / "trainer.log"
    log.write_text("")
    proc = tqmon_factory(
        ["--checkpoint-dir", str(root), "--checkpoint-interval", "0.2", "--log", str(log), "--log-interval", "0.1"]
    ).start()
    try:
        time.sleep(1.0)  # the checkpoint poll is now blocked in open()
        pending = 'tqmon_window_prompt_groups{partition="train",status="pending"}'
        for step in range(3):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S,000", time.gmtime())
            with log.open("a") as out:
                out.write(f"INFO:{stamp}:pending: {step}, running: 1, finished: 2, failure: 0\n")
            text = wait_for(proc, functools.partial(shows, pending, float(step)))
            assert sample_value(text, 'tqmon_source_up{source="log"}') == 1
        assert max_latency(proc.url, 1.0) < 1.0
        status = httpx.get(proc.url + "/api/v1/status", timeout=5).json()
        assert status["checkpoint"] is None  # nothing read, nothing invented
    finally:
        # The storage comes back: the blocked read gets its bytes (a FIFO has no size, so this read is
        # refused), then the file is a regular one again and the next poll reads it.
        def unblock() -> None:
            with open(pkl, "wb") as writer:
                writer.write(REAL_PICKLE)

        writer = threading.Thread(target=unblock, daemon=True)
        writer.start()
        writer.join(timeout=10)
        pkl.unlink()
        pkl.write_bytes(REAL_PICKLE)
    wait_for(proc, lambda t: sample_value(t, "tqmon_checkpoint_step") == 2, timeout=30)
    assert sample_value(proc.metrics(), 'tqmon_source_up{source="checkpoint"}') == 1


def skewed_log(path: Path, skew: float) -> None:
    """A resume and a window, written with the trainer's clock ``skew`` seconds off tqmon's."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S,000", time.gmtime(time.time() + skew))
    path.write_text(
        f"INFO:{stamp}:Resuming from /c/global_step_4, setting global step to 4\n"
        f"INFO:{stamp}:pending: 3, running: 1, finished: 0, failure: 0\n"
    )


def run_log(tmp_path: Path, skew: float) -> tuple[Tracker, float]:
    log = tmp_path / f"trainer{skew:+.0f}.log"
    skewed_log(log, skew)
    tracker = Tracker(StateStore(None))
    before = time.time()
    LogSource([str(log)], tracker).poll()
    return tracker, before


def test_a_trainer_clock_ahead_never_makes_data_look_newer_than_its_arrival(tmp_path: Path) -> None:
    tracker, before = run_log(tmp_path, skew=3600.0)
    snapshot = tracker.snapshot
    assert snapshot.trainer_last_event is not None and before <= snapshot.trainer_last_event <= time.time()
    [window] = snapshot.fresh_windows(time.time())
    assert window.observed_at <= time.time()
    # The record keeps what the trainer said (the log is the evidence), whatever tqmon's clock reads.
    [record] = tracker.snapshot.records
    assert record.started_at > time.time() + 3000


def test_a_trainer_clock_behind_ages_its_data_by_the_skew(tmp_path: Path) -> None:
    small, _ = run_log(tmp_path, skew=-60.0)  # within --stale-after (300 s): still served
    assert len(small.snapshot.fresh_windows(time.time())) == 1
    large, _ = run_log(tmp_path, skew=-3600.0)  # an hour behind: indistinguishable from an old log line
    assert large.snapshot.fresh_windows(time.time()) == ()
    last: Any = large.snapshot.trainer_last_event
    assert time.time() - last > 3500
