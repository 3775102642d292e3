"""A lean HTTP/1.1 client for the relay: what ``HttpBackend`` sends its POSTs to plain-HTTP
backends with (the LLM calls and their streams).

Why not httpx here: reading one streamed chunk through httpx and httpcore costs about three
times what the same read costs on a trio socket (``docs/BENCHMARKS.md``, "Where a relayed chunk
goes"): five generator layers, two context managers and a cancel scope per read, and a pool that
scans every connection it holds on each request. This client keeps what the relay needs and no
more: one request on one keep-alive connection at a time, the response head parsed once, and the
body de-chunked straight out of the socket's reads, so that whatever a read brought (one chunk or
ten, under load) goes downstream as one piece. httpx still serves HTTPS backends and every other
method (the poller's GETs, the passthrough's).

Errors are the ``BackendError`` tree, as everywhere past ``backends/``: a refused or dropped
connection is ``BackendUnavailable``, a malformed answer ``BackendProtocolError``, a connect
that does not complete in time ``BackendTimeout``, and a connection the proxy cannot open for
want of a file descriptor ``OutOfDescriptors`` (the proxy's trouble, not the backend's). Read
deadlines are the gateway's.
"""

from __future__ import annotations

import base64
import errno
import os
import re
import socket
from collections.abc import AsyncIterator, Sequence
from urllib.parse import unquote, urlsplit

import trio

from .. import descriptors
from ..errors import BackendProtocolError, BackendTimeout, BackendUnavailable, OutOfDescriptors
from ..urls import redact_url
from .base import UpstreamRequest

#: Bytes asked of the socket per read: many chunks of a stream that fell behind.
READ_SIZE = 65536
#: Largest response head read (status line and headers).
MAX_HEAD = 64 * 1024
#: Largest chunk-size line (with its extensions) or trailer line.
MAX_LINE = 4096
#: An idle connection older than this is closed, not reused: servers close theirs after a few
#: seconds (uvicorn, under vLLM and SGLang, after 5), and a request sent as they do is lost.
KEEPALIVE_S = 4.0

_HEX = re.compile(rb"[0-9A-Fa-f]+")
#: Request headers this client writes itself.
_OWN = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
_NO_BODY_STATUS = frozenset({204, 304})


class _Dropped(Exception):
    """The server closed the connection; ``received`` says whether any answer came first."""

    def __init__(self, received: bool) -> None:
        self.received = received


class Connection:
    """One non-blocking socket, read and written without trio's stream layers. A read that
    finds bytes waiting returns them at once; trio's ``receive_some`` would also yield to the
    scheduler after every successful read (a round trip per chunk). Waits are trio's own
    ``wait_readable`` / ``wait_writable``, so cancellation works as everywhere else."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address found for {host}")
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                code = sock.connect_ex(address)
                if code == errno.EINPROGRESS:
                    await trio.lowlevel.wait_writable(sock)
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
                return cls(sock)
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    async def receive(self, size: int, deadline: float | None = None) -> bytes:
        """Up to ``size`` bytes, at once if some are waiting; else the wait for them, which
        raises trio.TooSlowError at ``deadline`` (only a wait needs a cancel scope: the relay
        reads a stream that fell behind without one)."""
        while True:
            try:
                return self.sock.recv(size)
            except BlockingIOError:
                if deadline is None:
                    await trio.lowlevel.wait_readable(self.sock)
                    continue
                with trio.CancelScope(deadline=deadline) as scope:
                    await trio.lowlevel.wait_readable(self.sock)
                if scope.cancelled_caught:
                    raise trio.TooSlowError from None

    def receive_ready(self, size: int) -> bytes | None:
        """Up to ``size`` bytes if some are waiting (b"" at the end of the stream), else None."""
        try:
            return self.sock.recv(size)
        except BlockingIOError:
            return None

    async def receive_after_wait(self, size: int, deadline: float | None) -> bytes:
        """``receive`` for a caller that just found nothing waiting: the wait comes first,
        without a second read that would find nothing again."""
        while True:
            if deadline is None:
                await trio.lowlevel.wait_readable(self.sock)
            else:
                with trio.CancelScope(deadline=deadline) as scope:
                    await trio.lowlevel.wait_readable(self.sock)
                if scope.cancelled_caught:
                    raise trio.TooSlowError
            try:
                return self.sock.recv(size)
            except BlockingIOError:
                continue  # woken without bytes: wait again

    async def send_all(self, *parts: bytes) -> None:
        """Every byte of ``parts``, in order, gathered by the kernel (a request's head and a
        body of hundreds of kilobytes are not first copied into one)."""
        views = [memoryview(part) for part in parts if part]
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]

    def closed_by_peer(self) -> bool:
        """Whether an idle connection was closed (or written to) by the server meanwhile."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False  # nothing to read: still open
        except OSError:
            return True
        return True  # the end of the stream, or bytes nobody asked for

    def close(self) -> None:
        # Synchronous on purpose: the paths that close a connection are often being cancelled
        # (the client left).
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()


