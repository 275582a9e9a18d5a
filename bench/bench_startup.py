"""Startup time against the number of stored events: 1k, 100k and 1M (``python bench/bench_startup.py``).

A state dir as months of steps leave it without retention (one ``step_completed`` per step, a resume
every 500 steps) is built directly with the store, then tqmon's startup path is timed in this process:
open the store (quick_check, migration), replay it into the tracker, and run one retention round.
That is the first start on such a dir; the second start, after retention pruned it, is what every
later restart costs. Printed side by side, with the ratio to the 1k row.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tqmon.events import CheckpointRestored, Event, StepCompleted, TrainingStarted, WarmupDecided
from tqmon.retention import Retention, RetentionPolicy
from tqmon.store import DB_NAME, StateStore
from tqmon.tracker import Tracker

RESUME_EVERY = 500
BATCH = 10_000


def history(n: int, start: float) -> list[tuple[Event, str, float]]:
    """``n`` events: steps, with a resume (4 events) every :data:`RESUME_EVERY` steps; an hour apart at most."""
    events: list[tuple[Event, str, float]] = []
    step = 0
    while len(events) < n:
        at = start + len(events)
        if step % RESUME_EVERY == 0:
            events += [
                (TrainingStarted(id=f"start/{step}", resumed_from_step=step or None), "log", at),
                (CheckpointRestored(id=f"restore/{step}", step=step, restored_prompt_groups=8), "log", at),
                (WarmupDecided(id=f"warmup/{step}", submitted_prompt_groups=0, target_prompt_groups=8), "log", at),
            ]
        events.append((StepCompleted(id=f"step/{step}", global_step=step + 1, step_seconds=1.0), "jsonl", at))
        step += 1
    return events[:n]


def build(state: Path, n: int) -> None:
    store = StateStore(state)
    start = time.time() - 7 * 86400.0 - n  # older than retention's minimum age
    events = history(n, start)
    for first in range(0, len(events), BATCH):
        store.commit(events[first : first + BATCH])
    store.close()


def start_once(state: Path, policy: RetentionPolicy) -> tuple[float, int, int, int]:
    """(seconds, events replayed, events pruned, records kept) of one startup."""
    started = time.perf_counter()
    store = StateStore(state, exclusive=True)
    tracker = Tracker(store)
    replayed = tracker.replay()
    pruned = Retention(tracker, store, policy).prune()
    took = time.perf_counter() - started
    kept = len(tracker.snapshot.records)
    store.close()
    return took, replayed, pruned, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,100000,1000000", help="stored events per row")
    parser.add_argument("--retain-records", type=int, default=RetentionPolicy().records)
    args = parser.parse_args()
    policy = RetentionPolicy(records=args.retain_records)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tqmon-bench-startup-") as tmp:
        for n in (int(size) for size in args.sizes.split(",")):
            state = Path(tmp) / f"state-{n}"
            build(state, n)
            size_before = (state / DB_NAME).stat().st_size
            first = start_once(state, policy)
            second = start_once(state, policy)
            rows.append((n, size_before, first, second))
    base_first, base_second = rows[0][2][0], rows[0][3][0]
    print(f"retention: --retain-records {policy.records}; a resume every {RESUME_EVERY} steps")
    header = (
        f"{'stored events':>14} {'db MiB':>7} | {'1st start s':>11} {'x1k':>6} {'replayed':>9} {'pruned':>9} "
        f"| {'2nd start s':>11} {'x1k':>6} {'replayed':>9} {'records':>8}"
    )
    print(header)
    print("-" * len(header))
    for n, size, (t1, r1, p1, _k1), (t2, r2, _p2, k2) in rows:
        print(
            f"{n:>14,} {size / 2**20:>7.1f} | {t1:>11.3f} {t1 / base_first:>6.1f} {r1:>9,} {p1:>9,} "
            f"| {t2:>11.3f} {t2 / base_second:>6.1f} {r2:>9,} {k2:>8,}"
        )


if __name__ == "__main__":
    main()
