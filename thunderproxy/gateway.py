"""The call gateway: the one owner of an LLM call.

Every completion the proxy makes goes through :meth:`Gateway.open` (or its context-manager form
:meth:`Gateway.call`), whoever asks for it: the HTTP routes, the benchmark's agents in real or
virtual time, jobs that run inside the proxy. For each :class:`Call` it runs, in order:

1. the model's group: which backends serve ``call.model`` (an unknown model is refused);
2. admission (a stage that rate limits plug into; it admits everything by default);
3. the scheduler's lease: the program's policy decides whether the call goes out now or waits;
4. ``backend.send`` on the leased backend, within ``first_byte_timeout``;

and hands back an :class:`Exchange`, which relays the answer (reading usage on the way through
the call's :class:`Wire`) and, when it ends in any way, closes the lease exactly once, reports
the outcome to the backend's health and records the call's ``steps`` row. A call refused before
any backend saw it is recorded in ``rejections`` instead. From the moment a call is handed to
the gateway, nothing else records it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

import trio

from .audit import AuditLog, StepRecord
from .audit.records import RejectionRecord
from .backends import BackendNode, BackendPool, UpstreamRequest, UpstreamResponse, header
from .backends.h1 import H1Response
from .backends.pool import Route
from .causes import CauseLog, Told
from .errors import (
    BackendError,
    BackendProtocolError,
    BackendTimeout,
    ModelNotFound,
    ProxyStopping,
    ThunderproxyError,
    describe,
)
from .programs import StepUsage
from .programs.profile import Profiles
from .scheduling import Scheduler, StepLease
from .scheduling.classes import named_class

log = logging.getLogger("thunderproxy.gateway")

#: Status recorded for a call whose client went away before it ended (nginx's convention).
CLIENT_CLOSED = 499


def _at_boundary(relayed_tail: bytes) -> bytes:
    """What to send before an in-band error event so that it starts an event of its own: a
    blank line when the relayed bytes stopped in the middle of an event, else nothing."""
    if not relayed_tail or re.search(rb"\r?\n\r?\n\Z", relayed_tail):
        return b""
    return b"\n\n"


def backend_message(text: str | None) -> str:
    """The message of a backend's error answer (OpenAI's, Anthropic's or vLLM's JSON), else the
    answer's text, on one line and cut to 300 characters."""
    message: Any = text or ""
    try:
        payload = json.loads(message)
    except (ValueError, RecursionError):
        payload = None
    if isinstance(payload, dict):
        inner = payload.get("error")
        found = inner.get("message") if isinstance(inner, dict) else inner
        message = found if isinstance(found, str) else payload.get("message") or message
    return " ".join(str(message).split())[:300] or "(no message)"


def _calls(told: Told) -> str:
    """``3 calls in the last 61 s`` / ``1 call``: what a refusal line covers."""
    since = "" if told.since_s is None else f" in the last {told.since_s:.0f} s"
    return f"{told.count} call{'' if told.count == 1 else 's'}{since}"


def header_safe(value: str) -> str:
    """``value`` as an HTTP header value: program ids may hold any character, headers may not."""
    if value.isascii() and value.isprintable():
        return value
    return quote(value, safe="")


class Tap(Protocol):
    """Reads usage out of a streamed answer (and may hide what the client did not ask for)."""

    usage: StepUsage | None
    error: str | None
    #: The protocol's end-of-stream event has passed.
    complete: bool

    @property
    def overflowed(self) -> bool:
        """One event grew past the tap's bound: the stream is a backend fault."""
        ...

    #: The stream has carried generated output (not only a role chunk or a start event).
    content_started: bool

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class Wire(Protocol):
    """One API's wire format, as far as the gateway needs it."""

    def tap(self, call: Call) -> Tap: ...

    def usage_from_body(self, body: bytes) -> tuple[StepUsage | None, str | None]:
        """Usage of a whole (non-streamed) answer, and a note when the counts were refused or
        clamped; raises ValueError if it is not JSON."""
        ...

    def error_event(self, error: ThunderproxyError) -> bytes:
        """How a stream that already answered 200 ends when the call fails mid-way."""
        ...


