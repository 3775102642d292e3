"""The ``admin`` blueprint: what changes the proxy's state from outside, behind the admin token
(http/auth.py) or, with ``[clients]``, a client's own key for its own programs."""

from __future__ import annotations

from quart import Blueprint, Response, jsonify, request

from ...errors import InvalidRequest
from ..auth import admin_allowed, require_admin
from ..clients import Clients, scoped
from ..proxy import parse_json_object
from ..services import Services


def create_blueprint(services: Services, clients: Clients) -> Blueprint:
    bp = Blueprint("admin", __name__)
    settings = services.settings

    @bp.post("/programs/release")
    async def release_program() -> Response:
        authorization = request.headers.get("authorization")
        # With [clients], a client releases its own programs (the id it sent them with); the
        # admin token, when one is set, names any program by its full id (``client:id``).
        client = None
        if clients.enabled and not (
            settings.admin_token and admin_allowed(authorization, settings.admin_token)
        ):
            client = clients.identify(request.headers.items())
        else:
            require_admin(authorization, settings.admin_token)
        body = parse_json_object(await request.get_data(False, False, False))
        program_id = body.get("program_id")
        if not isinstance(program_id, str) or not program_id:
            raise InvalidRequest("program_id must be a non-empty string.", param="program_id")
        tracked = scoped(client, program_id)
        services.scheduler.release(tracked)
        clients.forget(tracked)  # a later call continuing it starts anew
        return jsonify({"program_id": program_id, "released": True})

    return bp
