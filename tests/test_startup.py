"""Startup that says what is wrong: ``serve``'s one-line refusals and source state lines, ``/readyz``'s rules,
and ``inspect``'s guidance, all through the real CLI in a subprocess (and real sockets and HTTP)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import TqmonProcess, sample_value
from tests.test_hydra_config import HYDRA
from tqmon.server import READYZ_RULES

README = Path(__file__).resolve().parents[1] / "README.md"
Factory = Callable[..., TqmonProcess]


def tqmon(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQMON_")}
    return subprocess.run(
        [sys.executable, "-m", "tqmon.cli", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single ``Error: ...`` line a refusal prints: nothing else, no traceback, no usage block."""
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    return lines[0]


def wait_for_line(proc: TqmonProcess, line: str, times: int = 1, timeout: float = 15.0) -> list[str]:
    """tqmon's output lines once ``line`` is among them ``times`` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = proc.log_path.read_text().splitlines()
        if lines.count(line) >= times:
            return lines
        time.sleep(0.1)
    raise AssertionError(f"never printed {line!r}:\n{proc.log_path.read_text()}")


# ---------------------------------------------------------------- serve refuses in one line


def test_a_port_in_use_is_one_line_and_nothing_claims_to_serve(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = tqmon("serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 1
    assert one_error_line(done) == f"Error: --listen 127.0.0.1:{port}: port {port} is already in use (another tqmon?)"


@pytest.mark.parametrize(
    ("listen", "code", "message"),
    [
        ("127.0.0.1:99999", 2, "Error: --listen: port out of range (1-65535): 99999 in '127.0.0.1:99999'"),
        ("nowhere", 2, "Error: --listen: expected HOST:PORT (e.g. 127.0.0.1:9842), got 'nowhere'"),
        # .invalid never resolves (RFC 6761); the host is named, not mistaken for a non-loopback address
        (
            "tqmon-no-such-host.invalid:9842",
            1,
            "Error: --listen: cannot resolve host 'tqmon-no-such-host.invalid': Name or service not known",
        ),
    ],
    ids=["port-out-of-range", "no-port", "unresolvable-host"],
)
def test_a_listen_address_that_cannot_work_is_one_line_naming_the_flag(
    tmp_path: Path, listen: str, code: int, message: str
) -> None:
    done = tqmon("serve", "--listen", listen, "--state-dir", str(tmp_path / "state"))
    assert done.returncode == code
    assert one_error_line(done) == message
    assert not (tmp_path / "state").exists()


def test_an_unusable_state_dir_is_one_line(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    done = tqmon("serve", "--listen", "127.0.0.1:1", "--state-dir", str(a_file))
    assert done.returncode == 2
    assert one_error_line(done) == f"Error: --state-dir {a_file} is a file, not a directory"

    below = a_file / "state"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = tqmon("serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(below))
    assert done.returncode == 1
    assert one_error_line(done) == f"Error: --state-dir {below}: unusable: Not a directory"


# ---------------------------------------------------------------- source state lines on stderr


def test_each_source_problem_is_one_line_at_start_and_its_recovery_once(tmp_path: Path, tqmon_factory: Factory) -> None:
    log = tmp_path / "trainer.log"
    proc = tqmon_factory(["--log", str(log), "--jsonl", str(tmp_path), "--log-interval", "0.1"]).start()
    lines = wait_for_line(proc, f"jsonl: {tmp_path} is a directory, not a log file")
    serving = next(i for i, line in enumerate(lines) if "serving on http://127.0.0.1:" in line)
    waiting = f"log: {log} does not exist (yet): waiting"
    lines = wait_for_line(proc, waiting)
    time.sleep(0.5)  # five more failed polls of each: still one line each
    lines = proc.log_path.read_text().splitlines()
    assert lines.index(waiting) > serving
    assert lines.count(waiting) == 1 and lines.count(f"jsonl: {tmp_path} is a directory, not a log file") == 1

    log.write_text("")
    recovered = f"log: {log}: reading"
    wait_for_line(proc, recovered)
    time.sleep(0.5)
    assert proc.log_path.read_text().splitlines().count(recovered) == 1

    log.unlink()
    lines = wait_for_line(proc, waiting, times=2)  # it changed again: said again
    assert lines.count(recovered) == 1


# ---------------------------------------------------------------- /readyz


def test_a_fresh_run_without_a_checkpoint_is_ready(tmp_path: Path, tqmon_factory: Factory) -> None:
    checkpoints = tmp_path / "checkpoints"  # verl creates it at its first save
    proc = tqmon_factory(["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "0.1"]).start()
    latest = checkpoints / "latest_checkpointed_iteration.txt"
    wait_for_line(
        proc,
        f"checkpoint: no checkpoint saved yet: {latest} does not exist ({checkpoints} does not exist yet): waiting",
    )
    ready = httpx.get(proc.url + "/readyz", timeout=5)
    assert (ready.status_code, ready.json()) == (
        200,
        {"ready": True, "sources": {"checkpoint": True, "events": True}, "problems": []},
    )
    text = proc.metrics()
    assert sample_value(text, 'tqmon_source_up{source="checkpoint"}') == 1
    assert sample_value(text, "tqmon_checkpoint_step") is None  # nothing saved: no step
    assert sample_value(text, 'tqmon_source_errors_total{reason="unavailable",source="checkpoint"}') == 0

    (checkpoints / "global_step_3").mkdir(parents=True)  # a save without transfer_queue/ (restores nothing)
    latest.write_text("3")
    wait_for_line(proc, f"checkpoint: {checkpoints}: reading")
    deadline = time.monotonic() + 10
    while sample_value(proc.metrics(), "tqmon_checkpoint_step") != 3:
        assert time.monotonic() < deadline, proc.metrics()
        time.sleep(0.1)


def test_readyz_rules_are_documented_in_openapi_and_the_readme(tqmon_factory: Factory) -> None:
    proc = tqmon_factory().start()
    schema = httpx.get(proc.url + "/openapi.json", timeout=5).json()
    assert schema["paths"]["/readyz"]["get"]["description"] == READYZ_RULES
    assert " ".join(READYZ_RULES.split()) in " ".join(README.read_text().split())


# ---------------------------------------------------------------- inspect


def checkpoint_root(path: Path, latest: int, steps: tuple[int, ...]) -> Path:
    """A verl checkpoint root whose steps hold no transfer_queue/ (what verl writes in sync mode)."""
    for step in steps:
        (path / f"global_step_{step}").mkdir(parents=True)
    (path / "latest_checkpointed_iteration.txt").write_text(str(latest))
    return path


def test_inspect_on_a_run_dir_suggests_the_checkpoint_dir_below(tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = checkpoint_root(run / "checkpoints" / "proj" / "exp", 4, (2, 4))
    (run / ".hydra").mkdir()
    done = tqmon("inspect", str(run))
    assert done.returncode == 1
    assert one_error_line(done) == f"Error: {run} has no latest_checkpointed_iteration.txt; did you mean {root}?"


def test_inspect_on_a_dir_that_is_not_verl_says_what_was_expected(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    done = tqmon("inspect", str(tmp_path))
    assert done.returncode == 1
    assert one_error_line(done) == (
        f"Error: {tmp_path} has no latest_checkpointed_iteration.txt and no global_step_N dir: expected verl's "
        "trainer.default_local_dir (the dir of latest_checkpointed_iteration.txt and global_step_N/), a "
        "global_step_N dir or its transfer_queue dir; no checkpoint saved yet?"
    )

    checkpoint_root(tmp_path / "steps-only", 7, (7,)).joinpath("latest_checkpointed_iteration.txt").unlink()
    done = tqmon("inspect", str(tmp_path / "steps-only"))
    assert one_error_line(done) == (
        f"Error: {tmp_path / 'steps-only'} has no latest_checkpointed_iteration.txt, but holds global_step_7: "
        "inspect it with --step 7"
    )


def test_inspect_without_a_config_points_at_trainer_config(tmp_path: Path) -> None:
    done = tqmon("inspect", str(checkpoint_root(tmp_path / "ckpt", 4, (4,))))
    assert done.returncode == 0, done.stderr
    assert (
        "note: T, M, O and the under-submission need the trainer config: --trainer-config "
        "<run dir>/.hydra/config.yaml, or --train-batch-size and --num-warmup-batches" in done.stdout
    )


def write_config(path: Path, text: str = HYDRA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_inspect_warns_when_the_config_saves_checkpoints_elsewhere(tmp_path: Path) -> None:
    config = write_config(tmp_path / "run" / ".hydra" / "config.yaml")  # default_local_dir: checkpoints/demo
    here = checkpoint_root(tmp_path / "run" / "checkpoints" / "demo", 4, (4,))
    elsewhere = checkpoint_root(tmp_path / "other" / "ckpt", 4, (4,))

    done = tqmon("inspect", str(here), "--trainer-config", str(config))
    assert (done.returncode, done.stderr) == (0, "")

    done = tqmon("inspect", str(elsewhere), "--trainer-config", str(config))
    assert done.returncode == 0
    assert done.stderr == (
        f"warning: {config} saves checkpoints to trainer.default_local_dir=checkpoints/demo, not to {elsewhere}: "
        "is it the config of this run?\n"
    )
    absolute = write_config(tmp_path / "abs.yaml", HYDRA.replace("checkpoints/demo", str(elsewhere)))
    assert tqmon("inspect", str(elsewhere), "--trainer-config", str(absolute)).stderr == ""


def test_inspect_step_is_the_users_choice_not_the_files(tmp_path: Path) -> None:
    root = checkpoint_root(tmp_path / "ckpt", 4, (2, 4))
    done = tqmon("inspect", str(root), "--step", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "resuming from step 2 (chosen with --step 2; latest_checkpointed_iteration.txt says 4: verl would resume "
        "from step 4) will restore 0 prompt groups"
    )
    report = json.loads(tqmon("inspect", str(root), "--step", "2", "--json").stdout)
    assert (report["step"], report["step_chosen_by"], report["latest_step"]) == (2, "--step 2", 4)
    latest = json.loads(tqmon("inspect", str(root), "--json").stdout)
    assert (latest["step"], latest["step_chosen_by"], latest["latest_step"]) == (4, None, 4)

    done = tqmon("inspect", str(root), "--step", "3")
    assert done.returncode == 1
    assert (
        one_error_line(done)
        == f"Error: step 3 was asked for, but {root / 'global_step_3'} does not exist (saved: 2, 4)"
    )


def test_invalid_yaml_in_trainer_config_is_one_line_with_the_line_number(tmp_path: Path) -> None:
    broken = HYDRA.splitlines().index("      max_lag: 4") + 1  # 1-based
    config = write_config(tmp_path / "config.yaml", HYDRA.replace("      max_lag: 4", "      max_lag: 4: 5"))
    root = checkpoint_root(tmp_path / "ckpt", 4, (4,))
    for command in (["inspect", str(root)], ["serve", "--state-dir", str(tmp_path / "state")]):
        done = tqmon(*command, "--trainer-config", str(config))
        assert done.returncode == 2
        line = one_error_line(done)
        assert line == (
            f"Error: --trainer-config: {config}: line {broken}, column 17: invalid YAML: mapping values are not "
            "allowed here"
        )
