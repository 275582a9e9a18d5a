"""The checkpoint source and ``tqmon inspect`` against real ``tq.save_checkpoint`` output.

A module fixture runs Ray and TransferQueue locally (the test owns that cluster; tqmon never calls
``tq.init``/``tq.close``), puts verl-shaped prompt and trajectory keys into partition "train" and
saves two checkpoints. The composition at step 40 (sampled at step 41):

    pending 3, running 2 (g=40) · finished 4 (g=40), 3 (g=39), 2 (g=37), 2 (g=30) · failure 2 (g=38), 2 (g=35)
    R = 20, K = 5; 22 trajectories of finished groups, 1 of a running group, 3 orphans (26)

With B=8, num_warmup_batches=3 (T=24) and threshold 4: stale = finished with g <= 37 = 4, doomed 8,
M = 4, useful 20 - 8 + 4 = 16, under-submitted 8. With verl's default threshold 8 only g=30 is stale.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from tqmon.checkpoint import layout, unpickler
from tqmon.checkpoint.layout import read_checkpoint
from tqmon.checkpoint.unpickler import CheckpointError
from tqmon.cli import main
from tqmon.composition import compose
from tqmon.conditions import evaluate
from tqmon.events import CheckpointSaved, parse_event
from tqmon.exporters import html
from tqmon.exporters.prometheus import build_registry, render
from tqmon.sim.rollout import trajectory_tag
from tqmon.snapshot import Tally
from tqmon.sources.checkpoint import CheckpointSource
from tqmon.sources.logparse import parse_line
from tqmon.store import StateStore
from tqmon.tracker import Tracker
from tqmon.versions import FLAG, installed, named
from tqmon.warmup import GivenConfig, TrainerConfig

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported (in the fixture)

STEP40 = {"pending": 3, "running": 2, "finished": 11, "failure": 4}
AGES40 = {"1": 9, "2": 3, "3": 2, "4": 2, "6": 2, "11": 2}
CONFIG_FLAGS = ["--train-batch-size", "8", "--num-warmup-batches", "3"]


def uid(i: int) -> str:
    return uuid.UUID(int=i + 1).hex  # uuid4-like hex, never contains "_"


P = [uid(i) for i in range(24)]
ORPHANS = [uid(100 + i) for i in range(3)]


def batch(n: int, **columns: Any) -> Any:
    """A TensorDict of ``n`` rows, each column ``(width, dtype)``, like the fields verl puts."""
    import torch
    from tensordict import TensorDict  # type: ignore[import-untyped]

    return TensorDict({name: torch.ones(n, w, dtype=dtype) for name, (w, dtype) in columns.items()}, batch_size=[n])


def prompt_fields(n: int) -> Any:
    import torch

    return batch(n, input_ids=(4, torch.int64), attention_mask=(4, torch.int64))


# DAPO metric "acc" of each finished group's two trajectories, as numpy scalars (reward functions return them):
# verl 0.9.1 filters a group when np.std of float() of its values is 0.
ACC: dict[str, tuple[np.floating[Any], np.floating[Any]]] = {
    P[5]: (np.float64(0.5), np.float32(0.5)),  # equal as float() reads them: zero variance
    P[6]: (np.float64(0.1), np.float32(0.1)),  # the float32 reads 0.10000000149011612: kept
    P[7]: (np.float32(0.1), np.float32(0.1)),  # zero variance
    P[8]: (np.float64(1.0), np.float64(0.0)),
    P[9]: (np.float64(0.25), np.float64(0.25)),  # zero variance
    P[10]: (np.float32(0.3), np.float64(0.3)),
    P[11]: (np.float32(1.0), np.float64(1.0)),  # zero variance
    P[12]: (np.float64(0.0), np.float32(0.0)),  # zero variance, stale first (g 37)
    P[13]: (np.float64(0.7), np.float64(0.7)),  # zero variance, stale first
    P[14]: (np.float32(0.2), np.float64(0.2)),
    P[15]: (np.float64(0.5), np.float64(0.5)),  # zero variance, stale first (g 30)
}


def trajectory_fields(keys: list[str]) -> Any:
    """verl's trajectory fields, built as its agent loop builds them (``list_of_dict_to_tensordict``)."""
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [
        {
            "responses": torch.ones(3, dtype=torch.int64),
            "rm_scores": torch.ones(3, dtype=torch.bfloat16),
            "response_mask": torch.ones(3, dtype=torch.bool),
            "extra_fields": {"reward_extra_info": {"acc": acc(key)}},
        }
        for key in keys
    ]
    return list_of_dict_to_tensordict(rows)


def acc(key: str) -> np.floating[Any]:
    uid, _, index = key.split("_")
    return ACC.get(uid, (np.float64(0.0), np.float64(0.0)))[int(index)]


def put_prompts(tq: Any, keys: list[str], g: int, status: str) -> None:
    """verl submits prompts pending; the rollout updates the status tag, which merges into the stored tag."""
    pending = [{"is_prompt": True, "status": "pending", "global_steps": g} for _ in keys]
    tq.kv_batch_put(keys=keys, partition_id="train", tags=pending, fields=prompt_fields(len(keys)))
    if status != "pending":
        tq.kv_batch_put(keys=keys, partition_id="train", tags=[{"status": status} for _ in keys])


def put_trajectories(tq: Any, keys: list[str], g: int) -> None:
    tags = [trajectory_tag(g, g, g + 1) for _ in keys]
    tags[0] = tags[0] | {"is_prompt": False}  # an explicit False counts as a trajectory too
    tq.kv_batch_put(keys=keys, partition_id="train", tags=tags, fields=trajectory_fields(keys))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Real checkpoints at steps 40 and 45 under one root, plus what kv_list said when each was saved."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    root = tmp_path_factory.mktemp("ckpt")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 1000}}}))
    try:
        put_prompts(tq, P[0:3], 40, "pending")
        put_prompts(tq, P[3:5], 40, "running")
        put_prompts(tq, P[5:9], 40, "finished")
        put_prompts(tq, P[9:12], 39, "finished")
        put_prompts(tq, P[12:14], 37, "finished")
        put_prompts(tq, P[14:16], 30, "finished")
        put_prompts(tq, P[16:18], 38, "failure")
        put_prompts(tq, P[18:20], 35, "failure")
        finished = P[5:16]
        put_trajectories(tq, [f"{u}_0_{i}" for u in finished for i in range(2)], 39)
        put_trajectories(tq, [f"{P[3]}_0_0"], 40)  # a running group's first finished trajectory
        put_trajectories(tq, [f"{u}_0_0" for u in ORPHANS], 40)  # trained at step 40, prompt keys gone
        tq.kv_batch_put(
            keys=["valprompt"], partition_id="val", tags=[{"is_prompt": True, "status": "pending", "global_steps": 40}]
        )
        kv40 = tq.kv_list("train")["train"]
        tq.save_checkpoint(root / "global_step_40" / "transfer_queue", metadata={"global_steps": 40})

        # Step 45: two finished groups failed, the orphans were cleared, four new prompts are pending.
        tq.kv_batch_put(keys=P[9:11], partition_id="train", tags=[{"status": "failure"}] * 2)
        tq.kv_clear(keys=[f"{u}_0_0" for u in ORPHANS], partition_id="train")
        put_prompts(tq, P[20:24], 45, "pending")
        kv45 = tq.kv_list("train")["train"]
        tq.save_checkpoint(root / "global_step_45" / "transfer_queue", metadata={"global_steps": 45})
        (root / "latest_checkpointed_iteration.txt").write_text("40")
        yield {"root": root, "kv40": kv40, "kv45": kv45}
    finally:
        tq.close()
        ray.shutdown()


