"""``tqmon`` command line: every option is also a ``TQMON_*`` environment variable."""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import Field, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import click
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from tqmon import __version__
from tqmon.rules import RuleConfig
from tqmon.service import ConfigError, ServiceConfig, StartupError
from tqmon.warmup import TRAINER_MODES, GivenConfig, TrainerConfig, verl_setting

FC = TypeVar("FC", bound=Callable[..., Any])
SettingsT = TypeVar("SettingsT")  # a settings dataclass built from flags


class SettingError(click.ClickException):
    """A flag that cannot work: one line ``Error: ...`` (no usage block), exit status 2 like click's own."""

    exit_code = 2


def option(*decls: str, env: str, **kwargs: Any) -> Callable[[FC], FC]:
    """A click option that is also the environment variable ``TQMON_<env>``."""
    return click.option(*decls, envvar=f"TQMON_{env}", show_envvar=True, **kwargs)


def settings_options(cls: type, env_prefix: str = "") -> Callable[[FC], FC]:
    """One option per field of the settings dataclass ``cls`` that carries a help, with its default; each is
    also ``TQMON_<env_prefix><FIELD>``. A field holding a nested settings dataclass adds its fields
    prefixed with the field's name (``tq`` -> ``--tq-budget``)."""

    def decorate(func: FC) -> FC:
        for name, spec, hint in reversed(list(settings_fields(cls))):
            many = get_origin(hint) is tuple
            kinds = [arg for arg in (hint, *get_args(hint)) if arg is not type(None)]
            kwargs: dict[str, Any] = {"multiple": many, "metavar": spec.metadata.get("metavar")}
            if hint is bool:
                kwargs = {"is_flag": True}  # off unless given
            elif get_origin(hint) is Literal:
                kwargs["type"] = click.Choice(get_args(hint))
            elif Path in kinds:
                kwargs["type"] = click.Path(path_type=Path)  # ServiceConfig.validate says what is wrong, in one line
            else:
                kwargs["type"] = str if many else next(k for k in kinds if isinstance(k, type))
            if spec.default not in (None, (), False):
                kwargs["show_default"] = True
            func = option(
                "--" + name.replace("_", "-"),
                name,
                default=spec.default,
                help=spec.metadata["help"],
                env=env_prefix + name.upper(),
                **kwargs,
            )(func)
        return func

    return decorate


def settings_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Field[Any], Any]]:
    """(flag name, field, type) of every field of ``cls`` that is a flag, nested settings flattened."""
    hints = get_type_hints(cls)
    for spec in fields(cls):
        if is_dataclass(hints[spec.name]):
            yield from settings_fields(hints[spec.name], f"{prefix}{spec.name}_")
        elif "help" in spec.metadata:
            yield prefix + spec.name, spec, hints[spec.name]


