"""Benchmark of the live TransferQueue poller against a real TQ holding 1k to 1M verl-shaped keys.

Run with ``.venv/bin/python bench/bench_tq_poll.py [--sizes 1000,10000,100000,1000000]``. This process
plays the trainer: it starts a local Ray cluster and a real TQ (``tq.init``), then grows partition
``train`` to each size in turn (one third prompt keys with a pending/running/finished/failure mix, the
rest ``{uid}_{session}_{i}`` trajectory keys, 1 in 20 of them orphans), tags only: ``kv_batch_put``
without fields registers new keys with their tags and never touches a storage unit. At each size:

- ``kv_list`` call time through tqmon's read-only ``ControllerClient`` (what the poller calls) and the
  trainer's ``tq.kv_list`` (what verl's ``_count_tq_prompt_groups`` calls), taking turns;
- tqmon's full aggregation (``windows_from``: both partitions, every status, ages, orphans) against a bare
  prompt count like verl's on the same reply (issue 15 target: at most 3x), with ``--baseline REV`` also the
  aggregation of git revision ``REV`` (its ``tqmon/composition.py``) on the same reply, and its profile: the
  classification pass (prompt groups by status and step, each prompt key with whether it is in flight,
  trajectory keys collected) and the trajectory attribution pass (each trajectory key split and its uid
  looked up among the prompt keys: orphans and in-flight);
- what the default 1% budget makes of the measured cost: the interval ``PollBudget`` picks and its busy share;
- a real ``tqmon serve --ray-address`` subprocess polling flat out (``--tq-budget 1``, 0.5 s interval):
  ``GET /metrics`` latency once it has read the whole window (target: 1M within 1.2x of 1k), its RSS,
  and the trainer-visible stall of a small TQ call while it polls compared with the idle controller;
  both series are spread evenly over two poll cycles, so they see tqmon mid-poll as often as asleep.

Sizes that do not fit the machine are skipped with the limit that was hit, and the run goes on.
Ctrl-C (or any error) still closes TQ, shuts Ray down and stops the tqmon subprocess.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1; before ray is imported

import httpx
from aggregation import Aggregation, aggregation_of, bare_count, composition_at
from bench_service import free_port, percentile, stop_process, table

from tqmon.composition import attribute, classify_keys
from tqmon.sim.rollout import trajectory_tag
from tqmon.sources.tq import ControllerClient, PollBudget, PollSettings, windows_from

DEFAULT_SIZES = (1_000, 10_000, 100_000, 1_000_000)
PUT_CHUNK = 10_000  # keys per kv_batch_put while filling
STEP = 40  # the newest global_steps in the window; ages run 0..11 below it
SCRAPES = 200
WARMUP_SCRAPES = 20
PROBES = 40  # small trainer TQ calls per stall measurement
MIN_SPAN = 2.0  # seconds a latency series is spread over at least (see ``poll_cycles``)
PHASE_LIMIT = 120.0  # seconds any one latency series may take; fewer samples are reported if it is hit
CALL_TIMEOUT = 120.0  # a 1M kv_list takes seconds; the poller's default --tq-timeout (5 s) is not the point here
START_TIMEOUT = 120.0
MEMORY_MARGIN = 2 << 30  # bytes left to the other users of the machine
STATUSES = ("pending", "pending", "running", "finished", "finished", "finished", "finished", "finished", "finished")
VAL_KEYS = [uuid.UUID(int=10**12 + i).hex for i in range(4)]  # the stall probes' own tiny partition


def repeats(size: int) -> int:
    """Calls per timing series: enough for a p95 at small sizes, affordable at 1M (where p95 ~ max)."""
    return 21 if size <= 100_000 else 7


def uid(group: int) -> str:
    return uuid.UUID(int=group + 1).hex  # uuid4-like hex, never contains "_"


def prompt_tag(group: int) -> dict[str, Any]:
    status = "failure" if group % 10 == 9 else STATUSES[group % 10]
    return {"is_prompt": True, "status": status, "global_steps": STEP - group % 12}


def key_and_tag(index: int) -> tuple[str, dict[str, Any]]:
    """Key ``index`` of the window: groups of three, a prompt and its two trajectories, so growing the
    window from one size to the next only adds keys. Every 20th group's second trajectory is an orphan."""
    group, role = divmod(index, 3)
    if role == 0:
        return uid(group), prompt_tag(group)
    owner = uid(10**9 + group) if role == 2 and group % 20 == 0 else uid(group)
    g = STEP - group % 12
    return f"{owner}_0_{role - 1}", trajectory_tag(g, g, g + 1)


