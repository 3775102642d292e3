"""The docs match the code: every flag and command a user can type is in the README, and every
flag a doc gives a command exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from thunderproxy.cli import cli
from thunderproxy.config import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


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


def command_lines(text: str) -> list[tuple[str, str]]:
    """(command, rest of the line) for every `thunderproxy <command> ...` the text shows."""
    return re.findall(r"thunderproxy(?:\.pyz)? ([a-z]+)\b([^`\n]*)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_shown_with_a_command_exists(doc: Path) -> None:
    for name, rest in command_lines(doc.read_text()):
        command = cli.commands.get(name)
        if command is None:
            continue  # prose such as "thunderproxy sits between"
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        known.add("--help")
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
            assert flag in known, f"{doc.name}: thunderproxy {name} has no {flag}"
