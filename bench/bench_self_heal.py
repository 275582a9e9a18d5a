"""What the verl plugin's self-heal adds to a resume: ``TQMON_SELF_HEAL=off`` against ``on``, side by side.

Run with ``PYTHONPATH=. .venv/bin/python bench/bench_self_heal.py`` (needs the ``verl`` extra; a local Ray
cluster and TransferQueue on CPU; about a minute). One previous run's window (failed, stale finished and kept
groups, so verl's warmup leaves the window ``doomed`` short) is saved once with verl's ``_save_checkpoint``;
each round then resumes it in a fresh TransferQueue controller with verl's real trainer
(``PPOTrainerColocateAsync``, the plugin's manager with a recording worker, as ``tests/test_verl_parity.py``
drives it): ``_load_checkpoint``, the manager's ``create``, the re-issue, ``on_train_begin`` (the warmup), and
the first step's ``prepare_step``, where the self-heal tops up. Rounds alternate off / on, so the machine's
load drifts over both alike. Reported: the median resume up to the first sample, and the median
``prepare_step`` (its batch, plus the top-up with ``on``), per mode, and the difference. The worker here only
records what it is sent; on GPUs ``generate_sequences`` returns after the dispatch just the same, so the
difference is the top-up's own cost: a dataloader fetch, one ``kv_batch_put`` and one dispatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from tests.test_verl_parity import (  # after the environment: ray reads it at import
    TQ_CONFIG,
    Case,
    _RecordingWorkers,
    make_trainer,
    recorder_class,
    restart_transfer_queue,
    save_previous_run,
    verl_config,
)

STEP = 10
# R = 24 at global_step_10; T = 8 x 4 = 32; verl submits M = 8; 14 are doomed (6 failed, 8 stale), deficit 14.
CASE = Case(
    "bench",
    STEP,
    (("pending", 10, 2), ("finished", 10, 8), ("finished", 5, 8), ("failure", 10, 6)),
    overrides=("trainer.v1.colocate_async.num_warmup_batches=8", "trainer.v1.sampler.max_off_policy_threshold=3"),
    sample=False,
)


def resume_once(root: Path, mode: str) -> tuple[float, float, list[int]]:
    """One resume up to the first sample: (whole seconds, prepare_step seconds, prompts per dispatch)."""
    import ray
    from verl.utils.import_utils import load_class_from_fqn
    from verl.utils.skip import SkipManager

    os.environ["TQMON_SELF_HEAL"] = mode
    restart_transfer_queue(_tq())
    ray.get(_RecordingWorkers.recorder.dispatched.remote())
    config = verl_config(root, CASE.overrides)
    started = time.perf_counter()
    trainer = make_trainer(config)
    trainer._load_checkpoint()
    manager_cls = load_class_from_fqn(
        config.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    trainer.agent_loop_manager = manager_cls.create(config=config, llm_client=None)
    SkipManager.init(config)
    trainer.global_steps += 1
    SkipManager.set_step(trainer.global_steps)
    trainer._reissue_inflight_prompts()
    trainer.on_train_begin()
    before_step = time.perf_counter()
    trainer.prepare_step()
    ended = time.perf_counter()
    return ended - started, ended - before_step, ray.get(_RecordingWorkers.recorder.dispatched.remote())


def _tq() -> Any:
    import transfer_queue as tq

    return tq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="resumes per mode, alternating (default 6)")
    args = parser.parse_args()
    import ray
    from omegaconf import OmegaConf

    # The plugin reports to an address nobody listens on: its poster drops in the background, as with tqmon away.
    os.environ["TQMON_URL"] = "http://127.0.0.1:9"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq = _tq()
    tq.init(OmegaConf.create(TQ_CONFIG))
    _RecordingWorkers.recorder = recorder_class().remote()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "bench"
            root.mkdir()
            save_previous_run(tq, root, CASE)
            times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
            dispatched: dict[str, list[int]] = {}
            resume_once(root, "off")  # warm both paths up (imports, the first Ray calls)
            resume_once(root, "on")
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    whole, step, dispatched[mode] = resume_once(root, mode)
                    times[mode].append((whole, step))
    finally:
        tq.close()
        ray.shutdown()
    load = os.getloadavg()
    print(f"{args.rounds} rounds per mode, alternating; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print("| mode | dispatches (prompts) | resume to first sample, median | prepare_step, median |")
    print("| --- | --- | ---: | ---: |")
    medians = {}
    for mode, rows in times.items():
        whole = statistics.median(row[0] for row in rows)
        step = statistics.median(row[1] for row in rows)
        medians[mode] = (whole, step)
        print(f"| {mode} | {dispatched[mode]} | {whole * 1000:.1f} ms | {step * 1000:.1f} ms |")
    extra = medians["on"][1] - medians["off"][1]
    print(
        f"top-up cost (prepare_step on - off): {extra * 1000:.1f} ms; whole resume on / off: "
        f"{medians['on'][0] / medians['off'][0]:.2f}x"
    )


if __name__ == "__main__":
    main()