def grow(tq: Any, start: int, stop: int) -> None:
    for low in range(start, stop, PUT_CHUNK):
        keys, tags = zip(*(key_and_tag(i) for i in range(low, min(low + PUT_CHUNK, stop))), strict=True)
        tq.kv_batch_put(keys=list(keys), partition_id="train", tags=list(tags))


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def series(call: Callable[[], object], count: int, span: float = 0.0) -> list[float]:
    """Seconds per call, the calls started evenly over ``span`` seconds (back to back if they take longer),
    stopping early at ``PHASE_LIMIT``."""
    samples: list[float] = []
    started = time.monotonic()
    while len(samples) < count and time.monotonic() - started < PHASE_LIMIT:
        time.sleep(max(0.0, started + len(samples) * span / count - time.monotonic()))
        samples.append(timed(call))
    return samples


def poll_cycles(kv_list_seconds: float) -> float:
    """Two poll cycles of the flat-out tqmon (a kv_list, then the interval: the 0.5 s floor or the cost, as
    ``--tq-budget 1`` allows): a series spread over them samples every phase of a poll, as a Prometheus
    scrape or a trainer call arriving at a random time would, instead of fitting into one sleep."""
    return max(MIN_SPAN, 2 * (kv_list_seconds + max(0.5, kv_list_seconds)))


def p95(samples: Sequence[float]) -> float:
    """The 95th percentile, or the max below 20 samples (where a p95 would be guesswork)."""
    return percentile(samples, 95) if len(samples) >= 20 else max(samples)


def ms(samples: Sequence[float]) -> tuple[str, str, str]:
    """Median, p95 and max in milliseconds."""
    median, high, top = (f"{value * 1e3:,.2f}" for value in (statistics.median(samples), p95(samples), max(samples)))
    return median, high, top


def child_of(pid: int) -> int | None:
    """tqmon's TQ poller: its child started by multiprocessing's spawn (not the resource tracker)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and b"spawn_main" in cmdline:
                return int(entry.name)
    return None


def proc_status(pid: int | None, field_name: str) -> int | None:
    """A ``/proc/<pid>/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def mib(size: int | None) -> str:
    return "n/a" if size is None else f"{size / 2**20:,.0f}"


FAST_POLLING = (
    "--tq-budget",
    "1",
    "--tq-min-interval",
    "0.5",
    "--tq-max-interval",
    "0.5",
    "--tq-timeout",
    str(CALL_TIMEOUT),
)


class Tqmon:
    """``tqmon serve --ray-address`` joining this cluster as a subprocess, polling as fast as it can (or as
    ``polling`` says)."""

    def __init__(self, gcs: str, workdir: Path, polling: Sequence[str] = FAST_POLLING) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = workdir / f"tqmon-{self.port}.out"
        command = [sys.executable, "-m", "tqmon.cli", "serve", "--listen", f"127.0.0.1:{self.port}"]
        command += ["--state-dir", str(workdir / f"state-{self.port}"), "--log-level", "warning"]
        command += ["--ray-address", gcs, *polling]
        with self.out.open("ab") as out:
            # os.environ carries RAY_AUTH_MODE=token (set by ray.init) so the subprocess may join.
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ)

    def reply_keys(self, client: httpx.Client) -> float | None:
        for line in client.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name == "tqmon_tq_reply_keys":
                return float(value)
        return None

    def wait_for_window(self, client: httpx.Client, keys: int) -> float:
        """Seconds from spawn until a poll has read all ``keys`` (startup, join, lookup and a full poll)."""
        started = time.monotonic()
        while time.monotonic() - started < START_TIMEOUT + CALL_TIMEOUT:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tqmon exited with {self.proc.returncode}: {self.out.read_text()[-2000:]}")
            try:
                if self.reply_keys(client) == keys:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"tqmon did not read {keys:,} keys in time: {self.out.read_text()[-2000:]}")

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)


