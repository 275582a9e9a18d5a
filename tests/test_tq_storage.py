"""The storage-unit walk and verl's zero-variance test, on files TransferQueue's own storage class writes.

``StorageUnitData.save_checkpoint`` (TQ 0.1.11, no Ray needed) pickles real torch tensors and dicts as a
storage unit does; the tests compare the walk with torch's and numpy's own answers, and check that nothing
outside the metric is built or run.
"""

from __future__ import annotations

import io
import math
import pickle
import random
import shutil
import struct
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transfer_queue.storage.simple_storage import StorageUnitData

from tqmon.checkpoint.storage import (
    KEEP,
    SKIP,
    FilterVerdicts,
    Select,
    SelectiveWalker,
    filter_verdicts,
    read_metric_values,
    round_to,
    with_verdicts,
)
from tqmon.checkpoint.unpickler import CheckpointError
from tqmon.derivation import checkpoint_doomed
from tqmon.events import CheckpointSaved, GroupCount
from tqmon.warmup import WarmupConfig, is_zero_variance, known_doomed, pairwise_sum


def test_zero_variance_is_numpys_std_bit_for_bit() -> None:
    rng = random.Random(12)
    pool = [0.1, 0.2, 0.3, 1.0, 0.0, -0.0, 1e16, -1e16, 1e-320, 5e-324, 1e308, math.nan, math.inf, -math.inf]
    cases: list[list[float]] = [[0.1] * 3, [0.1] * 8, [0.3] * 5, [1.0], [], [1e308] * 2, [1e-200, 2e-200]]
    for _ in range(4000):
        n = rng.choice([2, 3, 5, 7, 8, 9, 16, 17, 64, 129, 300])
        base = rng.choice(pool[:10]) if rng.random() < 0.6 else rng.random()
        cases.append([base if rng.random() < 0.9 else rng.choice(pool) for _ in range(n)])
    decided = {True: 0, False: 0}
    for values in cases:
        with np.errstate(all="ignore"):
            numpy_says = len(values) > 1 and float(np.std(values)) == 0.0
            numpy_sum = float(np.add.reduce(np.array(values)))
        assert is_zero_variance(values) is numpy_says, values
        ours = pairwise_sum(values)
        assert ours == numpy_sum or (math.isnan(ours) and math.isnan(numpy_sum)), values
        decided[numpy_says] += 1
    assert is_zero_variance([0.1] * 3) is False  # numpy's mean is 0.10000000000000002
    assert min(decided.values()) > 100  # both answers were exercised


def save_unit(path: Path, fields: dict[str, list[Any]], indexes: list[int]) -> Path:
    """One storage-unit file, written by TransferQueue's own storage class."""
    unit = StorageUnitData(1000)
    unit.put_data(fields, indexes)
    path.parent.mkdir(parents=True, exist_ok=True)
    unit.save_checkpoint(path, "TQ_STORAGE_UNIT_test")
    (path.parent / "storage_unit_info.json").write_text('[{"position": 0, "storage_unit_id": "TQ_STORAGE_UNIT_test"}]')
    return path


def unit_path(tmp_path: Path) -> Path:
    return tmp_path / "transfer_queue" / "simple_storage" / "su_0_TQ_STORAGE_UNIT_test.pkl"


