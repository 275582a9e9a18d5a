"""``tqmon`` command line: every option is also a ``TQMON_*`` environment variable."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from tqmon import __version__
from tqmon.events import TrainerConfig
from tqmon.retention import RetentionPolicy
from tqmon.rules import RuleConfig
from tqmon.server import serve_forever
from tqmon.service import ServiceConfig
from tqmon.sim.cli import sim
from tqmon.sim.scenarios import SCENARIOS
from tqmon.sources.tq import PollBudget
from tqmon.warmup import OFF_POLICY_STRATEGIES, TRAINER_MODES

LISTEN_DEFAULT = "127.0.0.1:9842"
FC = TypeVar("FC", bound=Callable[..., Any])


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT``."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise click.BadParameter(f"expected HOST:PORT (e.g. {LISTEN_DEFAULT}), got {value!r}")
    return host.strip("[]"), int(port)


def option(*decls: str, env: str, **kwargs: Any) -> Callable[[FC], FC]:
    """A click option that is also the environment variable ``TQMON_<env>``."""
    return click.option(*decls, envvar=f"TQMON_{env}", show_envvar=True, **kwargs)


def _threshold(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``max_off_policy_threshold``: a non-negative integer, or ``null`` (staleness eviction off)."""
    text = "null" if value is None else value.strip().lower()
    if text in ("null", "none", "~"):
        return None
    if not text.isdigit():
        raise click.BadParameter(f"expected a non-negative integer or 'null', got {value!r}")
    return int(text)


@dataclass(frozen=True)
class TrainerFlags:
    """The verl settings given on the command line (the same knobs as a ``run_started`` event's config)."""

    trainer_mode: str
    train_batch_size: int | None
    gen_batch_size: int | None
    num_warmup_batches: float | None
    max_off_policy_threshold: int | None
    max_off_policy_strategy: str
    skip_rollout_tq: bool
    filter_groups: bool
    trainer_config: Path | None

    @property
    def missing(self) -> list[str]:
        """The flags without which T cannot be computed."""
        return [
            flag
            for flag, value in (
                ("--train-batch-size", self.train_batch_size),
                ("--num-warmup-batches", self.num_warmup_batches),
            )
            if value is None
        ]

    def config(self) -> TrainerConfig | None:
        """The trainer config, or None while a flag it needs is missing."""
        if self.missing:
            return None
        try:
            return TrainerConfig(
                train_batch_size=self.train_batch_size,
                gen_batch_size=self.gen_batch_size,
                num_warmup_batches=self.num_warmup_batches,
                skip_rollout_tq=self.skip_rollout_tq,
                max_off_policy_threshold=self.max_off_policy_threshold,
                max_off_policy_strategy=self.max_off_policy_strategy,
                filter_groups=self.filter_groups,
            )
        except ValidationError as err:
            raise click.UsageError(f"invalid trainer config: {err}") from None

    def resolve(self) -> tuple[str, TrainerConfig, str] | None:
        """``(trainer_mode, config, where it came from)`` from the Hydra file or the flags; None if neither."""
        if self.trainer_config is not None:
            if len(self.missing) < 2:
                raise click.UsageError("give either --trainer-config or --train-batch-size/--num-warmup-batches")
            from tqmon.hydra_config import HydraConfigError, load_trainer_config

            try:
                mode, from_file = load_trainer_config(self.trainer_config)
            except HydraConfigError as err:
                raise click.BadParameter(str(err), param_hint="--trainer-config") from None
            return mode, from_file, f"file:{self.trainer_config}"
        if len(self.missing) == 1:
            raise click.UsageError(f"the trainer config also needs {self.missing[0]}")
        from_flags = self.config()
        return None if from_flags is None else (self.trainer_mode, from_flags, "flags")


