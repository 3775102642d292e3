"""The admin token: one check for every state-changing endpoint and for Datasette."""

from __future__ import annotations

import base64
import hmac

from ..errors import Unauthorized


def admin_allowed(authorization: str | None, token: str) -> bool:
    """True if no token is configured, or ``authorization`` carries it: ``Bearer <token>``, or
    HTTP Basic with the token as password."""
    if not token:
        return True
    if not authorization:
        return False
    scheme, _, presented = authorization.partition(" ")
    presented = presented.strip()
    if scheme.lower() == "basic":
        # A browser asked for credentials: any user name, the token as password.
        try:
            presented = base64.b64decode(presented, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    # Constant-time comparison: the token must not leak through response timing.
    return hmac.compare_digest(presented.encode(), token.encode())


def require_admin(authorization: str | None, token: str) -> None:
    if not admin_allowed(authorization, token):
        raise Unauthorized(
            "This endpoint needs the admin token: send 'Authorization: Bearer <token>' with the "
            "value given to --admin-token."
        )