def test_metrics_equal_torchs_sum_and_the_extra_fields(tmp_path: Path) -> None:
    stacked = torch.tensor([[0.0, 0.3], [0.0, 0.7]], dtype=torch.float32)  # row views share one storage
    scores = [
        stacked[0],
        stacked[1],
        torch.tensor([0.25, 0.5, 0.125], dtype=torch.bfloat16),
        torch.tensor([0.1, 0.2], dtype=torch.float16),
        torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64),
        torch.arange(6, dtype=torch.float32).reshape(2, 3).t()[1],  # strided: elements 1 and 4
        torch.tensor([2, 3], dtype=torch.int64),
    ]
    extra = [{"reward_extra_info": {"acc": 0.5, "other": "x" * 1000}, "turn_scores": [1, 2]} for _ in scores]
    extra[1] = {"reward_extra_info": {"acc": 1}}  # a single item: pickled with SETITEM, no mark
    extra[2] = {"turn_scores": []}  # no metric
    extra[3] = {"reward_extra_info": {"acc": True}}
    fields: dict[str, list[Any]] = {"responses": [torch.ones(3, dtype=torch.int64) for _ in scores]}
    fields |= {"rm_scores": scores, "extra_fields": extra}
    save_unit(unit_path(tmp_path), fields, list(range(len(scores))))
    tq_dir = tmp_path / "transfer_queue"

    reward = read_metric_values(tq_dir, "reward", range(len(scores)))
    assert reward.values == {i: float(t.sum().item()) for i, t in enumerate(scores)}
    assert reward.missing == frozenset()
    acc = read_metric_values(tq_dir, "acc", [0, 1, 2, 3, 99])
    assert acc.values == {0: 0.5, 1: 1.0, 3: 1.0}
    assert acc.missing == {2, 99}  # no metric, and an index no unit holds
    assert read_metric_values(tq_dir, "acc", [4]).values == {4: 0.5}  # only what is wanted is read


