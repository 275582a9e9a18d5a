"""The warmup model against verl 0.9.1's ``_add_async_warmup_batches`` and ``ReplayBufferAsync``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tqmon.warmup import (
    RestoredGroup,
    WarmupConfig,
    WarmupState,
    classify_doomed,
    decide_warmup,
    is_legacy_growth,
    is_legacy_unconditional,
    known_doomed,
    legacy_submitted,
    target_window,
    under_submitted,
)


def cfg(**overrides: object) -> WarmupConfig:
    """verl's CPU-test trainer: colocate_async, train_batch_size 4, num_warmup_batches 3 (T = 12)."""
    base: dict[str, object] = {"trainer_mode": "colocate_async", "train_batch_size": 4, "num_warmup_batches": 3}
    return WarmupConfig(**(base | overrides))


# (case, config overrides, restored R, resumed, expected T, submitted M, over O, state, logged)
CASES = [
    ("fresh start submits the whole window", {}, 0, False, 12, 12, 0, WarmupState.FRESH_START, True),
    ("restored 12 skips", {}, 12, True, 12, 0, 0, WarmupState.SKIPPED_FULL, True),
    ("restored 6 tops up 6", {}, 6, True, 12, 6, 0, WarmupState.TOPPED_UP, True),
    ("restored 13 submits nothing", {}, 13, True, 12, 0, 1, WarmupState.SKIPPED_OVER_RESTORED, True),
    ("zero warmup is silent", {"num_warmup_batches": 0}, 5, True, 0, 0, 5, WarmupState.DISABLED, False),
    ("negative warmup is silent", {"num_warmup_batches": -1}, 0, False, 0, 0, 0, WarmupState.DISABLED, False),
    ("skip.rollout_tq is silent", {"skip_rollout_tq": True}, 3, True, 12, 0, 0, WarmupState.DISABLED, False),
    ("fractional 1.5 x 4 = 6", {"num_warmup_batches": 1.5}, 0, False, 6, 6, 0, WarmupState.FRESH_START, True),
    ("fractional restore tops up", {"num_warmup_batches": 1.5}, 4, True, 6, 2, 0, WarmupState.TOPPED_UP, True),
    ("sync mode does nothing", {"trainer_mode": "sync"}, 0, False, 12, 0, 0, WarmupState.SYNC_MODE, False),
    (
        "separate_async behaves the same",
        {"trainer_mode": "separate_async"},
        6,
        True,
        12,
        6,
        0,
        WarmupState.TOPPED_UP,
        True,
    ),
    ("async ignores gen_batch_size", {"gen_batch_size": 5}, 0, False, 12, 12, 0, WarmupState.FRESH_START, True),
    ("resume without a TQ checkpoint", {}, 0, True, 12, 12, 0, WarmupState.TOPPED_UP, True),
]


@pytest.mark.parametrize(
    ("overrides", "restored", "resumed", "target", "submitted", "over", "state", "logged"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_decide_warmup_matches_verl(
    overrides: dict[str, object],
    restored: int,
    resumed: bool,
    target: int,
    submitted: int,
    over: int,
    state: WarmupState,
    logged: bool,
) -> None:
    config = cfg(**overrides)
    decision = decide_warmup(config, restored, resumed=resumed)
    if state is not WarmupState.SYNC_MODE:
        assert target_window(config) == target
    assert (decision.submitted, decision.over_restored, decision.state, decision.logged) == (
        submitted,
        over,
        state,
        logged,
    )


def test_gen_batch_size_rounds_the_target_down_outside_async_modes() -> None:
    # Sync mode keeps the user's gen_batch_size: floor(1.5 * 64 / 40) * 40 = 80, not 96.
    sync = cfg(trainer_mode="sync", train_batch_size=64, num_warmup_batches=1.5, gen_batch_size=40)
    assert target_window(sync) == 80
    # DAPO forces 1 like the async modes do.
    config = cfg(
        trainer_mode="sync", train_batch_size=64, num_warmup_batches=1.5, gen_batch_size=40, filter_groups=True
    )
    assert target_window(config) == 96


def test_terminal_only_restore_counts_toward_r_but_nothing_is_reissued() -> None:
    config = cfg()
    groups = [RestoredGroup("finished", 40)] * 10 + [RestoredGroup("failure", 40)] * 2
    decision = decide_warmup(config, len(groups), resumed=True)
    assert decision.submitted == 0 and decision.state is WarmupState.SKIPPED_FULL
    reissued = sum(g.status in ("pending", "running") for g in groups)
    assert reissued == 0
    doomed = classify_doomed(config, groups, checkpoint_step=40)
    assert doomed == {"failure": 2, "stale": 0, "filtered": 0}
    assert under_submitted(12, 12, sum(doomed.values()), decision.submitted) == 2


def test_doom_precedence_failure_then_stale_then_filtered() -> None:
    config = cfg(max_off_policy_threshold=4, filter_groups=True)
    # Resume from N=10, first sample at 11: staleness span = 11 - g + 1 > 4  <=>  g < 8.
    groups = [
        RestoredGroup("failure", 1, filtered=True),  # failure wins over stale and filtered
        RestoredGroup("finished", 7, filtered=True),  # stale wins over filtered
        RestoredGroup("finished", 8, filtered=True),  # span 4: not stale, filtered
        RestoredGroup("finished", 8),  # useful
        RestoredGroup("pending", 1),  # in flight: re-issued, never evicted
        RestoredGroup("running", 1),
    ]
    assert classify_doomed(config, groups, checkpoint_step=10) == {"failure": 1, "stale": 1, "filtered": 1}


@pytest.mark.parametrize(
    ("overrides", "stale"),
    [
        ({"max_off_policy_threshold": 2}, 1),
        ({"max_off_policy_threshold": None}, 0),  # null disables staleness
        ({"max_off_policy_threshold": 2, "max_off_policy_strategy": "wait"}, 0),  # only "drop" evicts
    ],
)
def test_stale_only_with_drop_and_a_threshold(overrides: dict[str, object], stale: int) -> None:
    groups = [RestoredGroup("finished", 5), RestoredGroup("finished", 9)]
    assert classify_doomed(cfg(**overrides), groups, checkpoint_step=9)["stale"] == stale


def test_filtered_needs_filter_groups_enabled() -> None:
    groups = [RestoredGroup("finished", 9, filtered=True)]
    assert classify_doomed(cfg(), groups, checkpoint_step=9)["filtered"] == 0
    assert classify_doomed(cfg(filter_groups=True), groups, checkpoint_step=9)["filtered"] == 1


def test_legacy_unconditional_warmup_signatures() -> None:
    config = cfg()
    assert legacy_submitted(config, 3) == 12
    assert is_legacy_unconditional(restored=12, target=12, submitted=12)  # stacked a full window
    assert not is_legacy_unconditional(restored=0, target=12, submitted=12)  # a fresh start is legit
    assert not is_legacy_unconditional(restored=6, target=12, submitted=6)  # 0.9.1 top-up
    assert is_legacy_growth(previous_restored=12, restored=24, target=12)
    assert not is_legacy_growth(previous_restored=12, restored=12, target=12)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("trainer_mode", "async", "trainer_mode"),
        ("train_batch_size", 0, "train_batch_size"),
        ("gen_batch_size", 0, "gen_batch_size"),
        ("max_off_policy_strategy", "keep", "max_off_policy_strategy"),
    ],
)
def test_invalid_config_names_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cfg(**{field: value})


