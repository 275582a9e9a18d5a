"""tqmon's load on the TransferQueue controller measured against verl's own, on a real TQ with 1k-100k keys.

Run with ``.venv/bin/python bench/bench_verl_share.py [--sizes 1000,10000,100000] [--seconds 40]``. This
process plays the trainer: a local Ray cluster and a real TQ (``tq.init``), partition ``train`` filled with
verl-shaped keys (``bench_tq_poll.key_and_tag``), and verl 0.9.1's real ``ReplayBufferAsync`` running its
sync loop as ``wait_for_sampleable`` does while it waits: ``get_sampleable_count`` (one
``_sync_metadata_from_transfer_queue``, i.e. one ``tq.kv_list()`` of everything), then ``poll_interval``
(verl's default, 2 s). At each size, three phases of ``--seconds`` each, side by side in one run:

- ``verl alone``: the sync loop and nothing else;
- ``+ tqmon poll``: a ``tqmon serve --ray-address`` subprocess with its defaults (1% budget, 15 s steady
  interval; ``--tq-fast-period 0``, so the steady state is measured rather than the 5 minutes of fast polling
  after it finds a controller);
- ``+ tqmon plugin``: the same tqmon with the verl plugin's ``WindowReporter`` watching the replay buffer
  (the window from verl's own sync); measured once tqmon has switched to its 10-minute cross-check.

The controller's busy share is its process CPU time (``/proc/<pid>/stat`` utime + stime, 10 ms ticks) over the
phase; ``- idle`` subtracts the idle controller's (measured first, with the put probe running); tqmon's share is
the phase's minus ``verl alone``'s (at 1k keys both are within a few ticks: noise), next to tqmon's own estimate
of its share (``tqmon_tq_controller_busy_ratio``: measured ``kv_list`` cost over its interval). tqmon's
``kv_list`` calls are counted from its TQ source's successes (``/api/v1/status`` read 4 times a second).
Meanwhile the trainer's 1-tag ``kv_batch_put`` (a status update, verl's most frequent TQ call) is timed
10 times a second: its p95 per phase.

A phase is too short to see tqmon's sparse polls in the controller's CPU time (at 100k keys the 1% budget
polls about once a minute, and a tick is 10 ms), so each size also starts with a calibration: the controller's
CPU time per verl sync and per tqmon ``kv_list``, from calls back to back. Shares are then CPU per call times
calls per second, at the rates measured in the phases (verl: one sync per ``poll_interval`` after the previous
returned; tqmon: the interval it chose, or its cross-check with the plugin).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1; before ray is imported

import bench_tq_poll
import httpx
from bench_service import percentile, table
from bench_tq_poll import STEP, Trainer, close_cluster

DEFAULT_SIZES = (1_000, 10_000, 100_000)
POLL_INTERVAL = 2.0  # verl's ReplayBuffer default poll_interval
PUT_EVERY = 0.1  # seconds between the trainer's 1-tag puts
STATUS_EVERY = 0.25  # seconds between reads of tqmon's status (to count its polls)
START_TIMEOUT = 180.0
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Phase:
    """One measured phase: the controller's CPU share, tqmon's polls, the puts, verl's syncs."""

    name: str
    seconds: float = 0.0
    controller_cpu: float = 0.0
    puts: list[float] = field(default_factory=list)
    syncs: list[float] = field(default_factory=list)  # seconds per verl sync (kv_list + verl's own loop)
    tqmon_polls: int | None = None
    tqmon_estimate: float | None = None  # tqmon's own busy-ratio estimate for its polling (cost / interval)
    tqmon_interval: float | None = None  # the poll interval tqmon chose (the cross-check's, with the plugin)
    plugin_posts: int | None = None

    @property
    def share(self) -> float:
        return self.controller_cpu / self.seconds