class _Marker:
    """Touches a file when unpickled by anything that runs globals."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_hostile_object_elsewhere_is_skipped_and_in_the_metric_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    n = 3
    fields: dict[str, list[Any]] = {
        "raw_prompt": [_Marker(marker) for _ in range(n)],
        "extra_fields": [{"reward_extra_info": {"acc": 1.0}} for _ in range(n)],
    }
    fields["extra_fields"][2] = {"reward_extra_info": {"acc": _Marker(marker)}}
    save_unit(unit_path(tmp_path), fields, list(range(n)))
    tq_dir = tmp_path / "transfer_queue"
    assert read_metric_values(tq_dir, "acc", [0, 1]).values == {0: 1.0, 1: 1.0}
    read = read_metric_values(tq_dir, "acc", [1, 2])
    assert (read.values, read.missing) == ({1: 1.0}, frozenset())  # refused, not read as missing
    assert read.refused == {
        2: "su_0_TQ_STORAGE_UNIT_test.pkl, global index 2: refused global pathlib.Path.touch in the DAPO metric's field"
    }
    assert not marker.exists()


def test_numpy_scalar_metrics_are_what_verls_float_reads(tmp_path: Path) -> None:
    """verl 0.9.1 takes ``float(reward_extra_info[metric])``; reward functions often return numpy scalars.

    Each dtype is first pickled where the walk skips (trajectory 0 is not wanted), so the metric's scalars refer
    back to it; "same" holds the very scalar object of "acc", pickled as a back-reference to it."""
    metrics: list[Any] = [
        np.float64(0.1),
        np.float32(0.1),  # 0.10000000149011612: the float32's own value, as float() gives it
        np.float16(0.1),
        np.float32(-2.5),
        np.float64(1e300),
        np.complex64(1.5 + 2j),  # float() of a numpy complex is its real part
        np.int64(-(2**62) - 1),
        np.uint8(200),
        np.int8(-7),
        np.bool_(True),
    ]
    first = {"reward_extra_info": {f"k{i}": type(v)(1) for i, v in enumerate(metrics)}}  # every dtype, skipped
    extra = [first] + [{"reward_extra_info": {"acc": v, "same": v}} for v in metrics]
    fields: dict[str, list[Any]] = {"responses": [np.arange(4) for _ in extra], "extra_fields": extra}
    save_unit(unit_path(tmp_path), fields, list(range(len(extra))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        expected = {i + 1: float(v) for i, v in enumerate(metrics)}  # verl's own reading
    read = read_metric_values(tmp_path / "transfer_queue", "acc", expected)
    assert read.values == expected
    assert read.values[2] == 0.10000000149011612 and read.values[7] == -(2**62) - 1.0
    assert (read.missing, read.refused) == (frozenset(), {})
    same = read_metric_values(tmp_path / "transfer_queue", "same", [1, 2, 3])
    assert same.values == {1: 0.1, 2: float(np.float32(0.1)), 3: float(np.float16(0.1))}


def test_numpy_1_pickles_of_scalars_are_decoded(tmp_path: Path) -> None:
    """``tests/data/numpy1_storage_unit.pkl``: a storage unit's state pickled by numpy 1.26.4, whose scalars are
    ``numpy.core.multiarray.scalar`` (numpy 2 writes ``numpy._core``), written as TQ's ``save_checkpoint`` writes
    it (``pickle.HIGHEST_PROTOCOL``)::

        rows = {0: {"reward_extra_info": {"score": np.float32(0.1), "acc": np.float64(0.1)}},
                1: {"reward_extra_info": {"acc": np.float32(0.1), "score": np.float64(2.0)}},
                2: {"reward_extra_info": {"acc": np.float16(0.1)}}, 3: {"reward_extra_info": {"acc": np.int64(-3)}}}
        state = {"storage_unit_id": "TQ_STORAGE_UNIT_test", "storage_unit_size": 1000,
                 "field_data": {"responses": {i: np.arange(4) for i in rows}, "extra_fields": rows},
                 "active_keys": set(rows)}
        pickle.dump(state, open("numpy1_storage_unit.pkl", "wb"), protocol=pickle.HIGHEST_PROTOCOL)
    """
    fixture = Path(__file__).parent / "data" / "numpy1_storage_unit.pkl"
    assert b"numpy.core.multiarray" in fixture.read_bytes() and b"numpy._core" not in fixture.read_bytes()
    with warnings.catch_warnings(), fixture.open("rb") as handle:
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2 reads numpy.core through a shim
        rows = pickle.load(handle)["field_data"]["extra_fields"]  # our own fixture: real numpy's reading
    path = unit_path(tmp_path)
    path.parent.mkdir(parents=True)
    shutil.copy(fixture, path)
    (path.parent / "storage_unit_info.json").write_text('[{"position": 0, "storage_unit_id": "TQ_STORAGE_UNIT_test"}]')
    for metric in ("acc", "score"):
        read = read_metric_values(tmp_path / "transfer_queue", metric, range(4))
        expected = {
            i: float(row["reward_extra_info"][metric]) for i, row in rows.items() if metric in row["reward_extra_info"]
        }
        assert read.values == expected
        assert read.missing == frozenset(range(4)) - expected.keys() and read.refused == {}
    assert read_metric_values(tmp_path / "transfer_queue", "acc", range(4)).values == {
        0: 0.1,
        1: 0.10000000149011612,
        2: 0.0999755859375,
        3: -3.0,
    }


def test_a_metric_value_tqmon_cannot_decode_refuses_its_group_with_the_reason(tmp_path: Path) -> None:
    """Never read as missing (verl would not raise for it): the group's verdict is unknown, and why is said."""
    acc = [
        np.float64(1.0), np.float64(1.0),  # a: zero variance
        np.longdouble(0.5), np.float64(0.5),  # b: float() works in verl, tqmon cannot decode an 80-bit float
        np.float32(0.5), np.float32(0.5),  # c: zero variance
        (1.0, {}, 2.0), np.float64(0.0),  # d: a tuple the walk does not build whole
        np.float64(0.0), np.float64(1.0),  # e: kept
    ]  # fmt: skip
    extra = [{"reward_extra_info": {"acc": v}} for v in acc]
    fields: dict[str, list[Any]] = {"rm_scores": [torch.tensor([0.0, 1.0]) for _ in acc], "extra_fields": extra}
    path = save_unit(unit_path(tmp_path), fields, list(range(len(acc))))
    keys: list[tuple[str, object, object]] = [
        (uid, None, {"is_prompt": True, "status": "finished", "global_steps": 5}) for uid in "abcde"
    ]
    keys += [(f"{'abcde'[i // 2]}_0_{i % 2}", i, {"status": "success"}) for i in range(len(acc))]
    verdicts = filter_verdicts(keys, tmp_path / "transfer_queue", "acc")
    assert (verdicts.filtered, verdicts.finished, verdicts.missing, verdicts.refused) == ({5: 2}, 5, 0, 2)
    assert not verdicts.decided
    unit = "su_0_TQ_STORAGE_UNIT_test.pkl"
    assert verdicts.refusal == (
        f"{unit}, global index 2: refused a numpy scalar of dtype 'f16' (tqmon decodes numpy's bool, int, float and "
        "complex) in the DAPO metric's field"
    )
    refused = read_metric_values(tmp_path / "transfer_queue", "acc", range(len(acc))).refused
    assert (
        refused[6] == f"{unit}, global index 6: refused the value under 'acc', which the walk could not build in "
        "the DAPO metric's field"
    )
    assert refused.keys() == {2, 6}

    path.write_bytes(path.read_bytes().replace(b"_load_from_bytes", b"_load_from_bytez"))  # a global not allowed
    read = read_metric_values(tmp_path / "transfer_queue", "reward", [0, 1])
    assert (read.values, read.missing) == ({}, frozenset())
    assert read.refused == {
        i: f"{unit}, global index {i}: refused global torch.storage._load_from_bytez in the DAPO metric's field"
        for i in (0, 1)
    }


