"""The docs match the code: every flag and command a user can type is in the README."""

from __future__ import annotations

from pathlib import Path

import pytest

from thunderproxy.cli import cli
from thunderproxy.config import SETTINGS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_serve_flag_is_documented(setting: object) -> None:
    assert f"`{setting.flag}" in README  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_command_is_documented_and_has_help(name: str) -> None:
    command = cli.commands[name]
    assert command.help, name
    assert f"thunderproxy {name}" in README


def test_the_two_commands_are_in_the_readme() -> None:
    assert "python3 zipapp.py && python3 dist/thunderproxy.pyz" in README
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert ".venv/bin/pip install --quiet --disable-pip-version-check -e '.[test]'" in ci
    test_command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest"
    assert test_command in README
