"""The checkout the generators write into, found explicitly rather than next to an installed package."""

from __future__ import annotations

import tomllib
from pathlib import Path


class NotACheckout(RuntimeError):
    """The generators run from a tqmon git checkout only."""


def repo_root(start: Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: the working directory) whose pyproject.toml
    declares the ``tqmon`` project."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        pyproject = directory / "pyproject.toml"
        if pyproject.is_file() and tomllib.loads(pyproject.read_text()).get("project", {}).get("name") == "tqmon":
            return directory
    raise NotACheckout(f"no tqmon checkout at or above {here}: run the generators from the repository")


def write(relative: str, text: str) -> Path:
    """Write one generated file at ``relative`` (to the repository root) and say so."""
    path = repo_root() / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return path
