"""JSON inside the strings the proxy reads: tool-call arguments, Anthropic ``metadata.user_id``,
session headers, nested or oversized, on all three protocols, through a running proxy on loopback.

A request holding such JSON nested past the body's bound is refused in its protocol's error
shape (400, one ``rejections`` row); a backend answer holding it is relayed as it came, whole
(its stream ends with its final chunk), and its step row has the status the client saw.

The default suite runs a few dozen hypothesis examples; ``pytest -m fuzz`` runs thousands.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from tests.conftest import Live, live_fuzz_proxy, query
from tests.fuzzbackend import Answer
from thunderproxy.http.validate import MAX_JSON_DEPTH as MAX_NESTING

PATHS = {
    "chat": "/v1/chat/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
AUDIT_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    # The default router: hundreds of programs that are never released (each example starts
    # one) would fill tr's KV model of the test backend, and later calls would rightly wait.
    overrides = {"datasette": False, "max_body_bytes": 1_000_000, "router": "default"}
    with live_fuzz_proxy(tmp_path_factory.mktemp("nesting"), **overrides) as running:
        yield running


def deep(depth: int) -> str:
    """JSON text nesting arrays ``depth`` levels deep, inside an object."""
    return '{"a": ' + "[" * depth + "]" * depth + "}"


def request_body(protocol: str, embedded: str, *, stream: bool = False) -> dict[str, Any]:
    """A valid request of ``protocol`` carrying ``embedded`` in the string recognition parses."""
    if protocol == "chat":
        return {
            "model": "fake",
            "stream": stream,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "f", "arguments": embedded}}
                    ],
                },
                {"role": "tool", "content": "ok"},
            ],
        }
    if protocol == "messages":
        return {
            "model": "fake",
            "max_tokens": 16,
            "stream": stream,
            "metadata": {"user_id": embedded},
            "messages": [{"role": "user", "content": "hi"}],
        }
    return {
        "model": "fake",
        "stream": stream,
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "name": "f", "arguments": embedded},
            {"type": "function_call_output", "output": "ok"},
        ],
    }


def plain_request(protocol: str, *, stream: bool) -> dict[str, Any]:
    """A request with no program id, so that the answer is hashed for the next call."""
    if protocol == "chat":
        body = {"model": "fake", "stream": stream, "messages": [{"role": "user", "content": "x"}]}
        # Asked for, so that the usage chunk is relayed and the answer comes back byte for byte.
        return {**body, "stream_options": {"include_usage": True}} if stream else body
    if protocol == "messages":
        return {
            "model": "fake",
            "max_tokens": 16,
            "stream": stream,
            "messages": [{"role": "user", "content": "x"}],
        }
    return {"model": "fake", "stream": stream, "input": "x"}


def sse(*events: Any, done: bool = False) -> bytes:
    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def answer_with(protocol: str, arguments: str, *, stream: bool) -> Answer:
    """A backend answer of ``protocol`` whose tool call carries ``arguments`` (no call id, so
    that recognition compares the arguments themselves)."""
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    if protocol == "chat":
        if stream:
            call = {"index": 0, "function": {"name": "f", "arguments": arguments}}
            body = sse(
                {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                {"choices": [], "usage": usage},
                done=True,
            )
            return Answer(content_type="text/event-stream", pieces=(body,))
        message = {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}],
        }
        payload = {"choices": [{"index": 0, "message": message}], "usage": usage}
        return Answer(pieces=(json.dumps(payload).encode(),))
    if protocol == "messages":
        anthropic_usage = {"input_tokens": 3, "output_tokens": 2}
        if stream:
            body = b"".join(
                b"event: " + name.encode() + b"\n" + sse(data)
                for name, data in [
                    (
                        "message_start",
                        {"type": "message_start", "message": {"usage": anthropic_usage}},
                    ),
                    (
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": 0,
                            "content_block": {"type": "tool_use", "name": "f", "input": {}},
                        },
                    ),
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "input_json_delta", "partial_json": arguments},
                        },
                    ),
                    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 2}}),
                    ("message_stop", {"type": "message_stop"}),
                ]
            )
            return Answer(content_type="text/event-stream", pieces=(body,))
        # A whole Messages answer carries the input as an object: the text goes in as it is.
        text = '{"content": [{"type": "tool_use", "name": "f", "input": ' + arguments + "}], "
        text += '"usage": ' + json.dumps(anthropic_usage) + "}"
        return Answer(pieces=(text.encode(),))
    item = {"type": "function_call", "name": "f", "arguments": arguments}
    response = {"id": "resp_1", "output": [item], "usage": {"input_tokens": 3, "output_tokens": 2}}
    if stream:
        body = b"event: response.completed\n" + sse(
            {"type": "response.completed", "response": response}
        )
        return Answer(content_type="text/event-stream", pieces=(body,))
    return Answer(pieces=(json.dumps(response).encode(),))


def check_error_shape(protocol: str, r: httpx.Response, status: int) -> dict[str, Any]:
    """The proxy's own error in ``protocol``'s shape; returns its error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    payload = r.json()
    if protocol == "messages":
        assert payload["type"] == "error"
        assert payload["error"]["type"] == "invalid_request_error"
        return dict(payload["error"])
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    return dict(payload["error"])


