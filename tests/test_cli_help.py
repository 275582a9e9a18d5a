"""Every command's ``--help`` reads as written: click prints help text verbatim, so ``%%`` would show doubled."""

from __future__ import annotations

import click
from click.testing import CliRunner

from tqmon.cli import main


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    for name, command in group.commands.items():
        found += _commands(command, (*path, name)) if isinstance(command, click.Group) else [(*path, name)]
    return found


def test_serve_help_shows_one_percent_sign() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "(0.01 = 1%)" in " ".join(result.output.split())


def test_no_help_text_doubles_a_percent_sign() -> None:
    commands = _commands(main)
    assert ("serve",) in commands and ("rules",) in commands
    for path in commands:
        result = CliRunner().invoke(main, [*path, "--help"], terminal_width=200)
        assert result.exit_code == 0, (path, result.output)
        assert "%%" not in result.output, path