class ChunkedDecoder:
    """De-chunks ``Transfer-Encoding: chunked`` bytes fed in any splits: ``feed`` returns the
    payload of every piece complete so far, joined; ``done`` once the last chunk and trailers
    have passed. Raises ValueError on malformed framing."""

    _SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._state = self._SIZE
        self._left = 0
        #: Bytes that came after the end of the body (the connection cannot be reused).
        self.extra = False

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer
        if not buffer:
            if self._state == self._SIZE:
                # The common case of a stream read between chunks: one read, one whole chunk
                # (a bare hex size, its data, CRLF): its data is sliced out, nothing copied
                # into the buffer. Anything else (several chunks, extensions, a split) goes on.
                end = data.find(b"\r\n", 0, MAX_LINE)
                if end > 0 and _HEX.fullmatch(data, 0, end):
                    length = int(data[:end], 16)
                    stop = end + 2 + length
                    if length and len(data) == stop + 2 and data.endswith(b"\r\n"):
                        return data[end + 2 : stop]
            elif self._state == self._DATA and len(data) <= self._left:
                # A stream read mid-chunk: no copy at all.
                self._left -= len(data)
                if not self._left:
                    self._state = self._DATA_END
                return data
        buffer += data
        out: list[bytes] = []
        pos = 0
        end_of_buffer = len(buffer)
        while True:
            state = self._state
            if state == self._DATA:
                take = min(self._left, end_of_buffer - pos)
                if take:
                    out.append(bytes(buffer[pos : pos + take]))
                    pos += take
                    self._left -= take
                if self._left:
                    break
                self._state = self._DATA_END
            elif state == self._DATA_END:
                if end_of_buffer - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                pos += 2
                self._state = self._SIZE
            elif state == self._SIZE or state == self._TRAILER:
                end = buffer.find(b"\r\n", pos)
                if end < 0:
                    if end_of_buffer - pos > MAX_LINE:
                        raise ValueError("chunk-size or trailer line too long")
                    break
                line = bytes(buffer[pos:end])
                pos = end + 2
                if state == self._TRAILER:
                    if not line:
                        self._state = self._DONE
                    continue
                size = line.split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size):
                    raise ValueError(f"bad chunk size {size[:20]!r}")
                self._left = int(size, 16)
                self._state = self._DATA if self._left else self._TRAILER
            else:  # done
                if pos < end_of_buffer:
                    self.extra = True
                pos = end_of_buffer
                break
        del buffer[:pos]
        return b"".join(out) if len(out) != 1 else out[0]


