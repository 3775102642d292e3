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


# --- docs/ARCHITECTURE.md's module table -------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = ROOT / "thunderproxy"
_NAMES = re.compile(r"`([^`\s]+)`")


def package_modules() -> set[str]:
    """Every module of the package, by its path under ``thunderproxy/`` (``http/edges.py``)."""
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}


def module_rows(text: str) -> list[tuple[str, str]]:
    """(first cell, whole row) of every row of the "Modules" table."""
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) > 1:
            rows.append((cells[0], line))
    return rows


def named_in_first_cell(cell: str) -> tuple[set[str], set[str]]:
    """(modules, folders) a row's first cell names. A name without a folder after one with a
    folder is in that folder (```backends/http.py`, `asgi.py```); a folder (```council/```)
    stands for its ``__init__.py``."""
    modules: set[str] = set()
    folders: set[str] = set()
    folder = ""
    for name in _NAMES.findall(cell):
        if "/" not in name.rstrip("/"):
            name = folder + name
        if name.endswith("/"):
            folders.add(name)
            modules.add(name + "__init__.py")
            folder = name
        else:
            parent = name.rpartition("/")[0]
            folder = parent + "/" if parent else ""
            modules.add(name)
    return modules, folders


def named_in_folder_row(folder: str, row: str, known: set[str]) -> set[str]:
    """The modules of ``folder`` that its row names anywhere, in backticks: by their path under
    the package or under the folder (``engine/core.py``), a subfolder by its path (its
    ``__init__.py``), or a module by its name alone (``limiter`` or ``limiter.py``)."""
    inside = {m for m in known if m.startswith(folder)}
    covered: set[str] = set()
    for name in _NAMES.findall(row):
        relative = name.removeprefix(folder)
        for candidate in (name, folder + relative):
            if candidate.endswith("/"):
                candidate += "__init__.py"
            elif not candidate.endswith(".py"):
                candidate += ".py"
            if candidate in inside:
                covered.add(candidate)
        if "/" not in relative:
            stem = relative.removesuffix(".py")
            covered |= {m for m in inside if m.rpartition("/")[2] == stem + ".py"}
    return covered


def documented_modules(text: str, known: set[str]) -> tuple[set[str], set[str]]:
    """(modules the table covers, names its first cells give that are no module)."""
    covered: set[str] = set()
    stale: set[str] = set()
    for cell, row in module_rows(text):
        modules, folders = named_in_first_cell(cell)
        covered |= modules & known
        stale |= modules - known - {f + "__init__.py" for f in folders if (PACKAGE / f).is_dir()}
        for folder in folders:
            covered |= named_in_folder_row(folder, row, known)
    return covered, stale


def test_every_module_has_a_row_in_the_architecture_table() -> None:
    known = package_modules()
    covered, _ = documented_modules(ARCHITECTURE.read_text(), known)
    missing = sorted(known - covered)
    assert not missing, (
        "docs/ARCHITECTURE.md's module table has no row for: " + ", ".join(missing) + " (give "
        "each a row, or name it in backticks in its package's row: the doc says how)"
    )


def test_every_row_of_the_architecture_table_names_a_module_that_exists() -> None:
    _, stale = documented_modules(ARCHITECTURE.read_text(), package_modules())
    assert not stale, f"docs/ARCHITECTURE.md's module table names no such module: {sorted(stale)}"


def test_the_table_check_finds_a_module_left_out() -> None:
    text = ARCHITECTURE.read_text()
    known = package_modules()
    without = "\n".join(
        line for line in text.splitlines() if not line.startswith("| `gateway.py` |")
    )
    assert "gateway.py" in known - documented_modules(without, known)[0]