@pytest.fixture
def root(saved: dict[str, Any], tmp_path: Path) -> Path:
    """A private copy of the checkpoint root (latest = 40) a test may break."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved["root"], copy)
    return copy


def pkl(root: Path, step: int = 40) -> Path:
    return root / f"global_step_{step}" / "transfer_queue" / "controller_state.pkl"


def run_inspect(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, ["inspect", *args], env=env, catch_exceptions=False)


def words(text: str) -> str:
    return " ".join(text.split())


def inspect_json(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = run_inspect(*args, "--json", env=env)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


# ---------------------------------------------------------------- the reader


def test_reader_reproduces_kv_list_composition(saved: dict[str, Any]) -> None:
    reading = read_checkpoint(saved["root"])
    c = reading.composition
    assert reading.step == 40
    assert reading.user_metadata == {"global_steps": 40}
    assert reading.storage_saved is True
    assert c.by_status == STEP40
    assert (c.restored, c.reissued, c.trajectories, c.orphan_trajectories, c.inflight_trajectories) == (20, 5, 26, 3, 1)
    assert {str(age): n for age, n in c.by_age(41).items()} == AGES40
    assert c.groups[("finished", 37)] == 2 and c.groups[("failure", 35)] == 2
    # The restricted reader sees exactly what the live controller's kv_list saw when the checkpoint was saved.
    assert c == compose(saved["kv40"])
    later = read_checkpoint(saved["root"], 45).composition
    assert later.by_status == {"pending": 7, "running": 2, "finished": 9, "failure": 6}
    assert (later.orphan_trajectories, later.trajectories) == (0, 23)
    assert later == compose(saved["kv45"])


def test_allowlist_covers_a_real_controller_state_and_nothing_is_imported(saved: dict[str, Any]) -> None:
    """Every global a real checkpoint references is allowed, and resolves to a stand-in, not TQ or torch."""
    seen: set[tuple[str, str]] = set()

    class Recording(unpickler.RestrictedUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    with pkl(saved["root"]).open("rb") as handle:
        state = Recording(handle).load()
    assert {
        ("transfer_queue.controller", "DataPartitionStatus"),
        ("transfer_queue.controller", "FieldMeta"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.storage", "_load_from_bytes"),
        ("torch", "bfloat16"),
        ("torch", "int64"),
    } <= seen
    train = state["partitions"]["train"]
    assert type(train) is unpickler.PartitionState
    assert type(train.state["production_status"]) is unpickler.OpaqueTensor
    assert train.state["field_metadata"]["rm_scores"].state["dtype"] == "torch.bfloat16"

    code = (
        "import sys; from pathlib import Path; from tqmon.checkpoint.layout import read_checkpoint; "
        f"assert read_checkpoint(Path({str(saved['root'])!r})).composition.restored == 20; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transfer_queue', 'ray')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reading_and_inspecting_never_write(root: Path) -> None:
    before = tree(root)
    time.sleep(0.01)
    read_checkpoint(root)
    assert run_inspect(str(root), *CONFIG_FLAGS).exit_code == 0
    tracker = Tracker(StateStore(None))
    CheckpointSource(root, tracker).poll()
    assert tracker.snapshot.checkpoint is not None
    assert tree(root) == before


# ---------------------------------------------------------------- tqmon inspect


def test_inspect_without_config_prints_what_the_checkpoint_alone_tells(saved: dict[str, Any]) -> None:
    result = run_inspect(str(saved["root"]))
    assert result.exit_code == 0, result.output
    text = words(result.stdout)
    assert text.startswith(
        "resuming from step 40 will restore 20 prompt groups: 3 pending, 2 running, 11 finished (2 stale), 4 failed;"
    )
    assert "by age at 41 1: 9 · 2: 3 · 3: 2 · 4: 2 · 6: 2 · 11: 2" in text
    assert "re-issued K 5 (pending + running" in text and "clears 1 old trajectories" in text
    # Without the config, verl's eviction defaults decide stale and filtered, and the output names them.
    assert "doomed failure 4 · stale 2 · filtered 0" in text
    assert "doomed assumes verl's defaults max_off_policy_threshold=8, max_off_policy_strategy=drop, " in text
    assert "trajectories 26 (3 orphaned" in text
    assert "need the trainer config" in text and "target T" not in text

    data = inspect_json(str(saved["root"]))
    assert (data["restored"], data["reissued"], data["orphan_trajectories"]) == (20, 5, 3)
    assert data["by_status"] == STEP40 and data["by_age"] == AGES40
    assert data["doomed"] == {"failure": 4, "stale": 2, "filtered": 0}
    assert data["assumed_defaults"] == [
        "max_off_policy_threshold=8",
        "max_off_policy_strategy=drop",
        "filter_groups=false",
    ]
    assert data["target"] is None and data["under_submitted"] is None and data["config"] is None


def test_inspect_with_config_predicts_the_deficit(saved: dict[str, Any]) -> None:
    args = [str(saved["root"]), *CONFIG_FLAGS, "--max-off-policy-threshold", "4"]
    text = run_inspect(*args).stdout
    assert text.splitlines()[0] == (
        "resuming from step 40 will restore 20 prompt groups: 3 pending, 2 running, 11 finished (4 stale), "
        "4 failed; verl 0.9.1's warmup will submit 4; useful window right after warmup 16 of 24 — under-submitted by 8"
    )
    # The version is the verl installed next to tqmon (the venv pins 0.9.1), and the output says so.
    assert "verl 0.9.1 (from installed: the verl package next to tqmon)" in words(text)
    data = inspect_json(*args)
    assert data["verl_version"] == {
        "version": "0.9.1",
        "semantics": "verl-0.9.1",
        "source": "installed",
        "detail": "the verl package next to tqmon",
    }
    assert data["doomed"] == {"failure": 4, "stale": 4, "filtered": 0}
    assert (data["target"], data["warmup_submitted"], data["over_restored"]) == (24, 4, 0)
    assert (data["useful_after_warmup"], data["under_submitted"], data["warmup_state"]) == (16, 8, "topped_up")
    assert data["under_submitted_is_lower_bound"] is False


def test_inspect_config_from_env_default_threshold_and_over_restore(saved: dict[str, Any]) -> None:
    env = {"TQMON_TRAIN_BATCH_SIZE": "8", "TQMON_NUM_WARMUP_BATCHES": "3"}
    data = inspect_json(str(saved["root"]), env=env)  # verl's default threshold 8: only g=30 is stale
    assert data["doomed"] == {"failure": 4, "stale": 2, "filtered": 0}
    assert (data["useful_after_warmup"], data["under_submitted"]) == (18, 6)

    data = inspect_json(str(saved["root"]), "--num-warmup-batches", "2", "--max-off-policy-threshold", "4", env=env)
    assert (data["target"], data["warmup_submitted"], data["over_restored"]) == (16, 0, 4)
    assert (data["warmup_state"], data["useful_after_warmup"], data["under_submitted"]) == (
        "skipped_over_restored",
        12,
        4,
    )

    data = inspect_json(str(saved["root"]), "--max-off-policy-threshold", "null", env=env)
    assert data["doomed"] == {"failure": 4, "stale": 0, "filtered": 0}
    assert data["under_submitted"] == 4

    data = inspect_json(str(saved["root"]), "--trainer-mode", "sync", env=env)  # verl restores no TQ state
    assert (data["restored"], data["reissued"], data["target"], data["warmup_state"]) == (0, 0, 0, "sync_mode")
    assert data["by_status"] == STEP40  # what the checkpoint holds, all the same


LEGACY_LINE = "INFO:2026-11-28 22:14:03,123:Added 3 warmup batches to the agent loop manager\n"
CURRENT_LINE = "INFO:2026-11-28 22:14:03,123:Restored 20 training prompt groups from TransferQueue\n"


@pytest.fixture
def no_verl_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """tqmon without verl next to it: the installed version tells nothing."""
    import importlib.metadata

    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "verl":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_inspect_predicts_verl_0_9_0s_unconditional_warmup(saved: dict[str, Any]) -> None:
    """verl 0.9.0 submits num_warmup_batches whole batches whatever R: M = 3 x 8 = 24 on top of R = 20."""
    args = [str(saved["root"]), *CONFIG_FLAGS, "--max-off-policy-threshold", "4", "--verl-version", "0.9.0"]
    text = run_inspect(*args).stdout
    assert text.splitlines()[0] == (
        "resuming from step 40 will restore 20 prompt groups: 3 pending, 2 running, 11 finished (4 stale), "
        "4 failed; verl 0.9.0's warmup will submit 24; useful window right after warmup 36 of 24 — over-filled by "
        "20 (R + M - T: the warmup ignores R; kept all run)"
    )
    assert "verl 0.9.0 (from flag: --verl-version (TQMON_VERL_VERSION))" in words(text)
    assert "warmup M 24 (legacy_unconditional)" in words(text) and "over-filled 20 (R + M - T)" in words(text)
    data = inspect_json(*args)
    assert (data["verl_version"]["semantics"], data["verl_version"]["source"]) == ("verl-0.9.0", "flag")
    assert (data["target"], data["warmup_submitted"], data["warmup_state"]) == (24, 24, "legacy_unconditional")
    assert (data["over_restored"], data["over_filled"], data["useful_after_warmup"]) == (0, 20, 36)
    assert data["under_submitted"] == 0
    assert [p["semantics"] for p in data["predictions"]] == ["verl-0.9.0"]
    # The same from the environment variable.
    env = {"TQMON_VERL_VERSION": "0.9.0"}
    assert inspect_json(str(saved["root"]), *CONFIG_FLAGS, env=env)["warmup_submitted"] == 24


def test_inspect_with_an_unknown_version_says_so_and_predicts_both_warmups(
    saved: dict[str, Any], no_verl_installed: None
) -> None:
    args = [str(saved["root"]), *CONFIG_FLAGS, "--max-off-policy-threshold", "4"]
    data = inspect_json(*args)
    assert data["verl_version"] == {"version": None, "semantics": None, "source": None, "detail": None}
    current, legacy = data["predictions"]
    assert (current["semantics"], current["warmup_submitted"], current["warmup_state"]) == (
        "verl-0.9.1",
        4,
        "topped_up",
    )
    assert (current["useful_after_warmup"], current["under_submitted"], current["over_filled"]) == (16, 8, 0)
    assert (legacy["semantics"], legacy["warmup_submitted"]) == ("verl-0.9.0", 24)
    assert (legacy["useful_after_warmup"], legacy["under_submitted"], legacy["over_filled"]) == (36, 0, 20)
    # Where the warmups agree the top level says it; where they differ it stays open rather than pick one.
    assert (data["target"], data["over_restored"]) == (24, 0)
    assert (data["warmup_submitted"], data["warmup_state"], data["under_submitted"]) == (None, None, None)
    assert any("the verl version is unknown" in note for note in data["notes"])

    text = run_inspect(*args).stdout
    assert words(text.splitlines()[0]).endswith(
        "4 failed; the warmup depends on the verl version, which is unknown: verl 0.9.1's warmup would submit 4; "
        "useful window right after warmup 16 of 24 — under-submitted by 8; verl 0.9.0's warmup would submit 24; "
        "useful window right after warmup 36 of 24 — over-filled by 20 (R + M - T: the warmup ignores R; kept all run)"
    )
    rows = [words(line) for line in text.splitlines()]
    assert "warmup of verl-0.9.1 verl-0.9.0" in rows  # a column per warmup
    assert "warmup M 4 (topped_up) 24 (legacy_unconditional)" in rows
    assert "over-filled 0 20 (R + M - T)" in rows
    assert "under-submitted 8 0" in rows
    assert "verl verl version unknown: no source named a release, so both warmups are predicted" in words(text)


def test_inspect_reads_the_version_from_the_logs_own_lines(
    saved: dict[str, Any], tmp_path: Path, no_verl_installed: None
) -> None:
    """The log beats --verl-version: 0.9.0's warmup line, or a line only 0.9.1 writes."""
    legacy, current = tmp_path / "legacy.log", tmp_path / "current.log"
    legacy.write_text(
        "INFO:2026-11-28 22:14:01,000:Resuming from /c/global_step_40, setting global step to 40\n" + LEGACY_LINE
    )
    current.write_text(CURRENT_LINE)
    args = [str(saved["root"]), *CONFIG_FLAGS]
    data = inspect_json(*args, "--log", str(legacy), "--verl-version", "0.9.1")
    assert (data["verl_version"]["semantics"], data["verl_version"]["source"]) == ("verl-0.9.0", "log")
    assert data["verl_version"]["version"] == "<0.9.1" and "Added 3 warmup batches" in data["verl_version"]["detail"]
    assert data["warmup_submitted"] == 24
    data = inspect_json(*args, "--log", str(current), "--verl-version", "0.9.0")
    assert (data["verl_version"]["semantics"], data["verl_version"]["source"]) == ("verl-0.9.1", "log")
    assert data["warmup_submitted"] == 4
    not_a_log = tmp_path / "state.pkl"
    not_a_log.write_bytes(b"\x80\x04K\x01.")
    result = run_inspect(*args, "--log", str(not_a_log))
    assert result.exit_code == 1 and "not a verl trainer log" in result.output


