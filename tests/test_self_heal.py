"""The verl plugin's self-heal on released verl 0.9.1: its real trainer, ``ReplayBufferAsync`` and TransferQueue.

The previous run's window holds failed, stale finished and (with DAPO) zero-variance groups: verl's warmup
submits ``max(0, T - R)`` and the first sample evicts the doomed groups, so the useful window after the warmup
is ``T - doomed``. With ``TQMON_SELF_HEAL=on`` the plugin submits the deficit through verl's own
``_add_prompts_to_generate`` and the window is T; ``off`` and ``dry-run`` leave it at ``T - doomed``. The
record tqmon derives from the plugin's events says so, and a restart whose checkpoint holds the top-up adds
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TqmonProcess
from tests.test_verl_parity import (
    DAPO_DOOMED,
    DAPO_OVERRIDES,
    DAPO_STEP,
    B,
    Case,
    clear_window,
    cluster,  # noqa: F401  (the module's Ray cluster and TransferQueue)
    gauge,
    restart_transfer_queue,
    resume,
    save_dapo_run,
    save_previous_run,
    settled,
    train_uids,
    verl_log,  # noqa: F401
)

pytestmark = pytest.mark.parity

STEP = 10
THRESHOLD = 3  # stale at the first sample (step 11): finished groups with global_steps <= 7
MIXED = Case(
    "mixed",
    STEP,
    (("pending", 10, 1), ("running", 10, 1), ("finished", 10, B), ("finished", 5, 2), ("failure", 10, 1)),
    overrides=(
        "trainer.v1.colocate_async.num_warmup_batches=3",
        f"trainer.v1.sampler.max_off_policy_threshold={THRESHOLD}",
    ),
)
T = 3 * B
MIXED_DOOMED = {"failure": 1, "stale": 2, "filtered": 0}
WANT = {("events", "warmup_decided"), ("events", "self_heal_decided"), ("events", "checkpoint_restored")}


def heal(
    tq: Any, root: Path, case: Case, mode: str, tqmon: TqmonProcess, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, dict[str, Any]]:
    """verl's resume up to its first sample with the plugin's self-heal in ``mode``; tqmon's record of it."""
    monkeypatch.setenv("TQMON_URL", tqmon.url)
    monkeypatch.setenv("TQMON_SELF_HEAL", mode)
    restart_transfer_queue(tq)
    verl = resume(tq, root, case)
    want = WANT if mode != "off" else WANT - {("events", "self_heal_decided")}
    return verl, settled(tqmon, want)["records"][-1]


@pytest.mark.parametrize(
    ("name", "mode"),
    [("mixed", "off"), ("mixed", "dry-run"), ("mixed", "on"), ("dapo", "off"), ("dapo", "dry-run"), ("dapo", "on")],
)
def test_the_self_heal_fills_the_window_verl_left_short(
    name: str,
    mode: str,
    cluster: Any,  # noqa: F811
    tmp_path: Path,
    verl_log: Path,  # noqa: F811
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tq = cluster
    clear_window(tq)
    if name == "dapo":
        case, doomed = Case("dapo", DAPO_STEP, overrides=DAPO_OVERRIDES), DAPO_DOOMED
        save_dapo_run(tq, tmp_path)
    else:
        case, doomed = MIXED, MIXED_DOOMED
        save_previous_run(tq, tmp_path, case)
    tqmon = tqmon_factory(["--log", str(verl_log), "--log-interval", "0.1"]).start()
    verl, record = heal(tq, tmp_path, case, mode, tqmon, monkeypatch)

    lost = sum(doomed.values())
    deficit = T - (verl.restored - lost + verl.warmup_submitted)
    assert deficit > 0  # the case leaves verl's window short
    topped = deficit if mode == "on" else 0
    # What the workers received: the re-issue, the warmup, the step's batch, the top-up, then the first sample's
    # refills of exactly what it evicted (verl's own eviction metrics: each doomed group once).
    head = [n for n in (verl.reissued, verl.warmup_submitted) if n]
    assert verl.dispatched[: len(head) + 1] == [*head, B]
    after = verl.dispatched[len(head) + 1 :]
    assert after[: 1 if topped else 0] == ([topped] if topped else [])
    assert sum(after[1 if topped else 0 :]) == lost
    # The useful window after the warmup: what the first sample did not evict, plus what was submitted.
    window = verl.restored - lost + verl.warmup_submitted + topped
    assert window == (T if mode == "on" else T - lost)
    # The first step sampled a full batch and left the window (refills aside) at that useful size.
    left = len(train_uids(tq)) - lost
    assert left == window

    # tqmon's record: the decision with its inputs, and a deficit that is really 0 after an `on` top-up.
    assert record["doomed"] == doomed
    assert record["under_submitted"] == deficit - topped
    assert record["under_submitted_lower_bound"] is False
    assert record["disagreements"] == [], record["disagreements"]
    metrics = tqmon.metrics()
    if mode == "off":
        assert record["self_heal"] is None
        assert gauge(metrics, "tqmon_resume_self_heal_prompt_groups", mode="on") is None
        return
    heal_record = record["self_heal"]
    assert heal_record["mode"] == mode
    assert (heal_record["target"], heal_record["restored"]) == (T, verl.restored)
    assert heal_record["warmup_submitted"] == verl.warmup_submitted
    assert heal_record["doomed"] == doomed
    assert (heal_record["deficit"], heal_record["deficit_exact"]) == (deficit, True)
    assert (heal_record["planned"], heal_record["submitted"]) == (deficit, topped)
    assert heal_record["max_top_up"] == T
    assert gauge(metrics, "tqmon_resume_self_heal_prompt_groups", mode=mode) == deficit
    assert gauge(metrics, "tqmon_resume_under_submitted_prompt_groups") == deficit - topped


def test_a_restart_whose_checkpoint_holds_the_top_up_adds_nothing(
    cluster: Any,  # noqa: F811
    tmp_path: Path,
    verl_log: Path,  # noqa: F811
    tqmon_factory: Callable[..., TqmonProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tq = cluster
    clear_window(tq)
    case = Case(MIXED.name, STEP, MIXED.groups, overrides=MIXED.overrides, sample=False)
    save_previous_run(tq, tmp_path, case)
    tqmon = tqmon_factory(["--log", str(verl_log), "--log-interval", "0.1"]).start()
    first, record = heal(tq, tmp_path, case, "on", tqmon, monkeypatch)
    topped = record["self_heal"]["submitted"]
    assert topped == 3
    # verl saves before the first step completes (the resumed step's checkpoint): the top-up is in R now.
    first.trainer.global_steps = STEP
    first.trainer._save_checkpoint()

    second, record = heal(tq, tmp_path, case, "on", tqmon, monkeypatch)
    assert second.restored == first.restored + first.warmup_submitted + B + topped
    head = [n for n in (second.reissued, second.warmup_submitted) if n]
    assert second.dispatched == [*head, B]  # no top-up
    assert record["self_heal"]["submitted"] == 0
    assert record["self_heal"]["planned"] == 0
    assert record["under_submitted"] == 0