class Background:
    """A loop on a thread until stopped: the sync loop, the put probe, the status reader."""

    def __init__(self, body: Callable[[], None], every: float) -> None:
        self._stop = threading.Event()
        self._body, self._every = body, every
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._body()
            self._stop.wait(self._every)

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def replay_buffer() -> Any:
    """verl 0.9.1's ReplayBufferAsync as the trainer builds it by default (colocate_async, drop at 8)."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    return ReplayBufferAsync(
        trainer_mode="colocate_async",
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=POLL_INTERVAL,
    )


class Tqmon(bench_tq_poll.Tqmon):
    """``tqmon serve --ray-address`` with its default polling, as a subprocess."""

    def __init__(self, gcs: str, workdir: Path) -> None:
        super().__init__(gcs, workdir, ("--tq-fast-period", "0", "--tq-timeout", "30"))
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.successes: set[float] = set()

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = self.http.get("/api/v1/status").json()
        return body

    def count_polls(self) -> None:
        """Remember the TQ source's last success: each distinct value is one kv_list poll."""
        try:
            tq = next((s for s in self.status()["sources"] if s["source"] == "tq"), None)
        except httpx.HTTPError:
            return
        if tq is not None and tq["last_success"] is not None:
            self.successes.add(tq["last_success"])

    def wait_for(self, ready: Callable[[dict[str, Any]], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tqmon exited with {self.proc.returncode}: {self.out.read_text()[-2000:]}")
            try:
                if ready(self.status()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"tqmon never {what}: {self.out.read_text()[-2000:]}")

    def stop(self) -> None:
        self.http.close()
        super().stop()


@contextmanager
def tqmon_running(gcs: str, workdir: Path) -> Iterator[Tqmon]:
    tqmon = Tqmon(gcs, workdir)
    try:
        tqmon.wait_for(lambda s: s["tq"] is not None and s["tq"]["reply_keys"] is not None, "polled TransferQueue")
        yield tqmon
    finally:
        tqmon.stop()


def measure(trainer: Trainer, buffer: Any | None, name: str, seconds: float, tqmon: Tqmon | None = None) -> Phase:
    """One phase: verl's sync loop (without a buffer: the idle controller), the put probe and, with tqmon,
    its poll counter."""
    phase = Phase(name)
    put = trainer.probes()["trainer kv_batch_put (1 tag)"]

    def sync() -> None:
        started = time.perf_counter()
        assert buffer is not None
        buffer.get_sampleable_count(STEP, "train")
        phase.syncs.append(time.perf_counter() - started)

    def probe() -> None:
        started = time.perf_counter()
        put()
        phase.puts.append(time.perf_counter() - started)

    loops = [Background(probe, PUT_EVERY)]
    if buffer is not None:
        loops.append(Background(sync, POLL_INTERVAL))
    if tqmon is not None:
        loops.append(Background(tqmon.count_polls, STATUS_EVERY))
    if tqmon is not None:
        tqmon.count_polls()  # the poll before the phase is not the phase's
    polls_before = len(tqmon.successes) if tqmon is not None else 0
    cpu, started = cpu_seconds(trainer.controller_pid), time.monotonic()
    with ExitStack() as running:
        for loop in loops:
            running.enter_context(loop)
        time.sleep(seconds)
    phase.seconds = time.monotonic() - started
    phase.controller_cpu = cpu_seconds(trainer.controller_pid) - cpu
    if tqmon is not None:
        tqmon.count_polls()
        phase.tqmon_polls = len(tqmon.successes) - polls_before
        poll = tqmon.status()["tq"]
        phase.tqmon_estimate, phase.tqmon_interval = poll["busy_ratio"], poll["interval"]
    return phase


def plugin_phase(trainer: Trainer, workdir: Path, seconds: float) -> Phase:
    """verl's buffer watched by the plugin's WindowReporter, posting to a tqmon in cross-check mode."""
    from tqmon.integrations.poster import EventPoster
    from tqmon.integrations.verl import watch_replay_buffer
    from tqmon.integrations.window import WindowReporter

    buffer = replay_buffer()
    with tqmon_running(trainer.gcs, workdir) as tqmon:
        reporter = WindowReporter(EventPoster(tqmon.url), "bench/plugin")
        assert watch_replay_buffer(buffer, reporter)
        buffer.get_sampleable_count(STEP, "train")  # the first sync feeds the window
        tqmon.wait_for(lambda s: bool(s["tq"] and s["tq"]["cross_check"]), "switched to its cross-check")
        phase = measure(trainer, buffer, "+ tqmon plugin (cross-check)", seconds, tqmon)
        phase.plugin_posts = reporter.posted
    return phase


@dataclass(frozen=True)
class Calibration:
    """Controller CPU seconds per call, each from calls back to back on a quiet controller (minus idle)."""

    verl_sync: float
    tqmon_kv_list: float
    calls: int


def calibrate(trainer: Trainer, buffer: Any, size: int) -> Calibration:
    """What one verl sync and one tqmon poll cost the controller: its CPU time over ``calls`` of each (enough
    for many 10 ms ticks at every size), minus what the idle controller burns in the same time."""
    from tqmon.sources.tq import ControllerClient

    calls = max(5, min(500, 2_000_000 // size))
    client = ControllerClient(trainer.gcs, 120.0)
    client.find()
    try:
        idle = controller_cpu_during(trainer, lambda: time.sleep(2.0)) / 2.0

        def per_call(call: Callable[[], object]) -> float:
            started = time.monotonic()
            cpu = controller_cpu_during(trainer, lambda: [call() for _ in range(calls)])
            return max(0.0, cpu - idle * (time.monotonic() - started)) / calls

        verl = per_call(lambda: buffer.get_sampleable_count(STEP, "train"))
        tqmon = per_call(lambda: client.kv_list(120.0))
    finally:
        client.close()
    return Calibration(verl, tqmon, calls)


def controller_cpu_during(trainer: Trainer, work: Callable[[], object]) -> float:
    cpu = cpu_seconds(trainer.controller_pid)
    work()
    return cpu_seconds(trainer.controller_pid) - cpu


def run_size(trainer: Trainer, size: int, workdir: Path, seconds: float) -> tuple[list[Phase], Calibration]:
    trainer.grow_to(size)
    buffer = replay_buffer()
    calibration = calibrate(trainer, buffer, size)
    phases = [measure(trainer, None, "controller idle", seconds)]
    phases.append(measure(trainer, buffer, "verl alone", seconds))
    with tqmon_running(trainer.gcs, workdir) as tqmon:
        phases.append(measure(trainer, buffer, "+ tqmon poll (1% budget)", seconds, tqmon))
    phases.append(plugin_phase(trainer, workdir, seconds))
    return phases, calibration


def size_table(size: int, phases: list[Phase], calibration: Calibration) -> str:
    idle, verl = phases[0], phases[1]
    verl_share = verl.share - idle.share
    rows = []
    for phase in phases:
        added = phase.share - verl.share if phase.tqmon_polls is not None else None
        rows.append(
            [
                phase.name,
                f"{100 * phase.share:.2f}",
                f"{100 * (phase.share - idle.share):.2f}" if phase is not idle else "-",
                f"{100 * added:+.2f}" if added is not None else "-",
                f"{added / verl_share:+.1%}" if added is not None and verl_share > 0 else "-",
                "-" if phase.tqmon_polls is None else str(phase.tqmon_polls),
                "-" if phase.tqmon_estimate is None else f"{100 * phase.tqmon_estimate:.3f}",
                f"{1e3 * statistics.median(phase.syncs):,.1f}" if phase.syncs else "-",
                f"{1e3 * percentile(phase.puts, 95):,.2f}" if len(phase.puts) >= 20 else "-",
            ]
        )
    header = ["phase", "ctrl CPU %", "- idle %", "tqmon %", "of verl's", "tqmon polls", "tqmon est. %"]
    header += ["verl sync ms", "put p95 ms"]
    sync = statistics.median(verl.syncs)
    polled, fed = phases[2], phases[3]
    # Controller CPU per call times calls per second: verl syncs every poll_interval after its sync returns,
    # tqmon every interval it chose (with the plugin: every cross-check).
    verl_rate = calibration.verl_sync / (sync + POLL_INTERVAL)
    poll_rate = calibration.tqmon_kv_list / (polled.tqmon_interval or float("inf"))
    fed_rate = calibration.tqmon_kv_list / (fed.tqmon_interval or float("inf"))
    notes = (
        f"controller CPU per call ({calibration.calls} calls each): verl sync {1e3 * calibration.verl_sync:.2f} ms, "
        f"tqmon kv_list {1e3 * calibration.tqmon_kv_list:.2f} ms\n"
        f"controller share = CPU per call x calls per second: verl {100 * verl_rate:.3f}% (a sync every "
        f"{sync + POLL_INTERVAL:.2f} s); tqmon without the plugin {100 * poll_rate:.4f}% (every "
        f"{polled.tqmon_interval or 0:.1f} s) = {poll_rate / verl_rate:.1%} of verl's; with the plugin "
        f"{100 * fed_rate:.5f}% (a cross-check every {fed.tqmon_interval or 0:.0f} s) = {fed_rate / verl_rate:.2%}\n"
        f"{phases[-1].plugin_posts} plugin window posts; phases of {phases[1].seconds:.0f} s"
    )
    return table(f"{size:,} keys in train (verl's sync every {POLL_INTERVAL:g} s)", header, rows) + notes + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated key counts")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    args = parser.parse_args()
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))
    print(f"sizes {sizes}; {os.cpu_count()} CPUs; phases of {args.seconds:g} s", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="tqmon-bench-share-") as name:
            trainer = Trainer(max(sizes))
            for size in sizes:
                print(size_table(size, *run_size(trainer, size, Path(name), args.seconds)), flush=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", flush=True)
    finally:
        close_cluster()


if __name__ == "__main__":
    main()
