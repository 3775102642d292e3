"""docs/SIMULATOR.md documents every knob; BENCHMARKS.md has the simulator's figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from thunderproxy.sim.config import COMPAT_VERSIONS, PROFILES, SimConfig

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SimConfig)])
def test_every_knob_is_documented(field: str) -> None:
    meta = next(f.metadata for f in dataclasses.fields(SimConfig) if f.name == field)
    flag = meta.get("flag") or "--" + field.replace("_", "-")
    assert (
        f"`{flag}" in (DOCS / "SIMULATOR.md").read_text()
        or f", `{flag}`" in (DOCS / "SIMULATOR.md").read_text()
    )


def test_profiles_and_compat_levels_are_documented() -> None:
    text = (DOCS / "SIMULATOR.md").read_text()
    for name in PROFILES:
        assert f"`{name}`" in text
    for level in COMPAT_VERSIONS:
        assert f"`{level}`" in text
    assert "FIT_TABLE" not in text
    assert "CONFORMANCE_RESULT" not in text


def test_benchmarks_section_has_commands() -> None:
    text = (DOCS / "BENCHMARKS.md").read_text()
    section = text.split("## Simulated backend", 1)[1].split("\n## ", 1)[0]
    assert "python -m thunderproxy.sim.loadtest" in section
    assert "clock behind" in section
