"""The admin token: one check for every state-changing endpoint and for Datasette."""

from __future__ import annotations

import hmac

from ..errors import Unauthorized


def admin_allowed(authorization: str | None, token: str) -> bool:
    """True if no token is configured, or ``authorization`` is ``Bearer <token>``."""
    if not token:
        return True
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    # Constant-time comparison: the token must not leak through response timing.
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip(), token)


def require_admin(authorization: str | None, token: str) -> None:
    if not admin_allowed(authorization, token):
        raise Unauthorized(
            "This endpoint needs the admin token: send 'Authorization: Bearer <token>' with the "
            "value given to --admin-token."
        )
