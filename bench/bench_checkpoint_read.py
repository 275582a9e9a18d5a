"""Benchmark of the checkpoint read with DAPO's filter metric against the controller state alone.

Run with ``.venv/bin/python bench/bench_checkpoint_read.py [--sizes 10000,100000] [--n 4]``. This process
plays the trainer: it starts a local Ray cluster and a real TransferQueue (one storage unit), fills
partition ``train`` with ``size`` prompt groups (70% finished, the rest pending/running/failure) whose
finished groups have ``n`` trajectories each, put with the fields verl's agent-loop worker puts
(``responses``, ``response_mask``, ``rm_scores`` and ``extra_fields`` with ``reward_extra_info``, built by
verl's ``list_of_dict_to_tensordict``), and saves it with ``tq.save_checkpoint``. One group in three has a
zero-variance metric.

Each read runs in a fresh ``python -c`` child, so its peak RSS (``VmHWM``: unlike ``ru_maxrss`` it does not
inherit this Ray-and-torch process's high-water mark through fork) is its own, and all modes
run side by side on the same checkpoint:

- ``controller``: ``read_checkpoint`` without a metric, what tqmon read before (``controller_state.pkl``);
- ``+ acc``: the same with ``algorithm.filter_groups.metric=acc`` (``extra_fields.reward_extra_info``);
- ``+ reward``: with the metric ``reward`` (``rm_scores`` tensors, decoded from their bytes);
- ``+ reward, unscanned``: the same without the pickle pre-scan of each tensor's small torch records (the child
  replaces ``storage._prescan`` with a no-op): what the pre-scan costs.

Each mode is read ``--repeat`` times, the modes in turn, and the medians are shown; the read's CPU time is
shown next to its wall time, since on a loaded machine it is the steadier of the two.

Ctrl-C (or any error) still closes TQ and shuts Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1; before ray is imported

from bench_service import table

DEFAULT_SIZES = (10_000, 100_000)
STEP = 40
PUT_GROUPS = 500  # prompt groups per kv_batch_put while filling
RESPONSE_LEN = 32  # tokens per response, +0..6 so that rows are ragged
READ = """
import json, re, sys, time
from pathlib import Path
from tqmon.checkpoint import storage
from tqmon.checkpoint.layout import read_checkpoint
if sys.argv[3] == "unscanned":
    storage._prescan = lambda *args: None
started, cpu = time.perf_counter(), time.process_time()
reading = read_checkpoint(Path(sys.argv[1]), filter_metric=sys.argv[2] or None)
seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
v = reading.filter_verdicts
print(json.dumps({
    "seconds": seconds,
    "cpu": cpu,
    "rss": int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024,
    "restored": reading.composition.restored,
    "filtered": None if v is None else sum(v.filtered.values()),
    "storage_bytes": None if v is None else v.storage_bytes,
    "error": None if reading.filter_error is None else str(reading.filter_error),
}))
"""


def uid(group: int) -> str:
    return uuid.UUID(int=group + 1).hex


STATUSES = ("finished",) * 7 + ("pending", "running", "failure")


def fill(tq: Any, size: int, n: int) -> int:
    """``size`` prompt groups; returns how many are finished with zero variance."""
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    zero = 0
    for low in range(0, size, PUT_GROUPS):
        groups = range(low, min(low + PUT_GROUPS, size))
        statuses = {g: STATUSES[g % 10] for g in groups}
        keys: list[str] = []
        tags: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        for g in groups:
            if statuses[g] != "finished":
                continue
            flat = g % 3 == 0
            zero += flat
            for session in range(n):
                value = 1.0 if flat else float(session % 2)
                length = RESPONSE_LEN + len(rows) % 7  # ragged, as responses are: each row its own storage
                scores = torch.zeros(length, dtype=torch.float32)
                scores[-1] = value
                keys.append(f"{uid(g)}_{session}_0")
                tags.append({"status": "success", "global_steps": STEP - g % 5})
                rows.append(
                    {
                        "responses": torch.ones(length, dtype=torch.int64),
                        "response_mask": torch.ones(length, dtype=torch.int64),
                        "rm_scores": scores,
                        "extra_fields": {"reward_extra_info": {"acc": value}, "turn_scores": [], "tool_rewards": []},
                    }
                )
        prompts = [uid(g) for g in groups]
        prompt_tags = [{"is_prompt": True, "status": statuses[g], "global_steps": STEP - g % 5} for g in groups]
        tq.kv_batch_put(keys=prompts, partition_id="train", tags=prompt_tags)
        if keys:
            tq.kv_batch_put(keys=keys, partition_id="train", tags=tags, fields=list_of_dict_to_tensordict(rows))
    return zero


def save(root: Path, size: int, n: int) -> int:
    """A real TQ checkpoint at ``root/global_step_{STEP}`` as verl lays it out; the zero-variance count."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    capacity = size * (n + 1) + 10
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        storage = {"num_data_storage_units": 1, "total_storage_size": capacity}
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": storage}}))
        try:
            started = time.perf_counter()
            zero = fill(tq, size, n)
            filled = time.perf_counter() - started
            tq.save_checkpoint(root / f"global_step_{STEP}" / "transfer_queue", metadata={"global_steps": STEP})
            (root / "latest_checkpointed_iteration.txt").write_text(str(STEP))
            saved = time.perf_counter() - started - filled
            print(f"  filled {size} groups in {filled:.0f} s, saved in {saved:.0f} s", flush=True)
            return zero
        finally:
            tq.close()
    finally:
        ray.shutdown()


