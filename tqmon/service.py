"""Wires the store, the tracker, the sources and the registry of one tqmon process."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from tqmon.events import TrainerConfig
from tqmon.exporters.prometheus import build_registry
from tqmon.retention import Retention, RetentionPolicy
from tqmon.sources.checkpoint import CheckpointSource
from tqmon.sources.logfile import LogSource, parse_jsonl
from tqmon.sources.tq import PollBudget, PollerProcess, TQSource
from tqmon.store import StateStore
from tqmon.tracker import Tracker

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


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 9842
    state_dir: Path = Path("tqmon-state")
    log_patterns: tuple[str, ...] = ()
    log_interval: float = 1.0
    jsonl_patterns: tuple[str, ...] = ()
    token: str | None = None
    stale_after: float = 300.0
    max_body_bytes: int = 1 << 20
    process_metrics: bool = True
    checkpoint_dir: Path | None = None
    checkpoint_interval: float = 10.0
    trainer: tuple[str, TrainerConfig, str] | None = None  # (trainer_mode, config, origin); run_started overrides
    ray_address: str | None = None
    tq_timeout: float = 5.0
    tq_budget: PollBudget = field(default_factory=PollBudget)
    recover: bool = False  # move a corrupt state file aside instead of refusing to start
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    def validate(self) -> None:
        if not is_loopback(self.host) and not self.token:
            raise ConfigError(
                f"listening on {self.host} (not loopback) requires --token / TQMON_TOKEN: "
                "the event API would otherwise accept anyone's events"
            )
        if self.stale_after <= 0:
            raise ConfigError(f"--stale-after must be positive, got {self.stale_after}")
        if self.log_interval <= 0:
            raise ConfigError(f"--log-interval must be positive, got {self.log_interval}")
        if self.checkpoint_interval <= 0:
            raise ConfigError(f"--checkpoint-interval must be positive, got {self.checkpoint_interval}")
        if self.tq_timeout <= 0:
            raise ConfigError(f"--tq-timeout must be positive, got {self.tq_timeout}")
        try:
            self.tq_budget.validate()
            self.retention.validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None


class Service:
    """Sources feed the tracker; the registry renders the tracker's snapshot."""

    def __init__(self, config: ServiceConfig) -> None:
        config.validate()
        self.config = config
        self.token = config.token
        self.max_body_bytes = config.max_body_bytes
        self.store = StateStore(config.state_dir, exclusive=True, recover=config.recover)
        self.tracker = Tracker(self.store, stale_after=config.stale_after, flag_config=config.trainer)
        replayed = self.tracker.replay()
        if replayed:
            log.info("restored %d events from %s", replayed, self.store.path)
        self.tracker.register_source("events", stale_after=None)
        self.retention = Retention(self.tracker, self.store, config.retention)
        self.log_source = (
            LogSource(list(config.log_patterns), self.tracker, interval=config.log_interval)
            if config.log_patterns
            else None
        )
        self.jsonl_source = (
            LogSource(
                list(config.jsonl_patterns),
                self.tracker,
                interval=config.log_interval,
                source="jsonl",
                parse=parse_jsonl,
            )
            if config.jsonl_patterns
            else None
        )
        self.checkpoint_source = (
            CheckpointSource(config.checkpoint_dir, self.tracker, interval=config.checkpoint_interval)
            if config.checkpoint_dir is not None
            else None
        )
        self.tq_source = (
            TQSource(self.tracker, PollerProcess(config.ray_address, config.tq_timeout), config.tq_budget)
            if config.ray_address
            else None
        )
        self.registry: CollectorRegistry = build_registry(
            lambda: self.tracker.snapshot, process_metrics=config.process_metrics
        )

    @property
    def sources(self) -> list[LogSource | CheckpointSource | TQSource]:
        candidates = (self.log_source, self.jsonl_source, self.checkpoint_source, self.tq_source)
        return [source for source in candidates if source is not None]

    def start(self) -> None:
        self.retention.start()
        for source in self.sources:
            source.start()

    def stop(self) -> None:
        for source in self.sources:
            source.stop()
        self.retention.stop()
        self.store.close()
