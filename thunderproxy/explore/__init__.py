"""Exploring the audit db with Datasette: one port, canned questions, charts.

``serve`` shows Datasette read-only under ``/datasette/`` on the proxy's own port
(:func:`mount_datasette`): Datasette runs in a process of its own and the proxy relays to it, so
rendering a page never takes the time of the loop that relays the streams (``mount.py``).
``thunderproxy explore DB`` shows the same pages for a db copied off a server (``standalone``).
The metadata, canned queries and dashboard charts ship as ``metadata.yaml`` in this package.

Importing this package is cheap: the proxy itself never imports Datasette.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from .names import DATABASE_NAME, MOUNT_PATH, READ_METHODS, ASGIApp

if TYPE_CHECKING:
    from ..config import Settings
    from ..http.services import Services

__all__ = ["DATABASE_NAME", "MOUNT_PATH", "READ_METHODS", "ASGIApp", "mount_datasette"]


@asynccontextmanager
async def mount_datasette(
    app: ASGIApp, settings: Settings, services: Services | None = None
) -> AsyncIterator[ASGIApp]:
    """Yield the ASGI app to serve: ``app`` itself, or with ``--datasette`` an app that relays
    ``/datasette/`` to the explorer's process and everything else to ``app``; that process is
    supervised for as long as the block lives as the component ``explorer`` of ``services``, its
    state shown in their ``/health`` (``explorer`` and ``components``) and ``/metrics``."""
    if not settings.datasette:
        yield app
        return
    from .mount import open_datasette_mount

    async with open_datasette_mount(
        app,
        settings.db,
        admin_token=settings.admin_token,
        components=None if services is None else services.components,
    ) as mounted:
        if services is not None:
            services.explorer = mounted.explorer.status
        yield mounted