_TRAINER_OPTIONS = (
    option(
        "--trainer-mode",
        type=click.Choice(sorted(TRAINER_MODES)),
        default="colocate_async",
        show_default=True,
        help="trainer.v1.trainer_mode.",
        env="TRAINER_MODE",
    ),
    option(
        "--train-batch-size",
        type=click.IntRange(min=1),
        default=None,
        help="data.train_batch_size (B); needed for T.",
        env="TRAIN_BATCH_SIZE",
    ),
    option(
        "--gen-batch-size",
        type=click.IntRange(min=1),
        default=None,
        help="data.gen_batch_size (the async modes and DAPO force 1).",
        env="GEN_BATCH_SIZE",
    ),
    option(
        "--num-warmup-batches",
        type=float,
        default=None,
        help="trainer.v1.<mode>.num_warmup_batches (may be fractional); needed for T.",
        env="NUM_WARMUP_BATCHES",
    ),
    option(
        "--max-off-policy-threshold",
        metavar="INT|null",
        callback=_threshold,
        default="8",
        show_default=True,
        help="trainer.v1.sampler.max_off_policy_threshold, or 'null'.",
        env="MAX_OFF_POLICY_THRESHOLD",
    ),
    option(
        "--max-off-policy-strategy",
        type=click.Choice(sorted(OFF_POLICY_STRATEGIES)),
        default="drop",
        show_default=True,
        help="trainer.v1.sampler.max_off_policy_strategy (only 'drop' evicts stale groups).",
        env="MAX_OFF_POLICY_STRATEGY",
    ),
    option(
        "--skip-rollout-tq", is_flag=True, help="skip.rollout_tq.enable (disables the warmup).", env="SKIP_ROLLOUT_TQ"
    ),
    option("--filter-groups", is_flag=True, help="algorithm.filter_groups.enable (DAPO).", env="FILTER_GROUPS"),
    option(
        "--trainer-config",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="verl's resolved Hydra config (<run dir>/.hydra/config.yaml): all the knobs above at once.",
        env="TRAINER_CONFIG",
    ),
)
_TRAINER_PARAMS = tuple(f.name for f in fields(TrainerFlags))


def trainer_config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the trainer-config flags; the command receives them as one ``trainer: TrainerFlags`` argument."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = TrainerFlags(**{name: kwargs.pop(name) for name in _TRAINER_PARAMS})
        return func(*args, trainer=flags, **kwargs)

    command: Callable[..., Any] = wrapper
    for decorator in reversed(_TRAINER_OPTIONS):
        command = decorator(command)
    return command


def _progressbar(label: str, total: int) -> AbstractContextManager[Any]:
    return click.progressbar(length=total, label=label, file=sys.stderr)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="tqmon")
def main() -> None:
    """tqmon: Prometheus sidecar for verl V1 async training's TransferQueue prefetch window.

    It tells whether a run that resumed from a checkpoint refilled its rollout window correctly
    (restored R, target T, warmup expected vs submitted, doomed groups, under-submission).
    """


