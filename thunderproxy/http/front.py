"""The HTTP/1.1 front: the streamed LLM routes served on trio's sockets, everything else by
Hypercorn.

Measured on the relay's trivial backend (docs/BENCHMARKS.md, "Quiet machine: the routers, both
floors"), a bare ASGI relay on Hypercorn already cost more CPU per relayed chunk than the
proxy's whole budget: Hypercorn's per-event machinery (its protocol events, h11's writer, a
memory channel and a task per request, a lock and a shielded scope per write) is paid once per
chunk. So this server owns the listening socket and serves the requests the fast path takes
(``http/fastpath.py``) itself, with a minimal ASGI face, and hands every other connection to
Hypercorn, in this process, for the rest of its life.

What it serves itself: ``POST`` to one of ``FAST_ROUTES`` (no ``root_path``, as
``FastRoutes.route`` asks), HTTP/1.1, a ``Content-Length`` body, no ``Transfer-Encoding``,
``Expect`` or ``Upgrade``, and no ``server_names`` in Hypercorn's config to check. Those run
through the very ASGI callable Hypercorn is given (the app, Datasette's mount, worker mode's
middleware), with the scope Hypercorn would build, ``http.request`` events as the body arrives
and ``http.disconnect`` when the client goes. The answer is written as each ``send`` comes: the
head (through h11, with Hypercorn's ``date`` and ``server`` headers) together with the first
body, then one socket write per body event with the chunk framing written here. h11 parses
every request head and reads the body, so malformed input gets the refusals Hypercorn gives
(400, 431 past ``--max-header-bytes``, with ``Connection: close``), and its state machine says
when a connection may carry the next request.

Any other request (other paths and methods, websockets, ``h2c`` and HTTP/2 prior knowledge,
chunked bodies, HTTP/1.0) hands its connection to Hypercorn's own ``TCPServer``, over a stream
that first replays the bytes already read. In process rather than piped to a Hypercorn on a
private socket, because then nothing changes for those requests: the client's address is the
real peer's (a pipe would show 127.0.0.1), there is one lifespan, one ``WorkerContext`` whose
``terminated`` event closes idle connections of both kinds at shutdown, and one nursery whose
deadline is the graceful timeout ``drain_then_stop`` sets (``http/drain.py``), with no second
server to stop in step. With ``--certfile`` the front is not used: TLS is Hypercorn's.

The limits stay where they were: ``--client-timeout`` bounds the wait for a request head (the
connection is closed silently, as Hypercorn closes an idle one) and, in the fast path, for its
body (408); ``--max-header-bytes`` is h11's limit (431) and the fast path's own count;
``--max-body-bytes`` the fast path's (413). A slow reader holds the exchange in its write,
so nothing is buffered past the kernel's socket buffer; a client that leaves is seen by the
fast path's watcher (``receive`` returns ``http.disconnect``), which cancels the exchange: the
gateway records 499 and closes the lease. While watching, bytes of a pipelined next request are
kept for it (up to ``--max-header-bytes``; past that the watch stops, as Hypercorn stops
reading while a request runs). A connection closed with input unread (a refused head, a 413 or
408 before the body) first shuts its sending side and drops what still comes, for up to
``LINGER_S``: closed at once, the kernel would reset it, and the reset can overtake the answer.

The sockets are read and written directly, as the upstream client does (``backends/h1.py``):
bytes already waiting cost no trip through trio's scheduler; waits are trio's
``wait_readable``/``wait_writable``, so cancellation and backpressure work as everywhere else.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from itertools import chain
from typing import Any
from urllib.parse import unquote

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import parse_socket_addr, repr_socket_addr, wrap_app

from .. import descriptors
from ..causes import CauseLog
from .fastpath import BODY_WRITER, FAST_ROUTES

log = logging.getLogger("thunderproxy.http")

#: The ASGI callable both servers are given.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

#: Request headers that send a request to Hypercorn whatever its path.
_HANDED_OFF = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
#: Seconds a connection closed with input unread waits for the client to close (``linger``).
LINGER_S = 2.0
#: One write in this many yields to trio's scheduler (see ``Connection._write``).
YIELD_EVERY = 16


class Replayed(trio.abc.HalfCloseableStream):
    """A client's socket stream that first gives back the bytes the front already read from
    it: what Hypercorn's ``TCPServer`` reads when it takes a connection over. It has the
    ``socket`` Hypercorn reads the client's address from, and no TLS handshake."""

    def __init__(self, stream: trio.SocketStream, data: bytes) -> None:
        self.stream = stream
        self.socket = stream.socket
        self._data = data

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._data:
            await trio.lowlevel.checkpoint()
            size = len(self._data) if max_bytes is None else max_bytes
            data, self._data = self._data[:size], self._data[size:]
            return data
        return bytes(await self.stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class HandOff(Exception):
    """The request just read is not the front's: Hypercorn takes the connection, replaying
    ``data`` (everything read since the request began)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class Front:
    """The front's state shared by its connections: the app, Hypercorn's config and context,
    and the idle connections to close when the server stops."""

    def __init__(
        self,
        app: ASGIApp,
        config: HypercornConfig,
        context: WorkerContext,
        lifespan_state: LifespanState,
    ) -> None:
        self.app = app
        self.config = config
        self.context = context
        self.lifespan_state = lifespan_state
        self.wrapped = wrap_app(app, config.wsgi_max_body_size, None)  # type: ignore[arg-type]
        #: The cancel scopes of connections waiting for a request head.
        self.idle: set[trio.CancelScope] = set()

    def close_idle(self) -> None:
        for scope in self.idle:
            scope.cancel()

    async def handle(self, sock: socket.socket) -> None:
        """One client connection, for as long as it lasts."""
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
        except OSError:
            sock.close()
            return  # gone before it was served
        connection = Connection(self, sock, client, server)
        replay: bytes | None = None
        try:
            await connection.serve()
        except HandOff as hand_off:
            replay = hand_off.data
        except OSError:
            pass  # the client went; its exchange, if any, has already seen it
        except Exception:
            # One connection's fault must not stop the server (Hypercorn's would not either).
            log.exception("Error serving a connection on the HTTP front")
        finally:
            if replay is None:  # closed however the connection ended, cancellation included
                try:
                    if connection.unread():
                        await connection.linger()
                finally:
                    trio.lowlevel.notify_closing(sock)
                    sock.close()
        if replay is not None:
            state = ConnectionState(self.lifespan_state.copy())
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
            hypercorn = TCPServer(
                self.wrapped,
                self.config,
                self.context,
                state,
                Replayed(stream, replay),  # type: ignore[arg-type]
            )
            await hypercorn.run()


class Connection:
    """One client connection while the front serves it."""

    def __init__(
        self,
        front: Front,
        sock: socket.socket,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
    ) -> None:
        self.front = front
        self.config = front.config
        self.sock = sock
        self.client = client
        self.server = server
        self.state = front.lifespan_state.copy()
        self.h11 = h11.Connection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )
        self.requests = 0
        self.writes = 0
        # Per exchange:
        self.body_done = False
        self.gone = False
        self.started = False
        self.done = False
        self.chunked = False
        self.head = b""
        self.watching: trio.CancelScope | None = None

    async def serve(self) -> None:
        """Requests until the connection closes or one is Hypercorn's (``HandOff``)."""
        while True:
            request = await self._next_request()
            if request is None:
                return
            self.requests += 1
            await self._exchange(request)
            conn = self.h11
            if (
                self.front.context.terminated.is_set()
                or conn.our_state is not h11.DONE
                or conn.their_state is not h11.DONE
            ):
                return  # a closed, refused, unfinished or last exchange: close
            conn.start_next_cycle()

    async def _next_request(self) -> h11.Request | None:
        """The next request head (None: close the connection), bounded like an idle
        connection in Hypercorn: ``--client-timeout`` (its keep-alive timeout), and the stop."""
        conn = self.h11
        front = self.front
        read = bytearray(conn.trailing_data[0])
        request: h11.Request | None = None
        with trio.move_on_after(self.config.keep_alive_timeout) as idle:
            front.idle.add(idle)
            try:
                if front.context.terminated.is_set():
                    return None
                while True:
                    try:
                        event = conn.next_event()
                    except h11.RemoteProtocolError as error:
                        await self._refuse(error.error_status_hint)
                        return None
                    if isinstance(event, h11.Request):
                        request = event
                        break
                    if event is not h11.NEED_DATA:
                        return None  # the client closed
                    data = await self._read()
                    read += data
                    conn.receive_data(data)
            finally:
                front.idle.discard(idle)
        if request is None:
            return None
        if not self._ours(request):
            raise HandOff(bytes(read))
        return request

    def _ours(self, request: h11.Request) -> bool:
        if request.method != b"POST" or request.http_version != b"1.1":
            return False
        if self.config.root_path or self.config.server_names:
            return False
        path = request.target.partition(b"?")[0]
        if path.decode("latin-1") not in FAST_ROUTES:
            return False  # also a percent-encoded path: Hypercorn decodes it
        length = False
        for name, _ in request.headers:
            if name in _HANDED_OFF:
                return False
            if name == b"content-length":
                length = True
        return length

    async def _refuse(self, status: int) -> None:
        """Hypercorn's answer to a head h11 cannot take, sent as it sends it."""
        conn = self.h11
        if conn.our_state not in {h11.IDLE, h11.SEND_RESPONSE}:
            return
        headers = [(b"content-length", b"0"), (b"connection", b"close")]
        response = h11.Response(
            status_code=status, headers=[*headers, *self.config.response_headers("h11")]
        )
        try:
            data = (conn.send(response) or b"") + (conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            if conn.their_state is not h11.ERROR:
                raise
            return
        await self._write(data)

    async def _exchange(self, request: h11.Request) -> None:
        path, _, query = request.target.partition(b"?")
        scope = {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": "POST",
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query,
            "root_path": self.config.root_path,
            "headers": list(request.headers),
            "client": self.client,
            "server": self.server,
            "state": self.state.copy(),
            "extensions": {BODY_WRITER: self.write_body},
        }
        self.body_done = self.gone = self.started = self.done = self.chunked = False
        self.head = b""
        try:
            await self.front.app(scope, self.receive, self.send)
        except Exception:
            # As Hypercorn treats an app that raised: logged, and a 500 if nothing was sent.
            await self.config.log.exception("Error in ASGI Framework")
        if not self.started and not self.gone:
            await self._refuse(500)
        elif self.head and not self.done and not self.gone:
            # The app started an answer and returned without a body: its head still goes
            # out, and the connection then closes on the unfinished answer.
            await self._write(self.head)

    async def receive(self) -> dict[str, Any]:
        """The body as h11 reads it, then the client's disconnect."""
        if self.gone:
            return {"type": "http.disconnect"}
        conn = self.h11
        if not self.body_done:
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Data):
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if isinstance(event, h11.EndOfMessage):
                    self.body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                data = await self._read()
                if not data:
                    self.gone = True
                    return {"type": "http.disconnect"}
                conn.receive_data(data)
        # The body is read: wait for the client to leave, keeping what it sends meanwhile
        # (a pipelined request) for the next exchange.
        with trio.CancelScope() as self.watching:
            while len(conn.trailing_data[0]) <= self.config.h11_max_incomplete_size:
                data = await self._read()
                if not data:
                    self.gone = True
                    return {"type": "http.disconnect"}
                conn.receive_data(data)
            await trio.sleep_forever()
        self.gone = True  # the answer could not be written: the client has gone
        return {"type": "http.disconnect"}

    def unread(self) -> bool:
        """Whether the client may have sent bytes that were not read: a refused head, or a body
        the answer did not wait for (413, 408)."""
        return not self.gone and self.h11.their_state in (h11.ERROR, h11.SEND_BODY)

    async def linger(self) -> None:
        """Close our side, then read and drop what the client still sends, for up to
        ``LINGER_S``: closing a socket with unread bytes resets the connection, and a reset
        can reach the client before it has read the answer that explains it."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        with trio.move_on_after(LINGER_S):
            while await self._read():
                pass

    async def _read(self) -> bytes:
        """What the client sent (b"": it has gone). Bytes already waiting are returned at once,
        without the trip through trio's scheduler that ``receive_some`` takes after every read
        (as the upstream client does, backends/h1.py); the wait is trio's, and cancellable."""
        sock = self.sock
        while True:
            try:
                return sock.recv(MAX_RECV)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
            except OSError:
                return b""

    async def send(self, message: dict[str, Any]) -> None:
        if self.done or self.gone:
            return  # as Hypercorn ignores what is sent after the end or the client's leaving
        if message["type"] == "http.response.body" and self.chunked:
            # The hot path: one write per relayed chunk, framed here.
            body = message.get("body", b"")
            more = message.get("more_body", False)
            out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
            if self.head:
                out, self.head = self.head + out, b""
            if not more:
                out += self.h11.send(h11.EndOfMessage()) or b""
                self.done = True
            if out:
                await self._write(out)
            return
        if message["type"] == "http.response.start" and not self.started:
            self._start(message)
            if self.chunked:
                # A streamed answer's head goes out at once, as Hypercorn sends it: the client
                # reads it while the backend works on the first token. Held for the first
                # chunk, it was read after that token, and counted in the client's TTFT.
                head, self.head = self.head, b""
                await self._write(head)
        elif message["type"] == "http.response.body" and self.started:
            conn = self.h11
            out = self.head + (conn.send(h11.Data(data=bytes(message.get("body", b"")))) or b"")
            self.head = b""
            if not message.get("more_body", False):
                out += conn.send(h11.EndOfMessage()) or b""
                self.done = True
            await self._write(out)
        else:
            raise RuntimeError(f"unexpected ASGI message {message['type']!r}")

    async def write_body(self, body: bytes) -> None:
        """``send`` of a body with more to come, without the message (``BODY_WRITER``): the
        relay's hot path, one write per relayed chunk, framed here."""
        if self.done or self.gone:
            return
        if not self.chunked:
            await self.send({"type": "http.response.body", "body": body, "more_body": True})
            return
        out = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
        if self.head:
            out, self.head = self.head + out, b""
        if out:
            await self._write(out)

    def _start(self, message: dict[str, Any]) -> None:
        """The response head, as Hypercorn writes it: sent with the whole body of an answer
        of known length, at once for a streamed one."""
        self.started = True
        status = int(message["status"])
        headers = [(bytes(n).strip(), bytes(v).strip()) for n, v in message.get("headers", [])]
        extra = self.config.response_headers("h11")
        if self.requests >= self.config.keep_alive_max_requests:
            extra.append((b"connection", b"close"))
        self.head = (
            self.h11.send(h11.Response(status_code=status, headers=list(chain(headers, extra))))
            or b""
        )
        # h11 frames a body without a length as chunks (the request is HTTP/1.1); such a body
        # is framed here, chunk by chunk, and h11 only writes its end.
        self.chunked = status not in (204, 304) and not any(
            n.lower() == b"content-length" for n, _ in headers
        )

    async def _write(self, data: bytes) -> None:
        """All of ``data``, written straight to the socket; waits (trio's) only while the
        kernel's buffer is full, which is the backpressure a slow reader puts on the relay."""
        sock = self.sock
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[sock.send(view) :]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)
            self.writes += 1
            if self.writes % YIELD_EVERY == 0:
                # Neither this write nor the upstream read that found bytes waiting yields:
                # a stream that never waits would otherwise hold the loop (and not see a
                # cancellation) for as long as its backend keeps up.
                await trio.lowlevel.checkpoint()
        except OSError:
            self.gone = True
            if self.watching is not None:
                self.watching.cancel()  # the exchange's watcher reports the disconnect


