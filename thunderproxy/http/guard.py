"""What the passthrough may reach, and who may read the proxy's own listings. Pure functions:
no I/O, no trio, so every bypass attempt is a plain unit test.

A backend serves more than inference: vLLM's ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``,
``/v1/load_lora_adapter``, ``/collective_rpc``, ``/start_profile``, the simulator's ``/_sim/*``
change its state for everyone. The passthrough relays only the paths under ``--passthrough``;
any other path needs the admin token, and with no admin token configured it is refused (403), so
a proxy started with defaults never exposes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

from ..errors import ConfigError, Forbidden
from .auth import admin_allowed, require_admin

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
#: Characters a normalised path is forwarded with unescaped (RFC 3986 pchar and ``/``).
PATH_SAFE = "/:@!$&'()*+,;=-._~"


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


def path_allowed(normal: str, prefixes: tuple[str, ...]) -> bool:
    """Whether a normalised path lies under one of the prefixes, at a segment boundary:
    ``/v1/models`` allows ``/v1/models/x`` but not ``/v1/models-admin``."""
    for prefix in prefixes:
        if prefix == EVERYTHING:
            return True
        stem = prefix.rstrip("/")
        if not stem or normal == stem or normal.startswith(stem + "/"):
            return True
    return False


@dataclass(frozen=True)
class PassthroughGuard:
    """The ``--passthrough`` list with the admin token: decides, and says what to forward."""

    prefixes: tuple[str, ...]
    admin_token: str = ""

    def check(self, path: str, authorization: str | None) -> str:
        """The path to forward (the normalised one, so what was checked is what the backend
        routes), or raise: Unauthorized without the admin token, Forbidden when none is set."""
        normal = normalize_path(path)
        if normal is None:
            raise Forbidden(
                "The request path has control characters or nested percent-encoding; "
                "send a plain path."
            )
        if not path_allowed(normal, self.prefixes):
            if not self.admin_token:
                raise Forbidden(
                    f"{normal} is not relayed to the backend: it is outside --passthrough "
                    "(THUNDERPROXY_PASSTHROUGH). Add its prefix there, or set --admin-token "
                    "and send that token to reach it."
                )
            require_admin(authorization, self.admin_token)
        trailing = "/" if path.endswith("/") and normal != "/" else ""
        return quote(normal + trailing, safe=PATH_SAFE)

    def carries_admin_token(self, authorization: str | None) -> bool:
        """Whether ``authorization`` is the admin token: it is the proxy's secret, never the
        backend's, so it is not forwarded."""
        return bool(self.admin_token) and admin_allowed(authorization, self.admin_token)


def reads_allowed(authorization: str | None, *, protect_reads: bool, admin_token: str) -> bool:
    """Whether the listings (/programs, /profiles, /metrics, /health's detail) may be shown:
    always unless ``--protect-reads``, then only with the admin token (when one is set)."""
    if not protect_reads:
        return True
    return admin_allowed(authorization, admin_token)


#: The guard of a proxy built without settings: the default list, no admin token.
DEFAULT_GUARD = PassthroughGuard(parse_prefixes(",".join(DEFAULT_PASSTHROUGH)))