if TYPE_CHECKING:
    from .protocols import Protocol as WireProtocol
    from .protocols import ProtocolWire

    # Never run: it makes the type checker prove that ProtocolWire is the gateway's Wire.
    _WIRE: Wire = ProtocolWire(WireProtocol.CHAT)


@dataclass
class Admitted:
    """What admission hands back for an admitted call: the served model to send it to when
    admission chose one (an alias's fallback), else None; implementations add what they must
    settle in ``done``."""

    served: str | None = None


class Admission(Protocol):
    async def admit(self, call: Call, now: float) -> Admitted:
        """Return to admit ``call``; raise a ThunderproxyError to refuse it."""
        ...

    def done(self, admitted: Admitted, usage: StepUsage | None, status: int, now: float) -> None:
        """Called once for every admitted call when it ends, however it ends (``usage`` None:
        nothing was reported), so reservations are settled."""
        ...


class AdmitAll:
    async def admit(self, call: Call, now: float) -> Admitted:
        return Admitted()

    def done(self, admitted: Admitted, usage: StepUsage | None, status: int, now: float) -> None:
        return None


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


@dataclass(frozen=True)
class Call:
    """One LLM call, protocol-neutral: what to send, for which program, since when."""

    program_id: str
    endpoint: str
    body: dict[str, Any]
    wire: Wire
    arrived_at: float
    model: str | None = None
    stream: bool = False
    headers: Sequence[tuple[str, str]] = ()
    #: Characters of prompt text: the token estimate for a program not measured yet.
    context_chars: int = 0
    #: The client did not ask for the usage chunk the proxy requested: hide it.
    hide_usage: bool = False
    method: str = "POST"
    #: How the call was tied to its program (protocols/recognition.py's Source), recorded on its
    #: steps row, and on its program's first transition when this call creates it.
    source: str | None = None
    #: For a prompt continuation (``prefix``, ``prompt_prefix``, ``edited_prefix``): how many
    #: messages matched.
    matched_messages: int | None = None
    #: The body (this one, or it with another model) as the bytes sent; an edge that kept the
    #: client's bytes sends them again for what did not change (http/body.py).
    encode: Callable[[dict[str, Any]], bytes] = field(default=_dumps, repr=False)
    #: The configured client that sent it (``[clients]``), recorded on its row; None: none.
    client: str | None = None
    #: The client's key headers, withheld from ``headers``: sent only to a backend set to
    #: receive them (``Gateway.key_receivers``).
    client_key: Sequence[tuple[str, str]] = field(default=(), repr=False)


