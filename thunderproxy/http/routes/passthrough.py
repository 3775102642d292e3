"""The ``passthrough`` blueprint: any path no other route serves, relayed to a backend where
``--passthrough`` allows it (http/proxy.py, http/guard.py). Registered last: at ``/`` the
readouts' ``GET``/``HEAD`` come first."""

from __future__ import annotations

from quart import Blueprint, Response

from ..proxy import Proxy

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def create_blueprint(proxy: Proxy) -> Blueprint:
    bp = Blueprint("passthrough", __name__)

    @bp.route("/", methods=ALL_METHODS, defaults={"path": ""})
    @bp.route("/<path:path>", methods=ALL_METHODS)
    async def passthrough(path: str) -> Response:
        return await proxy.passthrough("/" + path)

    return bp