class H1Response:
    """A response whose head has been read; the body is read by ``aiter_raw`` or ``aread``."""

    def __init__(
        self,
        pool: H1Pool,
        stream: Connection,
        status_code: int,
        headers: list[tuple[str, str]],
        rest: bytes,
        *,
        reusable: bool,
        length: int | None,
        chunked: bool,
    ) -> None:
        self._pool = pool
        self._stream: Connection | None = stream
        self.status_code = status_code
        self._headers = headers
        self._rest = rest  # body bytes that came with the head
        self._reusable = reusable
        self._length = length  # None: chunked or until the connection closes
        self._chunked = ChunkedDecoder() if chunked else None
        self._complete = length == 0 and not chunked
        if self._complete:
            self._reusable = reusable and not rest  # bytes after an empty body: not HTTP
            self._release()

    @property
    def headers(self) -> Sequence[tuple[str, str]]:
        return self._headers

    async def aiter_raw(self, read_timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body as the socket delivers it, de-chunked: one piece per read. With a
        ``read_timeout``, each piece must come within that many seconds of the wait for it
        starting (at once when it is asked for and not there yet), else trio.TooSlowError (the
        gateway's read deadline, kept here where the waits are)."""
        data = self._rest
        self._rest = b""
        decoder = self._chunked
        # The deadline starts when a piece must be waited for (not when it is asked for:
        # the clock is read only where the relay waits, not for every piece that was there).
        deadline: float | None = None
        while not self._complete:
            if data:
                if decoder is not None:
                    try:
                        out = decoder.feed(data)
                    except ValueError as exc:
                        self._abort()
                        raise self._pool.malformed(f"bad chunked body ({exc})") from None
                    if decoder.done:
                        self._complete = True
                        self._reusable = self._reusable and not decoder.extra
                elif self._length is not None:
                    out = data[: self._length]
                    self._length -= len(out)
                    if self._length == 0:
                        self._complete = True
                        self._reusable = self._reusable and len(out) == len(data)
                else:
                    out = data
                if self._complete:
                    self._release()
                if out:
                    yield out
                    deadline = None
                if self._complete:
                    return
            stream = self._stream
            if stream is None:
                raise self._pool.unavailable("the response was closed before its end")
            try:
                ready = stream.receive_ready(READ_SIZE)
                if ready is None:
                    if deadline is None and read_timeout is not None:
                        deadline = trio.current_time() + read_timeout
                    data = await stream.receive_after_wait(READ_SIZE, deadline)
                else:
                    data = ready
            except (OSError, trio.ClosedResourceError):
                self._abort()
                raise self._pool.unavailable("dropped the connection") from None
            if not data:
                if decoder is None and self._length is None:
                    self._complete = True  # a body delimited by the connection's close
                    self._reusable = False
                    self._release()
                    return
                self._abort()
                raise self._pool.unavailable("dropped the connection mid-answer")

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        return b"".join(parts)

    async def aclose(self) -> None:
        # An answer not read to its end closes its connection: that is how the backend learns
        # to abort the request (vLLM frees its KV blocks).
        if not self._complete:
            self._abort()

    def _release(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            self._pool.release(stream, reusable=self._reusable)

    def _abort(self) -> None:
        self._complete = True
        self._reusable = False
        self._release()


def _header_encoding(headers: list[tuple[bytes, bytes]]) -> str:
    """How the answer's header values are read as text: as httpx reads them (ASCII, else UTF-8
    if every value is, else latin-1), so a header relayed to the client keeps its bytes."""
    for encoding in ("ascii", "utf-8"):
        try:
            for _, value in headers:
                value.decode(encoding)
        except UnicodeDecodeError:
            continue
        return encoding
    return "latin-1"


def out_of_descriptors(backend: str, error: OSError) -> OutOfDescriptors:
    """The error for a connection to ``backend`` the proxy could not open for want of a file
    descriptor: counted and logged (once a minute) as the proxy's own trouble, not the
    backend's (``descriptors.py``)."""
    descriptors.note_out(f"connecting to {backend}", error)
    return OutOfDescriptors(
        f"The proxy is out of file descriptors ({os.strerror(error.errno or 0)}) and could not "
        f"open a connection to backend {backend}, which is not at fault. Retry shortly; the "
        "operator should raise the proxy's limit (ulimit -n, systemd's LimitNOFILE=).",
        backend=backend,
    )


class H1Pool:
    """Keep-alive connections to one backend, ``max_connections`` requests at a time."""

    def __init__(self, url: str, *, connect_timeout: float, max_connections: int) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"H1Pool speaks plain HTTP only, not {redact_url(url)}")
        self.name = redact_url(url)
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        netloc = parts.netloc.rsplit("@", 1)[-1]
        head = f"host: {netloc}\r\n"
        #: Headers of the request not sent as the client gave them: the ones this pool writes.
        self._own = _OWN
        if parts.username is not None or parts.password is not None:
            secret = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            head += f"authorization: Basic {base64.b64encode(secret.encode()).decode()}\r\n"
            # The backend's credentials win: a second Authorization (an SDK always sends its
            # key) makes nginx and most servers answer 400, whichever one they would accept.
            self._own = _OWN | {"authorization"}
        self._fixed = head.encode("latin-1")
        self.connect_timeout = connect_timeout
        self._slots = trio.Semaphore(max_connections)
        #: Idle connections, the most recently used last, with when each became idle.
        self._idle: list[tuple[Connection, float]] = []
        self.closed = False

    def unavailable(self, what: str) -> BackendUnavailable:
        return BackendUnavailable(
            f"Backend {self.name} is unreachable or {what}; check that it is running.",
            backend=self.name,
        )

    def malformed(self, what: str) -> BackendProtocolError:
        return BackendProtocolError(
            f"Backend {self.name} sent a malformed HTTP answer: {what}.", backend=self.name
        )

    def head(self, request: UpstreamRequest) -> bytes:
        lines = [f"{request.method} {self.prefix}{request.target} HTTP/1.1\r\n".encode("latin-1")]
        lines.append(self._fixed)
        for name, value in request.headers:
            if name.lower() in self._own:
                continue
            # The bytes the client sent: the server decoded them as latin-1.
            raw = name.encode("latin-1", "replace") + b": " + value.encode("latin-1", "replace")
            if b"\r" in raw or b"\n" in raw or b"\0" in raw:
                raise BackendProtocolError(
                    f"Header {name!r} holds a line break and cannot be sent to {self.name}.",
                    backend=self.name,
                )
            lines.append(raw + b"\r\n")
        if request.content or request.method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: %d\r\n" % len(request.content))
        lines.append(b"\r\n")
        return b"".join(lines)

    async def send(self, request: UpstreamRequest) -> H1Response:
        head = self.head(request)
        try:
            # A free slot is taken without the checkpoint ``acquire`` always makes: that trip
            # through trio's scheduler put each call behind every task ready at that moment
            # (at 32 streams, about half a millisecond of other streams' chunks and calls'
            # ends) before its request went out. The call waits in the head read anyway.
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        try:
            while True:
                stream, reused = await self._connection()
                try:
                    try:
                        await stream.send_all(head, request.content)
                    except OSError:
                        raise _Dropped(False) from None
                    return await self._read_head(stream, request.method)
                except _Dropped as dropped:
                    stream.close()
                    if reused and not dropped.received:
                        continue  # closed while idle, before it read this request: retry once
                    raise self.unavailable("dropped the connection") from None
                except BaseException:
                    stream.close()
                    raise
        except BaseException:
            self._slots.release()
            raise

    async def _connection(self) -> tuple[Connection, bool]:
        now = trio.current_time()
        while self._idle:
            stream, since = self._idle.pop()
            # Readable while idle: the server closed it (or broke the protocol).
            if now - since < KEEPALIVE_S and not stream.closed_by_peer():
                return stream, True
            stream.close()
        try:
            with trio.fail_after(self.connect_timeout):
                return await Connection.open(self.host, self.port), False
        except trio.TooSlowError:
            raise BackendTimeout(
                f"Backend {self.name} did not accept a connection within "
                f"{self.connect_timeout} s; check that it is running.",
                backend=self.name,
            ) from None
        except OSError as exc:
            if exc.errno in descriptors.OUT_ERRNOS:
                raise out_of_descriptors(self.name, exc) from None
            raise self.unavailable(f"refused the connection ({exc.strerror or exc})") from None

    async def _read_head(self, stream: Connection, method: str) -> H1Response:
        buffer = b""
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD:
                    raise self.malformed(f"a response head over {MAX_HEAD} bytes")
                try:
                    data = await stream.receive(READ_SIZE)
                except (OSError, trio.ClosedResourceError):
                    raise _Dropped(bool(buffer)) from None
                if not data:
                    raise _Dropped(bool(buffer))
                buffer += data
                continue
            head, buffer = buffer[:end], buffer[end + 4 :]
            response = self._response(stream, head, buffer, method)
            if response is not None:
                return response
            # An interim 1xx answer: the real one follows.

    def _response(
        self, stream: Connection, head: bytes, rest: bytes, method: str
    ) -> H1Response | None:
        lines = head.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise self.malformed(f"status line {lines[0][:40]!r}")
        try:
            status = int(status_line[1])
        except ValueError:
            raise self.malformed(f"status line {lines[0][:40]!r}") from None
        if 100 <= status < 200:
            return None
        raw: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise self.malformed(f"header line {line[:40]!r}")
            raw.append((name.lower(), value.strip()))
        encoding = _header_encoding(raw)
        headers = [(k.decode("latin-1"), v.decode(encoding)) for k, v in raw]
        length: int | None = None
        chunked = False
        reusable = status_line[0] == b"HTTP/1.1"
        for key, text in headers:
            if key == "content-length":
                if not text.isdigit() or (length is not None and int(text) != length):
                    raise self.malformed(f"content-length {text[:20]!r}")
                length = int(text)
            elif key == "transfer-encoding":
                chunked = text.lower().rsplit(",", 1)[-1].strip() == "chunked"
                if not chunked:
                    raise self.malformed(f"transfer-encoding {text[:40]!r}")
            elif key == "connection" and "close" in text.lower():
                reusable = False
        if method == "HEAD" or status in _NO_BODY_STATUS:
            length, chunked = 0, False
        elif chunked:
            length = None
        elif length is None:
            reusable = False  # the body ends when the connection closes
        return H1Response(
            self,
            stream,
            status,
            headers,
            rest,
            reusable=reusable,
            length=length,
            chunked=chunked,
        )

    def release(self, stream: Connection, *, reusable: bool) -> None:
        """A response is done with ``stream``: keep it for the next request, or close it."""
        self._slots.release()
        if reusable and not self.closed:
            self._idle.append((stream, trio.current_time()))
        else:
            stream.close()

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop()[0].close()