@main.command()
@option("--listen", default=LISTEN_DEFAULT, show_default=True, help="HOST:PORT to serve on.", env="LISTEN")
@option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("tqmon-state"),
    show_default=True,
    help="Directory for the SQLite state (resume history, counters, log offsets); survives restarts.",
    env="STATE_DIR",
)
@option(
    "--log",
    "logs",
    multiple=True,
    metavar="PATH",
    help="verl trainer log to follow like tail -F (repeatable, globs allowed; the env var is space-separated).",
    env="LOG",
)
@option(
    "--jsonl",
    "jsonl",
    multiple=True,
    metavar="PATH",
    help="verl's file-logger metrics (trainer.logger=[...,file], VERL_FILE_LOGGER_PATH): step times, generation "
    "wait and evictions by reason. Truncated by verl on every restart; repeatable, globs allowed.",
    env="JSONL",
)
@option(
    "--log-interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between polls of the --log and --jsonl files.",
    env="LOG_INTERVAL",
)
@option(
    "--token",
    default=None,
    help="Bearer token the event API requires; mandatory when --listen is not a loopback address.",
    env="TOKEN",
)
@option(
    "--stale-after",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds after which a source's live data is dropped from /metrics and the source reads down.",
    env="STALE_AFTER",
)
@option(
    "--max-body-bytes",
    type=int,
    default=1 << 20,
    show_default=True,
    help="Largest event API body accepted.",
    env="MAX_BODY_BYTES",
)
@option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="tqmon's own logging.",
    env="LOG_LEVEL",
)
@option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="verl's trainer.default_local_dir: predict the next resume from its latest TransferQueue checkpoint "
    "(read-only).",
    env="CHECKPOINT_DIR",
)
@option(
    "--checkpoint-interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between checkpoint dir polls.",
    env="CHECKPOINT_INTERVAL",
)
@option(
    "--ray-address",
    default=None,
    metavar="ADDR|auto",
    help="Watch the live TransferQueue of the Ray cluster at ADDR (GCS host:port; 'auto' = the local cluster). "
    "Read-only: tqmon never calls tq.init/tq.close and creates nothing in the cluster. Default: off.",
    env="RAY_ADDRESS",
)
@option(
    "--tq-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Hard timeout of every call to Ray and the TQ controller; a lost controller reads down within it.",
    env="TQ_TIMEOUT",
)
@option(
    "--tq-budget",
    type=float,
    default=0.01,
    show_default=True,
    help="Largest share of the TQ controller's request thread tqmon's kv_list polls may take (0.01 = 1%%); "
    "wins over --tq-max-interval.",
    env="TQ_BUDGET",
)
@option(
    "--tq-min-interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Fastest poll interval, used for --tq-fast-period seconds after a resume or a new controller.",
    env="TQ_MIN_INTERVAL",
)
@option(
    "--tq-max-interval",
    type=float,
    default=15.0,
    show_default=True,
    help="Steady poll interval, unless the budget needs longer.",
    env="TQ_MAX_INTERVAL",
)
@option(
    "--tq-fast-period",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds of fast polling after a resume is detected (when the window matters most).",
    env="TQ_FAST_PERIOD",
)
@option(
    "--recover",
    is_flag=True,
    help="If the state file is corrupt or not tqmon's, move it aside (timestamped) and start empty, re-reading "
    "the sources; without it tqmon refuses to start. See docs/reliability.md.",
    env="RECOVER",
)
@option(
    "--retain-records",
    type=int,
    default=1000,
    show_default=True,
    help="Resume records kept in the state dir (with the events behind them); older ones are pruned.",
    env="RETAIN_RECORDS",
)
@option(
    "--retain-days",
    type=float,
    default=365.0,
    show_default=True,
    help="Resume records older than this are pruned too (the latest start is always kept).",
    env="RETAIN_DAYS",
)
@option(
    "--retain-min-age",
    type=float,
    default=3600.0,
    show_default=True,
    help="Seconds an event is kept whatever retention says: a post retried within it is still a duplicate.",
    env="RETAIN_MIN_AGE",
)
@trainer_config_options
def serve(
    listen: str,
    state_dir: Path,
    logs: tuple[str, ...],
    jsonl: tuple[str, ...],
    log_interval: float,
    token: str | None,
    stale_after: float,
    max_body_bytes: int,
    log_level: str,
    checkpoint_dir: Path | None,
    checkpoint_interval: float,
    ray_address: str | None,
    tq_timeout: float,
    tq_budget: float,
    tq_min_interval: float,
    tq_max_interval: float,
    tq_fast_period: float,
    recover: bool,
    retain_records: int,
    retain_days: float,
    retain_min_age: float,
    trainer: TrainerFlags,
) -> None:
    """Serve /metrics, /api/v1/status and the trainer event API (POST /api/v1/events).

    Sources: trainer logs (--log), verl's JSONL metrics (--jsonl), the checkpoint dir (--checkpoint-dir),
    the live TransferQueue (--ray-address) and events the trainer posts. The trainer config is optional:
    --trainer-config or both --train-batch-size and --num-warmup-batches; a run_started event overrides either.
    """
    host, port = parse_listen(listen)
    config = ServiceConfig(
        host=host,
        port=port,
        state_dir=state_dir,
        log_patterns=tuple(p for item in logs for p in item.split()),
        jsonl_patterns=tuple(p for item in jsonl for p in item.split()),
        log_interval=log_interval,
        token=token or None,
        stale_after=stale_after,
        max_body_bytes=max_body_bytes,
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval=checkpoint_interval,
        trainer=trainer.resolve(),
        ray_address=ray_address,
        tq_timeout=tq_timeout,
        tq_budget=PollBudget(
            budget=tq_budget, min_interval=tq_min_interval, max_interval=tq_max_interval, fast_period=tq_fast_period
        ),
        recover=recover,
        retention=RetentionPolicy(records=retain_records, days=retain_days, min_age=retain_min_age),
    )
    serve_forever(config, log_level)


@main.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@option("--json", "as_json", is_flag=True, help="Print the records as JSON instead of a table.", env="ANALYZE_JSON")
def analyze(logs: tuple[str, ...], as_json: bool) -> None:
    """Print the resume records and verdicts found in finished verl logs (read in the order given)."""
    from tqmon.report import table
    from tqmon.sources.logfile import ingest_file
    from tqmon.store import StateStore
    from tqmon.tracker import Tracker

    tracker = Tracker(StateStore(None))
    tracker.register_source("log", stale_after=None)
    malformed = sum(ingest_file(path, tracker) for path in logs)
    records = tracker.records()
    if as_json:
        click.echo(json.dumps({"records": [r.to_json() for r in records], "malformed_lines": malformed}, indent=2))
        return
    if not records:
        click.echo("no trainer start found in " + ", ".join(logs))
    else:
        click.echo(table(records))
    if malformed:
        click.echo(f"{malformed} malformed verl line(s) skipped", err=True)


