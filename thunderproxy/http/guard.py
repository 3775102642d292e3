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
from urllib.parse import quote

from ..config.passthrough import DEFAULT_PASSTHROUGH as DEFAULT_PASSTHROUGH
from ..config.passthrough import EVERYTHING as EVERYTHING
from ..config.passthrough import normalize_path as normalize_path
from ..config.passthrough import parse_prefixes as parse_prefixes
from ..errors import Forbidden
from .auth import admin_allowed, require_admin

#: Characters a normalised path is forwarded with unescaped (RFC 3986 pchar and ``/``).
PATH_SAFE = "/:@!$&'()*+,;=-._~"


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
