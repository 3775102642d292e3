"""Reading traces into workloads; the only file I/O of workload building.

Which file a ``--trace`` value names, and the traces that ship with the package, are
``thunderproxy.traces``; an audit db given as ``--trace`` is read here.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...traces import (
    COMPRESSED,
    DEFAULT_TRACE,
    SHORT_NAMES,
    plain_name,
    read_csv,
    read_jsonl,
    resolve,
)
from . import workload
from .synthetic import SYNTHETIC, synthetic
from .workload import Workload

__all__ = ["DEFAULT_TRACE", "SHORT_NAMES", "load_workload", "read_audit_steps", "resolve"]


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
    if trace in SYNTHETIC:
        return synthetic(trace, seed=seed)
    path = resolve(trace)
    if path.suffix in (".db", ".sqlite", ".sqlite3"):
        return workload.from_audit_steps(read_audit_steps(path, run_id), name=path.stem)
    name = plain_name(path)
    if name.startswith("mooncake_") and name.endswith("_trace.jsonl"):
        wanted = name.replace("_trace.jsonl", "_sessions.csv")
        beside = [path.with_name(wanted), path.with_name(wanted + COMPRESSED)]
        sessions = next((p for p in beside if p.is_file()), None)
        if sessions is None:
            raise ConfigError(f"{path.name} needs its sessions file {wanted} beside it.")
        kind = name.removeprefix("mooncake_").removesuffix("_trace.jsonl")
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
