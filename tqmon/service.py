"""Wires the store, the tracker, the sources and the registry of one tqmon process."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from tqmon.events import TrainerConfig
from tqmon.exporters.prometheus import build_registry
from tqmon.sources.checkpoint import CheckpointSource
from tqmon.sources.logfile import LogSource
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
    token: str | None = None
    stale_after: float = 300.0
    max_body_bytes: int = 1 << 20
    process_metrics: bool = True
    checkpoint_dir: Path | None = None
    checkpoint_interval: float = 10.0
    trainer: tuple[str, TrainerConfig] | None = None  # (trainer_mode, config) from flags; run_started overrides

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


class Service:
    """Sources feed the tracker; the registry renders the tracker's snapshot."""

    def __init__(self, config: ServiceConfig) -> None:
        config.validate()
        self.config = config
        self.token = config.token
        self.max_body_bytes = config.max_body_bytes
        self.store = StateStore(config.state_dir)
        self.tracker = Tracker(self.store, stale_after=config.stale_after, flag_config=config.trainer)
        replayed = self.tracker.replay()
        if replayed:
            log.info("restored %d events from %s", replayed, self.store.path)
        self.tracker.register_source("events", stale_after=None)
        self.log_source = (
            LogSource(list(config.log_patterns), self.tracker, interval=config.log_interval)
            if config.log_patterns
            else None
        )
        self.checkpoint_source = (
            CheckpointSource(config.checkpoint_dir, self.tracker, interval=config.checkpoint_interval)
            if config.checkpoint_dir is not None
            else None
        )
        self.registry: CollectorRegistry = build_registry(
            lambda: self.tracker.snapshot, process_metrics=config.process_metrics
        )

    def start(self) -> None:
        if self.log_source is not None:
            self.log_source.start()
        if self.checkpoint_source is not None:
            self.checkpoint_source.start()

    def stop(self) -> None:
        if self.log_source is not None:
            self.log_source.stop()
        if self.checkpoint_source is not None:
            self.checkpoint_source.stop()
        self.store.close()