async def serve_front(
    app: ASGIApp,
    config: HypercornConfig,
    listener: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the bound socket ``listener`` until ``shutdown_trigger`` returns, as
    ``hypercorn.trio.serve`` would: lifespan startup, ``started(binds)``, then on the trigger
    stop accepting, close idle connections and give the rest ``config.graceful_timeout``
    (read when the trigger returns), then lifespan shutdown."""
    lifespan_state: LifespanState = {}
    context = WorkerContext(None)
    front = Front(app, config, context, lifespan_state)
    lifespan = Lifespan(front.wrapped, config, lifespan_state)
    binds = [f"http://{repr_socket_addr(listener.family, listener.getsockname())}"]
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(_accept, front, listener, connections)
                task_status.started(binds)
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            trio.lowlevel.notify_closing(listener)
            listener.close()  # stop listening
            await context.terminated.set()
            front.close_idle()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


#: accept() errors that mean "out of resources for now": wait and accept again, as trio's
#: ``serve_listeners`` does, rather than stop serving.
_ACCEPT_LATER = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_SLEEP_S = 0.1


async def _accept(front: Front, listener: socket.socket, connections: trio.Nursery) -> None:
    # The out-of-resource errors other than descriptors (memory, buffers) are told once a
    # minute: the loop retries ten times a second while they last.
    told_errors = CauseLog()
    while True:
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            await trio.lowlevel.wait_readable(listener)
            continue
        except OSError as error:
            if error.errno not in _ACCEPT_LATER:
                await trio.lowlevel.checkpoint()
                continue  # one connection failed (e.g. reset while queued): the next one
            if error.errno in descriptors.OUT_ERRNOS:
                descriptors.note_out("accepting a connection", error)
            else:
                told = told_errors.note(error.errno, str(error), trio.current_time())
                if told is not None:
                    log.error(
                        "accept failed (%s), %d times since the last line; accepting again "
                        "every %s s while it lasts",
                        error,
                        told.count,
                        _ACCEPT_SLEEP_S,
                    )
            await trio.sleep(_ACCEPT_SLEEP_S)
            continue
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connections.start_soon(front.handle, sock)
        # accept() that finds a connection waiting does not yield: a flood of connections
        # (or an error that repeats) would otherwise hold the loop and its cancellation.
        await trio.lowlevel.checkpoint()
