"""The optional dependencies (pyproject's extras) a command needs: checked before it starts, refused in one line.

The check finds the modules without importing them: importing Ray or torch takes seconds, and the command
imports them itself once it runs.
"""

from __future__ import annotations

import importlib.util

import click

# Each extra's top-level modules, as pyproject.toml's [project.optional-dependencies] installs them
# (tests/test_runtime_imports.py holds the two equal).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "tq": ("ray", "transfer_queue", "tensordict"),
}


class MissingExtra(click.ClickException):
    """An extra a command needs is not installed: click prints the one line, never a traceback."""


def require_extra(extra: str, purpose: str) -> None:
    """Raise :class:`MissingExtra`, naming the extra and its missing modules, unless all of them are installed."""
    missing = [module for module in EXTRA_MODULES[extra] if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtra(
            f"{purpose} needs the {extra} extra: pip install 'tqmon[{extra}]' ({', '.join(missing)} not installed)"
        )