@contextmanager
def tqmon_running(gcs: str, workdir: Path) -> Iterator[Tqmon]:
    tqmon = Tqmon(gcs, workdir)
    try:
        yield tqmon
    finally:
        tqmon.stop()


@dataclass
class Result:
    """Everything measured at one size; ``skipped`` says which limit stopped it."""

    size: int
    fill_seconds: float = 0.0
    client_list: list[float] = field(default_factory=list)
    trainer_list: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)
    bare: list[float] = field(default_factory=list)
    classify: list[float] = field(default_factory=list)  # windows_from's first pass over train
    attribute: list[float] = field(default_factory=list)  # its second pass, over train's trajectory keys
    baseline: list[float] = field(default_factory=list)  # windows_from with --baseline's composition module
    load: tuple[float, ...] = ()  # the machine's load average (1, 5, 15 min) right after the aggregation timings
    steady: tuple[float, float | None] = (0.0, None)  # interval chosen at 1%, busy share
    fast: tuple[float, float | None] = (0.0, None)
    span: float = 0.0  # seconds each latency series under polling was spread over
    smoothed_cost: float = 0.0  # PollBudget's view of a kv_list after all the calls above, last ones weighing most
    first_window: float = 0.0
    scrapes: list[float] = field(default_factory=list)
    metrics_bytes: int = 0
    tqmon_rss: int | None = None
    tqmon_hwm: int | None = None
    poller_rss: int | None = None  # tqmon's child that talks to Ray and aggregates the reply
    poller_hwm: int | None = None
    controller_rss: int | None = None
    footprint: int | None = None  # controller + tqmon peak + this process, for extrapolating to the next size
    stall: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # op -> (idle, polled)
    skipped: str | None = None


class Trainer:
    """The trainer side of the cluster: Ray, TQ and the keys put so far."""

    def __init__(self, capacity: int) -> None:
        import ray
        import transfer_queue as tq
        from omegaconf import OmegaConf

        context: Any = ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        self.gcs = str(context.address_info["gcs_address"])
        # Storage capacity is moot (tags-only puts never reach a storage unit) but sized as the window anyway.
        conf = {"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": capacity}}}
        tq.init(OmegaConf.create(conf))
        self.tq = tq
        self.keys = 0
        tq.kv_batch_put(keys=VAL_KEYS, partition_id="val", tags=[prompt_tag(0) for _ in VAL_KEYS])
        handle = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        pid: Any = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        self.controller_pid: int = int(pid)

    def grow_to(self, size: int) -> float:
        seconds = timed(lambda: grow(self.tq, self.keys, size))
        self.keys = size
        return seconds

    def probes(self) -> dict[str, Callable[[], object]]:
        """Small calls a trainer makes all the time: a status tag update and listing a tiny partition."""
        return {
            "trainer kv_batch_put (1 tag)": lambda: self.tq.kv_batch_put(
                keys=VAL_KEYS[:1], partition_id="val", tags=[{"status": "pending"}]
            ),
            'trainer kv_list("val")': lambda: self.tq.kv_list("val"),
        }


def close_cluster() -> None:
    """The trainer's shutdown: safe however far ``Trainer()`` got (``tq.close`` skips what was never made)."""
    import ray
    import transfer_queue as tq

    tq.close()
    ray.shutdown()


def time_kv_list(result: Result, trainer: Trainer, client: ControllerClient) -> dict[str, dict[str, Any]]:
    """Both ways of listing, taking turns so background load hits both alike; returns the last reply."""
    reply: dict[str, dict[str, Any]] = {}
    for _ in range(repeats(result.size)):
        reply = {}  # drop the previous reply before the next arrives: two 1M replies are GiBs
        started = time.perf_counter()
        reply = client.kv_list(client.timeout)
        result.client_list.append(time.perf_counter() - started)
        result.trainer_list.append(timed(trainer.tq.kv_list))
    keys = sum(len(tags) for tags in reply.values())
    if keys != result.size + len(VAL_KEYS):
        raise RuntimeError(f"kv_list returned {keys:,} keys, expected {result.size + len(VAL_KEYS):,}")
    return reply


