"""Datasette for ``serve``: in a process of its own, on the proxy's port under ``/datasette/``.

Datasette renders its pages in Python on its event loop; a page of 1,000 rows of 100 links takes
a core for a second. Run on the loop that relays every stream (through trio-asyncio, as it once
was), 16 such pages at once held ``/health`` for 14.6 s and a live stream for 5 s. So Datasette
runs in a child process (``child.py``) on a Unix socket in a private folder, and
:class:`DatasetteMount` relays ``/datasette/...`` to it: the proxy's loop only copies bytes.

:class:`ExplorerProcess` supervises the child: started on the first ``/datasette/`` request (a
proxy nobody explores pays nothing), restarted with a growing pause if it dies, stopped with the
proxy, and never outliving it (``child.die_with_parent``). Its state is in ``/health``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from ..http.auth import admin_allowed
from ..supervision import Components, supervised
from .child import EXIT_ORPHANED, EXIT_OVERRUN
from .names import MOUNT_PATH, READ_METHODS

log = logging.getLogger("thunderproxy.explore")

#: ``/datasette``: requests for it are redirected to ``/datasette/``.
PREFIX = MOUNT_PATH.rstrip("/")
#: How long a child may take to import and start Datasette and listen before it is killed and
#: retried.
START_TIMEOUT_S = 30.0
#: How long a request waits for the explorer to come up before it is answered 503.
REQUEST_WAIT_S = 20.0
#: The name of the explorer's process among the supervised components (``/health``'s
#: ``components``, ``thunderproxy_component_up``).
COMPONENT = "explorer"
#: How long the relay waits for the explorer's next bytes.
RELAY_READ_TIMEOUT_S = 600.0
#: Longest request target (path and query) relayed to the explorer: past httpx's own bound
#: (64 KiB) the relay failed with a bare 500; a SQL query in a URL is a few KB.
MAX_TARGET_BYTES = 32 * 1024
#: After SIGTERM, how long the child may take to stop before SIGKILL.
STOP_GRACE_S = 3.0
#: Headers of one hop, not relayed (RFC 9110 §7.6.1); the admin token stays with the proxy.
HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"authorization",
    }
)

Scope = dict[str, Any]
Receive = Any
Send = Any
ASGIApp = Any


def package_root() -> str:
    """The folder ``thunderproxy`` is imported from (the zipapp's unpacked cache included)."""
    return str(Path(__file__).resolve().parents[2])


def describe_exit(code: int) -> str:
    if code == EXIT_OVERRUN:
        return f"exit {code}: a query ran past the time limit inside one SQLite instruction"
    if code == EXIT_ORPHANED:
        return f"exit {code}: it lost the proxy that started it"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


class ExplorerEnded(Exception):
    """The explorer's process ended: the supervisor restarts it."""


class ExplorerProcess:
    """Runs and watches the explorer's process for one proxy run (restarted as a supervised
    component: :meth:`serve`)."""

    def __init__(self, db_path: str, socket_path: str, *, time_limit_ms: int) -> None:
        self.db_path = db_path
        self.socket_path = socket_path
        self.time_limit_ms = time_limit_ms
        #: idle (not asked for yet), starting, up, restarting (waiting its backoff), stopped.
        self.state = "idle"
        self.pid: int | None = None
        self.starts = 0
        self.last_exit: str | None = None
        self._up_since: float | None = None
        self._wanted = trio.Event()
        self._changed = trio.Event()
        self._popen: subprocess.Popen[bytes] | None = None

    def status(self) -> dict[str, Any]:
        """What ``/health`` shows as ``explorer``."""
        up = self._up_since
        return {
            "state": self.state,
            "pid": self.pid,
            "restarts": max(0, self.starts - 1),
            "up_s": None if up is None else round(trio.current_time() - up, 1),
            "last_exit": self.last_exit,
        }

    def _set(self, state: str) -> None:
        self.state = state
        self._changed.set()
        self._changed = trio.Event()

    async def wait_up(self) -> None:
        """Ask for the explorer and wait until it serves."""
        self._wanted.set()
        while self.state != "up":
            await self._changed.wait()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """One life of the explorer's process, run as the supervised component ``explorer``: it
        starts on the first request for it, and its end, never expected while the proxy runs, is
        raised, so that the supervisor (``supervision.py``) logs it, counts it in ``/health``
        and ``/metrics``, and starts the next after its backoff."""
        task_status.started()
        ended = False
        try:
            await self._wanted.wait()
            await self._run_once()
            ended = True
        finally:
            self._set("restarting" if ended else "stopped")
        raise ExplorerEnded(f"Datasette's process ended ({self.last_exit})")

    def _argv(self) -> list[str]:
        # The same interpreter, and without site-packages if the proxy runs without them (the
        # zipapp does): everything is found under package_root().
        flags = ["-S"] if sys.flags.no_site else []
        return [
            sys.executable,
            *flags,
            "-m",
            "thunderproxy.explore.child",
            "--db",
            self.db_path,
            "--socket",
            self.socket_path,
            "--parent-pid",
            str(os.getpid()),
            "--time-limit-ms",
            str(self.time_limit_ms),
        ]

    async def _run_once(self) -> None:
        self._set("starting")
        self.starts += 1
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root(), env.get("PYTHONPATH")]))
        token = trio.lowlevel.current_trio_token()
        started = trio.Event()
        ready = trio.Event()
        exited = trio.Event()
        outcome: dict[str, Any] = {}

        def report(event: trio.Event) -> None:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass

        def keep() -> None:
            # The child asks the kernel to kill it when the thread that started it ends
            # (PR_SET_PDEATHSIG). trio starts processes from its cached worker threads, which
            # end when idle; this thread lives exactly as long as the child does.
            try:
                if os.path.exists(self.socket_path):
                    os.unlink(self.socket_path)  # an earlier child's
                popen = subprocess.Popen(
                    self._argv(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    # A terminal's Ctrl-C goes to the proxy alone, which stops this process
                    # after it has drained (the process would otherwise exit at once and be
                    # restarted during the drain).
                    start_new_session=True,
                )
            except OSError as exc:
                outcome["error"] = f"could not start {sys.executable}: {exc}"
                report(started)
                report(exited)
                return
            self._popen = popen
            report(started)
            assert popen.stdout is not None
            assert popen.stdin is not None
            if popen.stdout.readline().strip() == b"ready":
                report(ready)
            outcome["code"] = popen.wait()
            popen.stdout.close()
            popen.stdin.close()
            report(exited)

        threading.Thread(target=keep, name="explore-child", daemon=True).start()
        try:
            await started.wait()
            popen = self._popen
            if popen is not None:
                with trio.move_on_after(START_TIMEOUT_S) as waiting:
                    async with trio.open_nursery() as nursery:

                        async def until_exit() -> None:
                            await exited.wait()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(until_exit)
                        await ready.wait()
                        nursery.cancel_scope.cancel()
                if waiting.cancelled_caught:
                    log.error("explorer process did not listen within %.0f s", START_TIMEOUT_S)
                    popen.kill()
                elif ready.is_set():
                    self.pid = popen.pid
                    self._up_since = trio.current_time()
                    self._set("up")
            await exited.wait()
        finally:
            popen = self._popen
            if popen is not None and not exited.is_set():
                with trio.CancelScope(shield=True):
                    popen.terminate()
                    with trio.move_on_after(STOP_GRACE_S):
                        await exited.wait()
                    if not exited.is_set():
                        popen.kill()
                        await exited.wait()
            self._popen = None
            self.pid = None
            self._up_since = None
            if "error" in outcome:
                self.last_exit = outcome["error"]
            elif "code" in outcome:
                self.last_exit = describe_exit(outcome["code"])


def request_allowed(scope: Scope, admin_token: str) -> bool:
    """Whether a request under ``/datasette/`` may reach Datasette: with ``--admin-token``, only
    one that carries it (as a bearer token, or as the password of HTTP Basic auth so that a
    browser can ask for it)."""
    authorization = None
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            authorization = value.decode("latin-1")
    return admin_allowed(authorization, admin_token)


async def _respond(send: Send, status: int, body: dict[str, Any], headers: list[Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class DatasetteMount:
    """The ASGI app served when Datasette is on: ``/datasette/...`` is checked here (admin
    token, read-only) and relayed to the explorer's process; everything else (lifespan
    included) goes to the proxy app."""

    def __init__(
        self,
        app: ASGIApp,
        explorer: ExplorerProcess,
        client: httpx.AsyncClient,
        *,
        admin_token: str = "",
    ) -> None:
        self.app = app
        self.explorer = explorer
        self.client = client
        self.admin_token = admin_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        # The proxy's hot path pays for this one comparison and nothing else.
        if not path.startswith(PREFIX) or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if path != PREFIX and not path.startswith(MOUNT_PATH):
            await self.app(scope, receive, send)  # e.g. /datasette-foo is the backend's
            return
        if not request_allowed(scope, self.admin_token):
            error = {
                "message": "The audit log needs the admin token (--admin-token): send it as "
                "'Authorization: Bearer <token>', or as the password when the browser asks.",
                "type": "authentication_error",
            }
            challenge = (b"www-authenticate", b'Basic realm="thunderproxy"')
            await _respond(send, 401, {"error": error}, [challenge])
            return
        if scope["method"] not in READ_METHODS:
            # Read-only: no form, API or canned query of the explorer takes a write.
            error = {"message": "The audit log is read-only.", "type": "method_not_allowed"}
            await _respond(send, 405, {"error": error}, [(b"allow", b"GET, HEAD")])
            return
        if path == PREFIX:
            query = scope.get("query_string", b"")
            location = MOUNT_PATH.encode() + (b"?" + query if query else b"")
            await _respond(send, 302, {"location": location.decode()}, [(b"location", location)])
            return
        await self.relay(scope, send)

    async def relay(self, scope: Scope, send: Send) -> None:
        explorer = self.explorer
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        if len(target) > MAX_TARGET_BYTES:
            await self._too_long(send, len(target))
            return
        with trio.move_on_after(REQUEST_WAIT_S):
            await explorer.wait_up()
        if explorer.state != "up":
            await self._unavailable(send, 503, f"is {explorer.state}")
            return
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in HOP_HEADERS]
        try:
            request = self.client.build_request(
                scope["method"], "http://explorer" + target.decode("latin-1"), headers=headers
            )
        except httpx.InvalidURL:
            await self._too_long(send, len(target))  # httpx's own bound, should it be lower
            return
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            await self._unavailable(send, 502, f"did not answer ({type(exc).__name__})")
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k, v) for k, v in response.headers.raw if k.lower() not in HOP_HEADERS
                    ],
                }
            )
            # An error past this point ends the connection: the client sees a cut response.
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def _too_long(self, send: Send, size: int) -> None:
        error = {
            "message": f"The URL is {size} bytes; the explorer takes at most "
            f"{MAX_TARGET_BYTES}. Shorten the query, or run it with sqlite3 on a copy of the "
            "audit db.",
            "type": "uri_too_long",
        }
        await _respond(send, 414, {"error": error}, [])

    async def _unavailable(self, send: Send, status: int, what: str) -> None:
        last = self.explorer.last_exit
        error = {
            "message": f"The explorer (Datasette's own process) {what}"
            + (f"; it last ended with {last}" if last else "")
            + ". It restarts by itself: retry shortly; /health shows its state as 'explorer'.",
            "type": "service_unavailable",
        }
        await _respond(send, status, {"error": error}, [(b"retry-after", b"1")])