def test_unneeded_payloads_are_seeked_over_not_read(tmp_path: Path) -> None:
    n = 4
    fields = {
        "input_ids": [torch.ones(2_000_000, dtype=torch.int64) for _ in range(n)],  # 16 MB a row
        "rm_scores": [torch.tensor([0.0, 1.0]) for _ in range(n)],
    }
    path = save_unit(unit_path(tmp_path), fields, list(range(n)))
    assert path.stat().st_size > 60_000_000
    tracemalloc.start()
    try:
        result = read_metric_values(tmp_path / "transfer_queue", "reward", range(n))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.values == dict.fromkeys(range(n), 1.0)
    assert peak < 4_000_000  # the 64 MB of token ids never came into memory


@pytest.mark.parametrize(
    ("damage", "reason", "message"),
    [
        (lambda b: b[:-50], "invalid_data", "truncated pickle"),
        (lambda b: b"\x80\x05(\x8c\x02osK\x01Q.", "invalid_data", "refused pickle opcode"),
        (lambda b: b.replace(b"FloatStorage", b"ShortStorage"), "invalid_data", "torch storage holds"),
    ],
)
def test_a_damaged_unit_is_refused_with_a_reason(tmp_path: Path, damage: Any, reason: str, message: str) -> None:
    path = save_unit(unit_path(tmp_path), {"rm_scores": [torch.tensor([0.0, 1.0])]}, [0])
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as err:
        read_metric_values(tmp_path / "transfer_queue", "reward", [0])
    assert err.value.reason == reason


def test_caps_refuse_as_too_large(tmp_path: Path) -> None:
    save_unit(unit_path(tmp_path), {"rm_scores": [torch.zeros(4) for _ in range(3)]}, [0, 1, 2])
    with pytest.raises(CheckpointError, match="over the 100 cap") as err:
        read_metric_values(tmp_path / "transfer_queue", "reward", [0], max_bytes=100)
    assert err.value.reason == "too_large"
    data = pickle.dumps({"a": [f"x{i}" for i in range(50)]}, protocol=5)
    with pytest.raises(CheckpointError, match="more than 10 objects") as err:
        SelectiveWalker(io.BytesIO(data), Select(lambda _: KEEP), max_memo=10).load()
    assert err.value.reason == "too_large"


def test_an_ambiguous_single_item_dict_never_loses_a_wanted_value() -> None:
    """Dicts of one item are pickled without a mark; the walk builds both readings, opcodes decide."""
    tree = {0: {}, 1: {"k": 1.5}, 2: {"k": 2.5}, 3: {"x": {}}, 4: {"k": 4.5}}
    data = pickle.dumps(tree, protocol=5)
    inner = Select(lambda key: KEEP if key == "k" else SKIP)
    result = SelectiveWalker(io.BytesIO(data), Select(lambda key: inner if key in (1, 4) else SKIP)).load()
    assert isinstance(result, dict)
    assert {key: value for key, value in result.items() if value} == {1: {"k": 1.5}, 4: {"k": 4.5}}


