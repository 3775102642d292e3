"""The traces that ship with the package: found by short name with nothing configured, read
from their compressed files, and a folder of one's own still taking precedence."""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path

import pytest

from thunderproxy import traces
from thunderproxy.bench.workloads.traces import load_workload
from thunderproxy.errors import ConfigError

# What the decompressed files must hash to (thunderproxy/traces/README.md).
SHA256 = {
    "thunderagent_sweagent_glm45_calls.jsonl": (
        "0caa64142004393c8f3d90325d7d712a0e85b5640b9a8a3f48de111b1407258f"
    ),
    "mooncake_synthetic_sessions.csv": (
        "79e1d4ea90a48d6b9ddf5d93a026d94474f5ea925a52d0e291db28404c838176"
    ),
}


@pytest.fixture(autouse=True)
def _no_trace_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(traces.TRACES_ENV, raising=False)


@pytest.mark.parametrize("short", sorted(traces.SHORT_NAMES))
def test_every_short_name_is_found_in_the_package(short: str) -> None:
    path = traces.resolve(short)
    assert path.parent == traces.packaged_dir()
    assert path.name.endswith(".xz")


@pytest.mark.parametrize("name", sorted(SHA256))
def test_packaged_files_decompress_to_the_recorded_bytes(name: str) -> None:
    data = lzma.decompress((traces.packaged_dir() / (name + ".xz")).read_bytes())
    assert hashlib.sha256(data).hexdigest() == SHA256[name]


def test_licences_and_attribution_ship_beside_the_traces() -> None:
    folder = traces.packaged_dir()
    readme = (folder / "README.md").read_text()
    for licence in ("LICENSE-ThunderAgent.txt", "LICENSE-Mooncake-Apache-2.0.txt"):
        assert (folder / licence).is_file()
        assert licence in readme


def test_the_main_workloads_load_with_nothing_configured() -> None:
    assert len(load_workload("thunderagent").programs) == 133
    assert len(load_workload("mooncake-synthetic").programs) == 2549


def test_a_folder_of_ones_own_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = {"program_id": "r/x", "run": "r", "instance_id": "x", "step": 1}
    (tmp_path / "thunderagent_sweagent_glm45_calls.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setenv(traces.TRACES_ENV, str(tmp_path))
    path = traces.resolve("thunderagent")
    assert path.parent == tmp_path
    assert traces.read_jsonl(path) == [row]


def test_an_unknown_trace_names_the_short_names_and_the_variable() -> None:
    with pytest.raises(ConfigError) as err:
        traces.resolve("no-such-trace")
    assert "thunderagent" in str(err.value)
    assert traces.TRACES_ENV in str(err.value)
