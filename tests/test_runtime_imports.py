"""The runtime package imports with only its base dependencies: nothing dev-only ships in the wheel or image.

A fresh ``pip install`` into a new venv needs the network and a minute or more, so this builds the same
environment from what is installed here: an interpreter without site-packages (``-S``) whose path holds the
worktree and the base dependencies of pyproject.toml with their own dependencies, closed transitively from
their metadata, and nothing else. A module importing httpx, grafana-foundation-sdk or any other package
outside that closure fails exactly as it would in the image.
"""

from __future__ import annotations

import importlib.metadata
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

import tqmon

ROOT = Path(__file__).resolve().parent.parent
# Runtime modules that run inside a process which already has an extra installed (the module says so).
NEEDS_EXTRA = {
    "tqmon.exporters.otlp": "otel",  # imported only when --otlp-endpoint is set
    "tqmon.integrations.verl": "verl",  # loaded by verl itself, as its trainer plugin
    "tqmon.sim.replay": "tq",  # the simulated trainer drives a real TransferQueue
    "tqmon.sim.rollout": "tq",
    "tqmon.sim.trainer": "tq",
}


def base_distributions() -> set[str]:
    """The base dependencies and everything they require (extras and markers evaluated), by name."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    todo = [Requirement(spec) for spec in pyproject["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        requirement = todo.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(requirement.name) or []:
            nested = Requirement(spec)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                todo.append(nested)
    return seen


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