def test_inspect_names_verl_0_9_0s_failure_on_a_fractional_warmup(saved: dict[str, Any]) -> None:
    args = [str(saved["root"]), "--train-batch-size", "8", "--num-warmup-batches", "1.5", "--verl-version", "0.9.0"]
    data = inspect_json(*args)
    assert (data["target"], data["warmup_submitted"], data["warmup_state"]) == (12, None, "unknown")
    assert any("1.5 is not a whole number, so its warmup raises TypeError" in note for note in data["notes"])
    assert "verl 0.9.0's warmup fails (see note)" in run_inspect(*args).stdout.splitlines()[0]
    result = run_inspect(str(saved["root"]), "--verl-version", "latest")
    assert result.exit_code == 2 and "expected a verl release like 0.9.1, got 'latest'" in result.output


def test_inspect_filter_groups_gives_a_lower_bound(saved: dict[str, Any]) -> None:
    args = [str(saved["root"]), *CONFIG_FLAGS, "--max-off-policy-threshold", "4", "--filter-groups"]
    data = inspect_json(*args)
    assert data["doomed"] == {"failure": 4, "stale": 4}  # DAPO's verdicts are not in a checkpoint
    assert (data["under_submitted"], data["under_submitted_is_lower_bound"]) == (8, True)
    text = run_inspect(*args).stdout
    assert "under-submitted by at least 8" in text.splitlines()[0]
    # The table says the same as the headline: a lower bound, not an exact-looking 8.
    rows = [line for line in text.splitlines() if line.startswith("under-submitted ")]
    assert [words(row) for row in rows] == ["under-submitted at least 8 (doomed filtered not known)"]


