"""``tqmon`` command line: every option is also a ``TQMON_*`` environment variable."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from tqmon import __version__
from tqmon.server import serve_forever
from tqmon.service import ServiceConfig

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
    "--log-interval", type=float, default=1.0, show_default=True, help="Seconds between log polls.", env="LOG_INTERVAL"
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
def serve(
    listen: str,
    state_dir: Path,
    logs: tuple[str, ...],
    log_interval: float,
    token: str | None,
    stale_after: float,
    max_body_bytes: int,
    log_level: str,
) -> None:
    """Serve /metrics, /api/v1/status and the trainer event API (POST /api/v1/events)."""
    host, port = parse_listen(listen)
    config = ServiceConfig(
        host=host,
        port=port,
        state_dir=state_dir,
        log_patterns=tuple(p for item in logs for p in item.split()),
        log_interval=log_interval,
        token=token or None,
        stale_after=stale_after,
        max_body_bytes=max_body_bytes,
    )
    serve_forever(config, log_level)


@main.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON instead of a table.")
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


@main.command()
@option("--listen", default=LISTEN_DEFAULT, show_default=True, help="HOST:PORT to serve on.", env="LISTEN")
@click.option("--speed", type=float, default=20.0, show_default=True, help="Log lines written per second.")
def demo(listen: str, speed: float) -> None:
    """Replay a bundled log of a preempted and resumed verl run into a file and serve tqmon on it."""
    from tqmon.demo import run_demo

    host, port = parse_listen(listen)
    run_demo(host, port, speed)


if __name__ == "__main__":
    sys.exit(main())