def test_negative_restore_and_impossible_doom_are_rejected() -> None:
    with pytest.raises(ValueError, match="restored"):
        decide_warmup(cfg(), -1, resumed=True)
    with pytest.raises(ValueError, match="doomed"):
        under_submitted(target=12, restored=3, doomed=4, submitted=0)


configs = st.builds(
    WarmupConfig,
    trainer_mode=st.sampled_from(["colocate_async", "separate_async"]),
    train_batch_size=st.integers(1, 512),
    num_warmup_batches=st.one_of(st.integers(-2, 8).map(float), st.floats(0.01, 8, allow_nan=False)),
    gen_batch_size=st.one_of(st.none(), st.integers(1, 64)),
    skip_rollout_tq=st.booleans(),
)


@given(configs, st.integers(0, 5000), st.booleans())
def test_invariants(config: WarmupConfig, restored: int, resumed: bool) -> None:
    decision = decide_warmup(config, restored, resumed=resumed)
    target = target_window(config)
    assert target >= 0
    if config.num_warmup_batches > 0:
        assert target == math.floor(config.num_warmup_batches * config.train_batch_size)
    assert decision.over_restored == max(0, restored - target)
    if decision.state is WarmupState.DISABLED:
        assert decision.submitted == 0 and not decision.logged
    else:
        # The window right after warmup is exactly max(T, R): never under, over only by the restore.
        assert restored + decision.submitted == max(target, restored)
        assert decision.submitted * decision.over_restored == 0
    assert under_submitted(target, restored, 0, decision.submitted) == (
        target - restored if decision.state is WarmupState.DISABLED and restored < target else 0
    )


@given(
    st.lists(
        st.tuples(st.sampled_from(["pending", "running", "finished", "failure"]), st.integers(0, 50), st.booleans()),
        max_size=60,
    ),
    st.one_of(st.none(), st.integers(1, 10)),
    st.booleans(),
)
def test_doomed_is_a_partition_of_terminal_groups(
    raw: list[tuple[str, int, bool]], threshold: int | None, filter_groups: bool
) -> None:
    config = cfg(max_off_policy_threshold=threshold, filter_groups=filter_groups)
    groups = [RestoredGroup(status, step, filtered) for status, step, filtered in raw]
    doomed = classify_doomed(config, groups, checkpoint_step=50)
    assert doomed["failure"] == sum(g.status == "failure" for g in groups)
    terminal = sum(g.status in ("finished", "failure") for g in groups)
    assert sum(doomed.values()) <= terminal
    if threshold is None:
        assert doomed["stale"] == 0
    if not filter_groups:
        assert doomed["filtered"] == 0
    assert 0 <= under_submitted(12, len(groups), sum(doomed.values()), 0) <= 12


def test_known_doomed_decides_only_what_the_evidence_can() -> None:
    groups = [RestoredGroup("failure", 9), RestoredGroup("finished", 1), RestoredGroup("finished", 9)]
    statuses = {"failure": 1, "finished": 2}
    # Composition and config: every reason, except DAPO verdicts nobody supplied.
    assert known_doomed(cfg(), statuses, groups, 9) == {"failure": 1, "stale": 1, "filtered": 0}
    assert known_doomed(cfg(filter_groups=True), statuses, groups, 9) == {"failure": 1, "stale": 1}
    # Statuses alone: failures; the config adds only the reasons it rules out.
    assert known_doomed(None, statuses, None, 9) == {"failure": 1}
    assert known_doomed(cfg(max_off_policy_threshold=None), statuses, None, 9) == {
        "failure": 1,
        "stale": 0,
        "filtered": 0,
    }
    assert known_doomed(None, None, None, 9) is None
