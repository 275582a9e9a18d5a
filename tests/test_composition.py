"""The window aggregation (``compose``, ``windows_from``) against a reference written the plain way.

The aggregation is written for speed (bench/README.md has its profile); this test keeps it honest: over random
partitions with prompts of every status, trajectories, orphans, trajectories owned by a non-prompt key,
malformed keys ("", "_", no uid, several underscores, a newline) and prompt keys that contain an underscore,
every number it returns equals the reference's, and every bad tag is refused naming a key that is bad.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tqmon.composition import Composition, CompositionError, compose
from tqmon.sources.tq import windows_from, windows_of
from tqmon.warmup import PARTITIONS, PROMPT_STATUSES

UIDS = ("a", "b", "ab", "ba", "a_b", "")  # short, so trajectory keys find (or miss) them often
VALID_STEPS = st.integers(min_value=0, max_value=30)


def reference(tags: Mapping[str, Any]) -> tuple[list[tuple[tuple[Any, Any], int]], int, int, int, int]:
    """verl's reading, one key at a time: (groups in first-seen order, trajectories, orphans, in-flight, keys).

    A prompt group is a key whose tag says ``is_prompt`` (``_count_tq_prompt_groups``); every other key is a
    trajectory, owned by the prompt whose key is its uid, the part before the first ``_``
    (``key.split("_", 1)[0]``, as ``_reissue_inflight_prompts`` splits it).
    """
    groups: Counter[tuple[Any, Any]] = Counter()
    trajectories = []
    for key, tag in tags.items():
        if tag.get("is_prompt", False):
            groups[(tag.get("status"), tag.get("global_steps"))] += 1
        else:
            trajectories.append(key)
    orphans = inflight = 0
    for key in trajectories:
        owner = tags.get(key.split("_", 1)[0])
        if owner is None or not owner.get("is_prompt", False):
            orphans += 1
        elif owner.get("status") in ("pending", "running"):
            inflight += 1
    return list(groups.items()), len(trajectories), orphans, inflight, len(tags)


def numbers(c: Composition) -> tuple[list[tuple[tuple[Any, Any], int]], int, int, int, int]:
    return list(c.groups.items()), c.trajectories, c.orphan_trajectories, c.inflight_trajectories, c.keys


def key_strategy() -> st.SearchStrategy[str]:
    uid = st.sampled_from(UIDS)
    trajectory = st.builds(lambda u, s, i: f"{u}_{s}_{i}", uid, st.integers(0, 2), st.integers(0, 3))
    malformed = st.text(alphabet="ab_0\n", max_size=6)
    return st.one_of(uid, trajectory, malformed)


def prompt_tag(statuses: st.SearchStrategy[Any], steps: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"is_prompt": st.sampled_from([True, 1, "yes"]), "status": statuses, "global_steps": steps}
    )


NON_PROMPT_TAG: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"is_prompt": st.sampled_from([False, 0, None, ""])}),
    st.fixed_dictionaries({"status": st.sampled_from(["success", "pending"]), "global_steps": VALID_STEPS}),
)
VALID_TAG = st.one_of(prompt_tag(st.sampled_from(PROMPT_STATUSES), VALID_STEPS), NON_PROMPT_TAG)
PARTITION = st.dictionaries(key_strategy(), VALID_TAG, max_size=40)


@settings(max_examples=400, deadline=None)
@given(PARTITION)
def test_compose_equals_the_reference(tags: dict[str, dict[str, Any]]) -> None:
    assert numbers(compose(tags)) == reference(tags)


class Steps:
    def __init__(self) -> None:
        self.done = 0

    def update(self, n_steps: int) -> None:
        self.done += n_steps


@settings(max_examples=100, deadline=None)
@given(PARTITION)
def test_compose_in_progress_chunks_equals_the_reference(tags: dict[str, dict[str, Any]]) -> None:
    """The checkpoint reader's path: the same fold over chunks of keys, with a progress bar."""
    progress = Steps()
    with patch("tqmon.composition.PROGRESS_EVERY", 3):
        assert numbers(compose(tags, progress)) == reference(tags)
    assert progress.done == len(tags)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([*PARTITIONS, "other"]), PARTITION, max_size=3), st.none() | VALID_STEPS)
def test_windows_from_a_reply_equals_the_reference(
    reply: dict[str, dict[str, dict[str, Any]]], trainer_step: int | None
) -> None:
    """A whole ``kv_list`` reply: train and val windows (a missing partition is empty), every partition's keys."""
    windows, keys = windows_from(reply, trainer_step, 100.0, 30.0)
    expected: dict[str, Composition] = {p: Composition(*reference_composition(reply.get(p, {}))) for p in PARTITIONS}
    assert windows == windows_of(expected, trainer_step, 100.0, 30.0)
    # The views carry the counts themselves (the comparison above is not between two empty views).
    assert [(w.trajectories, w.orphan_trajectories) for w in windows] == [
        (c.trajectories, c.orphan_trajectories) for c in expected.values()
    ]
    assert keys == sum(len(tags) for tags in reply.values())


def reference_composition(tags: Mapping[str, Any]) -> tuple[dict[tuple[Any, Any], int], int, int, int, int]:
    groups, trajectories, orphans, inflight, keys = reference(tags)
    return dict(groups), trajectories, orphans, inflight, keys


BAD_STATUS = st.sampled_from(["success", "done", None, 3])
BAD_STEPS = st.one_of(st.integers(max_value=-1), st.none(), st.just("7"))
ANY_TAG = st.one_of(
    VALID_TAG,
    prompt_tag(BAD_STATUS, VALID_STEPS),
    prompt_tag(st.sampled_from(PROMPT_STATUSES), BAD_STEPS),
    prompt_tag(BAD_STATUS, BAD_STEPS),
    st.just({"is_prompt": True}),
    st.sampled_from([None, 5, "tag", ("is_prompt", True)]),  # not a dict at all
)


def complaints(tags: Mapping[str, Any]) -> set[str]:
    """Every message that rightly refuses ``tags``: a tag that is no dict wins (the fold stops at it);
    otherwise any prompt with a status verl never writes or a ``global_steps`` that is no step."""
    not_dicts = [key for key, tag in tags.items() if not isinstance(tag, Mapping)]
    if not_dicts:
        return {f"tag of key {not_dicts[0]!r} is {type(tags[not_dicts[0]]).__name__}, not a dict"}
    bad = set()
    for key, tag in tags.items():
        if not tag.get("is_prompt", False):
            continue
        status, steps = tag.get("status"), tag.get("global_steps")
        if status not in PROMPT_STATUSES:
            bad.add(f"prompt key {key!r} has status {status!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            bad.add(f"prompt key {key!r} has global_steps {steps!r}")
    return bad


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(key_strategy(), ANY_TAG, max_size=20))
def test_bad_tags_are_refused_naming_a_bad_key(tags: dict[str, Any]) -> None:
    expected = complaints(tags)
    if not expected:
        assert numbers(compose(tags)) == reference(tags)
        return
    with pytest.raises(CompositionError) as refused:
        compose(tags)
    assert str(refused.value) in expected