# (row label, filter metric, whether the torch records are pre-scanned)
MODES = (
    ("controller", "", True),
    ("+ acc", "acc", True),
    ("+ reward", "reward", True),
    ("+ reward, unscanned", "reward", False),
)


def read(root: Path, metric: str, scanned: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    command = [sys.executable, "-c", READ, str(root), metric, "scanned" if scanned else "unscanned"]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def medians(root: Path, repeat: int) -> dict[str, dict[str, Any]]:
    """Each mode read ``repeat`` times, the modes in turn (so load drifts hit all alike); medians of time and RSS."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in MODES}
    for _ in range(repeat):
        for label, metric, scanned in MODES:
            runs[label].append(read(root, metric, scanned))
    return {
        label: results[0] | {key: statistics.median(r[key] for r in results) for key in ("seconds", "cpu", "rss")}
        for label, results in runs.items()
    }


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="prompt groups per checkpoint")
    parser.add_argument("--n", type=int, default=4, help="trajectories per finished group (rollout.n)")
    parser.add_argument("--repeat", type=int, default=3, help="reads of each mode (medians are shown)")
    args = parser.parse_args()
    rows: list[list[str]] = []
    costs: list[str] = []
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="tqmon-bench-ckpt-") as tmp:
            root = Path(tmp)
            print(f"{size} groups:", flush=True)
            zero = save(root, size, args.n)
            tq_dir = root / f"global_step_{STEP}" / "transfer_queue"
            controller = (tq_dir / "controller_state.pkl").stat().st_size
            storage = size_of(tq_dir / "simple_storage")
            results = medians(root, args.repeat)
            base = results["controller"]
            for label, metric, _ in MODES:
                result = results[label]
                assert result["error"] is None, result["error"]
                assert metric == "" or result["filtered"] == zero, (result, zero)
                rows.append(
                    [
                        f"{size:,}",
                        label,
                        f"{controller / 2**20:.1f}" + ("" if not metric else f" + {storage / 2**20:.0f}"),
                        f"{result['seconds']:.2f}",
                        f"{result['cpu']:.2f}",
                        f"{result['cpu'] / base['cpu']:.1f}x",
                        f"{result['rss'] / 2**20:.0f}",
                        f"{result['rss'] / base['rss']:.2f}x",
                        "-" if not metric else str(result["filtered"]),
                    ]
                )
            scanned, unscanned = results["+ reward"]["cpu"], results["+ reward, unscanned"]["cpu"]
            costs.append(
                f"{size:,} groups: + reward {scanned:.2f} CPU s with the torch records pre-scanned, "
                f"{unscanned:.2f} CPU s without: {scanned / unscanned:.2f}x"
            )
    memory = ["peak RSS MiB", "vs controller", "filtered"]
    header = ["groups", "read", "MiB read", "seconds", "CPU s", "CPU vs controller", *memory]
    print()
    title = f"checkpoint read, n={args.n} trajectories per finished group, medians of {args.repeat} reads"
    print(table(title, header, rows))
    print("pre-scan of the torch records inside each tensor:", *costs, sep="\n  ")


if __name__ == "__main__":
    main()
