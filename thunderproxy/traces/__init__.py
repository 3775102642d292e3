"""The workload traces that ship with the package, and how a ``--trace`` value finds a file.

The files here are third-party data, compressed with xz; README.md beside them says where each
comes from, how it was derived and under which licence (the licence texts are beside them too).
A ``--trace`` value is a path (plain or ``.xz``), a short name (``thunderagent``, ``mooncake``,
``mooncake-synthetic``), or a bare file name looked up first in ``$THUNDERPROXY_TRACES`` (a
folder of your own traces), then here.
"""

from __future__ import annotations

import csv
import json
import lzma
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError

TRACES_ENV = "THUNDERPROXY_TRACES"
SHORT_NAMES = {
    "thunderagent": "thunderagent_sweagent_glm45_calls.jsonl",
    "mooncake": "mooncake_conversation_trace.jsonl",
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
}
DEFAULT_TRACE = "thunderagent"
#: Packaged traces are stored compressed; a name is found with or without this suffix.
COMPRESSED = ".xz"


def packaged_dir() -> Path:
    """The traces that ship with the package: this folder."""
    return Path(__file__).resolve().parent


def traces_dirs() -> list[Path]:
    """Where a bare file name is looked up: ``$THUNDERPROXY_TRACES`` first, then the package."""
    configured = os.environ.get(TRACES_ENV)
    return ([Path(configured)] if configured else []) + [packaged_dir()]


def resolve(trace: str) -> Path:
    """The file a ``--trace`` value names (see the module docstring)."""
    name = SHORT_NAMES.get(trace, trace)
    candidates = [Path(name)]
    if not Path(name).is_absolute():
        candidates += [folder / name for folder in traces_dirs()]
    for candidate in candidates:
        for path in (candidate, candidate.with_name(candidate.name + COMPRESSED)):
            if path.is_file():
                return path
    known = ", ".join(sorted(SHORT_NAMES))
    raise ConfigError(
        f"Trace {trace!r} not found (looked at {', '.join(str(c) for c in candidates)}); pass "
        f"--trace with a file's path or one of {known}, or set {TRACES_ENV} to a folder of traces."
    )


def plain_name(path: Path) -> str:
    """The trace's file name without the compression suffix."""
    return path.name.removesuffix(COMPRESSED)


@contextmanager
def open_text(path: Path) -> Iterator[TextIO]:
    """A trace file as text, decompressed when it ends in ``.xz``."""
    if path.name.endswith(COMPRESSED):
        with lzma.open(path, "rt", encoding="utf-8", newline="") as fh:
            yield fh
    else:
        with path.open(encoding="utf-8", newline="") as fh:
            yield fh


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open_text(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open_text(path) as fh:
        return list(csv.DictReader(fh))
