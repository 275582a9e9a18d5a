"""The runtime package imports with only its base dependencies: nothing dev-only ships in the wheel or image.
The sidecar stands apart from the tooling (the simulator and the demo, on the tq extra): its CLI imports neither,
nor the HTTP server before ``serve`` runs, and a command that needs an extra not installed says which in one line.

A fresh ``pip install`` into a new venv needs the network and a minute or more, so this builds the same
environment from what is installed here: an interpreter without site-packages (``-S``) whose path holds the
worktree and the base dependencies of pyproject.toml with their own dependencies, closed transitively from
their metadata, and nothing else. A module importing httpx, grafana-foundation-sdk or any other package
outside that closure fails exactly as it would in the image.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import tqmon
from tests.conftest import free_port
from tests.test_startup import one_error_line
from tqmon.cli import LazyCommand, main
from tqmon.extras import EXTRA_MODULES

ROOT = Path(__file__).resolve().parent.parent
# Runtime modules that run inside a process which already has an extra installed (the module says so).
NEEDS_EXTRA = {
    "tqmon.exporters.otlp": "otel",  # imported only when --otlp-endpoint is set
    "tqmon.integrations.verl": "verl",  # loaded by verl itself, as its trainer plugin
    "tqmon.sim.replay": "tq",  # the simulated trainer drives a real TransferQueue
    "tqmon.sim.rollout": "tq",
    "tqmon.sim.trainer": "tq",
}
# The tooling: tqmon sim and tqmon demo, on a real TransferQueue; loaded only when those commands run.
TOOLING = ("tqmon.sim", "tqmon.demo")
# What the sidecar's startup never imports: the tooling, the tq extra (torch comes with it) and, before serve
# runs, the HTTP server.
NOT_AT_STARTUP = (*TOOLING, "torch", "transfer_queue", "tensordict", "ray", "fastapi", "starlette", "uvicorn")


def base_distributions() -> set[str]:
    """The base dependencies and everything they require (extras and markers evaluated), by name."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    todo = [Requirement(spec) for spec in pyproject["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = normalized(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(requirement.name) or []:
            nested = Requirement(spec)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                todo.append(nested)
    return seen


def normalized(name: str) -> str:
    return name.lower().replace("_", "-")


def base_site(target: Path) -> Path:
    """A directory of links to the files of the base distributions only."""
    target.mkdir()
    for name in base_distributions():
        dist = importlib.metadata.distribution(name)
        site = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            link = target / top
            if (site / top).exists() and not link.exists() and top != "__pycache__":
                link.symlink_to(site / top)
    return target


def runtime_modules() -> list[str]:
    """Every module of the package, except the extras' and ``__main__`` (running it is not importing it)."""
    names = [m.name for m in pkgutil.walk_packages(tqmon.__path__, "tqmon.")]
    return sorted(name for name in names if name not in NEEDS_EXTRA and not name.endswith(".__main__"))


def test_every_runtime_module_imports_with_the_base_dependencies_only(tmp_path: Path) -> None:
    site = base_site(tmp_path / "site")
    assert not (site / "httpx").exists() and not (site / "grafana_foundation_sdk").exists()
    assert (site / "fastapi").exists() and (site / "yaml").exists()
    modules = runtime_modules()
    assert {"tqmon.cli", "tqmon.server", "tqmon.rules", "tqmon.demo", "tqmon.sources.tq"} <= set(modules)
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, *modules],
        env={"PYTHONPATH": f"{ROOT}:{site}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_tooling_is_not_part_of_the_runtime_package() -> None:
    assert not any(name.split(".")[1] in {"docs", "dashboards", "dashlint"} for name in runtime_modules())
    assert (ROOT / "mixin" / "dashboards.py").is_file()


def is_under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def imported_by(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime ARGS``: its result and every module it imported (importtime lists each once)."""
    env = {**os.environ, "COLUMNS": "200"}  # the help's full width (110)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    rows = [line.split("|") for line in done.stderr.splitlines() if line.startswith("import time:")]
    return done, {row[2].strip() for row in rows[1:]}  # the first row is the header


def test_importing_the_cli_loads_neither_the_tooling_nor_the_extras_nor_the_server() -> None:
    done, modules = imported_by("-c", "import tqmon.cli")
    assert done.returncode == 0, done.stderr
    assert {"tqmon.cli", "tqmon.service", "click"} <= modules
    assert sorted(m for m in modules if is_under(m, NOT_AT_STARTUP)) == []


def test_tqmon_help_lists_every_command_without_importing_the_tooling_or_the_server() -> None:
    done, modules = imported_by("-m", "tqmon.cli", "--help")
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("Commands:\n")[1].splitlines()
    assert [line.split()[0] for line in listed] == ["analyze", "demo", "inspect", "rules", "serve", "sim"]
    assert "  demo     Watch a preempted and resumed verl run on a real TransferQueue, live." in listed
    # Shortened by click to the 110 columns of the help, as it shortened the loaded command's docstring.
    assert (
        "  sim      Simulate a verl 0.9.1 V1 async trainer on a real TransferQueue: a fresh start, a preemption,..."
        in listed
    )
    assert sorted(m for m in modules if is_under(m, NOT_AT_STARTUP)) == []


def test_a_lazy_command_is_listed_by_its_own_first_line_and_runs_as_itself() -> None:
    lazy = {name: command for name, command in main.commands.items() if isinstance(command, LazyCommand)}
    assert sorted(lazy) == ["demo", "sim"]
    for name, command in lazy.items():
        loaded = command.load()
        assert command.target.startswith(TOOLING) and loaded.name == name
        assert command.help == inspect.cleandoc(loaded.help or "").split("\n\n")[0]
        context = command.make_context(name, ["--help"], resilient_parsing=True)
        assert context.command is loaded


BLOCKER = """
import importlib, json, sys
from click.testing import CliRunner

blocked, attempts = json.loads(sys.argv[1]), []

class Blocker:
    \"\"\"Refuses the tq extra and the tooling as if they were not installed, and records who asked.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
for name in sys.argv[2:]:
    importlib.import_module(name)
from tqmon.cli import main

codes = {}
for command in [[], *[[name] for name in main.commands if name not in ("demo", "sim")]]:
    codes[" ".join(command)] = CliRunner().invoke(main, [*command, "--help"]).exit_code
print(json.dumps({"codes": codes, "attempts": attempts}))
"""


def test_the_runtime_imports_and_shows_its_help_with_the_tq_extra_and_the_tooling_blocked() -> None:
    runtime = [name for name in runtime_modules() if not is_under(name, TOOLING)]
    assert {"tqmon.cli", "tqmon.server", "tqmon.checkpoint.layout", "tqmon.sources.tq"} <= set(runtime)
    blocked = [*TOOLING, "torch", "transfer_queue", "tensordict", "ray"]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKER, json.dumps(blocked), *runtime],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["codes"] == {"": 0, "analyze": 0, "inspect": 0, "rules": 0, "serve": 0}
    assert result["attempts"] == []


@pytest.fixture(scope="module")
def base_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a base install: the worktree and the base dependencies only, no tq extra."""
    site = base_site(tmp_path_factory.mktemp("base") / "site")
    assert not any((site / module).exists() for module in EXTRA_MODULES["tq"])
    return {"PYTHONPATH": f"{ROOT}:{site}", "PATH": "/usr/bin:/bin"}


def base_tqmon(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``tqmon ARGS`` in the base install."""
    command = [sys.executable, "-S", "-m", "tqmon.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=30, check=False)


NO_TQ = "needs the tq extra: pip install 'tqmon[tq]' (ray, transfer_queue, tensordict not installed)"


@pytest.mark.parametrize(
    ("command", "status", "error"),
    [
        (
            ["serve", "--ray-address", "127.0.0.1:6379", "--state-dir", "{run}", "--listen", "127.0.0.1:{port}"],
            2,  # a setting that cannot work, as click's own usage errors
            f"Error: --ray-address {NO_TQ}",
        ),
        (["demo", "--workdir", "{run}"], 1, f"Error: tqmon demo {NO_TQ}"),
    ],
)
def test_a_command_needing_the_tq_extra_names_it_in_one_line_without_it(
    base_env: dict[str, str], tmp_path: Path, command: list[str], status: int, error: str
) -> None:
    """Refused before any state dir, socket or workdir exists."""
    run = tmp_path / "run"
    done = base_tqmon(base_env, *(arg.format(run=run, port=free_port()) for arg in command))
    assert one_error_line(done) == error
    assert done.returncode == status
    assert not run.exists()


def test_the_simulator_lists_its_scenarios_without_the_tq_extra_but_runs_none(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    listed = base_tqmon(base_env, "sim", "--list-scenarios")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("healthy-resume: ")
    done = base_tqmon(base_env, "sim", "--workdir", str(tmp_path / "run"))
    assert one_error_line(done) == f"Error: tqmon sim {NO_TQ}"
    assert done.returncode == 1
    assert not (tmp_path / "run").exists()


def test_each_extras_modules_are_the_ones_pyproject_installs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    providers = importlib.metadata.packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        installed_by = {normalized(dist) for module in modules for dist in providers[module]}
        assert installed_by == {normalized(Requirement(spec).name) for spec in extras[extra]}, extra
