"""Exploring the audit db with Datasette: one port, canned questions, charts.

``serve`` mounts Datasette read-only under ``/datasette/`` on the proxy's own port
(:func:`mount_datasette`, through trio-asyncio); ``thunderproxy explore DB`` shows the same pages
for a db copied off a server (``standalone``, plain asyncio). The metadata, canned queries and
dashboard charts ship as ``metadata.yaml`` in this package.

Importing this package is cheap and imports neither Datasette nor trio-asyncio: the proxy pays for
them only when Datasette is switched on, and ``explore`` never imports trio-asyncio at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import Settings

#: An ASGI application (the proxy's Quart app, or the mount in front of it).
ASGIApp = Any

#: Where Datasette lives, on the proxy's port and in ``explore`` alike.
MOUNT_PATH = "/datasette/"
#: The audit db's name in Datasette's URLs (``/datasette/audit/...``), whatever its file name.
DATABASE_NAME = "audit"
#: The only HTTP methods the explorer answers: it never takes a write.
READ_METHODS = frozenset({"GET", "HEAD"})


@asynccontextmanager
async def mount_datasette(app: ASGIApp, settings: Settings) -> AsyncIterator[ASGIApp]:
    """Yield the ASGI app to serve: ``app`` itself, or with ``--datasette`` an app that sends
    ``/datasette/`` to Datasette and everything else to ``app``, inside a trio-asyncio loop that
    lives as long as the block."""
    if not settings.datasette:
        yield app
        return
    from .mount import open_datasette_mount

    async with open_datasette_mount(app, settings.db, admin_token=settings.admin_token) as mounted:
        yield mounted