@main.command("inspect")
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="Inspect global_step_N, not the latest.",
    env="INSPECT_STEP",
)
@option("--json", "as_json", is_flag=True, help="Print the preflight as JSON.", env="INSPECT_JSON")
@trainer_config_options
def inspect_checkpoint(checkpoint_dir: Path, step: int | None, as_json: bool, trainer: TrainerFlags) -> None:
    """Preflight a resume: what restoring CHECKPOINT_DIR's TransferQueue state will do.

    CHECKPOINT_DIR is verl's trainer.default_local_dir (its latest checkpoint), a global_step_N dir or
    its transfer_queue dir. Prints R by status and age, K, the doomed groups, the orphan trajectories and,
    with --train-batch-size and --num-warmup-batches, T, M, O and the under-submission. Reads only.
    """
    from tqmon.sources.checkpoint import CheckpointError, preflight, read_checkpoint, render, resolve

    root, resolved = resolve(checkpoint_dir)
    resolved_config = trainer.resolve()
    try:
        reading = read_checkpoint(root, step if step is not None else resolved, progress=_progressbar)
    except CheckpointError as err:
        raise click.ClickException(str(err)) from None
    warmup = None if resolved_config is None else resolved_config[1].warmup_config(resolved_config[0])
    result = preflight(reading, warmup)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else render(result))


@main.command()
@option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    default="partial-restore",
    show_default=True,
    help="What the simulated trainer does before the preemption and at the resume (see `tqmon sim --help`).",
    env="DEMO_SCENARIO",
)
@option("--listen", default=LISTEN_DEFAULT, show_default=True, help="HOST:PORT tqmon serves on.", env="LISTEN")
@option(
    "--step-seconds",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Wall time of one simulated training step.",
    env="DEMO_STEP_SECONDS",
)
@option(
    "--steps-after-resume",
    type=click.IntRange(min=1),
    default=600,
    show_default=True,
    help="Steps the trainer runs after resuming (then it holds its TransferQueue until you stop the demo).",
    env="DEMO_STEPS_AFTER_RESUME",
)
@option(
    "--prometheus/--no-prometheus",
    default=None,
    help="Also run Prometheus on loopback with the alert rules [default: when `prometheus` is on PATH].",
    env="DEMO_PROMETHEUS",
)
@option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the run (log, checkpoints, tqmon state, outputs) here; default: a temp dir removed on exit.",
    env="DEMO_WORKDIR",
)
def demo(
    scenario: str,
    listen: str,
    step_seconds: float,
    steps_after_resume: int,
    prometheus: bool | None,
    workdir: Path | None,
) -> None:
    """Watch a preempted and resumed verl run on a real TransferQueue, live.

    Starts a local Ray cluster, the simulated verl 0.9.1 trainer on a real TransferQueue in it, tqmon
    attached to the live TQ, the trainer log and the checkpoint dir, and Prometheus with the alert rules
    when it is installed; prints the URLs and a live summary. Ctrl-C stops everything it started.
    """
    from tqmon.demo import run_demo

    if workdir is not None and workdir.exists() and any(workdir.iterdir()):
        raise click.UsageError(f"--workdir {workdir} is not empty; give a fresh directory")
    run_demo(
        scenario,
        parse_listen(listen),
        step_seconds=step_seconds,
        steps_after_resume=steps_after_resume,
        prometheus=prometheus,
        workdir=workdir,
    )


def rule_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """One option per ``RuleConfig`` field, with its help and default; each also ``TQMON_RULES_<FIELD>``."""
    for spec in reversed(fields(RuleConfig)):
        many = isinstance(spec.default, tuple)
        func = option(
            "--" + spec.name.replace("_", "-"),
            spec.name,
            type=str if many else type(spec.default),
            multiple=many,
            default=spec.default,
            show_default=True,
            help=spec.metadata["help"],
            env="RULES_" + spec.name.upper(),
        )(func)
    return func


@main.command("rules")
@option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the rules file here instead of to stdout.",
    env="RULES_OUTPUT",
)
@rule_options
def rules_command(output: Path | None, **params: Any) -> None:
    """Prometheus recording and alert rules for your setup (deploy/prometheus/tqmon-rules.yml has the defaults).

    Every threshold, duration and selector is a flag; check the result with `promtool check rules`.
    """
    from tqmon.rules import render

    try:
        config = RuleConfig(**params)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    text = render(config)
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)
        click.echo(f"wrote {output}", err=True)


main.add_command(sim)


if __name__ == "__main__":
    sys.exit(main())
