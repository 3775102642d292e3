"""Datasette for ``serve``: in a process of its own, on the proxy's port under ``/datasette/``.

Datasette renders its pages in Python on its event loop; a page of 1,000 rows of 100 links takes
a core for a second. Run on the loop that relays every stream (through trio-asyncio, as it once
was), 16 such pages at once held ``/health`` for 14.6 s and a live stream for 5 s. So Datasette
runs in a child process (``child.py``) on a Unix socket in a private folder, and
:class:`DatasetteMount` relays ``/datasette/...`` to it: the proxy's loop only copies bytes.

:class:`ExplorerProcess` supervises the child: started on the first ``/datasette/`` request (a
proxy nobody explores pays nothing), restarted with a growing pause if it dies, stopped with the
proxy, and never outliving it (``child.die_with_parent``). Its state is in ``/health``.

A process can be alive and still answer nothing (stopped by a signal, deadlocked): it is asked
every ``PROBE_INTERVAL_S`` on its own socket (``PROBE_PATH``, answered by its server's event
loop). Silent for ``SILENT_S``, ``/health`` says ``degraded`` and new requests wait for it; silent
for ``HUNG_S`` while using (almost) no CPU, or for ``STUCK_S`` however busy, it is killed and
restarted (:class:`Liveness` decides, pure). A probe the proxy cannot send for want of a file
descriptor says nothing about the explorer.
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

from .. import descriptors
from ..http.auth import admin_allowed
from ..supervision import Components, supervised
from .child import EXIT_ORPHANED, EXIT_OVERRUN
from .names import MOUNT_PATH, PROBE_PATH, READ_METHODS

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
#: How long the relay waits for the explorer's next bytes. A hung process is found by its
#: probes and restarted sooner; this bounds a request the process takes and never answers.
RELAY_READ_TIMEOUT_S = 30.0
#: How long the relay waits to connect, to send, and for a free connection of its pool.
RELAY_CONNECT_TIMEOUT_S = 5.0
RELAY_WRITE_TIMEOUT_S = 10.0
RELAY_POOL_TIMEOUT_S = 30.0
#: How often the process is probed, and how long one probe waits for its answer.
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
#: No answer for this long: ``/health`` says degraded and new requests wait for an answer.
SILENT_S = 3.0
#: No answer for this long with less CPU than ``HUNG_CPU_S`` used meanwhile: the process is
#: hung (stopped, deadlocked), so it is killed and restarted. One busy rendering a heavy page
#: uses the CPU and is left alone until ``STUCK_S``.
HUNG_S = 6.0
HUNG_CPU_S = 0.1
STUCK_S = 60.0
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


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user and system) the process ``pid`` has used; None where ``/proc`` cannot
    tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 14 and 15 of proc(5), counted from 1 with the pid and the name before ")".
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Liveness:
    """Whether the explorer's process answers its probes: pure, the time and the CPU it has
    used passed in."""

    def __init__(self, now: float, cpu: float | None) -> None:
        #: When it last answered (or was started), and its CPU time then.
        self.answered_at = now
        self.cpu_at = cpu

    def answered(self, now: float, cpu: float | None) -> bool:
        """It answered at ``now``; True if it had been silent (``SILENT_S``) until then."""
        was_silent = self.silent_s(now) >= SILENT_S
        self.answered_at, self.cpu_at = now, cpu
        return was_silent

    def silent_s(self, now: float) -> float:
        return now - self.answered_at

    def problem(self, now: float) -> str | None:
        silent = self.silent_s(now)
        if silent < SILENT_S:
            return None
        return f"has not answered a probe for {silent:.0f} s"

    def hung(self, now: float, cpu: float | None) -> str | None:
        """Why the process is to be killed and restarted at ``now``, or None."""
        silent = self.silent_s(now)
        if silent >= STUCK_S:
            return f"it answered no probe for {silent:.0f} s"
        if silent < HUNG_S or cpu is None or self.cpu_at is None:
            return None
        used = cpu - self.cpu_at
        if used >= HUNG_CPU_S:
            return None  # busy (a heavy page), not hung
        return f"it answered no probe for {silent:.0f} s and used {used:.2f} s of CPU: hung"


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
        #: The probes' findings while a process is up.
        self.liveness: Liveness | None = None
        #: Why the last process was killed for not answering, until the next one is up.
        self.hung: str | None = None

    def status(self) -> dict[str, Any]:
        """What ``/health`` shows as ``explorer``."""
        up = self._up_since
        now = trio.current_time()
        return {
            "state": self.state,
            "pid": self.pid,
            "restarts": max(0, self.starts - 1),
            "up_s": None if up is None else round(now - up, 1),
            "last_exit": self.last_exit,
            "problem": self.problem(now),
        }

    def problem(self, now: float) -> str | None:
        """What is wrong with the explorer at ``now`` though its process runs (the component
        check ``/health``'s ``degraded`` shows), or None."""
        liveness = self.liveness
        if self.state == "up" and liveness is not None:
            silent = liveness.problem(now)
            if silent is not None:
                return (
                    f"Datasette's process (pid {self.pid}) {silent}; requests to "
                    f"{MOUNT_PATH} wait for it, and it is restarted if it stays silent"
                )
        if self.state in ("starting", "restarting") and self.hung is not None:
            return f"restarting: the last process was killed because {self.hung}"
        return None

    def unavailable(self, now: float) -> str:
        """Why a request cannot be relayed at ``now``, to follow "The explorer ..."."""
        liveness = self.liveness
        silent = None if liveness is None else liveness.problem(now)
        if self.state == "up" and silent is not None:
            return silent
        if self.hung is not None:
            return f"is {self.state}: the last process was killed because {self.hung}"
        return f"is {self.state}"

    @property
    def serving(self) -> bool:
        """Up and answering its probes: a request relayed now is answered."""
        return self.state == "up" and self.problem(trio.current_time()) is None

    def _set(self, state: str) -> None:
        self.state = state
        self._changed.set()
        self._changed = trio.Event()

    async def wait_up(self) -> None:
        """Ask for the explorer and wait until it serves (up, and answering its probes)."""
        self._wanted.set()
        while not self.serving:
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
                    self.liveness = Liveness(self._up_since, cpu_seconds(popen.pid))
                    self.hung = None
                    self._set("up")
                    async with trio.open_nursery() as nursery:

                        async def watch(child: subprocess.Popen[bytes]) -> None:
                            await self._watch(child)
                            await exited.wait()

                        async def until_exit() -> None:
                            await exited.wait()
                            nursery.cancel_scope.cancel()

                        nursery.start_soon(until_exit)
                        nursery.start_soon(watch, popen)
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
            self.liveness = None
            if "error" in outcome:
                self.last_exit = outcome["error"]
            elif self.hung is not None:
                self.last_exit = f"killed because {self.hung}"
            elif "code" in outcome:
                self.last_exit = describe_exit(outcome["code"])

    async def _watch(self, popen: subprocess.Popen[bytes]) -> None:
        """Probe the process until it is found hung, then kill it (the supervisor starts the
        next); returns at once if it has no liveness to watch."""
        liveness = self.liveness
        while liveness is not None:
            await trio.sleep(PROBE_INTERVAL_S)
            answered = await self._probe()
            now = trio.current_time()
            cpu = cpu_seconds(popen.pid)
            if answered is None or answered:
                # None: the proxy could not ask (no descriptor), which says nothing of it.
                if liveness.answered(now, cpu) and answered:
                    log.warning("explorer process (pid %d) answers again", popen.pid)
                    self._set("up")  # wakes requests waiting for it
                continue
            reason = liveness.hung(now, cpu)
            if reason is not None:
                self.hung = reason
                log.error(
                    "explorer process (pid %d): %s; killing it, the next one starts at once",
                    popen.pid,
                    reason,
                )
                popen.kill()
                return

    async def _probe(self) -> bool | None:
        """Whether the process answers ``PROBE_PATH`` within ``PROBE_TIMEOUT_S``; None if
        the proxy could not open a socket for want of a descriptor."""
        with trio.move_on_after(PROBE_TIMEOUT_S):
            try:
                stream = await trio.open_unix_socket(self.socket_path)
            except OSError as exc:
                if exc.errno in descriptors.OUT_ERRNOS:
                    descriptors.note_out("probing the explorer", exc)
                    return None
                return False
            async with stream:
                try:
                    await stream.send_all(
                        f"GET {PROBE_PATH} HTTP/1.1\r\nhost: explorer\r\n"
                        "connection: close\r\n\r\n".encode()
                    )
                    head = await stream.receive_some(64)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    return False
                return head.startswith(b"HTTP/1.1 200")
        return False


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
        if not explorer.serving:
            await self._unavailable(send, 503, explorer.unavailable(trio.current_time()))
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
            out = descriptors.out_error(exc)
            if out is not None:
                descriptors.note_out("connecting to the explorer", out)
                await self._unavailable(send, 503, "could not be reached: the proxy is out of "
                                        "file descriptors (raise ulimit -n)")  # fmt: skip
                return
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
    components = components or Components()
    with tempfile.TemporaryDirectory(prefix="thunderproxy-explore-") as folder:
        # A private folder (mode 0700): only this user can reach the socket.
        socket_path = os.path.join(folder, "datasette.sock")
        explorer = ExplorerProcess(db_path, socket_path, time_limit_ms=limit_ms)
        # A process that runs but does not answer is no failure of the component; /health
        # shows it as the component's problem.
        components.register(COMPONENT).check = explorer.problem
        transport = httpx.AsyncHTTPTransport(uds=socket_path)
        # Seconds, not minutes: a hung process is found by its probes and restarted, so these
        # bound only a request a live process takes and never answers. The explorer renders
        # one page at a time: a page queued behind heavy ones for longer than the read
        # timeout gets a 502 (16 pages of 1,000 rows of 100 links took 112 s on a busy
        # machine). A client that gives up earlier cancels its relay.
        timeout = httpx.Timeout(
            connect=RELAY_CONNECT_TIMEOUT_S,
            read=RELAY_READ_TIMEOUT_S,
            write=RELAY_WRITE_TIMEOUT_S,
            pool=RELAY_POOL_TIMEOUT_S,
        )
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=8)
        async with (
            httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits) as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(supervised(components, COMPONENT, explorer.serve))
            try:
                yield DatasetteMount(app, explorer, client, admin_token=admin_token)
            finally:
                nursery.cancel_scope.cancel()
