"""``sim``: run one simulator scenario (a click command; every option is also a ``TQMON_SIM_*`` variable)."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import click

from tqmon.extras import require_extra
from tqmon.sim.scenarios import CHECKPOINT_DIR, LOG_FILE, SCENARIOS

if TYPE_CHECKING:
    from tqmon.sim.trainer import SimReport

FC = TypeVar("FC", bound=Callable[..., Any])
EXIT_STOPPED = 130


def option(*decls: str, env: str, **kwargs: Any) -> Callable[[FC], FC]:
    """A click option that is also the environment variable ``TQMON_SIM_<env>``, default shown."""
    return click.option(*decls, envvar=f"TQMON_SIM_{env}", show_envvar=True, show_default=True, **kwargs)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGTERM/SIGINT set the event instead of killing the process, so the TQ and Ray are shut down cleanly."""
    stop = threading.Event()

    def handle(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def top_up_on_sigusr1() -> Iterator[threading.Event]:
    """SIGUSR1 sets the event: the trainer fills its live window up to T at its next step."""
    requested = threading.Event()

    def handle(_signum: int, _frame: FrameType | None) -> None:
        requested.set()

    previous = signal.signal(signal.SIGUSR1, handle)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGUSR1, previous)


def connect(address: str | None) -> None:
    """Start a local Ray (4 logical CPUs: TQ's controller and storage unit need them) or join ``address``."""
    import ray

    if address is None:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def disconnect() -> None:
    """Leave the cluster (a local one started by :func:`connect` stops with it)."""
    import ray

    ray.shutdown()


def describe_scenarios() -> str:
    lines = []
    for scenario in SCENARIOS.values():
        lines += [f"{scenario.name}: {scenario.summary}", f"    tqmon flags: {' '.join(scenario.after.tqmon_flags())}"]
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    default="healthy-resume",
    help="What happens before the preemption and at the resume (--list-scenarios describes each).",
    env="SCENARIO",
)
@option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"Fresh directory for {LOG_FILE} (verl's log lines) and {CHECKPOINT_DIR}/ (trainer.default_local_dir); "
    "default: a new temporary directory.",
    env="WORKDIR",
)
@option(
    "--ray-address",
    default=None,
    help="Ray cluster to join (e.g. 127.0.0.1:6379 or auto); default: start a local one with 4 CPUs.",
    env="RAY_ADDRESS",
)
@option(
    "--step-seconds",
    type=click.FloatRange(min=0),
    default=0.5,
    help="Wall time of one training step and of one replay-buffer poll (one rollout tick each).",
    env="STEP_SECONDS",
)
@option(
    "--steps-before-preemption",
    type=click.IntRange(min=1),
    default=None,
    help="Steps trained before the preemption (steps after the last checkpoint are lost); default: the scenario's.",
    env="STEPS_BEFORE_PREEMPTION",
)
@option(
    "--steps-after-resume",
    type=click.IntRange(min=1),
    default=None,
    help="Steps trained after resuming from the latest checkpoint; default: the scenario's.",
    env="STEPS_AFTER_RESUME",
)
@option("--seed", type=int, default=0, help="Seeds the prompt uids and the rewards.", env="SEED")
@option(
    "--hold",
    is_flag=True,
    help="After the run keep the TransferQueue and Ray up until SIGTERM/SIGINT, so a sidecar can keep watching.",
    env="HOLD",
)
@option("--list-scenarios", is_flag=True, help="Describe the scenarios and their tqmon flags, then exit.", env="LIST")
def sim(
    scenario: str,
    workdir: Path | None,
    ray_address: str | None,
    step_seconds: float,
    steps_before_preemption: int | None,
    steps_after_resume: int | None,
    seed: int,
    hold: bool,
    list_scenarios: bool,
) -> None:
    """Simulate a verl 0.9.1 V1 async trainer on a real TransferQueue: a fresh start, a preemption, a resume.

    Writes verl's log lines and checkpoints into the workdir (point `tqmon serve --log WORKDIR/trainer.log
    --checkpoint-dir WORKDIR/checkpoints` and the scenario's trainer flags at them) and prints the simulator's
    own view of each start (R, K, T, M, O, doomed, under-submitted) as JSON on stdout. SIGUSR1 makes the
    trainer fill its live window up to T at its next step, as an operator would after an under-filled alert.
    """
    if list_scenarios:
        click.echo(describe_scenarios())
        return
    require_extra("tq", "tqmon sim")
    # Ray reads these when it is imported, with the trainer: torch, Ray and TransferQueue, which are imported
    # here so that `tqmon --help` does not wait for them.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # SIGTERM is how it stops: no trace dump
    from tqmon.sim.trainer import Stopped, check_workdir, run_scenario

    chosen = SCENARIOS[scenario]
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"tqmon-sim-{scenario}-"))
    click.echo(f"scenario {scenario}: {chosen.summary}", err=True)
    click.echo(f"log {workdir / LOG_FILE}, checkpoints {workdir / CHECKPOINT_DIR}", err=True)
    click.echo(f"tqmon flags: {' '.join(chosen.after.tqmon_flags())}", err=True)

    try:
        check_workdir(workdir)
    except FileExistsError as err:
        raise click.UsageError(str(err)) from None

    connect(ray_address)  # first: ray.init installs its own SIGTERM handler (exit 15), which ours replaces
    try:
        with stop_on_signals() as stop, top_up_on_sigusr1() as top_up:

            def done(report: SimReport) -> None:
                click.echo(json.dumps(report.to_json() | {"tqmon_flags": chosen.after.tqmon_flags()}))
                if hold:
                    click.echo("holding the TransferQueue until SIGTERM or SIGINT", err=True)
                    stop.wait()

            run_scenario(
                chosen,
                workdir,
                step_seconds=step_seconds,
                steps_before_preemption=steps_before_preemption,
                steps_after_resume=steps_after_resume,
                seed=seed,
                should_stop=stop.wait,
                on_done=done,
                top_up=top_up,
            )
    except Stopped:
        click.echo("stopped before the run finished", err=True)
        raise SystemExit(EXIT_STOPPED) from None
    finally:
        disconnect()