def test_inspect_accepts_a_step_dir_and_reports_progress_for_large_checkpoints(
    saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert inspect_json(str(saved["root"] / "global_step_45"))["restored"] == 24
    assert inspect_json(str(saved["root"] / "global_step_45" / "transfer_queue"))["step"] == 45
    assert inspect_json(str(saved["root"]), "--step", "45")["orphan_trajectories"] == 0

    assert "reading controller_state.pkl" not in run_inspect(str(saved["root"])).stderr  # small: no bar
    monkeypatch.setattr(layout, "LARGE_CHECKPOINT_BYTES", 0)
    result = run_inspect(str(saved["root"]), "--json")
    assert "reading controller_state.pkl" in result.stderr and "classifying 46 keys" in result.stderr
    assert json.loads(result.stdout)["restored"] == 20  # the bars never reach stdout


def test_inspect_reports_a_broken_checkpoint_as_an_error(root: Path) -> None:
    (root / "latest_checkpointed_iteration.txt").write_text("forty")
    result = run_inspect(str(root))
    assert result.exit_code == 1
    assert "latest_checkpointed_iteration.txt: expected a step number, got b'forty'" in result.stderr


# ---------------------------------------------------------------- the source, the tracker, the metrics


def value(exposition: str, name: str, **labels: str) -> float | None:
    """One sample of a text exposition, whatever order its labels are written in."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def metrics(tracker: Tracker) -> str:
    body, _ = render(build_registry(lambda: tracker.snapshot, process_metrics=False), None)
    return body.decode()


def test_source_feeds_the_tracker_and_the_metrics(root: Path) -> None:
    config = TrainerConfig(train_batch_size=8, num_warmup_batches=3, max_off_policy_threshold=4)
    tracker = Tracker(StateStore(None), given=GivenConfig("colocate_async", config, "flags"))
    source = CheckpointSource(root, tracker, interval=1.0)
    source.poll()
    view = tracker.snapshot.checkpoint
    assert view is not None
    assert (view.step, view.source, dict(view.by_status or {})) == (40, "checkpoint", STEP40)
    assert dict(view.doomed or {}) == {"failure": 4, "stale": 4, "filtered": 0}
    assert view.orphan_trajectories == 3
    assert tracker.snapshot.trainer_step is None  # a checkpoint on disk says nothing of the trainer's progress
    text = metrics(tracker)
    assert value(text, "tqmon_checkpoint_prompt_groups", status="finished") == 11
    assert value(text, "tqmon_checkpoint_doomed_prompt_groups", reason="stale") == 4
    assert value(text, "tqmon_checkpoint_orphan_trajectories") == 3
    assert value(text, "tqmon_source_up", source="checkpoint") == 1

    source.poll()  # unchanged: nothing new is ingested
    assert tracker.snapshot.counters[Tally.EVENTS] == {("checkpoint", "applied"): 1}

    (root / "latest_checkpointed_iteration.txt").write_text("45\n")
    source.poll()
    view = tracker.snapshot.checkpoint
    assert view is not None and view.step == 45
    assert dict(view.by_status or {}) == {"pending": 7, "running": 2, "finished": 9, "failure": 6}
    assert dict(view.doomed or {}) == {"failure": 6, "stale": 9, "filtered": 0}  # at step 46 every finished one
    assert view.orphan_trajectories == 0
    assert tracker.snapshot.counters[Tally.EVENTS] == {("checkpoint", "applied"): 2}


def test_source_predicts_the_warmup_of_the_verl_version_it_knows(root: Path) -> None:
    """The preflight series follow the version: both warmups while it is unknown, then the one it names."""
    config = TrainerConfig(train_batch_size=8, num_warmup_batches=3, max_off_policy_threshold=4)
    given = GivenConfig("colocate_async", config, "flags")
    tracker = Tracker(StateStore(None), given=given)
    CheckpointSource(root, tracker).poll()
    text = metrics(tracker)
    info = "tqmon_verl_version_info"
    assert value(text, info, verl_version="", semantics="unknown", source="unknown") == 1
    for semantics, submitted, over_filled, under in (("verl-0.9.1", 4, 0, 8), ("verl-0.9.0", 24, 20, 0)):
        assert value(text, "tqmon_checkpoint_warmup_submitted_prompt_groups", semantics=semantics) == submitted
        assert value(text, "tqmon_checkpoint_over_filled_prompt_groups", semantics=semantics) == over_filled
        assert value(text, "tqmon_checkpoint_under_submitted_prompt_groups", semantics=semantics) == under

    flagged = named("0.9.0", "flag", FLAG)
    tracker = Tracker(StateStore(None), given=given, versions=[v for v in (flagged, installed()) if v is not None])
    CheckpointSource(root, tracker).poll()
    text = metrics(tracker)
    assert value(text, info, verl_version="0.9.0", semantics="verl-0.9.0", source="flag") == 1
    assert value(text, "tqmon_checkpoint_warmup_submitted_prompt_groups", semantics="verl-0.9.0") == 24
    assert value(text, "tqmon_checkpoint_warmup_submitted_prompt_groups", semantics="verl-0.9.1") is None
    # The plugin's run_started names the release the trainer really runs: it wins over the flag.
    run = {"type": "run_started", "id": "run", "run_id": "r", "trainer_mode": "colocate_async", "verl_version": "0.9.1"}
    tracker.ingest([parse_event(run | {"config": config.model_dump()})], "events")
    text = metrics(tracker)
    assert value(text, info, verl_version="0.9.1", semantics="verl-0.9.1", source="run_started") == 1
    assert value(text, "tqmon_checkpoint_under_submitted_prompt_groups", semantics="verl-0.9.1") == 8
    assert value(text, "tqmon_checkpoint_under_submitted_prompt_groups", semantics="verl-0.9.0") is None


def test_serve_takes_the_verl_version_flag_and_refuses_a_non_release(
    root: Path, tmp_path: Path, tqmon_factory: Any
) -> None:
    args = ["--checkpoint-dir", str(root), *CONFIG_FLAGS, "--checkpoint-interval", "0.2"]
    tqmon = tqmon_factory([*args, "--verl-version", "0.9.0"]).start()
    deadline = time.monotonic() + 20
    text = ""
    while time.monotonic() < deadline:
        text = tqmon.metrics()
        if value(text, "tqmon_checkpoint_warmup_submitted_prompt_groups", semantics="verl-0.9.0") is not None:
            break
        time.sleep(0.1)
    assert value(text, "tqmon_checkpoint_warmup_submitted_prompt_groups", semantics="verl-0.9.0") == 24
    status = httpx.get(f"{tqmon.url}/api/v1/status").json()
    assert (status["verl_version"]["source"], status["verl_version"]["semantics"]) == ("flag", "verl-0.9.0")
    [outcome] = status["checkpoint"]["outcomes"]
    assert (outcome["semantics"], outcome["submitted"], outcome["over_filled"]) == ("verl-0.9.0", 24, 20)

    result = CliRunner().invoke(main, ["serve", "--state-dir", str(tmp_path / "s"), "--verl-version", "latest"])
    assert result.exit_code == 2 and "--verl-version: expected a verl release like 0.9.1, got 'latest'" in result.output


def doomed(tracker: Tracker) -> dict[str, int] | None:
    view = tracker.snapshot.checkpoint
    return None if view is None or view.doomed is None else dict(view.doomed)


def test_source_event_survives_restart_and_config_arriving_later(root: Path, tmp_path: Path) -> None:
    store = tmp_path / "state"
    tracker = Tracker(StateStore(store))
    CheckpointSource(root, tracker).poll()
    # No config yet: verl's default threshold 8 decides stale, and the view says it assumed it.
    assert doomed(tracker) == {"failure": 4, "stale": 2, "filtered": 0}
    view = tracker.snapshot.checkpoint
    assert view is not None and "max_off_policy_threshold=8" in view.assumed_defaults
    run = {
        "type": "run_started",
        "id": "run",
        "run_id": "r",
        "trainer_mode": "colocate_async",
        "config": {"train_batch_size": 8, "num_warmup_batches": 3, "max_off_policy_threshold": 4},
    }
    tracker.ingest([parse_event(run)], "events")
    assert doomed(tracker) == {"failure": 4, "stale": 4, "filtered": 0}  # the run's own threshold 4
    view = tracker.snapshot.checkpoint
    assert view is not None and view.assumed_defaults == ()

    restarted = Tracker(StateStore(store))
    restarted.replay()
    assert doomed(restarted) == {"failure": 4, "stale": 4, "filtered": 0}
    view = restarted.snapshot.checkpoint
    assert view is not None and view.step == 40 and view.orphan_trajectories == 3
    CheckpointSource(root, restarted).poll()  # the same checkpoint again: a duplicate, not a second event
    assert restarted.snapshot.counters[Tally.EVENTS][("checkpoint", "duplicate")] == 1


def test_tracker_checkpoint_saved_rules() -> None:
    tracker = Tracker(StateStore(None))
    by_status = {"pending": 1, "running": 0, "finished": 5, "failure": 2}
    tracker.ingest(
        [parse_event({"type": "checkpoint_saved", "id": "e1", "step": 30, "by_status": by_status})], "events"
    )
    view = tracker.snapshot.checkpoint
    # Statuses alone decide failure; verl's default filter_groups=false decides filtered; stale needs steps.
    assert view is not None and dict(view.doomed or {}) == {"failure": 2, "filtered": 0}
    assert view.assumed_defaults == ("filter_groups=false",)
    assert tracker.snapshot.trainer_step == 30  # the trainer said it saved step 30

    tracker.ingest([CheckpointSaved(id="log:1", step=30)], "log")  # the bare log line of the same save
    assert tracker.snapshot.checkpoint == view
    tracker.ingest([CheckpointSaved(id="log:2", step=35)], "log")  # a newer save replaces it
    assert tracker.snapshot.checkpoint is not None and tracker.snapshot.checkpoint.step == 35

    with pytest.raises(ValueError, match="disagrees with groups"):
        parse_event(
            {
                "type": "checkpoint_saved",
                "id": "x",
                "step": 3,
                "by_status": {"failure": 1},
                "groups": [{"status": "finished", "global_steps": 2, "count": 1}],
            }
        )


# ---------------------------------------------------------------- hostile and broken checkpoints


class _Shell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_nothing_runs(root: Path, tmp_path: Path) -> None:
    payload = pickle.dumps({"partitions": {"train": _Shell(tmp_path / "pwned")}})
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Shell(control)))  # the stock unpickler runs such a payload
    assert control.exists()

    pkl(root).write_bytes(payload)
    with pytest.raises(CheckpointError, match=rf"refused global {os.system.__module__}\.system") as err:
        read_checkpoint(root)
    assert err.value.reason == "invalid_data" and "controller_state.pkl" in str(err.value)
    assert not (tmp_path / "pwned").exists()


def test_payload_hidden_in_an_allowed_torch_storage_is_never_loaded(root: Path, tmp_path: Path) -> None:
    import torch.storage

    class Hidden:
        def __reduce__(self) -> tuple[Any, ...]:
            return (torch.storage._load_from_bytes, (pickle.dumps(_Shell(self.marker)),))

        marker = tmp_path / "pwned"

    Hidden.marker = tmp_path / "control"
    with pytest.raises(RuntimeError, match="magic number"):  # torch.load runs the inner pickle, then gives up
        pickle.loads(pickle.dumps(Hidden()))
    assert Hidden.marker.exists()

    Hidden.marker = tmp_path / "pwned"
    pkl(root).write_bytes(pickle.dumps({"partitions": {"train": Hidden()}}))
    with pytest.raises(CheckpointError, match="partition 'train' is OpaqueStorage"):
        read_checkpoint(root)
    assert not (tmp_path / "pwned").exists()


def _short(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


def test_an_allowed_global_cannot_be_reconfigured_by_build(root: Path) -> None:
    """``GLOBAL torch._utils _rebuild_tensor_v2`` then ``BUILD (None, {"__defaults__": (1,)})``: a stock
    function would silently keep the new defaults for every later read."""
    tamper = (
        b"\x80\x04" + _short("torch._utils") + _short("_rebuild_tensor_v2") + b"\x93"  # PROTO, STACK_GLOBAL
        b"N}" + _short("__defaults__") + b"K\x01\x85s\x86b."  # (None, {"__defaults__": (1,)}), BUILD, STOP
    )
    pkl(root).write_bytes(tamper)
    with pytest.raises(CheckpointError, match=r"refused to modify torch\._utils\._rebuild_tensor_v2"):
        read_checkpoint(root)
    assert unpickler._rebuild_tensor.__defaults__ is None


@pytest.mark.parametrize(
    ("breakage", "reason", "message"),
    [
        ("latest_not_a_number", "invalid_data", "latest_checkpointed_iteration.txt: expected a step number"),
        ("metadata_not_json", "invalid_data", "metadata.json: not valid JSON"),
        ("metadata_wrong_step", "invalid_data", "user_metadata.global_steps is 7, not 40"),
        ("pickle_truncated", "invalid_data", "controller_state.pkl: truncated pickle"),
        ("pickle_missing", "read_error", "controller_state.pkl does not exist"),
        ("step_dir_missing", "read_error", "says 40, but"),
    ],
)
def test_broken_checkpoint_fails_the_source_cleanly(root: Path, breakage: str, reason: str, message: str) -> None:
    tq_dir = root / "global_step_40" / "transfer_queue"
    good = pkl(root).read_bytes()
    match breakage:
        case "latest_not_a_number":
            (root / "latest_checkpointed_iteration.txt").write_text("step40")
        case "metadata_not_json":
            (tq_dir / "metadata.json").write_text('{"storage_saved": true,')
        case "metadata_wrong_step":
            (tq_dir / "metadata.json").write_text('{"storage_saved": true, "user_metadata": {"global_steps": 7}}')
        case "pickle_truncated":
            pkl(root).write_bytes(good[: len(good) // 2])
        case "pickle_missing":
            pkl(root).unlink()
        case "step_dir_missing":
            shutil.rmtree(root / "global_step_40")
    tracker = Tracker(StateStore(None))
    source = CheckpointSource(root, tracker)
    source.poll()
    source.poll()  # still broken: counted again, not re-read into a different answer
    snap = tracker.snapshot
    health = next(s for s in snap.sources if s.source == "checkpoint")
    assert not health.ok and message in (health.last_error or "")
    assert snap.counters[Tally.SOURCE_ERRORS] == {("checkpoint", reason): 2}
    assert snap.checkpoint is None and snap.counters[Tally.EVENTS] == {}


def test_no_checkpoint_yet_is_a_state_not_a_failure(tmp_path: Path) -> None:
    lines: list[str] = []
    tracker = Tracker(StateStore(None), announce=lines.append)
    CheckpointSource(tmp_path / "nothing-yet", tracker).poll()
    health = next(s for s in tracker.snapshot.sources if s.source == "checkpoint")
    assert health.ok and health.last_error is None and tracker.snapshot.counters[Tally.SOURCE_ERRORS] == {}
    latest = tmp_path / "nothing-yet" / "latest_checkpointed_iteration.txt"
    assert lines == [
        f"checkpoint: no checkpoint saved yet: {latest} does not exist ({latest.parent} does not exist yet): waiting"
    ]


def test_serve_keeps_serving_with_a_hostile_checkpoint(root: Path, tmp_path: Path, tqmon_factory: Any) -> None:
    good = pkl(root).read_bytes()
    pkl(root).write_bytes(pickle.dumps({"partitions": {"train": _Shell(tmp_path / "pwned")}}))
    args = ["--checkpoint-dir", str(root), "--checkpoint-interval", "0.2", *CONFIG_FLAGS]
    tqmon = tqmon_factory([*args, "--max-off-policy-threshold", "4"]).start()

    def wait_for(ok: Any, name: str, **labels: str) -> str:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text: str = tqmon.metrics()
            if ok(value(text, name, **labels)):
                return text
            time.sleep(0.1)
        raise AssertionError(f"{name}{labels} never satisfied the condition:\n{text}")

    errors = {"source": "checkpoint", "reason": "invalid_data"}
    text = wait_for(lambda v: v is not None and v >= 1, "tqmon_source_errors_total", **errors)
    assert value(text, "tqmon_source_up", source="checkpoint") == 0
    assert value(text, "tqmon_checkpoint_step") is None  # nothing was ingested
    assert httpx.get(tqmon.url + "/healthz", timeout=5).status_code == 200
    assert not (tmp_path / "pwned").exists()

    pkl(root).write_bytes(good)  # the operator restores the file: the source recovers by itself
    text = wait_for(lambda v: v == 1, "tqmon_source_up", source="checkpoint")
    assert value(text, "tqmon_checkpoint_step") == 40
    assert value(text, "tqmon_checkpoint_prompt_groups", status="failure") == 4
    assert value(text, "tqmon_checkpoint_doomed_prompt_groups", reason="stale") == 4
    assert value(text, "tqmon_checkpoint_orphan_trajectories") == 3


def test_checkpoint_series_follow_the_directory_back_and_away(root: Path) -> None:
    """A rollback (latest file set back, newer step deleted), a deleted step and a vanished dir are followed."""
    tracker = Tracker(StateStore(None))
    source = CheckpointSource(root, tracker)
    (root / "latest_checkpointed_iteration.txt").write_text("45\n")
    source.poll()
    assert value(metrics(tracker), "tqmon_checkpoint_step") == 45
    # The trainer's own "saved" line for a step the dir does not hold moves the trainer, not the dir's series.
    saved = parse_event({"type": "checkpoint_saved", "id": "log50", "step": 50})
    tracker.ingest([saved], "log")
    assert value(metrics(tracker), "tqmon_checkpoint_step") == 45

    (root / "latest_checkpointed_iteration.txt").write_text("40\n")
    shutil.rmtree(root / "global_step_45")
    source.poll()
    text = metrics(tracker)
    assert value(text, "tqmon_checkpoint_step") == 40
    assert value(text, "tqmon_checkpoint_prompt_groups", status="finished") == STEP40["finished"]
    assert value(text, "tqmon_checkpoint_orphan_trajectories") == 3
    assert value(text, "tqmon_source_up", source="checkpoint") == 1

    (root / "latest_checkpointed_iteration.txt").write_text("45\n")  # points at the deleted step
    source.poll()
    text = metrics(tracker)
    assert value(text, "tqmon_checkpoint_step") is None
    assert value(text, "tqmon_checkpoint_prompt_groups", status="finished") is None
    health = next(s for s in tracker.snapshot.sources if s.source == "checkpoint")
    assert not health.ok and "says 45, but" in (health.last_error or "")

    shutil.rmtree(root)
    source.poll()
    assert tracker.snapshot.checkpoint is None
    health = next(s for s in tracker.snapshot.sources if s.source == "checkpoint")
    # Not "no checkpoint saved yet": this source read global_step_40 here, so they were deleted.
    assert (
        not health.ok
        and health.last_error == f"checkpoints gone: {root} does not exist any more (global_step_40 was read)"
    )

    fresh = Tracker(StateStore(None))
    CheckpointSource(root, fresh).poll()  # never held one: a fresh run, up with no series
    health = next(s for s in fresh.snapshot.sources if s.source == "checkpoint")
    assert health.ok and fresh.snapshot.checkpoint is None


RESUME_LOG = """\
INFO:2026-11-28 22:00:00,000:Resuming from {root}/global_step_40, setting global step to 40
INFO:2026-11-28 22:00:01,000:Restored 20 training prompt groups from TransferQueue
INFO:2026-11-28 22:00:02,000:Re-issued 5 in-flight prompts for step 41; cleared 1 old trajectories from partition train
INFO:2026-11-28 22:00:03,000:Added 4 warmup prompts after restoring 20 of 24 target prompt groups
"""

TRAINER_CONFIG = """\
data: {train_batch_size: 8}
trainer:
  project_name: dapo
  experiment_name: run7
  v1:
    trainer_mode: colocate_async
    colocate_async: {num_warmup_batches: 3}
    sampler: {max_off_policy_threshold: 4, max_off_policy_strategy: drop}
"""


def test_analyze_with_the_checkpoint_dir_and_config_gets_the_exact_deficit(root: Path, tmp_path: Path) -> None:
    """R 20 with 4 failed and (threshold 8) 2 stale groups, T 24, M 4: verl's deficit is 6; the log alone
    cannot tell, and must not print it as an exact 0."""
    log = tmp_path / "trainer.log"
    log.write_text(RESUME_LOG.format(root=root))

    def record(*flags: str) -> dict[str, Any]:
        result = CliRunner().invoke(main, ["analyze", "--json", *flags, str(log)])
        assert result.exit_code == 0, result.output
        records: list[dict[str, Any]] = json.loads(result.stdout)["records"]
        assert len(records) == 1
        return records[0]

    bare = record()
    assert (bare["under_submitted"], bare["under_submitted_lower_bound"]) == (0, True)
    text = CliRunner().invoke(main, ["analyze", str(log)]).stdout
    assert "verdict" in text and "≥0" in text
    assert "deficit at least 0 (doomed failure, stale not known): not known to be ok" in text
    assert " ok" not in text.replace("not known to be ok", "")

    exact = record("--checkpoint-dir", str(root))
    assert exact["doomed"] == {"failure": 4, "stale": 2, "filtered": 0}
    assert (exact["under_submitted"], exact["under_submitted_lower_bound"]) == (6, False)
    assert exact["assumed_defaults"] == [
        "max_off_policy_threshold=8",
        "max_off_policy_strategy=drop",
        "filter_groups=false",
    ]
    text = CliRunner().invoke(main, ["analyze", "--checkpoint-dir", str(root), str(log)]).stdout
    assert "UNDER-SUBMITTED by 6 (assuming verl defaults max_off_policy_threshold=8" in text

    config = tmp_path / "config.yaml"
    config.write_text(TRAINER_CONFIG)
    configured = record("--checkpoint-dir", str(root), "--trainer-config", str(config))
    assert configured["doomed"] == {"failure": 4, "stale": 4, "filtered": 0}
    assert (configured["under_submitted"], configured["under_submitted_lower_bound"]) == (8, False)
    assert configured["assumed_defaults"] == [] and configured["run_id"] == "dapo/run7"


def test_serve_without_config_counts_stale_groups_by_verl_defaults_and_marks_lower_bounds(root: Path) -> None:
    """The serve path: the log's R, T and M; the checkpoint dir's composition; no trainer config."""
    from tqmon.report import verdict
    from tqmon.sources.logfile import parse_chunk

    lines = RESUME_LOG.format(root=root).encode().splitlines()
    events, _, errors = parse_chunk(enumerate(lines), "log")
    assert not errors
    alone = Tracker(StateStore(None))
    alone.ingest(events, "log")
    text = metrics(alone)
    assert value(text, "tqmon_resume_under_submitted_prompt_groups") == 0
    assert value(text, "tqmon_resume_under_submitted_lower_bound") == 1  # failure and stale unknown
    record = alone.snapshot.last_record
    assert record is not None and verdict(record).startswith("deficit at least 0 (doomed failure, stale not known)")

    tracker = Tracker(StateStore(None))
    CheckpointSource(root, tracker).poll()
    tracker.ingest(events, "log")
    text = metrics(tracker)
    assert value(text, "tqmon_resume_doomed_prompt_groups", reason="stale") == 2  # verl's default threshold 8
    assert value(text, "tqmon_resume_under_submitted_prompt_groups") == 6  # 24 - (20 - 6 + 4), not 2
    assert value(text, "tqmon_resume_under_submitted_lower_bound") == 0
    record = tracker.snapshot.last_record
    assert record is not None
    assert verdict(record) == (
        "UNDER-SUBMITTED by 6 (assuming verl defaults max_off_policy_threshold=8, max_off_policy_strategy=drop, "
        "filter_groups=false)"
    )


# ---------------------------------------------------------------- the checkpoint a resume actually loaded
# Step 40 holds 3 pending, 2 running, 11 finished and 4 failed groups (R 20); step 45, the latest, holds 24.
LOADED_40 = {"pending": 3, "running": 2, "finished": 11, "failure": 4}
OLDER_RESUME_LOG = """\
INFO:2026-11-28 22:00:00,000:Resuming from {folder}, setting global step to 40
INFO:2026-11-28 22:00:01,000:Restored 20 training prompt groups from TransferQueue
"""


@pytest.mark.parametrize("where", ["older_step_in_the_dir", "resume_from_path_outside"])
def test_serve_completes_a_resume_from_the_checkpoint_it_loaded_not_the_latest(
    root: Path, tmp_path: Path, tqmon_factory: Any, where: str
) -> None:
    """The log gives only R; the split comes from the checkpoint the resume loaded, the preflight stays at 45."""
    (root / "latest_checkpointed_iteration.txt").write_text("45")
    folder = root / "global_step_40"
    if where == "resume_from_path_outside":  # trainer.resume_from_path: not in the dir at all any more
        folder = tmp_path / "elsewhere" / "global_step_40"
        folder.parent.mkdir()
        shutil.move(root / "global_step_40", folder)
    log = tmp_path / "trainer.log"
    log.write_text(OLDER_RESUME_LOG.format(folder=folder))
    args = ["--checkpoint-dir", str(root), "--checkpoint-interval", "0.2", "--log", str(log), "--log-interval", "0.2"]
    tqmon = tqmon_factory([*args, *CONFIG_FLAGS]).start()

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text: str = tqmon.metrics()
        if value(text, "tqmon_resume_restored_prompt_groups", status="finished") is not None:
            break
        time.sleep(0.1)
    split = {s: value(text, "tqmon_resume_restored_prompt_groups", status=s) for s in LOADED_40}
    assert split == LOADED_40, text
    assert value(text, "tqmon_resume_restored_prompt_groups", status="unknown") in (None, 0)
    assert value(text, "tqmon_checkpoint_step") == 45  # the preflight view stays the directory's latest
    assert value(text, "tqmon_checkpoint_prompt_groups", status="pending") == 7
    assert value(text, "tqmon_source_up", source="checkpoint") == 1


def test_loaded_checkpoint_without_a_named_folder_and_a_missing_one(root: Path) -> None:
    """No folder named: global_step_N of the dir. A missing one is counted once, the source stays up."""
    (root / "latest_checkpointed_iteration.txt").write_text("45")
    tracker = Tracker(StateStore(None))
    source = CheckpointSource(root, tracker)
    tracker.ingest([parse_event({"id": "s", "type": "training_started", "resumed_from_step": 40})], "events")
    assert tracker.wanted_checkpoint() == (40, None)
    source.poll()
    record = tracker.snapshot.last_record
    assert record is not None and record.checkpoint_step == 40 and record.restored == 20
    assert {s: n for s, n in (record.restored_by_status or {}).items() if n} == LOADED_40
    assert tracker.wanted_checkpoint() is None
    assert tracker.snapshot.checkpoint is not None and tracker.snapshot.checkpoint.step == 45

    named = "/nowhere/global_step_40"
    start = {"id": "s", "type": "training_started", "resumed_from_step": 40, "checkpoint_path": named}
    mounted = Tracker(StateStore(None))  # the trainer's path is not visible here (mounted elsewhere): the dir's
    mounted.ingest([parse_event(start)], "events")
    CheckpointSource(root, mounted).poll()
    record = mounted.snapshot.last_record
    assert mounted.wanted_checkpoint() is None and record is not None and record.restored == 20

    shutil.rmtree(root / "global_step_40")  # the named folder is missing, and so is the fallback
    broken = Tracker(StateStore(None))
    source = CheckpointSource(root, broken)
    broken.ingest([parse_event(start)], "events")
    source.poll()
    source.poll()  # the same (missing) files: not read nor counted again
    text = metrics(broken)
    assert value(text, "tqmon_source_errors_total", source="checkpoint", reason="read_error") == 1
    assert value(text, "tqmon_source_up", source="checkpoint") == 1
    assert value(text, "tqmon_checkpoint_step") == 45
    assert broken.wanted_checkpoint() == (40, named)


# ---------------------------------------------------------------- DAPO verdicts from the storage units
# Every trajectory above has rm_scores = three bfloat16 ones, so each finished group's "reward" (the summed
# rm_scores) is 3.0 on both trajectories: zero variance. At step 41 with threshold 4, the 4 groups with
# g <= 37 are stale first; the other 7 finished groups are filtered. Their metric "acc" (numpy scalars, ACC)
# has zero variance in 7 groups, 3 of them stale: 4 are filtered.


def test_inspect_predicts_filtered_groups_from_the_storage_units(saved: dict[str, Any]) -> None:
    args = [str(saved["root"]), *CONFIG_FLAGS, "--max-off-policy-threshold", "4", "--filter-groups"]
    data = inspect_json(*args, "--filter-groups-metric", "reward")
    assert data["doomed"] == {"failure": 4, "stale": 4, "filtered": 7}
    assert data["doomed_complete"] is True
    assert (data["useful_after_warmup"], data["under_submitted"], data["under_submitted_is_lower_bound"]) == (
        9,
        15,
        False,
    )
    dapo = data["dapo"]
    assert (dapo["metric"], dapo["finished_judged"], dapo["zero_variance"], dapo["zero_variance_stale"]) == (
        "reward",
        11,
        11,
        4,
    )
    assert (dapo["missing_metric"], dapo["trajectories_read"]) == (0, 22)
    text = words(run_inspect(*args, "--filter-groups-metric", "reward").stdout)
    assert "filtered 7" in text and "under-submitted by 15" in text and "at least" not in text


def test_inspect_reports_progress_walking_large_storage_units(
    saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [str(saved["root"]), *CONFIG_FLAGS, "--filter-groups", "--filter-groups-metric", "reward"]
    assert "reading su_0_" not in run_inspect(*args).stderr  # small: no bar
    monkeypatch.setattr(layout, "LARGE_CHECKPOINT_BYTES", 0)
    result = run_inspect(*args, "--json")
    assert "reading su_0_" in result.stderr
    assert json.loads(result.stdout)["dapo"]["zero_variance"] == 11  # the bars never reach stdout


def test_inspect_predicts_filtered_groups_from_numpy_scalar_metrics(saved: dict[str, Any]) -> None:
    """verl reads float() of each np.float64/np.float32 "acc": no crash, and the float32 values as they are."""
    zero = {uid for uid, values in ACC.items() if float(np.std([float(v) for v in values])) == 0.0}  # verl's test
    assert zero == {P[5], P[7], P[9], P[11], P[12], P[13], P[15]}
    args = [str(saved["root"]), *CONFIG_FLAGS, "--max-off-policy-threshold", "4", "--filter-groups"]
    data = inspect_json(*args, "--filter-groups-metric", "acc")
    assert data["doomed"] == {"failure": 4, "stale": 4, "filtered": 4}
    assert (data["useful_after_warmup"], data["under_submitted"], data["under_submitted_is_lower_bound"]) == (
        12,
        12,
        False,
    )
    dapo = data["dapo"]
    assert (dapo["finished_judged"], dapo["zero_variance"], dapo["zero_variance_stale"]) == (11, 7, 3)
    assert (dapo["missing_metric"], dapo["refused_groups"], dapo["trajectories_read"]) == (0, 0, 22)
    assert data["notes"] == [
        "DAPO (acc): 7 of 11 finished groups have zero variance; verl reports 7 as filter_groups/evicted_samples, "
        "3 of them also as off_policy (doomed counts those as stale)"
    ]


def test_inspect_names_a_missing_metric_as_verls_first_sample_error(saved: dict[str, Any]) -> None:
    args = [str(saved["root"]), *CONFIG_FLAGS, "--filter-groups", "--filter-groups-metric", "score"]
    data = inspect_json(*args)
    assert "filtered" not in data["doomed"] and data["under_submitted_is_lower_bound"] is True
    assert data["dapo"]["missing_metric"] == 11
    assert any(
        "11 finished group(s) lack DAPO metric 'score'" in note and "RuntimeError" in note for note in data["notes"]
    )


def rewrite_unit(root: Path, field: str, values: dict[str, Any]) -> Path:
    """Step 40's storage unit with ``field`` of some trajectory keys replaced, through TQ's own storage class."""
    from transfer_queue.storage.simple_storage import StorageUnitData

    tq_dir = root / "global_step_40" / "transfer_queue"
    with open(tq_dir / "controller_state.pkl", "rb") as handle:
        index = {key: i for key, i, _ in layout.partition_keys(unpickler.restricted_load(handle))}
    path = next((tq_dir / "simple_storage").glob("su_*.pkl"))
    unit = StorageUnitData(1000)
    unit.load_checkpoint(path)  # our own test file: the stock unpickler is fine here
    unit.put_data({field: list(values.values())}, [index[key] for key in values])
    unit.save_checkpoint(path, path.stem.split("_", 2)[2])
    return path


def test_a_metric_value_tqmon_cannot_decode_is_said_and_counted_not_predicted_as_a_crash(root: Path) -> None:
    unit = rewrite_unit(root, "extra_fields", {f"{P[6]}_0_1": {"reward_extra_info": {"acc": np.longdouble(0.1)}}})
    config = TrainerConfig(train_batch_size=8, num_warmup_batches=3, filter_groups=True, filter_groups_metric="acc")
    lines: list[str] = []
    tracker = Tracker(StateStore(None), given=GivenConfig("colocate_async", config, "flags"), announce=lines.append)
    CheckpointSource(root, tracker, interval=1.0, filter_metric="acc").poll()
    text = metrics(tracker)
    assert value(text, "tqmon_source_errors_total", reason="invalid_data", source="checkpoint") == 1
    assert value(text, "tqmon_checkpoint_doomed_prompt_groups", reason="filtered") is None  # unknown, not 0
    assert value(text, "tqmon_checkpoint_doomed_prompt_groups", reason="failure") == 4
    reason = (
        f"1 finished group(s) refused: {unit.name}, global index {{}}: refused a numpy scalar of dtype 'f16' "
        "(tqmon decodes numpy's bool, int, float and complex) in the DAPO metric's field"
    )
    assert len(lines) == 1 and lines[0].startswith("checkpoint: DAPO's filtered groups unknown: 1 finished group(s)")
    index = int(lines[0].split("global index ")[1].split(":")[0])
    assert lines[0] == f"checkpoint: DAPO's filtered groups unknown: {reason.format(index)}"

    data = inspect_json(str(root), *CONFIG_FLAGS, "--filter-groups", "--filter-groups-metric", "acc")
    assert (data["dapo"]["missing_metric"], data["dapo"]["refused_groups"]) == (0, 1)
    assert "filtered" not in data["doomed"] and data["under_submitted_is_lower_bound"] is True
    assert data["notes"] == [
        "1 finished group(s) hold a value of DAPO metric 'acc' tqmon cannot decode, so filtered is unknown "
        f"({reason.format(index).split(': ', 1)[1]})"
    ]


# A legacy torch.save record of 14 bytes: PROTO 2, BININT 1, LONG_BINPUT 2**25, TUPLE1, STOP. CPython's
# unpickler sizes its memo array to the index: 512 MiB for these 14 bytes.
MEMO_BOMB = b"\x80\x02J\x01\x00\x00\x00r" + (1 << 25).to_bytes(4, "little") + b"\x85."


def test_a_torch_record_sizing_the_memo_is_refused_before_unpickling(root: Path) -> None:
    import collections
    import resource

    import torch

    class Storage:
        def __reduce__(self) -> tuple[Any, ...]:
            genuine = torch.ones(3, dtype=torch.bfloat16).untyped_storage().__reduce__()[1][0]
            return (torch.storage._load_from_bytes, (MEMO_BOMB + genuine,))

    class Scores:  # an rm_scores tensor whose storage's first record is the bomb
        def __reduce__(self) -> tuple[Any, ...]:
            return (torch._utils._rebuild_tensor_v2, (Storage(), 0, (3,), (1,), False, collections.OrderedDict()))

    assert len(MEMO_BOMB) == 14
    unit = rewrite_unit(root, "rm_scores", {f"{P[6]}_0_1": Scores()})
    lines: list[str] = []
    tracker = Tracker(
        StateStore(None), given=GivenConfig("colocate_async", DAPO_CONFIG, "flags"), announce=lines.append
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        started = time.monotonic()
        CheckpointSource(root, tracker, interval=1.0, filter_metric="reward").poll()
        seconds = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20, peak  # the stock unpickler allocates 512 MiB for the record
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50 << 10  # KiB
    assert seconds < 5
    assert lines == [
        f"checkpoint: DAPO's filtered groups unknown: {unit}: torch storage record refused before unpickling "
        "(memo_index): LONG_BINPUT 33554432 leaves a gap in a memo of 0"
    ]
    text = metrics(tracker)
    assert value(text, "tqmon_source_errors_total", reason="invalid_data", source="checkpoint") == 1
    assert value(text, "tqmon_source_up", source="checkpoint") == 1  # the rest of the checkpoint is served
    assert value(text, "tqmon_checkpoint_prompt_groups", status="finished") == 11
    assert doomed(tracker) == {"failure": 4, "stale": 4}  # filtered unknown


def test_unreadable_storage_units_are_counted_and_the_composition_still_served(root: Path) -> None:
    unit = next((root / "global_step_40" / "transfer_queue" / "simple_storage").glob("su_*.pkl"))
    unit.write_bytes(unit.read_bytes()[:-100])  # truncated
    config = TrainerConfig(train_batch_size=8, num_warmup_batches=3, filter_groups=True, filter_groups_metric="reward")
    lines: list[str] = []
    tracker = Tracker(StateStore(None), given=GivenConfig("colocate_async", config, "flags"), announce=lines.append)
    CheckpointSource(root, tracker, interval=1.0, filter_metric="reward").poll()
    text = metrics(tracker)
    assert value(text, "tqmon_source_errors_total", reason="invalid_data", source="checkpoint") == 1
    assert value(text, "tqmon_source_up", source="checkpoint") == 1
    assert value(text, "tqmon_checkpoint_prompt_groups", status="finished") == 11
    assert value(text, "tqmon_checkpoint_doomed_prompt_groups", reason="filtered") is None  # unknown, not 0
    assert value(text, "tqmon_checkpoint_doomed_prompt_groups", reason="failure") == 4
    assert len(lines) == 1 and lines[0].startswith("checkpoint: DAPO's filtered groups unknown: ")
    assert "truncated pickle" in lines[0] and unit.name in lines[0]


# DAPO over the fixture: T 24, threshold 4, filtered by the "reward" metric, 4 rollouts per group.
DAPO_CONFIG = TrainerConfig(
    train_batch_size=8,
    num_warmup_batches=3,
    max_off_policy_threshold=4,
    filter_groups=True,
    filter_groups_metric="reward",
    rollout_n=4,
)


def test_source_exports_the_filtered_groups(root: Path) -> None:
    tracker = Tracker(StateStore(None), given=GivenConfig("colocate_async", DAPO_CONFIG, "flags"))
    CheckpointSource(root, tracker, interval=1.0, filter_metric="reward").poll()
    assert doomed(tracker) == {"failure": 4, "stale": 4, "filtered": 7}
    assert value(metrics(tracker), "tqmon_checkpoint_doomed_prompt_groups", reason="filtered") == 7


def test_dapo_verdicts_make_the_resume_deficit_exact(root: Path) -> None:
    """Under DAPO, filtered groups decided from the storage units are known: the deficit is exact, not a bound."""
    from tqmon.sources.logfile import parse_chunk

    config = DAPO_CONFIG
    events, _, errors = parse_chunk(enumerate(RESUME_LOG.format(root=root).encode().splitlines()), "log")
    assert not errors
    tracker = Tracker(StateStore(None), given=GivenConfig("colocate_async", config, "flags"))
    CheckpointSource(root, tracker, interval=1.0, filter_metric="reward").poll()
    tracker.ingest(events, "log")
    record = tracker.snapshot.last_record
    assert record is not None and record.doomed == {"failure": 4, "stale": 4, "filtered": 7}
    text = metrics(tracker)
    assert value(text, "tqmon_resume_under_submitted_prompt_groups") == 15  # 24 - (20 - 15 + 4)
    assert value(text, "tqmon_resume_under_submitted_lower_bound") == 0
    assert record.cost.wasted_rollouts == 15 * 4  # the cost reads the same complete doomed counts

    blind = Tracker(StateStore(None), given=GivenConfig("colocate_async", config, "flags"))
    CheckpointSource(root, blind, interval=1.0).poll()  # no metric read: filtered unknown, a lower bound
    blind.ingest(events, "log")
    assert value(metrics(blind), "tqmon_resume_under_submitted_prompt_groups") == 8  # 24 - (20 - 8 + 4)
    assert value(metrics(blind), "tqmon_resume_under_submitted_lower_bound") == 1
    assert blind.snapshot.last_record is not None and blind.snapshot.last_record.cost.wasted_rollouts is None


def test_analyze_reads_dapo_verdicts_from_the_checkpoint_dir(root: Path, tmp_path: Path) -> None:
    """analyze --checkpoint-dir gives the storage units DAPO's metric, as serve's checkpoint source does."""
    log = tmp_path / "trainer.log"
    log.write_text(RESUME_LOG.format(root=root))
    dapo = ["--train-batch-size", "8", "--num-warmup-batches", "3", "--max-off-policy-threshold", "4"]
    dapo += ["--filter-groups", "--filter-groups-metric", "reward", "--rollout-n", "4"]
    result = CliRunner().invoke(main, ["analyze", "--json", "--checkpoint-dir", str(root), *dapo, str(log)])
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)["records"]
    assert record["doomed"] == {"failure": 4, "stale": 4, "filtered": 7}
    assert (record["under_submitted"], record["under_submitted_lower_bound"]) == (15, False)
    assert record["cost"]["wasted_rollouts"] == 60


# ---------------------------------------------------------------- step regression at resume (issue 21)

# verl's own lines: the trainer's start, then Tracking's console backend (``concat_dict_to_str``) per step.
SCRATCH_LOG = """\
INFO:{at}:Training from scratch
step:1 - training/global_step:1 - timing_s/gen:2.5 - timing_s/step:10.0
step:2 - training/global_step:2 - timing_s/gen:2.5 - timing_s/step:10.0
"""
RESUMED_LOG = (
    RESUME_LOG
    + "step:{first} - training/global_step:{first} - timing_s/gen:2.5 - timing_s/step:10.0\n"
    + "step:{second} - training/global_step:{second} - timing_s/gen:2.5 - timing_s/step:10.0\n"
)
START = "2026-11-28 22:00:00,000"  # RESUME_LOG's first line


def _saved_before_the_start(root: Path) -> None:
    """Every global_step_N and the latest file written an hour before the start the logs below report."""
    before = datetime.datetime(2026, 11, 28, 21, 0).astimezone().timestamp()
    for path in [*root.glob("global_step_*"), root / "latest_checkpointed_iteration.txt"]:
        if path.exists():
            os.utime(path, (before, before))


def _analyze(log_text: str, tmp_path: Path, root: Path | None) -> dict[str, Any]:
    log = tmp_path / "trainer.log"
    log.write_text(log_text)
    flags = ["--checkpoint-dir", str(root)] if root is not None else []
    result = CliRunner().invoke(main, ["analyze", "--json", *flags, str(log)])
    assert result.exit_code == 0, result.output
    records: list[dict[str, Any]] = json.loads(result.stdout)["records"]
    assert len(records) == 1
    return records[0]


def _resumed(root: Path, first: int = 41, second: int = 42) -> str:
    return RESUMED_LOG.format(root=root, first=first, second=second)


def test_a_fresh_start_while_checkpoints_exist_without_the_latest_file_is_a_regression(
    root: Path, tmp_path: Path
) -> None:
    """verl #7952: FSDP async_save never writes latest_checkpointed_iteration.txt, so resume_mode=auto starts
    from scratch while global_step_40 and global_step_45 exist: flagged with both steps and why, by analyze and
    by serve's checkpoint source and metrics."""
    (root / "latest_checkpointed_iteration.txt").unlink()
    _saved_before_the_start(root)
    log_text = SCRATCH_LOG.format(at=START)
    record = _analyze(log_text, tmp_path, root)
    assert record["step_regressions"] == [{"step": 0, "newer_step": 45, "reason": "latest_file_missing"}]
    details = [
        e["detail"] for e in record["evidence"] if e["event_type"] in ("step_regression", "checkpoint_dir_listed")
    ]
    assert details == [
        "global_step_45 saved before",
        "step regression: started from scratch (step 0) while step 45 was saved: latest_checkpointed_iteration.txt"
        " is missing (verl's resume_mode=auto starts fresh)",
    ]
    text = CliRunner().invoke(main, ["analyze", "--checkpoint-dir", str(root), str(tmp_path / "trainer.log")]).stdout
    assert "STEP REGRESSION: began at step 0, step 45 was saved (latest_file_missing)" in text

    tracker = Tracker(StateStore(None))
    CheckpointSource(root, tracker).poll()
    lines = enumerate(log_text.splitlines())
    events = [e for i, line in lines if (e := parse_line(line, f"line{i}").event) is not None]
    tracker.ingest(events, "log")
    exposition = metrics(tracker)
    assert value(exposition, "tqmon_resume_step_regression_steps", reason="latest_file_missing") == 45
    assert value(exposition, "tqmon_resume_step_regression_steps", reason="step_repeated") == 0
    started = tracker.snapshot.records[-1].started_at
    holds = {c.alert: (c.state, c.detail) for c in evaluate(tracker.snapshot, started + 60)}
    assert holds["TQMonResumeStepRegression"] == ("true", "began at step 0, step 45 was saved (latest_file_missing)")
    page = html.render(tracker.snapshot, started + 60)
    assert (
        "<b class='flag' data-k='step-regression'>Step regression</b>: began at step 0, step 45 was saved"
        " (latest_file_missing)." in page
    )
    assert "latest_checkpointed_iteration.txt is missing (verl&#x27;s resume_mode=auto starts fresh)" in page


def test_a_resume_from_a_stale_latest_file_is_a_regression(root: Path, tmp_path: Path) -> None:
    """The latest file names 40 while global_step_45 exists: verl resumes from 40, five steps back."""
    _saved_before_the_start(root)
    record = _analyze(_resumed(root), tmp_path, root)
    assert record["step_regressions"] == [{"step": 40, "newer_step": 45, "reason": "latest_file_stale"}]
    assert any(
        "resumed from step 40 while step 45 was saved: latest_checkpointed_iteration.txt is stale: it names 40, not 45"
        in e["detail"]
        for e in record["evidence"]
    )


def test_a_resume_from_another_checkpoint_than_the_latest_file_names_is_a_choice(root: Path, tmp_path: Path) -> None:
    """The latest file names 45, verl loaded 40: trainer.resume_from_path (or resume_mode) chose it."""
    (root / "latest_checkpointed_iteration.txt").write_text("45")
    _saved_before_the_start(root)
    record = _analyze(_resumed(root), tmp_path, root)
    assert record["step_regressions"] == [{"step": 40, "newer_step": 45, "reason": "resume_choice"}]


def test_a_resume_from_the_newest_checkpoint_is_no_regression(root: Path, tmp_path: Path) -> None:
    """Only global_step_40 exists and the latest file names it; folders written after the start never count."""
    shutil.rmtree(root / "global_step_45")
    _saved_before_the_start(root)
    (root / "global_step_50").mkdir()  # saved by this start itself (mtime now, after the start's timestamps)
    record = _analyze(_resumed(root), tmp_path, root)
    assert record["step_regressions"] == []


def test_a_step_counted_twice_after_a_resume_is_flagged(root: Path, tmp_path: Path) -> None:
    """verl #7933: a fully-async resume from 40 logs step 40 again, and a step logged twice in one start."""
    shutil.rmtree(root / "global_step_45")
    _saved_before_the_start(root)
    record = _analyze(_resumed(root, first=40, second=41), tmp_path, root)
    assert record["step_regressions"] == [{"step": 40, "newer_step": 40, "reason": "step_repeated"}]
    assert "step 40 logged again after step 40: counted twice" in [e["detail"] for e in record["evidence"]]
    record = _analyze(_resumed(root, first=41, second=41), tmp_path, root)
    assert record["step_regressions"] == [{"step": 41, "newer_step": 41, "reason": "step_repeated"}]


def test_a_fresh_start_after_the_trainer_saved_is_a_regression_from_the_log_alone(tmp_path: Path) -> None:
    """Without the checkpoint dir the trainer's own "Saving checkpoint" line is the newer step; why is unknown."""
    log_text = (
        SCRATCH_LOG.format(at="2026-11-28 21:00:00,000")
        + "INFO:2026-11-28 21:30:00,000:Saving checkpoint to /ckpt/global_step_2\n"
        + SCRATCH_LOG.format(at=START)
    )
    log = tmp_path / "trainer.log"
    log.write_text(log_text)
    result = CliRunner().invoke(main, ["analyze", "--json", str(log)])
    records = json.loads(result.stdout)["records"]
    assert [r["step_regressions"] for r in records] == [[], [{"step": 0, "newer_step": 2, "reason": "unknown"}]]
