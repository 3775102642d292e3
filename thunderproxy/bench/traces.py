"""Finding and reading trace files; the only file I/O of workload building.

Traces live outside the repository (``../shared/traces`` next to it, read-only); the folder can
be moved with ``THUNDERPROXY_TRACES``. A ``--trace`` value is a path, or a bare file name looked
up in that folder, or a short name (``thunderagent``, ``mooncake``, ``mooncake-synthetic``).
"""

from __future__ import annotations

import csv
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import workload
from .workload import Workload

TRACES_ENV = "THUNDERPROXY_TRACES"
SHORT_NAMES = {
    "thunderagent": "thunderagent_sweagent_glm45_calls.jsonl",
    "mooncake": "mooncake_conversation_trace.jsonl",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
}
DEFAULT_TRACE = "thunderagent"


def traces_dirs() -> list[Path]:
    """``$THUNDERPROXY_TRACES``, else ``../shared/traces`` beside the repository root: found
    from the package in a checkout, or from the working directory when the package runs from
    the zipapp's cache (``python3 dist/thunderproxy.pyz`` in the repository root)."""
    configured = os.environ.get(TRACES_ENV)
    if configured:
        return [Path(configured)]
    # thunderproxy/bench/traces.py -> the repository root is two folders up from the package.
    beside_checkout = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
    return [beside_checkout, Path.cwd().parent / "shared" / "traces"]


def resolve(trace: str) -> Path:
    """The file a ``--trace`` value names (see the module docstring)."""
    name = SHORT_NAMES.get(trace, trace)
    candidates = [Path(name)]
    if not Path(name).is_absolute():
        candidates += [folder / name for folder in traces_dirs()]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"Trace {trace!r} not found (looked at {', '.join(str(c) for c in candidates)}); pass "
        f"--trace PATH or set {TRACES_ENV} to the traces folder."
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def read_audit_steps(path: Path, run_id: int | None = None) -> list[dict[str, Any]]:
    """The ``steps`` rows of an audit db (of one run, or of its latest run by default)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        if run_id is None:
            row = conn.execute("SELECT max(run_id) FROM steps").fetchone()
            run_id = None if row is None else row[0]
        rows = conn.execute("SELECT * FROM steps WHERE run_id IS ?", (run_id,)).fetchall()
    except sqlite3.Error as exc:
        raise ConfigError(f"{path} is not a thunderproxy audit db: {exc}") from None
    finally:
        conn.close()
    return [dict(r) for r in rows]


def load_workload(
    trace: str,
    *,
    seed: int = 0,
    run_id: int | None = None,
    shared_prefix_tokens: int | None = None,
    carry_answer: float | None = None,
) -> Workload:
    """Read a trace (ThunderAgent calls, a Mooncake trace or an audit db) into a Workload,
    reshaped to ``shared_prefix_tokens`` and ``carry_answer`` where given (``Workload.reshape``)."""
    loaded = _load(trace, seed=seed, run_id=run_id)
    try:
        return loaded.reshape(shared_prefix_tokens=shared_prefix_tokens, carry_answer=carry_answer)
    except ValueError as exc:
        raise ConfigError(f"--shared-prefix-tokens/--carry-answer: {exc}") from None


def _load(trace: str, *, seed: int, run_id: int | None) -> Workload:
    path = resolve(trace)
    if path.suffix in (".db", ".sqlite", ".sqlite3"):
        return workload.from_audit_steps(read_audit_steps(path, run_id), name=path.stem)
    if path.name.startswith("mooncake_") and path.name.endswith("_trace.jsonl"):
        sessions = path.with_name(path.name.replace("_trace.jsonl", "_sessions.csv"))
        if not sessions.is_file():
            raise ConfigError(f"{path.name} needs its sessions file {sessions.name} beside it.")
        kind = path.name.removeprefix("mooncake_").removesuffix("_trace.jsonl")
        return workload.mooncake(read_jsonl(path), read_csv(sessions), name=f"mooncake-{kind}")
    rows = read_jsonl(path)
    if rows and "program_id" in rows[0] and "input_tokens" in rows[0]:
        try:
            return workload.thunderagent(rows, seed=seed)
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    raise ConfigError(
        f"{path} is neither a ThunderAgent calls file, a Mooncake trace nor an audit db."
    )
