"""A state dir reused for another run is refused, loudly; the same run restarted (or given more) is not."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import TqmonProcess

RESUME = """\
INFO:2026-11-28 22:00:00,000:Resuming from /runs/a/global_step_40, setting global step to 40
INFO:2026-11-28 22:00:01,000:Restored 20 training prompt groups from TransferQueue
INFO:2026-11-28 22:00:03,000:Added 4 warmup prompts after restoring 20 of 24 target prompt groups
"""
CONFIG = """\
data: {{train_batch_size: 8}}
trainer:
  project_name: dapo
  experiment_name: {name}
  v1:
    trainer_mode: colocate_async
    colocate_async: {{num_warmup_batches: 3}}
"""


def records(proc: TqmonProcess) -> list[dict[str, object]]:
    status = httpx.get(proc.url + "/api/v1/status", timeout=5).json()
    found: list[dict[str, object]] = status["records"]
    return found


def test_a_state_dir_bound_to_another_run_is_refused(
    tmp_path: Path, tqmon_factory: Callable[..., TqmonProcess]
) -> None:
    first_log, second_log = tmp_path / "a.log", tmp_path / "b.log"
    first_log.write_text(RESUME)
    second_log.write_text("")
    config_a, config_b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    config_a.write_text(CONFIG.format(name="run_a"))
    config_b.write_text(CONFIG.format(name="run_b"))

    first = tqmon_factory(["--log", str(first_log), "--log-interval", "0.1", "--trainer-config", str(config_a)])
    first.start()
    for _ in range(100):
        if records(first):
            break
        time.sleep(0.1)
    [record] = records(first)
    assert record["run_id"] == "dapo/run_a"  # records carry the run's identity
    first.kill()

    # Another run, same (default-like) state dir: refused with one line naming both runs, not mixed.
    with pytest.raises(RuntimeError) as refused:
        tqmon_factory(["--log", str(second_log), "--trainer-config", str(config_b)]).start()
    message = str(refused.value)
    assert "tqmon exited with 2" in message
    assert f"--state-dir {first.state_dir} holds the history of another run (" in message
    assert "run_id dapo/run_a" in message and "differs in run_id, log" in message
    assert "Traceback" not in message

    # The same run restarted with one more source is the same run: its history is served.
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("")
    again = tqmon_factory(["--log", str(first_log), "--jsonl", str(jsonl), "--trainer-config", str(config_a)])
    again.start()
    assert [r["run_id"] for r in records(again)] == ["dapo/run_a"]
    again.kill()

    # Removing the state dir is the documented way to start afresh.
    shutil.rmtree(first.state_dir)
    fresh = tqmon_factory(["--log", str(second_log), "--trainer-config", str(config_b)]).start()
    assert records(fresh) == []
