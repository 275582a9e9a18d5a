"""Property fuzzing of every parser that reads what the field writes: the verl log-line parser, verl's
JSONL metrics, the Hydra config reader and the ``controller_state.pkl`` unpickler, seeded with real
artefacts and mutations of them.

Seeds: ``tests/data/controller_state.pkl`` is TransferQueue 0.1.11's own ``tq.save_checkpoint`` output and
``tests/data/sim_trainer.log`` the log of the same run (``tqmon sim --scenario doomed-mix --step-seconds 0.05``);
the JSONL and Hydra seeds are the verl shapes ``tests/test_jsonl.py`` and ``tests/test_hydra_config.py`` use.
Properties: nothing but the parser's own error escapes, a source keeps running and counts what it refused,
no crafted pickle allocates without bound or crashes the process, and nothing in a pickle ever runs.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_hydra_config import HYDRA
from tests.test_jsonl import step_line
from tqmon.catalog import LOG_LINE_OUTCOMES, PICKLE_REFUSAL_REASONS
from tqmon.checkpoint.layout import CONTROLLER_FILE, read_checkpoint
from tqmon.checkpoint.unpickler import CheckpointError
from tqmon.hydra_config import HydraConfigError, load_trainer_config
from tqmon.snapshot import SourceName, Tally
from tqmon.sources.checkpoint import CheckpointSource
from tqmon.sources.jsonlparse import parse_jsonl_line
from tqmon.sources.logfile import LogSource, parse_jsonl
from tqmon.sources.logparse import parse_line
from tqmon.store import StateStore
from tqmon.tracker import Tracker

DATA = Path(__file__).resolve().parent / "data"
REAL_PICKLE = (DATA / "controller_state.pkl").read_bytes()
LOG_SEEDS = [
    *(DATA / "sim_trainer.log").read_text().splitlines(),
    "(TaskRunnerV1 pid=4242, ip=10.0.0.7) \x1b[36mINFO:2026-01-01 00:00:00,000:"
    "Re-issued 3 in-flight prompts for step 11; cleared 5 old trajectories from partition train\x1b[0m",
    "INFO:2026-01-01 00:00:00,000:Restored 6 training prompt groups from TransferQueue",
    "INFO:2026-01-01 00:00:00,000:Skipping async warmup: 9 restored prompt groups already fill the 8-prompt "
    "prefetch window",
    "INFO:2026-01-01 00:00:00,000:Added 2 warmup batches to the agent loop manager",
]
JSONL_SEEDS = [step_line(41, gen=31.25, took=55.5, failure=3.0, stale=2), step_line(1, gen=1.0, took=2.0)]
FUZZ = settings(
    max_examples=150, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
EXAMPLES_SOURCE = 60  # examples that each write a file and run a real source poll


@st.composite
def mutated(draw: st.DrawFn, seeds: list[str]) -> str:
    """A seed with a few edits: characters replaced, inserted, deleted, numbers blown up, halves swapped."""
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(text)))
        match draw(st.sampled_from(["replace", "insert", "delete", "number", "truncate", "splice"])):
            case "replace":
                text = text[:at] + draw(st.characters()) + text[at + 1 :]
            case "insert":
                text = text[:at] + draw(st.text(max_size=12)) + text[at:]
            case "delete":
                text = text[:at] + text[at + draw(st.integers(1, 8)) :]
            case "number":
                big = draw(st.sampled_from(["-1", "1e309", "NaN", "99999999999999999999999", "0x10", "1_0", "٣"]))
                text = text[:at] + big + text[at:]
            case "truncate":
                text = text[:at]
            case "splice":
                text = text[:at] + draw(st.sampled_from(seeds))[at:]
    return text


# ---------------------------------------------------------------- the log-line and JSONL parsers


@FUZZ
@given(mutated(LOG_SEEDS))
def test_log_parser_never_raises(line: str) -> None:
    parsed = parse_line(line, "log:fuzz:1")
    assert parsed.outcome in LOG_LINE_OUTCOMES
    assert (parsed.event is not None) == (parsed.outcome == "event")
    assert (parsed.error is not None) == (parsed.outcome == "malformed")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def mutated_jsonl(draw: st.DrawFn) -> str:
    """Either a text mutation or a structural one: a known key given any JSON value."""
    if draw(st.booleans()):
        return draw(mutated(JSONL_SEEDS))
    record = json.loads(draw(st.sampled_from(JSONL_SEEDS)))
    target = record if draw(st.booleans()) else record["data"]
    key = draw(st.sampled_from(sorted(target)))
    target[key] = draw(json_values)
    return json.dumps(record)


@FUZZ
@given(mutated_jsonl())
def test_jsonl_parser_never_raises(line: str) -> None:
    parsed = parse_jsonl_line(line)
    assert parsed.outcome in LOG_LINE_OUTCOMES
    assert (parsed.error is not None) == (parsed.outcome == "malformed")


@settings(FUZZ, max_examples=EXAMPLES_SOURCE)
@given(st.lists(mutated(LOG_SEEDS), min_size=1, max_size=40), st.lists(mutated_jsonl(), min_size=1, max_size=20))
def test_sources_survive_any_lines_and_count_them(
    tmp_path_factory: pytest.TempPathFactory, log: list[str], jsonl: list[str]
) -> None:
    root = tmp_path_factory.mktemp("lines")
    (root / "trainer.log").write_text("\n".join(log) + "\n", errors="surrogatepass")
    (root / "metrics.jsonl").write_text("\n".join(jsonl) + "\n", errors="surrogatepass")
    tracker = Tracker(StateStore(None))
    log_source = LogSource([str(root / "trainer.log")], tracker)
    jsonl_source = LogSource([str(root / "metrics.jsonl")], tracker, source=SourceName.JSONL, parse=parse_jsonl)
    log_source.poll()
    jsonl_source.poll()
    snapshot = tracker.snapshot
    assert all(s.ok for s in snapshot.sources), snapshot.sources  # a bad line is counted, the source stays up
    lines = snapshot.counters[Tally.LOG_LINES]
    read = (root / "trainer.log").read_bytes().count(b"\n")
    assert sum(lines.values()) == read
    malformed = snapshot.counters[Tally.SOURCE_ERRORS]
    assert malformed.get(("log", "malformed_line"), 0) == lines.get(("malformed",), 0)


# ---------------------------------------------------------------- the Hydra config reader


@FUZZ
@given(mutated([HYDRA]))
def test_hydra_reader_raises_only_its_own_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("hydra") / "config.yaml"
    path.write_text(text, errors="surrogatepass")
    try:
        given = load_trainer_config(path)
    except HydraConfigError as err:
        assert str(path) in str(err)
    else:
        assert given.trainer_mode and given.config.train_batch_size > 0


# ---------------------------------------------------------------- the checkpoint unpickler

CANARY_PAYLOADS = [  # each would run a command or import a module if anything resolved it
    b"cos\nsystem\n(S'touch {canary}'\ntR.",
    b'cbuiltins\nexec\n(S\'open("{canary}", "w")\'\ntR.',
    b"\x8c\x08builtins\x8c\x04eval\x93\x8c\x1aopen('{canary}', 'w')\x85R.",
    b"ctorch.serialization\nload\n(S'{canary}'\ntR.",
]
HOSTILE = {  # crafted pickles and the reason each is refused with
    "forbidden_global": b"\x80\x02cos\nsystem\nq\x00.",
    "oversized_length": b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xx.",
    "memo_index": b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 27) + b".",
    "too_deep": b"\x80\x04}" + b")" + b"\x85" * 200_000 + b"Ns.",  # hashing this key would crash CPython
    "truncated": REAL_PICKLE[: len(REAL_PICKLE) // 2],
    "malformed": b"\x80\x02\xff\xfe.",
}


def checkpoint_dir(root: Path, pickle_bytes: bytes) -> Path:
    """A verl checkpoint dir whose ``global_step_2`` holds ``pickle_bytes`` as its controller state."""
    tq = root / "global_step_2" / "transfer_queue"
    tq.mkdir(parents=True)
    (tq / "metadata.json").write_text(json.dumps({"storage_saved": True, "user_metadata": {"global_steps": 2}}))
    (tq / CONTROLLER_FILE).write_bytes(pickle_bytes)
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    return root


def test_the_real_seed_reads(tmp_path: Path) -> None:
    """The seed is a valid controller state: the mutations below start from something that works."""
    reading = read_checkpoint(checkpoint_dir(tmp_path, REAL_PICKLE))
    assert reading.composition.by_status == {"pending": 0, "running": 2, "finished": 5, "failure": 1}


@st.composite
def mutated_pickle(draw: st.DrawFn, canary: str) -> bytes:
    data = bytearray(REAL_PICKLE)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        match draw(st.sampled_from(["flip", "insert", "delete", "truncate", "payload", "length"])):
            case "flip":
                if at < len(data):
                    data[at] ^= 1 << draw(st.integers(0, 7))
            case "insert":
                data[at:at] = draw(st.binary(max_size=16))
            case "delete":
                del data[at : at + draw(st.integers(1, 64))]
            case "truncate":
                del data[at:]
            case "payload":
                data[at:at] = draw(st.sampled_from(CANARY_PAYLOADS)).replace(b"{canary}", canary.encode())
            case "length":  # an opcode with a length claiming far more than the file holds
                opcode = draw(st.sampled_from([b"\x8e", b"\x8d", b"\x95", b"B", b"X", b"\x8b"]))
                size = draw(st.sampled_from([1 << 31, 1 << 40, (1 << 63) - 1]))
                packed = (
                    struct.pack("<Q", size)
                    if opcode in (b"\x8e", b"\x8d", b"\x95")
                    else struct.pack("<I", size % (1 << 32))
                )
                data[at:at] = opcode + packed
    return bytes(data)


def test_mutated_pickles_are_read_or_refused_and_nothing_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"

    @FUZZ
    @given(mutated_pickle(str(canary)))
    def check(data: bytes) -> None:
        root = tmp_path / "ckpt"
        shutil.rmtree(root, ignore_errors=True)
        checkpoint_dir(root, data)
        tracemalloc.start()
        try:
            read_checkpoint(root)
        except CheckpointError as err:
            assert err.reason == "invalid_data" and (err.refusal is None or err.refusal in PICKLE_REFUSAL_REASONS)
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < 32 * len(REAL_PICKLE) + (8 << 20), f"reading a {len(data)}-byte pickle allocated {peak} bytes"
        assert not canary.exists(), "a pickle ran code"

    check()


@pytest.mark.parametrize("reason", sorted(HOSTILE))
def test_each_hostile_pickle_is_refused_with_its_reason_and_counted(tmp_path: Path, reason: str) -> None:
    root = checkpoint_dir(tmp_path / "ckpt", HOSTILE[reason])
    tracemalloc.start()
    with pytest.raises(CheckpointError) as refused:
        read_checkpoint(root)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert refused.value.refusal == reason, refused.value
    assert peak < 64 << 20  # a 1 TiB length or a 2**27 memo index allocates nothing of the kind

    tracker = Tracker(StateStore(None))
    source = CheckpointSource(root, tracker)
    source.poll()
    source.poll()  # the same file again: reported, not counted twice
    counters = tracker.snapshot.counters
    assert counters[Tally.PICKLE_REFUSALS] == {(reason,): 1}
    [health] = [s for s in tracker.snapshot.sources if s.source == "checkpoint"]
    assert not health.ok and health.last_error is not None and CONTROLLER_FILE in health.last_error


def test_a_deep_pickle_would_crash_the_stock_unpickler_path() -> None:
    """Why ``too_deep`` exists: the same bytes through a bare unpickler kill the interpreter (in a child)."""
    script = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
    child = subprocess.run([sys.executable, "-c", script], input=HOSTILE["too_deep"], capture_output=True, check=False)
    assert child.returncode < 0  # killed by a signal (SIGSEGV): a crash, not an exception
