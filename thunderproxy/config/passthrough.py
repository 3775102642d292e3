"""The ``passthrough`` setting: its default prefixes, ``parse_prefixes`` for its value, and the
path normalisation both that check and the guard (http/guard.py) apply, so a prefix accepted at
start-up is the very prefix the guard relays. Pure.
"""

from __future__ import annotations

from urllib.parse import unquote

from ..errors import ConfigError

#: The OpenAI/vLLM inference and read-only API: nothing here changes a backend's state. vLLM's
#: ``/v1/responses`` and ``/v1/messages`` generate tokens the scheduler never sees (and keep
#: stored responses), so they are left to ``--passthrough`` too.
DEFAULT_PASSTHROUGH = (
    "/v1/models",
    "/v1/embeddings",
    "/v1/rerank",
    "/v2/rerank",
    "/rerank",
    "/v1/score",
    "/score",
    "/pooling",
    "/classify",
    "/v1/audio/",
    "/tokenize",
    "/detokenize",
    "/version",
    "/ping",
    "/load",
)
#: ``--passthrough *``: relay every path (the backend must guard itself).
EVERYTHING = "*"
#: Percent-decoding rounds before a path that still changes is refused: ``%252e`` is two.
MAX_DECODE_ROUNDS = 4


def parse_prefixes(value: str) -> tuple[str, ...]:
    """``--passthrough``'s comma-separated value as normalised prefixes (``*``: everything)."""
    prefixes = []
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        if item == EVERYTHING:
            prefixes.append(EVERYTHING)
            continue
        if not item.startswith("/"):
            raise ConfigError(
                f"--passthrough entry {item!r} is not a path prefix; give paths that start with "
                "'/', e.g. --passthrough /v1/models,/tokenize (or '*' for every path)."
            )
        normal = normalize_path(item)
        if normal is None:
            raise ConfigError(f"--passthrough entry {item!r} is not a plain path prefix.")
        prefixes.append(normal)
    return tuple(prefixes)


def normalize_path(path: str) -> str | None:
    """``path`` as a backend will route it: percent-decoded until stable, backslashes as slashes,
    empty, ``.`` and ``..`` segments resolved, no trailing slash. None for a path no honest
    client sends (a NUL or control character, or encoding nested too deep to settle)."""
    for _ in range(MAX_DECODE_ROUNDS):
        try:
            decoded = unquote(path, errors="strict") if "%" in path else path
        except UnicodeDecodeError:
            return None
        if decoded == path:
            break
        path = decoded
    else:
        return None
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):
        return None
    segments: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        # Some servers drop ';' parameters before resolving dot segments (``..;``).
        dots = segment.partition(";")[0]
        if segment == "" or dots == ".":
            continue
        if dots == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)