def time_aggregation(result: Result, reply: dict[str, dict[str, Any]], baseline: Aggregation | None) -> None:
    train = reply["train"]
    _, prompts, trajectory_keys = classify_keys(train)
    for _ in range(repeats(result.size)):
        result.full.append(timed(lambda: windows_from(reply, None, time.time())))
        result.bare.append(timed(lambda: bare_count(reply)))
        if baseline is not None:
            result.baseline.append(timed(lambda: baseline(reply)))
        result.classify.append(timed(lambda: classify_keys(train)))
        result.attribute.append(timed(lambda: attribute(prompts, trajectory_keys)))
    result.load = os.getloadavg()


def measure(
    trainer: Trainer, client: ControllerClient, size: int, workdir: Path, baseline: Aggregation | None
) -> Result:
    result = Result(size, fill_seconds=trainer.grow_to(size))
    probes = trainer.probes()
    idle = {name: series(call, PROBES, MIN_SPAN) for name, call in probes.items()}
    time_aggregation(result, time_kv_list(result, trainer, client), baseline)  # the reply is freed before tqmon starts
    result.span = span = poll_cycles(statistics.median(result.client_list))

    budget = PollBudget(PollSettings(budget=0.01))
    for cost in result.client_list:
        budget.record(cost)
    steady = budget.interval(now=0.0, last_cost=result.client_list[-1])
    budget.hurry(now=0.0)
    fast = budget.interval(now=1.0, last_cost=result.client_list[-1])
    result.steady, result.fast = (steady, budget.busy_ratio(steady)), (fast, budget.busy_ratio(fast))
    result.smoothed_cost = budget.cost or 0.0

    with tqmon_running(trainer.gcs, workdir) as tqmon, httpx.Client(base_url=tqmon.url, timeout=CALL_TIMEOUT) as http:
        result.first_window = tqmon.wait_for_window(http, size + len(VAL_KEYS))
        series(lambda: http.get("/metrics").raise_for_status(), WARMUP_SCRAPES)
        result.scrapes = series(lambda: http.get("/metrics").raise_for_status(), SCRAPES, span)
        result.metrics_bytes = len(http.get("/metrics").content)
        result.tqmon_rss = proc_status(tqmon.proc.pid, "VmRSS")
        result.tqmon_hwm = proc_status(tqmon.proc.pid, "VmHWM")
        poller = child_of(tqmon.proc.pid)
        result.poller_rss, result.poller_hwm = proc_status(poller, "VmRSS"), proc_status(poller, "VmHWM")
        result.controller_rss = proc_status(trainer.controller_pid, "VmRSS")
        own = proc_status(os.getpid(), "VmRSS")
        if result.controller_rss is not None and result.tqmon_hwm is not None and own is not None:
            result.footprint = result.controller_rss + result.tqmon_hwm + (result.poller_hwm or 0) + own
        for name, call in probes.items():
            result.stall[name] = (idle[name], series(call, PROBES, span))
    return result


def memory_check(done: Sequence[Result], size: int) -> str | None:
    """Refuse a size whose memory, extrapolated per key between the last two sizes measured (controller, tqmon
    peak and this process; one size alone is mostly import baseline), exceeds what the machine has free,
    rather than let the OOM killer pick a victim."""
    known = [r for r in done if r.footprint is not None][-2:]
    if len(known) < 2:
        return None
    before, last = known
    assert before.footprint is not None and last.footprint is not None
    per_key = max(0, last.footprint - before.footprint) / (last.size - before.size)
    need = per_key * (size - last.size) * 1.25
    available = mem_available() - MEMORY_MARGIN
    if need > available:
        return (
            f"memory: ~{need / 2**30:.1f} GiB more needed (extrapolated at {per_key:,.0f} B/key over controller, "
            f"tqmon peak and this process), {available / 2**30:.1f} GiB available beyond a 2 GiB margin"
        )
    return None


