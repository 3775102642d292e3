"""A backend that answers whatever a test tells it to: any status, headers, JSON or bytes, SSE
framing right or wrong (missing ends, CRLF, comments), split into pieces anywhere, any usage
values and sizes, or a connection cut mid-way. The hypothesis strategies that draw such answers
live here too.

A test stores an ``Answer`` under a case name in ``FuzzBackend.answers`` and sends its request
with ``X-Fuzz-Case: <name>``, which the proxy forwards like any other header. Every answer
carries ``X-Fuzz-Echo: <name>``, so a client can tell the backend's answer, relayed, from one
the proxy made itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import trio
from hypothesis import strategies as st
from quart import Response, request
from quart_trio import QuartTrio

from tests.fakebackend import LoopbackBackend, create_backend_app, serve_backend


class CutConnection(Exception):
    """Raised inside a streamed body: the server drops the connection mid-answer."""


@dataclass(frozen=True)
class Answer:
    status: int = 200
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()
    #: The body, sent piece by piece as separate writes.
    pieces: tuple[bytes, ...] = ()
    #: Then ``filler`` repeated ``filler_count`` times: large answers without drawing them.
    filler: bytes = b""
    filler_count: int = 0
    #: Drop the connection after the body instead of ending it.
    cut: bool = False

    def __repr__(self) -> str:
        # Short, so that hypothesis can print a failing example (a 1 MB repr is useless).
        body = self.body
        shown = repr(body[:300]) + (f"... ({len(body)} bytes)" if len(body) > 300 else "")
        return (
            f"Answer(status={self.status}, content_type={self.content_type!r}, "
            f"headers={self.headers!r}, pieces={len(self.pieces)}, body={shown}, "
            f"filler={self.filler[:20]!r}x{self.filler_count}, cut={self.cut})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis prints examples with this, not __repr__

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces) + self.filler * self.filler_count


@dataclass
class FuzzBackend(LoopbackBackend):
    answers: dict[str, Answer] = field(default_factory=dict)
    requests: int = 0


def create_fuzz_app(state: FuzzBackend) -> QuartTrio:
    app = create_backend_app("fuzzbackend")

    # The same answers on every protocol's route: the proxy's taps read each its own way.
    @app.post("/v1/chat/completions")
    @app.post("/v1/messages")
    @app.post("/v1/responses")
    async def chat() -> Response:
        await request.get_data(False, False, False)
        state.requests += 1
        case = request.headers.get("x-fuzz-case", "")
        answer = state.answers.get(case, Answer(pieces=(b"{}",)))

        async def body() -> AsyncIterator[bytes]:
            for piece in answer.pieces:
                yield piece
                await trio.lowlevel.checkpoint()
            for _ in range(answer.filler_count):
                yield answer.filler
                await trio.lowlevel.checkpoint()
            if answer.cut:
                raise CutConnection(case)

        response = Response(body(), status=answer.status, content_type=answer.content_type)
        for name, value in (*answer.headers, ("x-fuzz-echo", case)):
            response.headers.add(name, value)
        return response

    return app


async def serve_fuzz_backend(
    state: FuzzBackend, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    # Cut connections are what the tests ask for; Hypercorn's traceback for each is noise.
    await serve_backend(create_fuzz_app(state), state, log_errors=False, task_status=task_status)


# --- strategies --------------------------------------------------------------------------------

#: Text with lone surrogates among ordinary characters: valid JSON once escaped, no UTF-8 form.
texts = st.text(st.characters() | st.sampled_from(["\ud800", "\udfff", "\x00", "\n"]), max_size=20)
counts = st.one_of(
    st.integers(-5, 50_000),
    st.sampled_from([-(2**63), 2**31, 2**31 + 1, 2**63, 2**64, 10**30]),
    st.integers(),
    st.floats(),
    st.none(),
    st.booleans(),
    texts,
)
usages = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": counts,
        "completion_tokens": counts,
        "total_tokens": counts,
        "prompt_tokens_details": st.fixed_dictionaries({}, optional={"cached_tokens": counts})
        | st.none(),
    },
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=8,
)


def dumps(value: Any) -> bytes:
    # Python writes NaN and Infinity, which a broken backend might too.
    return json.dumps(value).encode()


chunk_payloads = st.one_of(
    st.builds(
        lambda text: {"object": "chat.completion.chunk", "choices": [{"delta": {"content": text}}]},
        texts,
    ),
    st.builds(lambda usage: {"choices": [], "usage": usage}, usages),
    st.builds(lambda message: {"error": {"message": message, "code": 500}}, texts | json_values),
    json_values,
)
event_bodies = st.one_of(
    st.builds(
        lambda p, sep: b"data:" + sep + dumps(p), chunk_payloads, st.sampled_from([b"", b" "])
    ),
    st.just(b"data: [DONE]"),
    st.just(b": ping"),
    st.just(b"event: message\ndata: {}"),
    st.binary(max_size=40),
)
event_ends = st.sampled_from([b"\n\n", b"\r\n\r\n", b"\n\r\n", b"\n", b"\r\n", b""])


@st.composite
def split_anywhere(draw: st.DrawFn, data: bytes) -> tuple[bytes, ...]:
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=6))
    points = sorted({0, len(data), *cuts})
    return tuple(data[a:b] for a, b in zip(points, points[1:], strict=False))


@st.composite
def sse_bodies(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(st.tuples(event_bodies, event_ends), max_size=8))
    return b"".join(body + end for body, end in events)


#: Large answers, made by the server: many small events, or one event that never ends.
fillers = st.sampled_from(
    [
        (b"", 0),
        (b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n', 2_000),
        # 1.3 MB without an event end, within the tap's bound (MAX_EVENT_BYTES): relayed as it
        # came. Past the bound is test_streams' 50 MB event: 33 MB an example made the fuzzing
        # slow enough to time out under load.
        (b"y" * 65_536, 20),
    ]
)
header_names = st.from_regex(r"\Ax-f-[a-z0-9-]{1,12}\Z")
#: Header text: printable ASCII mostly, any other printable character too (sent as UTF-8).
header_values = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E)
    | st.characters(min_codepoint=0xA0, exclude_categories=["Cs", "Zl", "Zp", "Cc"]),
    max_size=30,
).map(str.strip)
statuses = st.sampled_from([200, 200, 200, 201, 400, 404, 422, 429, 500, 502, 503]) | st.integers(
    200, 599
).filter(lambda s: s not in (204, 205, 304))


@st.composite
def answers(draw: st.DrawFn, *, stream: bool | None = None) -> Answer:
    """Any answer; with ``stream`` given, mostly one that fits such a request (an SSE stream,
    or JSON), so that most examples get past the status line into the body."""
    sse = (
        draw(st.booleans())
        if stream is None
        else draw(st.sampled_from([stream] * 4 + [not stream]))
    )
    if sse:
        body = draw(sse_bodies())
        content_type = draw(
            st.sampled_from(["text/event-stream", "text/event-stream; charset=utf-8"])
        )
    else:
        body = draw(
            st.one_of(
                st.builds(
                    lambda usage, extra: dumps({"choices": extra, "usage": usage}),
                    usages,
                    json_values,
                ),
                st.builds(dumps, json_values),
                st.binary(max_size=64),
                st.just(b"[" * 5_000),
            )
        )
        content_type = draw(
            st.sampled_from(["application/json", "text/plain", "text/event-stream"])
        )
    filler, filler_count = draw(fillers)
    return Answer(
        status=draw(st.just(200) | statuses),
        content_type=content_type,
        headers=tuple(draw(st.lists(st.tuples(header_names, header_values), max_size=3))),
        pieces=draw(split_anywhere(body)),
        filler=filler,
        filler_count=filler_count,
        cut=draw(st.sampled_from([False, False, False, False, True])),
    )
