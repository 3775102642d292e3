"""The explorer's fixed names: where it is mounted, the db's name in its URLs, the methods it
answers. Below the package's modules, which all use them (``__init__`` re-exports them).
"""

from __future__ import annotations

from typing import Any

#: An ASGI application (the proxy's Quart app, or the mount in front of it).
ASGIApp = Any

#: Where Datasette lives, on the proxy's port and in ``explore`` alike.
MOUNT_PATH = "/datasette/"
#: The audit db's name in Datasette's URLs (``/datasette/audit/...``), whatever its file name.
DATABASE_NAME = "audit"
#: The only HTTP methods the explorer answers: it never takes a write.
READ_METHODS = frozenset({"GET", "HEAD"})
#: The explorer process's liveness probe, answered by its server before Datasette (outside
#: ``MOUNT_PATH``, so the relay never forwards a client to it).
PROBE_PATH = "/-/alive"
