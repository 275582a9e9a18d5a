"""Prometheus ``file_sd`` registration: tqmon announces itself in a target file (``--file-sd PATH``).

On VMs and Slurm, where no service discovery knows the trainer's node, a Prometheus job with
``file_sd_configs`` over a shared directory picks up every tqmon that writes a file there, with labels for
its run, and drops it when the file goes. The file is written once tqmon's socket listens, so the first
scrape never meets a closed port; it is replaced atomically (written beside it, then renamed), so Prometheus
never reads half a file; it is removed when tqmon stops.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Labels read from the environment when set: the Slurm job that runs tqmon next to the trainer.
ENV_LABELS = {"SLURM_JOB_ID": "slurm_job_id", "SLURM_JOB_NAME": "slurm_job_name", "SLURM_CLUSTER_NAME": "slurm_cluster"}


class FileSDError(ValueError):
    """A --file-sd setting that cannot work; the message names it."""


def parse_labels(items: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` items as Prometheus target labels (names checked, ``__`` names reserved)."""
    labels: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise FileSDError(f"--file-sd-label expects NAME=VALUE with a Prometheus label name, got {item!r}")
        labels[name] = value
    return labels


def target_address(host: str, port: int) -> str:
    """What Prometheus should scrape: the listen address, or this host's name when listening on all."""
    if host in WILDCARD_HOSTS:
        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FileSDTarget:
    """One tqmon's entry in a ``file_sd`` directory."""

    def __init__(self, path: Path, address: str, labels: Mapping[str, str], environ: Mapping[str, str] = os.environ):
        if path.is_dir():
            raise FileSDError(f"--file-sd {path} is a directory: give the target file's path in it")
        if not path.parent.is_dir():
            raise FileSDError(f"--file-sd {path}: directory {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK):
            raise FileSDError(f"--file-sd {path}: directory {path.parent} is not writable")
        self.path = path
        from_env = {label: environ[var] for var, label in ENV_LABELS.items() if environ.get(var)}
        self.address = address
        self.group = {"targets": [address], "labels": {**from_env, **labels}}

    def register(self) -> None:
        """Write the target file atomically: a temp file in the same directory renamed over it."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump([self.group], out, indent=2, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)  # Prometheus often runs as another user
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        log.info("registered %s in %s", self.address, self.path)

    def deregister(self) -> None:
        """Remove the file: Prometheus drops the target on its next read of the directory."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("could not remove %s: %s", self.path, err)


def file_sd_target(path: Path | None, host: str, port: int, labels: Iterable[str]) -> FileSDTarget | None:
    """The target of ``tqmon serve --file-sd``, or None without the flag."""
    return None if path is None else FileSDTarget(path, target_address(host, port), parse_labels(labels))
