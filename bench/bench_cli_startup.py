"""The CLI's startup with its tooling and server loaded lazily against eagerly (``python bench/bench_cli_startup.py``).

Each command runs in a fresh interpreter, two ways, interleaved so that both see the same load: as shipped
(``tqmon.cli`` loads the demo, the simulator and, in ``serve``, FastAPI and uvicorn only when they run), and
eager, as the CLI was before issue 19: the modules its top imported (``tqmon.server``, ``tqmon.sim.cli``)
first, then the same command. Printed per command: the median and best wall time of ``--runs`` runs, their
ratios (the best is the steadier on a loaded machine), and the modules each way imported (counted from one
``python -X importtime`` run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EAGER = ("tqmon.server", "tqmon.sim.cli")  # what cli.py imported at its top before issue 19
COMMANDS = (("--help",), ("serve", "--help"), ("rules",))


def program(command: tuple[str, ...], eager: bool) -> list[str]:
    """The interpreter arguments that run ``tqmon COMMAND``, after the eager imports when ``eager``."""
    first = f"import {', '.join(EAGER)}; " if eager else ""
    return [
        "-c",
        f"{first}import sys; from tqmon.cli import main; sys.exit(main({list(command)!r}, prog_name='tqmon'))",
    ]


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, check=True)


def seconds(args: list[str]) -> float:
    started = time.perf_counter()
    run(args)
    return time.perf_counter() - started


def modules(args: list[str]) -> int:
    """Modules the run imported: ``-X importtime`` prints one row per module, after its header."""
    rows = [line for line in run(["-X", "importtime", *args]).stderr.splitlines() if line.startswith("import time:")]
    return len(rows) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15, help="runs per command and way")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.runs} runs each, interleaved; eager = {', '.join(EAGER)}")
    header = (
        f"{'command':<18} | {'lazy median s':>13} {'best':>6} {'modules':>7} "
        f"| {'eager median s':>14} {'best':>6} {'modules':>7} | {'eager/lazy median':>17} {'best':>6}"
    )
    print(header)
    print("-" * len(header))
    for command in COMMANDS:
        lazy, eager = program(command, eager=False), program(command, eager=True)
        run(lazy), run(eager)  # warm the file cache and the bytecode
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            times[False].append(seconds(lazy))
            times[True].append(seconds(eager))
        (lazy_s, lazy_best), (eager_s, eager_best) = ((statistics.median(t), min(t)) for t in times.values())
        print(
            f"{'tqmon ' + ' '.join(command):<18} | {lazy_s:>13.3f} {lazy_best:>6.3f} {modules(lazy):>7} "
            f"| {eager_s:>14.3f} {eager_best:>6.3f} {modules(eager):>7} "
            f"| {eager_s / lazy_s:>16.2f}x {eager_best / lazy_best:>5.2f}x"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