@dataclass
class Exchange:
    """A call whose backend has answered: relay its body, then it records itself."""

    gateway: Gateway
    call: Call
    lease: StepLease
    response: UpstreamResponse
    admitted: Admitted = field(default_factory=Admitted)
    #: The model the call was sent to (``call.model`` unless a name went elsewhere).
    served: str | None = None
    first_token_at: float | None = None
    usage: StepUsage = field(default_factory=StepUsage)
    done: bool = False
    #: The status the call was recorded with, once it ended (a 200 may still fail mid-stream).
    outcome: int | None = None

    @property
    def status_code(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> Sequence[tuple[str, str]]:
        return self.response.headers

    @property
    def node(self) -> BackendNode:
        return self.lease.node

    @property
    def is_event_stream(self) -> bool:
        return (
            self.call.stream
            and self.status_code == 200
            and "text/event-stream" in header(self.response, "content-type")
        )

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """The answer's body as it arrives, usage read on the way. A backend that fails
        mid-way ends the stream with the wire's error event (the 200 is already out)."""
        tap = self.call.wire.tap(self.call)
        read_timeout = self.gateway.read_timeout
        # The relay's own client keeps the read deadline where it waits, and only when it
        # must wait; any other answer is read under a cancel scope per chunk, which costs as
        # much as the rest of a chunk's relay when the chunk was already there.
        timed = isinstance(self.response, H1Response)
        chunks = (
            self.response.aiter_raw(read_timeout)
            if isinstance(self.response, H1Response)
            else self.response.aiter_raw()
        )
        first_byte_at: float | None = None
        #: The last piece relayed, and the bytes before it (kept only while that piece is
        #: shorter than a boundary): an error event must not be glued to a half-sent event.
        #: The tail is cut from them only when an error needs it, not per chunk.
        last, before = b"", b""
        #: Bytes sent to the client so far, for the line that logs a cut answer.
        relayed = 0
        feed = tap.feed
        following = chunks.__anext__
        try:
            while True:
                error: BackendError | None = None
                try:
                    if timed:
                        chunk = await following()
                    else:
                        # A bare scope, not fail_after: fail_after's context-manager layers
                        # cost as much as the scope itself.
                        deadline = trio.current_time() + read_timeout
                        with trio.CancelScope(deadline=deadline) as scope:
                            chunk = await following()
                        if scope.cancelled_caught:
                            error = self.gateway.timeout(self.node)
                except StopAsyncIteration:
                    break
                except trio.TooSlowError:
                    error = self.gateway.timeout(self.node)
                except BackendError as exc:
                    error = exc
                if error is not None:
                    if tap.complete:
                        # The answer was whole: a connection lost after it is no fault, and
                        # what trailed it goes out as it came, as at a clean end.
                        tail = tap.flush()
                        if tail:
                            yield tail
                        return
                    self._take_usage(tap)
                    self.finish(describe(error)[0], error=error.message)
                    self._log_cut(relayed, error)
                    yield _at_boundary((before + last)[-4:]) + self.call.wire.error_event(error)
                    return
                if first_byte_at is None:
                    first_byte_at = trio.current_time()
                out = feed(chunk)
                # The first token is the first event with generated output: a Responses stream
                # sends response.created, a Messages stream message_start, before any prefill.
                if self.first_token_at is None and tap.content_started:
                    self.first_token_at = trio.current_time()
                if tap.complete:
                    if not self.done:
                        # The answer is whole: a client that hangs up on the end event before
                        # the connection closes has still been served all of it.
                        if self.first_token_at is None:
                            self.first_token_at = first_byte_at
                        self._take_usage(tap)
                        if tap.error is not None:
                            self._log_error_event(relayed, tap.error)
                        self.finish(self.status_code, error=tap.error)
                elif tap.overflowed:
                    # An event past the bound: a relay that kept buffering it could be made to
                    # hold any amount. The tap dropped it whole; end the stream cleanly, in-band.
                    if out:
                        yield out
                    yield self._overflow_end(tap, relayed + len(out))
                    return
                if out:
                    before = (before + last)[-4:] if len(out) < 4 else b""
                    last = out
                    relayed += len(out)
                    yield out
        finally:
            # The backend's own iterator is closed here, not left to the garbage collector.
            close = getattr(chunks, "aclose", None)
            if close is not None:
                with trio.CancelScope(shield=True):
                    await close()
        tail = tap.flush()
        if tap.overflowed and not self.done:
            yield self._overflow_end(tap, relayed)
            return
        if self.first_token_at is None:
            # An answer with no output at all (or one the tap could not read): its first byte.
            self.first_token_at = first_byte_at
        self._take_usage(tap)
        if tap.error is not None and not self.done:
            self._log_error_event(relayed, tap.error)
        self.finish(self.status_code, error=tap.error)
        if tail:
            yield tail

    def _overflow_end(self, tap: Tap, relayed: int) -> bytes:
        """The step and the client's error event for a stream whose event was too long (the
        tap relays complete events only, so the error event starts an event of its own)."""
        fault = BackendProtocolError(
            f"Backend {self.node.url} sent a stream event larger than the proxy relays "
            f"({tap.error}); ask for a shorter answer (fewer tokens, smaller tool results).",
            backend=self.node.url,
        )
        self.finish(describe(fault)[0], error=fault.message)
        self._log_cut(relayed, fault)
        return self.call.wire.error_event(fault)

    def _log_cut(self, relayed: int, error: BackendError) -> None:
        """One line per answer a backend cut mid-way: the client got an in-band error event
        after a 200, which its own log may not show."""
        log.warning(
            "backend %s cut call %s (program %s) mid-answer after %d bytes relayed: %s",
            self.node.url,
            self.lease.request_id,
            self.lease.program.program_id,
            relayed,
            error.message,
        )

    def _log_error_event(self, relayed: int, error: str) -> None:
        """One line per streamed answer that its backend ended with an error of its own (an
        engine fault mid-generation, an unreadable usage report): the call is recorded as the
        200 the client got, so only this line and the step's ``error`` say so."""
        log.warning(
            "backend %s ended call %s (program %s) with an error after %d bytes relayed: %s",
            self.node.url,
            self.lease.request_id,
            self.lease.program.program_id,
            relayed,
            error,
        )

    def _take_usage(self, tap: Tap) -> None:
        if tap.usage is not None:
            self.usage = tap.usage

    async def read(self) -> bytes:
        """The whole answer; its usage (or why it has none) is recorded."""
        try:
            with trio.fail_after(self.gateway.read_timeout):
                content = await self.response.aread()
        except trio.TooSlowError:
            timeout = self.gateway.timeout(self.node)
            self.finish(describe(timeout)[0], error=timeout.message)
            raise timeout from None
        except BackendError as exc:
            self.finish(describe(exc)[0], error=exc.message)
            raise
        finally:
            await self.response.aclose()
        error = None
        if self.status_code == 200:
            try:
                usage, error = self.call.wire.usage_from_body(content)
                self.usage = usage or StepUsage()
            except (ValueError, RecursionError):
                error = "backend answered 200 with a body that is not JSON"
        else:
            error = content[:500].decode("utf-8", "replace")
        self.finish(self.status_code, error=error)
        return content

    def finish(self, status: int, *, error: str | None = None) -> None:
        """Record the call's outcome (only the first time)."""
        if self.done:
            return
        self.done = True
        self.outcome = status
        self.gateway.finish(self, status, error)

    async def aclose(self) -> None:
        """The exchange is over, however it went: a call not finished yet lost its client
        (499), or the proxy stopped before it could end (503)."""
        await self.response.aclose()
        if not self.done:
            status, message = self.gateway.cut_outcome()
            self.finish(status, error=message)


class Gateway:
    """Owns every LLM call: groups, admission, lease, send, and the record of how it went."""

    def __init__(
        self,
        *,
        pool: BackendPool,
        scheduler: Scheduler,
        audit: AuditLog,
        profiles: Profiles,
        first_byte_timeout: float = 600.0,
        read_timeout: float = 300.0,
        admission: Admission | None = None,
        key_receivers: frozenset[str] = frozenset(),
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.audit = audit
        self.profiles = profiles
        self.first_byte_timeout = first_byte_timeout
        self.read_timeout = read_timeout
        self.admission: Admission = admission or AdmitAll()
        #: Shown URLs of the backends that are sent a client's own key (``[clients]``
        #: ``forward_key_to``); every other backend gets the call without it.
        self.key_receivers = key_receivers
        #: Set when the proxy begins to shut down: calls cut from then on are not the
        #: client's doing.
        self.stopping = False
        #: Refusals told in the log: one line per cause a minute, never one per call.
        self.refusals = CauseLog()

    @asynccontextmanager
    async def call(self, call: Call) -> AsyncIterator[Exchange]:
        """``async with gateway.call(c) as exchange:`` read ``exchange.stream()`` or ``read()``."""
        exchange = await self.open(call)
        try:
            yield exchange
        finally:
            await exchange.aclose()

    async def open(self, call: Call) -> Exchange:
        """Run ``call`` up to the backend's answer. Raises the ThunderproxyError that refused
        or failed it (already recorded), or Cancelled if the caller went away meanwhile."""
        admitted: Admitted | None = None
        try:
            route = self.pool.route(call.model)
            admitted = await self.admission.admit(call, trio.current_time())
            if admitted.served is not None and admitted.served != route.served:
                # Admission pinned this program to another model of the alias's chain.
                route = Route(call.model, admitted.served, self.pool.route(admitted.served).nodes)
            lease = await self.scheduler.lease(
                call.program_id,
                route,
                arrived_at=call.arrived_at,
                context_chars=call.context_chars,
                source=call.source,
                program_class=named_class(call.body, call.headers),
                client=call.client,
            )
        except ThunderproxyError as exc:
            self._reject(call, exc)
            if admitted is not None:
                self.admission.done(admitted, None, describe(exc)[0], trio.current_time())
            raise
        except trio.Cancelled:
            self._never_sent(call)
            if admitted is not None:
                self.admission.done(admitted, None, self.cut_outcome()[0], trio.current_time())
            raise
        body = call.body
        served = route.served
        if served is not None and served != call.model:
            body = {**body, "model": served}  # an alias: the backend knows the served name
        headers = self.upstream_headers(lease.node, call.headers, call.client_key)
        if not any(name.lower() == "x-request-id" for name, _ in headers):
            # <program>-<step> names the call in vLLM's logs and the simulator's accounting.
            headers.append(("x-request-id", header_safe(lease.request_id)))
        request = UpstreamRequest(call.method, call.endpoint, headers, call.encode(body))
        try:
            response = await self.send(lease.node, request)
        except BackendError as exc:
            self._close(
                lease, call, describe(exc)[0], exc.message, admitted=admitted, served=served
            )
            raise
        except BaseException:
            status, message = self.cut_outcome()
            self._close(lease, call, status, message, admitted=admitted, served=served)
            raise
        return Exchange(self, call, lease, response, admitted, served)

    def upstream_headers(
        self,
        node: BackendNode,
        headers: Sequence[tuple[str, str]],
        client_key: Sequence[tuple[str, str]],
    ) -> list[tuple[str, str]]:
        """What goes to ``node``: ``headers``, and the client's withheld key headers only if
        ``node`` is set to receive them."""
        if client_key and node.url in self.key_receivers:
            return [*headers, *client_key]
        return list(headers)

    async def send(self, node: BackendNode, request: UpstreamRequest) -> UpstreamResponse:
        """``request`` to ``node`` until its answer starts (within ``first_byte_timeout``),
        the outcome reported to the node's health: the one way anything reaches a backend for
        a client (calls here, and the passthrough)."""
        try:
            # A bare scope, as in ``Exchange.stream``: fail_after's context-manager layers cost
            # as much as the scope itself, on every call.
            with trio.CancelScope(deadline=trio.current_time() + self.first_byte_timeout) as scope:
                response = await node.backend.send(request)
        except BackendError as exc:
            node.health.failed(exc)
            raise
        if scope.cancelled_caught:
            error = self.timeout(node)
            node.health.failed(error)
            raise error
        node.health.answered(response.status_code)
        return response

    def timeout(self, node: BackendNode) -> BackendError:
        return BackendTimeout(
            f"Backend {node.url} did not answer in time; it may be overloaded or hung "
            "(see --first-byte-timeout and --read-timeout).",
            backend=node.url,
        )

    def cut_outcome(self) -> tuple[int, str]:
        """Status and error of a call ended from outside: the client left (499), or the proxy
        began stopping first (503)."""
        if self.stopping:
            return describe(ProxyStopping(""))[0], "the proxy stopped before the call ended"
        return CLIENT_CLOSED, "client closed the connection before the response ended"

    def finish(self, exchange: Exchange, status: int, error: str | None) -> None:
        if 400 <= status < 500 and status == exchange.status_code:
            self._tell_backend_refused(exchange.node.url, status, backend_message(error))
        self._close(
            exchange.lease,
            exchange.call,
            status,
            error,
            usage=exchange.usage,
            first_token_at=exchange.first_token_at,
            admitted=exchange.admitted,
            served=exchange.served,
        )

    def _close(
        self,
        lease: StepLease,
        call: Call,
        status: int,
        error: str | None,
        *,
        usage: StepUsage | None = None,
        first_token_at: float | None = None,
        admitted: Admitted | None = None,
        served: str | None = None,
    ) -> None:
        if admitted is not None:
            # Settled before the lease, whether or not this close is the first: a reservation
            # must never be left held (the admission stage ignores a second settle).
            reported = usage if usage is not None and usage.known else None
            self.admission.done(admitted, reported, status, trio.current_time())
        usage = usage or StepUsage()
        if status == CLIENT_CLOSED:
            reason = "client disconnected"
        elif status >= 400:
            reason = f"request failed ({status})"
        else:
            reason = "response complete"
        if not self.scheduler.close(lease, usage, reason=reason, first_token_at=first_token_at):
            return
        now = trio.current_time()
        record = StepRecord.from_outcome(
            lease,
            program_id=lease.program.program_id,
            backend=lease.node.url,
            endpoint=call.endpoint,
            model=call.model,
            stream=call.stream,
            usage=usage,
            status=status,
            first_token_at=first_token_at,
            finished_at=now,
            error=error,
            source=call.source,
            matched_messages=call.matched_messages,
            served_model=served,
            client=call.client,
            program_class=lease.program_class,
        )
        self.audit.record(record)
        first = first_token_at
        self.profiles.add_step(
            lease.program.program_id,
            prefill_s=None if first is None else first - lease.sent_at,
            decode_s=None if first is None else now - first,
            pause_s=record.queue_s,
            tool_s=lease.tool_s,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
        )

    def _tell_backend_refused(self, backend: str, status: int, message: str) -> None:
        """A backend's 4xx reaches the client, whose own output may not say why: one line per
        backend, status and message (numbers aside: a context length differs per call) a
        minute."""
        cause = ("backend", backend, status, re.sub(r"\d+", "#", message))
        told = self.refusals.note(cause, message, trio.current_time())
        if told is not None:
            log.warning(
                "backend %s answered %d to %s: %s",
                backend,
                status,
                _calls(told),
                told.details[0][0],
            )

    def _tell_model_not_found(self, model: str) -> None:
        told = self.refusals.note("model_not_found", model, trio.current_time())
        if told is not None:
            log.warning(
                "refused %s for models no backend serves: %s (served: %s); ask for a served "
                "model, or send other names to one with --default-model or an [aliases] pattern",
                _calls(told),
                ", ".join(f"{name!r} x{n}" for name, n in told.details),
                ", ".join(self.pool.served_models(healthy_only=False)) or "none yet",
            )

    def _reject(self, call: Call, error: ThunderproxyError) -> None:
        if isinstance(error, ModelNotFound):
            self._tell_model_not_found(error.model)
        self.audit.record(
            RejectionRecord.refused(
                error,
                at=trio.current_time(),
                method=call.method,
                path=call.endpoint,
                program_id=call.program_id,
                client=call.client,
            )
        )

    def _never_sent(self, call: Call) -> None:
        """The caller left while its program was paused: the call is dropped for good."""
        program = self.scheduler.registry.find(call.program_id)
        status, message = self.cut_outcome()
        self.audit.record(
            StepRecord.never_sent(
                program_id=call.program_id,
                step=0 if program is None else program.step_count + 1,
                endpoint=call.endpoint,
                model=call.model,
                stream=call.stream,
                arrived_at=call.arrived_at,
                finished_at=trio.current_time(),
                status=status,
                error="client closed the connection while the program was paused"
                if status == CLIENT_CLOSED
                else message,
                source=call.source,
                matched_messages=call.matched_messages,
                client=call.client,
                program_class=None if program is None else program.program_class,
            )
        )


__all__ = ["AdmitAll", "Admission", "Admitted", "Call", "Exchange", "Gateway", "Tap", "Wire"]
