"""Each setting is declared once: the CLI flags, ``--help`` and the README's flag table follow the declarations."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from tqmon.cli import main, settings_fields
from tqmon.service import ServiceConfig
from tqmon.warmup import TrainerConfig, verl_setting

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_flags() -> dict[str, tuple[str, str]]:
    """``--flag`` -> (env, default) from the README's serve table."""
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*` \| `(TQMON_[A-Z_]+)` \| ([^|]+) \|", README.read_text(), re.M)
    return {flag: (env, default.strip().strip("`")) for flag, env, default in rows}


def shown(default: Any) -> str:
    """How the README writes a default: `none` for nothing, numbers without a needless .0."""
    if default in (None, ()):
        return "none"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def test_the_readme_table_lists_every_serve_setting_with_its_env_and_default() -> None:
    table = readme_flags()
    for name, spec, _ in settings_fields(ServiceConfig):
        flag = "--" + name.replace("_", "-")
        assert flag in table, f"{flag} is missing from the README table"
        env, default = table[flag]
        assert env == "TQMON_" + name.upper()
        assert default in (shown(spec.default), "off"), (flag, default, spec.default)


def test_serve_help_shows_every_setting_with_its_env_and_help() -> None:
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=1000).output.split())
    for name, spec, _ in settings_fields(ServiceConfig):
        assert f"--{name.replace('_', '-')}" in text
        assert f"TQMON_{name.upper()}" in text
        assert " ".join(spec.metadata["help"].split()) in text


def test_every_trainer_setting_is_a_flag_of_serve_and_inspect_with_its_verl_path() -> None:
    for command in ("serve", "inspect"):
        text = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=1000).output.split())
        for name in TrainerConfig.model_fields:
            assert f"--{name.replace('_', '-')}" in text and f"TQMON_{name.upper()}" in text
            assert verl_setting(name).path.split(".<mode>")[0] in text


def test_a_bad_listen_address_is_a_usage_error_naming_the_flag() -> None:
    result = CliRunner().invoke(main, ["serve", "--listen", "nowhere"])
    assert result.exit_code == 2 and "--listen" in result.output and "HOST:PORT" in result.output
