"""``--checkpoint-dir``: what the next resume from verl's newest checkpoint will restore, before it happens."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from tqmon.checkpoint.layout import read_checkpoint, signature
from tqmon.checkpoint.unpickler import CheckpointError
from tqmon.sources import SourceName
from tqmon.tracker import Tracker

log = logging.getLogger(__name__)


class CheckpointSource:
    """Polls the checkpoint dir every ``interval`` seconds; ingests one event per new checkpoint."""

    def __init__(self, checkpoint_dir: Path, tracker: Tracker, *, interval: float = 10.0) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.tracker = tracker
        self.interval = interval
        self._seen: tuple[object, ...] | None = None  # signature of the last read
        self._error: CheckpointError | None = None  # its error, re-reported until the files change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tqmon-checkpoint", daemon=True)
        tracker.register_source(SourceName.CHECKPOINT, stale_after=max(30.0, 10 * interval))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def poll(self) -> None:
        """One look at the checkpoint dir; never raises (the rest of the service must keep serving)."""
        started = time.monotonic()
        try:
            current = signature(self.checkpoint_dir)
            if current != self._seen:
                self._seen, self._error = current, None
                try:
                    reading = read_checkpoint(self.checkpoint_dir)
                except CheckpointError as err:
                    self._error = err
                else:
                    self.tracker.ingest([reading.to_event()], SourceName.CHECKPOINT)
        except Exception as err:  # a bug must not kill the thread: report it as this source's failure
            log.exception("checkpoint poll failed")
            self._seen, self._error = None, CheckpointError("read_error", f"{type(err).__name__}: {err}")
        duration = time.monotonic() - started
        if self._error is not None:
            self.tracker.source_failed(SourceName.CHECKPOINT, self._error.reason, str(self._error), duration=duration)
        else:
            self.tracker.source_succeeded(SourceName.CHECKPOINT, duration)