def from_flags(cls: type[SettingsT], flags: dict[str, Any], prefix: str = "") -> SettingsT:
    """The settings dataclass ``cls`` from the values of its ``settings_options``."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for spec in fields(cls):  # type: ignore[arg-type]
        if is_dataclass(hints[spec.name]):
            values[spec.name] = from_flags(hints[spec.name], flags, f"{prefix}{spec.name}_")
        elif "help" in spec.metadata:
            values[spec.name] = flags[prefix + spec.name]
    return cls(**values)


def _threshold(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """``max_off_policy_threshold``: a non-negative integer, or ``null`` (staleness eviction off)."""
    text = "null" if value is None else value.strip().lower()
    if text in ("null", "none", "~"):
        return None
    if not text.isdigit():
        raise click.BadParameter(f"expected a non-negative integer or 'null', got {value!r}")
    return int(text)


def _setting_option(name: str, spec: FieldInfo) -> Callable[[FC], FC]:
    """The flag of one :class:`TrainerConfig` field: its help and default from the declaration.

    A required setting has no default here: the trainer config is optional, and ``TrainerFlags`` says
    which flag is missing.
    """
    kwargs: dict[str, Any] = {"help": verl_setting(name).help, "env": name.upper()}
    args = get_args(spec.annotation)
    if spec.annotation is bool:
        kwargs["is_flag"] = True
    elif args and all(isinstance(arg, str) for arg in args):  # a Literal
        kwargs |= {"type": click.Choice(sorted(args)), "default": spec.default, "show_default": True}
    elif spec.annotation == int | None and spec.default is not None:  # a number or null
        kwargs |= {"metavar": "INT|null", "callback": _threshold, "default": str(spec.default), "show_default": True}
    elif str in args:  # a name, or none
        kwargs |= {"metavar": "NAME", "default": None}
    else:
        number = next(arg for arg in (spec.annotation, *args) if arg in (int, float))
        positive = any(getattr(item, "gt", None) == 0 for item in spec.metadata)
        kwargs |= {"type": click.IntRange(min=1) if number is int and positive else number, "default": None}
    return option("--" + name.replace("_", "-"), **kwargs)


@dataclass(frozen=True)
class TrainerFlags:
    """The verl settings given on the command line (the same knobs as a ``run_started`` event's config)."""

    trainer_mode: str
    trainer_config: Path | None
    settings: dict[str, Any]  # TrainerConfig's fields, as the flags gave them

    @property
    def missing(self) -> list[str]:
        """The flags without which T cannot be computed (the settings without a default)."""
        return [
            "--" + name.replace("_", "-")
            for name, spec in TrainerConfig.model_fields.items()
            if spec.is_required() and self.settings[name] is None
        ]

    def resolve(self) -> GivenConfig | None:
        """The trainer config from the Hydra file or the flags; None if neither gives one."""
        if self.trainer_config is not None:
            if len(self.missing) < len(REQUIRED_SETTINGS):
                flags = "/".join("--" + name.replace("_", "-") for name in REQUIRED_SETTINGS)
                raise click.UsageError(f"give either --trainer-config or {flags}")
            from tqmon.hydra_config import HydraConfigError, load_trainer_config

            try:
                return load_trainer_config(self.trainer_config)
            except HydraConfigError as err:
                raise SettingError(f"--trainer-config: {err}") from None
        if len(self.missing) == len(REQUIRED_SETTINGS):
            return None
        if self.missing:
            raise click.UsageError(f"the trainer config also needs {self.missing[0]}")
        try:
            return GivenConfig(self.trainer_mode, TrainerConfig(**self.settings), "flags")
        except ValidationError as err:
            raise click.UsageError(f"invalid trainer config: {err}") from None


REQUIRED_SETTINGS = tuple(name for name, spec in TrainerConfig.model_fields.items() if spec.is_required())
_TRAINER_OPTIONS = (
    option(
        "--trainer-mode",
        type=click.Choice(sorted(TRAINER_MODES)),
        default="colocate_async",
        show_default=True,
        help="trainer.v1.trainer_mode.",
        env="TRAINER_MODE",
    ),
    *(_setting_option(name, spec) for name, spec in TrainerConfig.model_fields.items()),
    option(
        "--trainer-config",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="verl's resolved Hydra config (<run dir>/.hydra/config.yaml): all the knobs above at once.",
        env="TRAINER_CONFIG",
    ),
)


def trainer_config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add the trainer-config flags; the command receives them as one ``trainer: TrainerFlags`` argument."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = {name: kwargs.pop(name) for name in TrainerConfig.model_fields}
        flags = TrainerFlags(kwargs.pop("trainer_mode"), kwargs.pop("trainer_config"), settings)
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
@settings_options(ServiceConfig)
@trainer_config_options
def serve(trainer: TrainerFlags, **flags: Any) -> None:
    """Serve /metrics, /api/v1/status and the trainer event API (POST /api/v1/events).

    Sources: trainer logs (--log), verl's JSONL metrics (--jsonl), the checkpoint dir (--checkpoint-dir),
    the live TransferQueue (--ray-address) and events the trainer posts. The trainer config is optional:
    --trainer-config or both --train-batch-size and --num-warmup-batches; a run_started event overrides either.
    """
    from tqmon.server import serve_forever  # FastAPI and uvicorn: 40% of every command's startup if imported above

    config = replace(from_flags(ServiceConfig, flags), trainer=trainer.resolve())
    try:
        serve_forever(config)
    except ConfigError as err:
        raise SettingError(str(err)) from None
    except StartupError as err:
        raise click.ClickException(str(err)) from None


@main.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@option(
    "--jsonl",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="verl's JSONL metrics file (trainer.logger file): the first step's evictions.",
    env="ANALYZE_JSONL",
)
@option(
    "--checkpoint-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="verl's trainer.default_local_dir: each resume's composition, so its doomed groups are exact.",
    env="ANALYZE_CHECKPOINT_DIR",
)
@option(
    "--log-timezone",
    default=None,
    metavar="ZONE",
    help="IANA zone the log's zone-less timestamps were written in [default: the machine's].",
    env="ANALYZE_LOG_TIMEZONE",
)
@option("--json", "as_json", is_flag=True, help="Print the records as JSON instead of a table.", env="ANALYZE_JSON")
@trainer_config_options
def analyze(
    logs: tuple[str, ...],
    jsonl: tuple[str, ...],
    checkpoint_dir: Path | None,
    log_timezone: str | None,
    as_json: bool,
    trainer: TrainerFlags,
) -> None:
    """Post-mortem: the resume records and verdicts of finished verl logs, derived as `serve` derives them.

    With --trainer-config (or the setting flags), --checkpoint-dir and --jsonl it gets the numbers serve
    would have had; without them, numbers it cannot know are marked as lower bounds. Several logs are read
    in time order.
    """
    from tqmon.postmortem import LogZone, NotATrainerLog
    from tqmon.postmortem import analyze as post_mortem
    from tqmon.report import table

    try:
        zone = LogZone.of(log_timezone)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--log-timezone") from None
    try:
        result = post_mortem(logs, jsonl=jsonl, checkpoint_dir=checkpoint_dir, given=trainer.resolve(), zone=zone)
    except NotATrainerLog as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    click.echo(f"log timestamps read in {zone.name} ({zone.chosen} zone)")
    if not result.records:
        click.echo("no trainer start found in " + ", ".join(logs))
    else:
        click.echo(table(result.records))
    for note in result.notes:
        click.echo(f"note: {note}")
    if result.malformed:
        click.echo(f"{result.malformed} malformed verl line(s) skipped", err=True)


def _release(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--verl-version``: a verl release (``0.9.0``, ``0.9.1rc1``), or nothing."""
    from tqmon.warmup import release

    if value is not None and release(value) is None:
        raise click.BadParameter(f"expected a verl release like 0.9.1, got {value!r}")
    return value


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
@option(
    "--log",
    "logs",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="verl trainer log (repeatable): its own lines tell the verl version, e.g. 0.9.0's 'Added {n} warmup batches'.",
    env="INSPECT_LOG",
)
@option(
    "--verl-version",
    default=None,
    metavar="X.Y.Z",
    callback=_release,
    help="The verl release that will resume (e.g. 0.9.0): picks the warmup predicted. The --log lines win over "
    "it; without either, the verl installed next to tqmon; with none, both warmups are predicted.",
    env="VERL_VERSION",
)
@trainer_config_options
def inspect_checkpoint(
    checkpoint_dir: Path,
    step: int | None,
    as_json: bool,
    logs: tuple[str, ...],
    verl_version: str | None,
    trainer: TrainerFlags,
) -> None:
    """Preflight a resume: what restoring CHECKPOINT_DIR's TransferQueue state will do.

    CHECKPOINT_DIR is verl's trainer.default_local_dir (its latest checkpoint), a global_step_N dir or
    its transfer_queue dir (a run dir gets the checkpoint dirs below it suggested). Prints R by status and age,
    K, the doomed groups, the orphan trajectories and, with --trainer-config (or --train-batch-size and
    --num-warmup-batches), T, M, O, the over-fill and the under-submission under the warmup of the verl version
    (--log, --verl-version or the installed verl; both warmups while it is unknown). Reads only.
    """
    from tqmon.checkpoint.layout import NoCheckpointYet, latest_step, read_checkpoint, resolve
    from tqmon.checkpoint.preflight import preflight, render
    from tqmon.checkpoint.unpickler import CheckpointError
    from tqmon.postmortem import NotATrainerLog, inspected_version

    root, resolved = resolve(checkpoint_dir)
    given = trainer.resolve()
    if trainer.trainer_config is not None:
        _warn_if_elsewhere(trainer.trainer_config, root)
    chosen_by = f"--step {step}" if step is not None else None if resolved is None else f"the path {checkpoint_dir}"
    try:
        reading = read_checkpoint(
            root,
            step if step is not None else resolved,
            progress=_progressbar,
            filter_metric=None if given is None else given.config.dapo_metric,
        )
    except NoCheckpointYet:
        raise click.ClickException(_not_a_checkpoint_dir(root)) from None
    except CheckpointError as err:
        raise click.ClickException(str(err)) from None
    latest = None
    if chosen_by is not None:
        with contextlib.suppress(CheckpointError):  # no or a broken latest file: verl would not pick a step
            latest = latest_step(root)
    try:
        version = inspected_version(logs, verl_version)
    except NotATrainerLog as err:
        raise click.ClickException(str(err)) from None
    warmup = None if given is None else given.warmup
    result = preflight(reading, warmup, version, chosen_by=chosen_by, latest=latest)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else render(result))


def _not_a_checkpoint_dir(root: Path) -> str:
    """What ``tqmon inspect`` expected of a dir without a checkpoint, and the path the user probably meant."""
    from tqmon.checkpoint.layout import checkpoint_dirs_below, saved_steps
    from tqmon.warmup import LATEST_FILE

    missing = f"{root} has no {LATEST_FILE}"
    candidates = checkpoint_dirs_below(root)
    if candidates:
        return f"{missing}; did you mean {' or '.join(map(str, candidates))}?"
    steps = saved_steps(root)
    if steps:
        return f"{missing}, but holds global_step_{steps[-1]}: inspect it with --step {steps[-1]}"
    return (
        f"{missing} and no global_step_N dir: expected verl's trainer.default_local_dir (the dir of {LATEST_FILE} "
        "and global_step_N/), a global_step_N dir or its transfer_queue dir; no checkpoint saved yet?"
    )


def _warn_if_elsewhere(config_path: Path, root: Path) -> None:
    """Warn when the trainer config saves its checkpoints somewhere else than the dir inspected."""
    from tqmon.hydra_config import read_setting

    saved_to = read_setting(config_path, "trainer.default_local_dir")
    if not isinstance(saved_to, str) or not saved_to:
        return
    configured, inspected = Path(saved_to), root.resolve()
    # A relative default_local_dir is relative to the trainer's working dir, which the config does not record.
    same = (
        configured.resolve() == inspected
        if configured.is_absolute()
        else inspected.parts[-len(configured.parts) :] == configured.parts
    )
    if not same:
        click.echo(
            f"warning: {config_path} saves checkpoints to trainer.default_local_dir={saved_to}, "
            f"not to {root}: is it the config of this run?",
            err=True,
        )


@main.command("rules")
@option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the rules file here instead of to stdout.",
    env="RULES_OUTPUT",
)
@settings_options(RuleConfig, env_prefix="RULES_")
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


class LazyCommand(click.Command):
    """A command whose module is imported only when it runs or shows its own help.

    ``tqmon --help`` lists it from ``summary``, the command's first docstring line (a test holds the two
    equal), so the sidecar's startup never imports the tooling behind it.
    """

    def __init__(self, name: str, target: str, summary: str) -> None:
        super().__init__(name, help=summary)  # help, not short_help: click shortens it as it did the docstring
        self.target = target  # "module:attribute"

    def load(self) -> click.Command:
        module, _, attribute = self.target.partition(":")
        command: click.Command = getattr(importlib.import_module(module), attribute)
        return command

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        """The loaded command's context: click parses the arguments and invokes that command."""
        return self.load().make_context(info_name, args, parent, **extra)


# The simulator and the demo: tooling on a real TransferQueue (the tq extra), not the sidecar.
main.add_command(
    LazyCommand("demo", "tqmon.demo:demo", "Watch a preempted and resumed verl run on a real TransferQueue, live.")
)
main.add_command(
    LazyCommand(
        "sim",
        "tqmon.sim.cli:sim",
        "Simulate a verl 0.9.1 V1 async trainer on a real TransferQueue: a fresh start, a preemption, a resume.",
    )
)


if __name__ == "__main__":
    sys.exit(main())