def rows(live: Live, table: str) -> int:
    return int(query(live.db, f"SELECT count(*) AS n FROM {table}")[0]["n"])


def wait_rows(live: Live, table: str, at_least: int) -> None:
    deadline = time.perf_counter() + AUDIT_WITHIN_S
    while rows(live, table) < at_least and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert rows(live, table) >= at_least


# --- requests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5_000])
@pytest.mark.parametrize("protocol", list(PATHS))
def test_deep_json_in_a_request_string_is_refused(live: Live, protocol: str, depth: int) -> None:
    """Before: 500 internal_error with a traceback at 5,000 levels (recognition parsed it)."""
    before = rows(live, "rejections")
    r = live.client.post(PATHS[protocol], json=request_body(protocol, deep(depth)))
    error = check_error_shape(protocol, r, 400)
    assert f"more than {MAX_NESTING} levels" in error["message"]
    wait_rows(live, "rejections", before + 1)


@pytest.mark.parametrize("protocol", list(PATHS))
def test_shallow_json_in_a_request_string_is_forwarded(live: Live, protocol: str) -> None:
    case = f"shallow-{next(live.cases)}"
    live.backend.answers[case] = Answer(pieces=(b"{}",))
    try:
        r = live.client.post(
            PATHS[protocol],
            json=request_body(protocol, deep(MAX_NESTING - 2)),
            headers={"x-fuzz-case": case},
        )
    finally:
        del live.backend.answers[case]
    assert r.status_code == 200, r.text
    assert r.headers["x-fuzz-echo"] == case


@pytest.mark.parametrize("protocol", ["chat", "responses"])
def test_deep_arguments_of_a_call_with_an_id_are_not_parsed(live: Live, protocol: str) -> None:
    """With an id, recognition compares the id and never parses the arguments: forwarded."""
    body = request_body(protocol, deep(5_000))
    if protocol == "chat":
        body["messages"][1]["tool_calls"][0]["id"] = "call_1"
    else:
        body["input"][1]["call_id"] = "call_1"
    case = f"with-id-{next(live.cases)}"
    live.backend.answers[case] = Answer(pieces=(b"{}",))
    try:
        r = live.client.post(PATHS[protocol], json=body, headers={"x-fuzz-case": case})
    finally:
        del live.backend.answers[case]
    assert r.status_code == 200, r.text
    assert r.headers["x-fuzz-echo"] == case


# --- answers -----------------------------------------------------------------------------------