def limit_hit(err: BaseException) -> str:
    """Which limit a failed size ran into, in words."""
    name = type(err).__name__
    if isinstance(err, MemoryError) or "OutOfMemory" in name or "memory" in str(err).lower():
        return f"memory: {name}: {err}"
    if isinstance(err, TimeoutError) or "Timeout" in name:
        return f"time: {name}: {err}"
    return f"TQ/Ray: {name}: {str(err)[:300]}"


def size_table(r: Result) -> str:
    rows = [
        ["kv_list via tqmon ControllerClient", *ms(r.client_list), f"{len(r.client_list)}"],
        ["kv_list via trainer tq.kv_list", *ms(r.trainer_list), f"{len(r.trainer_list)}"],
        ["windows_from (tqmon aggregation)", *ms(r.full), f"{len(r.full)}"],
        ["bare prompt count (verl)", *ms(r.bare), f"{len(r.bare)}"],
        *([["windows_from, --baseline revision", *ms(r.baseline), f"{len(r.baseline)}"]] if r.baseline else []),
        ["  profile: classification pass (train)", *ms(r.classify), f"{len(r.classify)}"],
        ["  profile: trajectory attribution (train)", *ms(r.attribute), f"{len(r.attribute)}"],
        ["GET /metrics while tqmon polls", *ms(r.scrapes), f"{len(r.scrapes)}"],
    ]
    for name, (idle, polled) in r.stall.items():
        rows.append([f"{name}, controller idle", *ms(idle), f"{len(idle)}"])
        rows.append([f"{name}, tqmon polling", *ms(polled), f"{len(polled)}"])
    ratio = statistics.median(r.full) / statistics.median(r.bare)
    steady, steady_busy = r.steady
    fast, fast_busy = r.fast
    notes = [
        f"aggregation / bare count (medians): {ratio:.2f}x (target <= 3x); profile: classification "
        f"{statistics.median(r.classify) / statistics.median(r.bare):.2f}x, trajectory attribution "
        f"{statistics.median(r.attribute) / statistics.median(r.bare):.2f}x"
        + (
            f"; --baseline revision {statistics.median(r.baseline) / statistics.median(r.bare):.2f}x"
            if r.baseline
            else ""
        )
        + f"; load average {' / '.join(f'{x:.2f}' for x in r.load)}",
        f"default budget 1% (smoothed cost {r.smoothed_cost * 1e3:,.1f} ms): "
        f"steady interval {steady:.2f} s (busy {100 * (steady_busy or 0):.3f}%), "
        f"after a resume {fast:.2f} s (busy {100 * (fast_busy or 0):.3f}%)",
        f"fill {r.fill_seconds:.1f} s; tqmon spawn -> window read {r.first_window:.1f} s; "
        f"/metrics body {r.metrics_bytes:,} B; series under polling spread over {r.span:.1f} s",
        f"RSS MiB: tqmon {mib(r.tqmon_rss)} (peak {mib(r.tqmon_hwm)}), its poller process {mib(r.poller_rss)} "
        f"(peak {mib(r.poller_hwm)}), TQ controller {mib(r.controller_rss)}",
    ]
    title = f"{r.size:,} keys in train (+{len(VAL_KEYS)} in val)"
    return table(title, ["measure", "median ms", "p95 ms", "max ms", "n"], rows) + "\n".join(notes) + "\n"


