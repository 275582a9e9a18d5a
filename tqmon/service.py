"""Wires the store, the tracker, the sources and the registry of one tqmon process."""

from __future__ import annotations

import ipaddress
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry

from tqmon.binding import Identity, StateDirTaken, bind, run_identity
from tqmon.exporters.prometheus import build_registry
from tqmon.extras import MissingExtra, require_extra
from tqmon.file_sd import FileSDError, file_sd_target
from tqmon.retention import Retention, RetentionPolicy
from tqmon.snapshot import Snapshot, SourceName
from tqmon.sources.checkpoint import CheckpointSource
from tqmon.sources.logfile import LogSource, parse_jsonl
from tqmon.sources.polling import Source
from tqmon.sources.tq import PollBudget, PollerProcess, PollSettings, TQSource
from tqmon.statelock import StateError
from tqmon.store import StateStore
from tqmon.tracker import Tracker
from tqmon.versions import FLAG, VerlVersion, installed, named
from tqmon.warmup import GivenConfig

if TYPE_CHECKING:
    from tqmon.exporters.otlp import OTLPExporter

LISTEN_DEFAULT = "127.0.0.1:9842"
LogLevel = Literal["debug", "info", "warning", "error"]
log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and why."""


class StartupError(RuntimeError):
    """The machine refuses a valid setting (a port in use, an unknown host, a state dir tqmon cannot create)."""


def _setting(default: Any, help: str, *, metavar: str | None = None) -> Any:
    """A ``ServiceConfig`` field that is a ``tqmon serve`` flag (and ``TQMON_<NAME>``): declared once here,
    with its default and help; the CLI, ``--help`` and the README table follow (a test checks the README)."""
    return field(default=default, metadata={"help": help, "metavar": metavar})


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``tqmon serve`` is told; frozen (what changes at run time lives in the sources)."""

    listen: str = _setting(LISTEN_DEFAULT, "HOST:PORT to serve on.", metavar="HOST:PORT")
    state_dir: Path = _setting(
        Path("tqmon-state"),
        "Directory for the SQLite state (resume history, counters, log offsets); survives restarts.",
        metavar="DIR",
    )
    recover: bool = _setting(
        False,
        "If the state file is corrupt or not tqmon's, move it aside (timestamped) and start empty, re-reading the "
        "sources; without it tqmon refuses to start. See docs/reliability.md.",
    )
    retain: RetentionPolicy = field(default_factory=RetentionPolicy)  # the --retain-* flags
    log: tuple[str, ...] = _setting(
        (),
        "verl trainer log to follow like tail -F (repeatable, globs allowed; the env var is space-separated).",
        metavar="PATH",
    )
    jsonl: tuple[str, ...] = _setting(
        (),
        "verl's file-logger metrics (trainer.logger=[...,file], VERL_FILE_LOGGER_PATH): step times, generation "
        "wait and evictions by reason. Truncated by verl on every restart; repeatable, globs allowed.",
        metavar="PATH",
    )
    log_interval: float = _setting(1.0, "Seconds between polls of the --log and --jsonl files.")
    token: str | None = _setting(
        None, "Bearer token the event API requires; mandatory when --listen is not a loopback address."
    )
    stale_after: float = _setting(
        300.0, "Seconds after which a source's live data is dropped from /metrics and the source reads down."
    )
    max_body_bytes: int = _setting(1 << 20, "Largest event API body accepted.")
    log_level: LogLevel = _setting("info", "tqmon's own logging.")
    checkpoint_dir: Path | None = _setting(
        None,
        "verl's trainer.default_local_dir: predict the next resume from its latest TransferQueue checkpoint "
        "(read-only).",
        metavar="DIR",
    )
    checkpoint_interval: float = _setting(10.0, "Seconds between checkpoint dir polls.")
    ray_address: str | None = _setting(
        None,
        "Watch the live TransferQueue of the Ray cluster at ADDR (GCS host:port; 'auto' = the local cluster). "
        "Read-only: tqmon never calls tq.init/tq.close and creates nothing in the cluster. Default: off.",
        metavar="ADDR|auto",
    )
    tq_timeout: float = _setting(
        5.0, "Hard timeout of every call to Ray and the TQ controller; a lost controller reads down within it."
    )
    tq: PollSettings = field(default_factory=PollSettings)  # the --tq-* flags
    trainer: GivenConfig | None = None  # the trainer flags or --trainer-config; run_started overrides it
    verl_version: str | None = _setting(
        None,
        "The verl release the trainer runs (e.g. 0.9.0): picks the warmup the checkpoint preflight predicts. "
        "The plugin's run_started and the log's own lines win over it; without any of them, the verl installed "
        "next to tqmon; with none, both warmups are predicted.",
        metavar="X.Y.Z",
    )
    process_metrics: bool = True
    otlp_endpoint: str | None = _setting(
        None,
        "Also push the metrics and resume log records over OTLP/HTTP to URL/v1/metrics and URL/v1/logs "
        "(needs the otel extra). Honours OTEL_EXPORTER_OTLP_ENDPOINT (this flag wins), "
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT and OTEL_EXPORTER_OTLP_LOGS_ENDPOINT (they win for their signal), "
        "OTEL_EXPORTER_OTLP_HEADERS, OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf), OTEL_EXPORTER_OTLP_COMPRESSION, "
        "OTEL_EXPORTER_OTLP_TIMEOUT (ms), OTEL_EXPORTER_OTLP_CERTIFICATE, OTEL_METRIC_EXPORT_INTERVAL (ms), "
        "OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, and POD_NAME, POD_NAMESPACE (downward API). Default: off.",
        metavar="URL",
    )
    file_sd: Path | None = _setting(
        None,
        "Announce this tqmon to Prometheus in a file_sd target file at PATH: written atomically once tqmon "
        "listens, removed on exit (docs/deploy.md).",
        metavar="PATH",
    )
    file_sd_label: tuple[str, ...] = _setting(
        (),
        "Label of the --file-sd target (repeatable; the env var is space-separated). SLURM_JOB_ID, "
        "SLURM_JOB_NAME and SLURM_CLUSTER_NAME add slurm_job_id, slurm_job_name and slurm_cluster.",
        metavar="NAME=VALUE",
    )

    @property
    def address(self) -> tuple[str, int]:
        """``--listen`` as (host, port); ``HOST:PORT`` or ``[IPv6]:PORT``."""
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ConfigError(f"--listen: expected HOST:PORT (e.g. {LISTEN_DEFAULT}), got {self.listen!r}")
        if not 0 < int(port) < 65536:
            raise ConfigError(f"--listen: port out of range (1-65535): {port} in {self.listen!r}")
        return host.strip("[]"), int(port)

    @property
    def told_version(self) -> VerlVersion | None:
        """``--verl-version`` as a version source (validated)."""
        return None if self.verl_version is None else named(self.verl_version, "flag", FLAG)

    @property
    def log_patterns(self) -> list[str]:
        return [pattern for item in self.log for pattern in item.split()]

    @property
    def jsonl_patterns(self) -> list[str]:
        return [pattern for item in self.jsonl for pattern in item.split()]

    def validate(self) -> None:
        host, _ = self.address
        if not is_loopback(host) and not self.token:
            raise ConfigError(
                f"listening on {host} (not loopback) requires --token / TQMON_TOKEN: "
                "the event API would otherwise accept anyone's events"
            )
        for flag, path in (("--state-dir", self.state_dir), ("--checkpoint-dir", self.checkpoint_dir)):
            if path is not None and path.exists() and not path.is_dir():
                raise ConfigError(f"{flag} {path} is a file, not a directory")
        if self.stale_after <= 0:
            raise ConfigError(f"--stale-after must be positive, got {self.stale_after}")
        if self.log_interval <= 0:
            raise ConfigError(f"--log-interval must be positive, got {self.log_interval}")
        if self.checkpoint_interval <= 0:
            raise ConfigError(f"--checkpoint-interval must be positive, got {self.checkpoint_interval}")
        if self.tq_timeout <= 0:
            raise ConfigError(f"--tq-timeout must be positive, got {self.tq_timeout}")
        if self.ray_address:
            try:
                require_extra("tq", "--ray-address")
            except MissingExtra as err:
                raise ConfigError(err.message) from None
        if self.verl_version is not None and self.told_version is None:
            raise ConfigError(f"--verl-version: expected a verl release like 0.9.1, got {self.verl_version!r}")
        try:
            self.tq.validate()
            self.retain.validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One source declared once: whether the settings ask for it and how it is built to follow the trainer.

    ``serve`` builds every enabled one; ``tqmon analyze`` reads the enabled file sources whole from the same
    settings (:data:`tqmon.postmortem.READERS`). Adding a source: its module, its :class:`SourceName`, its
    settings in :class:`ServiceConfig`, one entry here (and a reader if it can be read after the fact).
    """

    name: SourceName
    enabled: Callable[[ServiceConfig], bool]
    follow: Callable[[ServiceConfig, Tracker], Source]


def _checkpoint(config: ServiceConfig, tracker: Tracker) -> Source:
    assert config.checkpoint_dir is not None
    metric = config.trainer.config.dapo_metric if config.trainer else None
    return CheckpointSource(config.checkpoint_dir, tracker, interval=config.checkpoint_interval, filter_metric=metric)


def _log(config: ServiceConfig, tracker: Tracker) -> Source:
    return LogSource(config.log_patterns, tracker, interval=config.log_interval)


def _jsonl(config: ServiceConfig, tracker: Tracker) -> Source:
    return LogSource(
        config.jsonl_patterns, tracker, interval=config.log_interval, source=SourceName.JSONL, parse=parse_jsonl
    )


def _tq(config: ServiceConfig, tracker: Tracker) -> Source:
    assert config.ray_address is not None
    return TQSource(tracker, PollerProcess(config.ray_address, config.tq_timeout), PollBudget(config.tq))


# In the order analyze reads them: checkpoints first (their compositions complete the resumes that loaded
# them), then the logs, then the JSONL metrics (they carry no time).
SOURCES: tuple[SourceSpec, ...] = (
    SourceSpec(SourceName.CHECKPOINT, lambda c: c.checkpoint_dir is not None, _checkpoint),
    SourceSpec(SourceName.LOG, lambda c: bool(c.log_patterns), _log),
    SourceSpec(SourceName.JSONL, lambda c: bool(c.jsonl_patterns), _jsonl),
    SourceSpec(SourceName.TQ, lambda c: bool(c.ray_address), _tq),
)


class Service:
    """Sources feed the tracker; the registry renders the tracker's snapshot."""

    def __init__(self, config: ServiceConfig, announce: Callable[[str], None] | None = None) -> None:
        """``announce`` receives each source's state line when it changes (see :class:`Tracker`)."""
        config.validate()
        self.config = config
        self.otlp = (
            otlp_exporter(config.otlp_endpoint, lambda: self.tracker.snapshot, config.address[1])
            if config.otlp_endpoint
            else None  # refused here, before any state is touched
        )
        try:
            self.file_sd = file_sd_target(config.file_sd, *config.address, config.file_sd_label)
        except FileSDError as err:
            raise ConfigError(str(err)) from None
        self.token = config.token or None
        self.max_body_bytes = config.max_body_bytes
        try:
            self.store = StateStore(config.state_dir, exclusive=True, recover=config.recover)
        except StateError as err:  # locked, corrupt, foreign or too new: the message names the way out
            raise StartupError(str(err)) from None
        except (OSError, sqlite3.Error) as err:
            detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise StartupError(f"--state-dir {config.state_dir}: unusable: {detail}") from None
        try:
            bind(self.store, self.identity, config.state_dir)
        except StateDirTaken as err:
            self.store.close()
            raise ConfigError(str(err)) from None
        self.tracker = Tracker(
            self.store,
            stale_after=config.stale_after,
            given=config.trainer,
            versions=[told for told in (config.told_version, installed()) if told is not None],
            announce=announce,
        )
        replayed = self.tracker.replay()
        if replayed:
            log.info("restored %d events from %s", replayed, self.store.path)
        self.tracker.register_source(SourceName.EVENTS, stale_after=None)
        self.retention = Retention(self.tracker, self.store, config.retain)
        self.sources: list[Source] = [spec.follow(config, self.tracker) for spec in SOURCES if spec.enabled(config)]
        current = self.otlp.current if self.otlp is not None else (lambda: self.tracker.snapshot)
        self.registry: CollectorRegistry = build_registry(current, process_metrics=config.process_metrics)

    @property
    def identity(self) -> Identity:
        """The run this service monitors, as its state dir is bound to it."""
        config = self.config
        run_id = config.trainer.run_id if config.trainer is not None else ""
        return run_identity(run_id, config.checkpoint_dir, config.log_patterns, config.jsonl_patterns)

    def start(self) -> None:
        self.retention.start()
        for source in self.sources:
            source.start()
        if self.otlp is not None:
            self.otlp.start()
        if self.file_sd is not None:
            # Last, and from the app's lifespan, which serve_forever runs once the socket listens: the scrape
            # Prometheus makes as soon as it reads the file waits in the backlog instead of being refused.
            self.file_sd.register()

    def stop(self) -> None:
        if self.file_sd is not None:
            self.file_sd.deregister()
        for source in self.sources:
            source.stop()
        if self.otlp is not None:
            self.otlp.stop()  # after the sources: the final flush carries their last word
        self.retention.stop()
        self.store.close()


def otlp_exporter(endpoint: str, source: Callable[[], Snapshot], port: int) -> OTLPExporter:
    """Imported only when enabled, so the base install needs no OpenTelemetry; errors are one line."""
    try:
        from tqmon.exporters.otlp import OTLPConfigError, OTLPExporter
    except ImportError as err:
        raise ConfigError(str(err)) from None
    try:
        return OTLPExporter.from_environment(endpoint, source, port=port)
    except OTLPConfigError as err:
        raise ConfigError(str(err)) from None