@asynccontextmanager
async def open_datasette_mount(
    app: ASGIApp,
    db_path: str,
    *,
    admin_token: str = "",
    time_limit_ms: int | None = None,
    components: Components | None = None,
) -> AsyncIterator[DatasetteMount]:
    """The explorer's process, supervised as the component ``explorer`` of ``components``, and
    the mount that relays ``/datasette/`` to it in front of ``app``; both stop when the block
    exits (after the HTTP server has drained)."""
    from .instance import SETTINGS

    limit_ms = time_limit_ms or int(SETTINGS["sql_time_limit_ms"])
    with tempfile.TemporaryDirectory(prefix="thunderproxy-explore-") as folder:
        # A private folder (mode 0700): only this user can reach the socket.
        socket_path = os.path.join(folder, "datasette.sock")
        explorer = ExplorerProcess(db_path, socket_path, time_limit_ms=limit_ms)
        transport = httpx.AsyncHTTPTransport(uds=socket_path)
        # The explorer renders one page at a time: under a burst of heavy pages the last one
        # waits for all the others (16 pages of 1,000 rows of 100 links took 112 s on a busy
        # machine). A client that gives up earlier cancels its relay.
        timeout = httpx.Timeout(connect=5.0, read=RELAY_READ_TIMEOUT_S, write=10.0, pool=60.0)
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=8)
        async with (
            httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits) as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(supervised(components or Components(), COMPONENT, explorer.serve))
            try:
                yield DatasetteMount(app, explorer, client, admin_token=admin_token)
            finally:
                nursery.cancel_scope.cancel()