def summary(results: Sequence[Result]) -> str:
    done = [r for r in results if not r.skipped]
    header = ["", *(f"{r.size:,}" for r in results)]

    def row(label: str, cell: Callable[[Result], str]) -> list[str]:
        return [label, *(cell(r) if not r.skipped else "skipped" for r in results)]

    def ratio(r: Result) -> str:
        return f"{statistics.median(r.full) / statistics.median(r.bare):.2f}x"

    def baseline_ratio(r: Result) -> str:
        return f"{statistics.median(r.baseline) / statistics.median(r.bare):.2f}x" if r.baseline else "n/a"

    def put(r: Result, polled: int, column: int) -> str:
        return ms(next(iter(r.stall.values()))[polled])[column]

    rows = [
        row("kv_list tqmon median ms", lambda r: ms(r.client_list)[0]),
        row("kv_list tqmon p95 ms", lambda r: ms(r.client_list)[1]),
        row("kv_list trainer median ms", lambda r: ms(r.trainer_list)[0]),
        row("windows_from median ms", lambda r: ms(r.full)[0]),
        row("bare count median ms", lambda r: ms(r.bare)[0]),
        row("aggregation / bare", ratio),
        row("  --baseline revision / bare", baseline_ratio),
        row("  classification / bare", lambda r: f"{statistics.median(r.classify) / statistics.median(r.bare):.2f}x"),
        row("  attribution / bare", lambda r: f"{statistics.median(r.attribute) / statistics.median(r.bare):.2f}x"),
        row("load average (1 min) then", lambda r: f"{r.load[0]:.2f}"),
        row("/metrics median ms", lambda r: ms(r.scrapes)[0]),
        row("/metrics p95 ms", lambda r: ms(r.scrapes)[1]),
        row("/metrics max ms", lambda r: ms(r.scrapes)[2]),
        row("tqmon RSS MiB", lambda r: mib(r.tqmon_rss)),
        row("tqmon peak RSS MiB", lambda r: mib(r.tqmon_hwm)),
        row("poller RSS MiB", lambda r: mib(r.poller_rss)),
        row("poller peak RSS MiB", lambda r: mib(r.poller_hwm)),
        row("controller RSS MiB", lambda r: mib(r.controller_rss)),
        row("1% budget interval s", lambda r: f"{r.steady[0]:.2f}"),
        row("1% budget busy %", lambda r: f"{100 * (r.steady[1] or 0):.3f}"),
        row("1-tag put p95 ms idle", lambda r: put(r, 0, 1)),
        row("1-tag put p95 ms polled", lambda r: put(r, 1, 1)),
        row("1-tag put max ms idle", lambda r: put(r, 0, 2)),
        row("1-tag put max ms polled", lambda r: put(r, 1, 2)),
    ]
    lines = [table("Summary (tqmon polling flat out for /metrics and the polled stall)", header, rows)]
    if len(done) >= 2:
        small, large = done[0], done[-1]
        for label, pick in (("median", statistics.median), ("p95", p95)):
            scrape = pick(large.scrapes) / pick(small.scrapes)
            lines.append(f"/metrics {label} at {large.size:,} vs {small.size:,}: {scrape:.2f}x (target <= 1.2x)")
    lines += [f"{r.size:,}: skipped, {r.skipped}" for r in results if r.skipped]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated key counts")
    parser.add_argument(
        "--baseline", metavar="REV", help="also time the aggregation of git revision REV (e.g. main) side by side"
    )
    args = parser.parse_args()
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))
    baseline = aggregation_of(composition_at(args.baseline)) if args.baseline else None
    print(f"sizes {sizes}; {os.cpu_count()} CPUs, {mem_available() / 2**30:.1f} GiB available at start", flush=True)
    if args.baseline:
        print(f"--baseline revision: {args.baseline}", flush=True)

    results: list[Result] = []
    client: ControllerClient | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="tqmon-bench-tq-") as name:
            trainer = Trainer(max(sizes))
            client = ControllerClient(trainer.gcs, CALL_TIMEOUT)
            client.find()
            for size in sizes:
                refused = memory_check([r for r in results if not r.skipped], size)
                if refused or any(r.skipped for r in results):
                    results.append(Result(size, skipped=refused or "a smaller size already hit a limit"))
                else:
                    try:
                        results.append(measure(trainer, client, size, Path(name), baseline))
                    except Exception as err:  # a size that does not fit is a result, not a crash
                        results.append(Result(size, skipped=limit_hit(err)))
                if results[-1].skipped:
                    print(f"{size:,} keys: skipped, {results[-1].skipped}\n", flush=True)
                else:
                    print(size_table(results[-1]), flush=True)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", flush=True)
    finally:
        if client is not None:
            client.close()
        close_cluster()
    if results:
        print(summary(results), flush=True)


if __name__ == "__main__":
    main()
