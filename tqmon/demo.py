"""``tqmon demo``: a bundled verl log of a preempted, resumed and reconfigured run, replayed live.

The log is written line by line into a temporary file with today's timestamps, and ``tqmon serve``
follows it, so /metrics shows the resumes appear as a real trainer would produce them.
"""

from __future__ import annotations

import re
import tempfile
import threading
from datetime import datetime
from importlib.resources import files
from pathlib import Path

import click

from tqmon.server import serve_forever
from tqmon.service import ServiceConfig

TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}")


def bundled_log() -> list[str]:
    return files("tqmon").joinpath("data/demo-resume.log").read_text().splitlines()


def _restamp(line: str) -> str:
    now = datetime.now()
    return TIMESTAMP.sub(now.strftime("%Y-%m-%d %H:%M:%S,") + f"{now.microsecond // 1000:03d}", line, count=1)


def replay(lines: list[str], target: Path, speed: float, stop: threading.Event) -> None:
    with target.open("a", encoding="utf-8") as out:
        for line in lines:
            if stop.wait(1.0 / speed):
                return
            out.write(_restamp(line) + "\n")
            out.flush()


def run_demo(host: str, port: int, speed: float) -> None:
    with tempfile.TemporaryDirectory(prefix="tqmon-demo-") as tmp:
        log_path = Path(tmp) / "trainer.log"
        log_path.touch()
        stop = threading.Event()
        writer = threading.Thread(target=replay, args=(bundled_log(), log_path, speed, stop), daemon=True)
        writer.start()
        url = f"http://{host}:{port}"
        click.echo(
            f"tqmon demo: replaying a verl run (fresh start, healthy resume, over-restore after a config change)\n"
            f"  trainer log   {log_path}\n"
            f"  metrics       {url}/metrics\n"
            f"  status (JSON) {url}/api/v1/status\n"
            f"  after the replay: tqmon analyze {log_path}\n"
            "Ctrl-C stops it.",
            err=True,
        )
        try:
            serve_forever(
                ServiceConfig(host=host, port=port, state_dir=Path(tmp) / "state", log_patterns=(str(log_path),))
            )
        finally:
            stop.set()
            writer.join(timeout=2)
