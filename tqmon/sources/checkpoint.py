"""``--checkpoint-dir``: what the next resume from verl's newest checkpoint will restore, before it happens.

Under DAPO with a known metric it also reads the storage units for the groups DAPO will filter. It also reads
the checkpoint a resume actually loaded when that is not the newest one (``trainer.resume_from_path``, an
older ``global_step_N``), so the resume's record gets that checkpoint's composition."""

from __future__ import annotations

import time
from pathlib import Path

from tqmon.checkpoint.layout import NoCheckpointYet, listing, read_checkpoint, signature
from tqmon.checkpoint.unpickler import CheckpointError
from tqmon.snapshot import SourceName, Tally
from tqmon.sources.polling import PollingLoop
from tqmon.tracker import Tracker
from tqmon.warmup import LATEST_FILE, STEP_DIR


class CheckpointSource:
    """Polls the checkpoint dir every ``interval`` seconds; ingests one event per new checkpoint."""

    name = SourceName.CHECKPOINT

    def __init__(
        self, checkpoint_dir: Path, tracker: Tracker, *, interval: float = 10.0, filter_metric: str | None = None
    ) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.tracker = tracker
        self.interval = interval
        self.filter_metric = filter_metric  # DAPO's algorithm.filter_groups.metric: read the storage units too
        self._seen: tuple[object, ...] | None = None  # signature of the last read
        self._error: CheckpointError | None = None  # its error, re-reported until the files change
        self._filter_error: CheckpointError | None = None  # the storage units' of a readable checkpoint
        self._read_step: int | None = None  # the last checkpoint this process read here
        self._loaded_seen: tuple[object, ...] | None = None  # (step, folder, signature) of the last loaded read
        self._loop = PollingLoop(self.name, tracker, self.poll, interval)
        tracker.register_source(self.name, stale_after=max(30.0, 10 * interval), watching=str(checkpoint_dir))

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def poll(self) -> float:
        """One look at the checkpoint dir; a checkpoint it cannot read is this source's failure, no checkpoint
        yet is not (unless this process read one here before: then they were deleted). Storage units it cannot
        read are counted once per checkpoint; the composition stands."""
        started = time.monotonic()
        self.tracker.observe_checkpoint_listing(listing(self.checkpoint_dir))  # even without a latest file
        current = signature(self.checkpoint_dir)
        if current != self._seen:
            self._seen, self._error, self._filter_error = None, None, None  # read again if this read dies of a bug
            try:
                reading = read_checkpoint(self.checkpoint_dir, filter_metric=self.filter_metric)
            except NoCheckpointYet as err:
                self._error = err if self._read_step is None else self._gone()
                self.tracker.observe_checkpoint_dir(None)  # nothing saved (yet, or any more): no series
            except CheckpointError as err:
                self._error = err
                if err.refusal is not None:  # counted once per file version, like the read
                    self.tracker.count(Tally.PICKLE_REFUSALS, (err.refusal,))
                self.tracker.observe_checkpoint_dir(None)  # a deleted step or an unreadable file: no series
            else:
                self._read_step = reading.step
                self._filter_error = reading.filter_error
                if reading.filter_error is not None:
                    self.tracker.source_error(self.name, reading.filter_error.reason)
                event = reading.to_event()
                self.tracker.observe_checkpoint_dir(event)  # may step back: a rollback of the latest file
                self.tracker.ingest([event], self.name)
            self._seen = current
        self._read_loaded()
        duration = time.monotonic() - started
        if isinstance(self._error, NoCheckpointYet):  # a fresh run: up, with nothing to predict yet
            self.tracker.source_succeeded(self.name, duration, state=f"{self._error}: waiting")
        elif self._error is not None:
            self.tracker.source_failed(self.name, self._error.reason, str(self._error), duration=duration)
        elif self._filter_error is not None:
            state = f"DAPO's filtered groups unknown: {self._filter_error}"
            self.tracker.source_succeeded(self.name, duration, state=state)
        else:
            self.tracker.source_succeeded(self.name, duration)
        return self.interval

    def _read_loaded(self) -> None:
        """Read the checkpoint the newest resume loaded, if the tracker wants its composition: from the folder
        the log named, else (not named, or not visible here: a sidecar mounts the dir elsewhere) from
        ``global_step_N`` here. Once per file version; a failure is counted, never this source's failure (the
        latest checkpoint's view stands), and the preflight series keep the latest."""
        wanted = self.tracker.wanted_checkpoint()
        if wanted is None:
            return
        step, named = wanted
        here = self.checkpoint_dir / STEP_DIR.format(step)
        candidates = [here] if named is None else [Path(named), here]
        folder = next((path for path in candidates if path.is_dir()), candidates[0])
        current = (step, str(folder), signature(folder.parent, step))
        if current == self._loaded_seen:
            return
        self._loaded_seen = current
        try:
            if not folder.is_dir():
                tried = " nor ".join(map(str, candidates))
                raise CheckpointError("read_error", f"the resume loaded step {step}, but neither {tried} exists")
            if folder.name != STEP_DIR.format(step):
                raise CheckpointError("invalid_data", f"{folder} is not the folder of {STEP_DIR.format(step)}")
            reading = read_checkpoint(folder.parent, step, filter_metric=self.filter_metric)
        except CheckpointError as err:
            if err.refusal is not None:
                self.tracker.count(Tally.PICKLE_REFUSALS, (err.refusal,))
            self.tracker.source_error(self.name, err.reason)
            return
        if reading.filter_error is not None:
            self.tracker.source_error(self.name, reading.filter_error.reason)
        self.tracker.ingest([reading.to_event()], self.name)

    def _gone(self) -> CheckpointError:
        """No latest file after a checkpoint was read here: deleted checkpoints are a failure, not a fresh run."""
        latest = self.checkpoint_dir / LATEST_FILE
        where = latest if self.checkpoint_dir.is_dir() else self.checkpoint_dir
        return CheckpointError(
            "unavailable", f"checkpoints gone: {where} does not exist any more (global_step_{self._read_step} was read)"
        )