def exchange(live: Live, protocol: str, answer: Answer, *, stream: bool) -> httpx.Response:
    """The request through the proxy, its answer read whole (httpx raises if the stream lacks
    its final chunk); checks the step row's status is the one the client saw."""
    case = f"case-{next(live.cases)}"
    live.backend.answers[case] = answer
    before = rows(live, "steps")
    try:
        r = live.client.post(
            PATHS[protocol],
            json=plain_request(protocol, stream=stream),
            headers={"x-fuzz-case": case},
        )
    finally:
        del live.backend.answers[case]
    wait_rows(live, "steps", before + 1)
    status = query(live.db, "SELECT status FROM steps ORDER BY id DESC LIMIT 1")[0]["status"]
    assert status == r.status_code, (status, r.status_code, r.text[:300])
    return r


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("protocol", list(PATHS))
def test_deep_tool_arguments_in_an_answer_are_relayed(
    live: Live, protocol: str, stream: bool
) -> None:
    """Before: the stream ended without its final chunk, and a whole answer was a 500 while
    its step row said 200 (hashing the answer for recognition recursed past Python's limit)."""
    answer = answer_with(protocol, deep(5_000), stream=stream)
    r = exchange(live, protocol, answer, stream=stream)
    assert r.status_code == 200
    assert r.content == answer.body


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("protocol", list(PATHS))
def test_a_fault_in_learning_from_an_answer_never_reaches_the_client(
    live: Live, protocol: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever recognition fails on, after the client has the answer and its step is recorded,
    the answer stays whole and its status the step's."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("recognition bug")

    recognizer = live.proxy.services.recognizer
    monkeypatch.setattr(recognizer, "observe_answer", broken)
    monkeypatch.setattr(recognizer, "remember_response", broken)
    answer = answer_with(protocol, '{"x": 1}', stream=stream)
    r = exchange(live, protocol, answer, stream=stream)
    assert r.status_code == 200
    assert r.content == answer.body


# --- the fuzz ----------------------------------------------------------------------------------

protocols = st.sampled_from(list(PATHS))


@dataclass(frozen=True)
class Embedded:
    """JSON text as it may sit in a string, drawn as a short recipe: hypothesis prints (and
    pytest's warning filter refuses) reprs of the 200 KB texts themselves."""

    kind: str
    size: int = 0
    text: str = ""

    @property
    def value(self) -> str:
        if self.kind == "arrays":
            return deep(self.size)
        if self.kind == "objects":
            return '{"a": ' * self.size + "1" + "}" * self.size
        if self.kind == "unclosed":
            return "[" * self.size  # never closed: not JSON
        if self.kind == "wide":
            return json.dumps({"k": "v" * self.size})
        return self.text


embedded_texts = st.one_of(
    st.builds(Embedded, st.just("arrays"), st.integers(1, 3_000)),
    st.builds(Embedded, st.just("objects"), st.integers(1, 3_000)),
    st.builds(Embedded, st.just("unclosed"), st.integers(1, 3_000)),
    st.builds(Embedded, st.just("wide"), st.integers(1, 200_000)),
    st.builds(Embedded, st.just("text"), st.just(0), st.text(max_size=50)),
)
session_headers = st.sampled_from(
    ["x-session-id", "x-claude-code-session-id", "session-id", "x-litellm-session-id"]
)


def check_not_own_5xx(live: Live, protocol: str, r: httpx.Response, case: str) -> None:
    """A well-formed answer: the backend's, relayed, or the proxy's own 4xx in its shape."""
    if r.headers.get("x-fuzz-echo") == case:
        return
    assert r.status_code < 500, r.text[:500]
    assert r.status_code in (400, 413, 431), r.text[:500]
    if r.status_code != 431:  # the HTTP layer's own answer to an oversized head
        check_error_shape(protocol, r, r.status_code)


def check_request(
    live: Live, protocol: str, embedded: Embedded, header: str | None, stream: bool
) -> None:
    text = embedded.value
    case = f"req-{next(live.cases)}"
    live.backend.answers[case] = Answer(pieces=(b"{}",))
    headers: dict[str, Any] = {"x-fuzz-case": case}
    if header is not None:
        raw = text.encode("utf-8", "surrogatepass")[:60_000]
        # Any byte HTTP allows in a value: no controls, no surrounding blanks.
        headers[header] = bytes(b for b in raw if b >= 0x20 and b != 0x7F).strip(b" ")
    try:
        r = live.client.post(
            PATHS[protocol], json=request_body(protocol, text, stream=stream), headers=headers
        )
    finally:
        del live.backend.answers[case]
    event(f"{protocol} {r.status_code}")
    check_not_own_5xx(live, protocol, r, case)
    assert live.client.get("/health").status_code == 200


def check_answer(live: Live, protocol: str, embedded: Embedded, stream: bool) -> None:
    answer = answer_with(protocol, embedded.value, stream=stream)
    r = exchange(live, protocol, answer, stream=stream)
    event(f"{protocol} answer {r.status_code}")
    assert r.status_code == 200
    assert r.content == answer.body


EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
LONG = settings(EXAMPLES, max_examples=1_000)
requests = st.tuples(protocols, embedded_texts, st.none() | session_headers, st.booleans())
answers = st.tuples(protocols, embedded_texts, st.booleans())


@EXAMPLES
@given(drawn=requests)
def test_nested_strings_in_requests(
    live: Live, drawn: tuple[str, Embedded, str | None, bool]
) -> None:
    check_request(live, *drawn)


@EXAMPLES
@given(drawn=answers)
def test_nested_strings_in_answers(live: Live, drawn: tuple[str, Embedded, bool]) -> None:
    check_answer(live, *drawn)


@pytest.mark.fuzz
@LONG
@given(drawn=requests)
def test_nested_strings_in_requests_long(
    live: Live, drawn: tuple[str, Embedded, str | None, bool]
) -> None:
    check_request(live, *drawn)


@pytest.mark.fuzz
@LONG
@given(drawn=answers)
def test_nested_strings_in_answers_long(live: Live, drawn: tuple[str, Embedded, bool]) -> None:
    check_answer(live, *drawn)