def test_verdicts_split_the_composition_and_decide_filtered() -> None:
    groups = [
        GroupCount(status="finished", global_steps=9, count=3),
        GroupCount(status="failure", global_steps=9, count=1),
    ]
    verdicts = FilterVerdicts(
        "acc", {9: 2}, finished=3, missing=0, refused=0, refusal=None, trajectories=9, storage_bytes=1
    )
    assert [(g.count, g.filtered) for g in with_verdicts(groups, verdicts)] == [(1, False), (2, True), (1, False)]
    config = WarmupConfig(
        trainer_mode="colocate_async",
        train_batch_size=4,
        num_warmup_batches=2,
        filter_groups=True,
        filter_groups_metric="acc",
    )
    event = CheckpointSaved(id="c", time="2026-01-01T00:00:00Z", step=10, groups=groups)
    assert checkpoint_doomed(event, config) == {"failure": 1, "stale": 0}  # no verdicts: filtered unknown
    decided = event.model_copy(update={"filter_metric": "acc"})
    assert checkpoint_doomed(decided, config) == {"failure": 1, "stale": 0, "filtered": 0}  # decided: none
    statuses = {"finished": 3, "failure": 1}
    assert known_doomed(config, statuses, None, 10, filter_verdicts=True) == {"failure": 1}


def test_bfloat16_rounding_matches_torch() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        value = rng.uniform(-1e4, 1e4) if rng.random() < 0.8 else struct.unpack("<f", rng.randbytes(4))[0]
        if not math.isfinite(value):
            continue
        for kind, dtype in (
            ("BFloat16Storage", torch.bfloat16),
            ("HalfStorage", torch.float16),
            ("FloatStorage", torch.float32),
        ):
            assert round_to(kind, value) == float(torch.tensor(value, dtype=torch.float64).to(dtype).item()), (
                kind,
                value,
            )


@pytest.mark.parametrize(
    ("payload", "reason", "message"),
    [
        (b"\x80\x05" + b"(" * 5000 + b".", "invalid_data", "more than 1000 mark groups"),
        (b"\x80\x05}K\x01\x8e" + (1 << 62).to_bytes(8, "little"), "too_large", "over the cap"),
        (b"\x80\x05}K\x01\x8d" + (1 << 62).to_bytes(8, "little"), "too_large", "over the cap"),
        (b"\x80\x05K\x01K\x02s.", "invalid_data", "stack underflow"),
    ],
)
def test_hostile_shapes_are_refused_without_allocating(
    tmp_path: Path, payload: bytes, reason: str, message: str
) -> None:
    """Deep nesting, a huge declared payload where the metric is read, and items set on nothing."""
    path = save_unit(unit_path(tmp_path), {"rm_scores": [torch.zeros(2)]}, [0])
    path.write_bytes(payload)
    walker_spec = Select(lambda _: KEEP)  # everything is "needed": the worst case for the caps
    if reason == "too_large":
        with pytest.raises(CheckpointError, match=message) as err:
            SelectiveWalker(io.BytesIO(payload), walker_spec).load()
    else:
        with pytest.raises(CheckpointError, match=message) as err:
            read_metric_values(tmp_path / "transfer_queue", "reward", [0])
    assert err.value.reason == reason


def test_reading_runs_no_torch_transfer_queue_or_numpy(tmp_path: Path) -> None:
    import subprocess
    import sys

    save_unit(unit_path(tmp_path), {"rm_scores": [torch.tensor([0.0, 2.0])]}, [0])
    code = (
        "import sys; from pathlib import Path; from tqmon.checkpoint.storage import read_metric_values; "
        f"print(read_metric_values(Path({str(tmp_path / 'transfer_queue')!r}), 'reward', [0]).values[0], "
        "sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transfer_queue', 'numpy', 'ray', 'tensordict'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["2.0", "[]"]
