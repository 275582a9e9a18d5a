"""The CLI's startup with its tooling and server loaded lazily against eagerly (``python bench/bench_cli_startup.py``).

Each command runs in a fresh interpreter, two ways, interleaved so that both see the same load: as shipped
(``tqmon.cli`` loads the demo, the simulator and, in ``serve``, FastAPI and uvicorn only when they run), and
eager, as the CLI was before issue 19: the modules its top imported (``tqmon.server``, ``tqmon.sim.cli``)
first, then the same command. Printed per command: the medians of ``--runs`` runs' wall time and CPU time
(user + system; the steadier one on a loaded machine), their ratios, and the modules each way imported
(counted from one ``python -X importtime`` run).
"""

from __future__ import annotations

import argparse
import os
import resource
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


def seconds(args: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run; the CPU time (user + system) hardly moves with the machine's load."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    run(args)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


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
        f"{'command':<18} | {'lazy wall s':>11} {'CPU s':>6} {'modules':>7} "
        f"| {'eager wall s':>12} {'CPU s':>6} {'modules':>7} | {'eager/lazy wall':>15} {'CPU':>6}"
    )
    print(header)
    print("-" * len(header))
    for command in COMMANDS:
        lazy, eager = program(command, eager=False), program(command, eager=True)
        run(lazy), run(eager)  # warm the file cache and the bytecode
        samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.runs):
            samples[False].append(seconds(lazy))
            samples[True].append(seconds(eager))
        (lazy_wall, lazy_cpu), (eager_wall, eager_cpu) = (
            (statistics.median(wall for wall, _ in runs), statistics.median(cpu for _, cpu in runs))
            for runs in samples.values()
        )
        print(
            f"{'tqmon ' + ' '.join(command):<18} | {lazy_wall:>11.3f} {lazy_cpu:>6.3f} {modules(lazy):>7} "
            f"| {eager_wall:>12.3f} {eager_cpu:>6.3f} {modules(eager):>7} "
            f"| {eager_wall / lazy_wall:>14.2f}x {eager_cpu / lazy_cpu:>5.2f}x"
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
