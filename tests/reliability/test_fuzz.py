"""Fuzzing both sides of a running proxy (hypothesis): arbitrary requests from clients, arbitrary
answers from a backend (tests/fuzzbackend.py). After every example the proxy is alive and
answers /health within 100 ms, the client got a well-formed answer (the backend's, relayed as
sent, or the proxy's own JSON error, or a well-formed SSE stream), and every call is one audit
row or counted as dropped.

The default suite runs a few dozen examples of each; ``pytest -m fuzz tests/reliability/
test_fuzz.py`` runs the same checks over thousands.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from tests.conftest import Live, live_fuzz_proxy, query
from tests.fuzzbackend import Answer, answers, texts
from thunderproxy.protocols.base import MAX_EVENT_BYTES
from thunderproxy.protocols.openai_chat import ChatTap

#: /health must answer within this, whatever came before.
HEALTH_WITHIN_S = 0.1
#: How long the audit writer may take to show a call's row (it batches every 50 ms).
AUDIT_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A fuzz backend and a proxy in front of it, for the whole module."""
    overrides = {"datasette": False, "max_body_bytes": 65_536}
    with live_fuzz_proxy(tmp_path_factory.mktemp("fuzz"), **overrides) as running:
        yield running


# --- the invariants ----------------------------------------------------------------------------


def check_alive(live: Live) -> None:
    """/health answers within HEALTH_WITHIN_S: the best of three tries, so that one scheduling
    hiccup of a busy machine is not taken for a stalled proxy (which fails all three)."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        r = live.client.get("/health")
        times.append(time.perf_counter() - started)
        assert r.status_code == 200
        if times[-1] < HEALTH_WITHIN_S:
            return
    raise AssertionError(f"/health took {', '.join(f'{t * 1000:.0f}' for t in times)} ms")


def check_proxy_error(r: httpx.Response) -> None:
    """An answer the proxy made itself: OpenAI's error JSON, never a 500 of its own."""
    assert r.status_code != 500, r.text
    assert r.status_code >= 400, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == r.status_code
    assert isinstance(error["message"], str)
    assert error["message"]


def audit_rows(live: Live) -> int:
    tables = ("steps", "rejections")
    rows = sum(query(live.db, f"SELECT count(*) AS n FROM {t}")[0]["n"] for t in tables)
    stats = live.client.get("/metrics").json()["audit"]
    dropped = sum(n for cause, n in stats["dropped_by_cause"].items() if cause.startswith(tables))
    return int(rows + dropped)


def check_audit(live: Live, before: int) -> None:
    """The call just made is one row in steps or rejections, or counted as dropped."""
    deadline = time.perf_counter() + AUDIT_WITHIN_S
    while (seen := audit_rows(live)) < before + 1 and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert seen == before + 1, (
        live.client.get("/metrics").json()["audit"],
        query(live.db, "SELECT program_id, status, error FROM steps ORDER BY id DESC LIMIT 3"),
        query(live.db, "SELECT * FROM rejections ORDER BY id DESC LIMIT 3"),
    )


def settled(live: Live) -> bool:
    """Every record accepted so far is written or counted as refused."""
    stats = live.client.get("/metrics").json()["audit"]
    queue_full = sum(n for cause, n in stats["dropped_by_cause"].items() if "queue full" in cause)
    return bool(stats["accepted"] == stats["written"] + stats["dropped"] - queue_full)


def post(live: Live, content: bytes, headers: dict[str, Any]) -> tuple[httpx.Response, int]:
    """The call, and the audit rows there were before it (once the writer has caught up, so a
    row of an earlier call cannot be taken for this call's)."""
    deadline = time.perf_counter() + AUDIT_WITHIN_S
    while not settled(live):
        assert time.perf_counter() < deadline, live.client.get("/metrics").json()["audit"]
        time.sleep(0.01)
    before = audit_rows(live)
    r = live.client.post("/v1/chat/completions", content=content, headers=headers)
    return r, before


# --- clients sending anything ------------------------------------------------------------------

#: JSON values as a careless client produces them: NaN, huge and negative numbers, surrogates.
wild_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**100, -(2**63) - 1, 2**64, math.nan, math.inf, -math.inf])
    | st.floats()
    | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=10,
)
chat_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": texts}),
    max_size=2,
)


#: True four times in five.
weighted = st.sampled_from([True, True, True, True, False])
typical: dict[str, list[Any]] = {
    "program_id": ["task-1", "täsk 😀", "a" * 256],
    "model": ["fake", "meta-llama/Llama-3.1-8B-Instruct"],
    "user": ["u1"],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": False}, {}],
    "extra_body": [{"program_id": "task-2"}, {}],
    "temperature": [0.0, 0.7],
    "max_tokens": [1, 4096],
}


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    # Mostly right, so that most examples are forwarded; any field may be anything.
    body: dict[str, Any] = {"messages": draw(chat_messages if draw(weighted) else wild_values)}
    for name, values in [
        ("program_id", texts | wild_values),
        ("model", texts | wild_values),
        ("user", texts),
        ("stream", st.booleans() | wild_values),
        ("stream_options", st.fixed_dictionaries({"include_usage": st.booleans()}) | wild_values),
        ("extra_body", st.fixed_dictionaries({"program_id": texts | wild_values}) | wild_values),
        ("temperature", st.floats()),
        ("max_tokens", st.integers()),
    ]:
        if draw(st.booleans()):
            body[name] = draw(values if not draw(weighted) else st.sampled_from(typical[name]))
    return body


def nested(depth: int) -> bytes:
    return b'{"messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"


request_bodies = st.one_of(
    chat_bodies().map(lambda body: json.dumps(body).encode()),
    chat_bodies().map(lambda body: json.dumps(body).encode()),
    chat_bodies().map(lambda body: json.dumps(body).encode()),
    wild_values.map(lambda value: json.dumps(value).encode()),
    st.integers(1, 5_000).map(nested),
    st.binary(max_size=200),
)
#: Header values a client can send: any byte but controls, no surrounding blanks (HTTP's rule).
latin1_values = st.binary(max_size=40).map(
    lambda raw: bytes(b for b in raw if b >= 0x20 and b != 0x7F).strip(b" ")
)
request_headers = st.fixed_dictionaries(
    {},
    optional={
        "x-program-id": latin1_values,
        "content-type": st.sampled_from(
            ["application/json", "text/plain", "x/\xff".encode("latin-1")]
        ),
        "x-request-id": latin1_values,
        "x-f-other": latin1_values,
    },
)


def check_any_request(live: Live, content: bytes, headers: dict[str, Any]) -> None:
    r, before = post(live, content, headers)
    event(f"status {r.status_code}")
    if r.status_code == 200:
        body = json.loads(content)  # only a valid chat body is forwarded
        assert isinstance(body, dict)
        assert isinstance(body.get("messages"), list)
        assert r.headers.get("x-fuzz-echo") == ""
    else:
        check_proxy_error(r)
        assert r.status_code in (400, 413), r.text
    check_alive(live)
    check_audit(live, before)


EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    # Explaining a failure replays it dozens of times against the live proxy: minutes, not news.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
LONG = settings(EXAMPLES, max_examples=2_000)


@EXAMPLES
@given(content=request_bodies, headers=request_headers)
def test_any_request(live: Live, content: bytes, headers: dict[str, Any]) -> None:
    check_any_request(live, content, headers)


@pytest.mark.fuzz
@LONG
@given(content=request_bodies, headers=request_headers)
def test_any_request_long(live: Live, content: bytes, headers: dict[str, Any]) -> None:
    check_any_request(live, content, headers)


# --- backends answering anything ---------------------------------------------------------------

#: The proxy's own error event and [DONE], last in a stream it cut (its JSON is one line).
ERROR_TAIL = re.compile(rb"data: (\{\"error\": [^\n]*\})\n\ndata: \[DONE\]\n\n\Z")
EVENT_BOUNDARY = re.compile(rb"(\A|\r?\n\r?\n)\Z")


def cut_by_proxy(answer: Answer) -> bool:
    """Whether a relayed stream must end with the proxy's own error event: it was cut, or never
    ends an event, before its protocol's end (``data: [DONE]``) passed whole."""
    # An event that never ends is relayed as it came up to the tap's bound, cut past it.
    unended = (
        answer.filler_count
        and b"\n\n" not in answer.filler
        and len(answer.filler) * answer.filler_count > MAX_EVENT_BYTES
    )
    return bool(answer.cut or unended) and not ended_before_cut(answer)


def ended_before_cut(answer: Answer) -> bool:
    """The stream's own end event (``data: [DONE]``) passed whole before anything could go
    wrong: read by the chat protocol's tap, whose notion of a complete answer this is."""
    tap = ChatTap(hide_usage_chunk=False)
    tap.feed(b"".join(answer.pieces))
    return tap.complete


def check_stream(answer: Answer, body: bytes, *, hidden: bool) -> int:
    """A relayed stream is the backend's whole events, then either the rest of its bytes or the
    proxy's error event after an event boundary; returns the status its step must have."""
    if cut_by_proxy(answer):
        tail = ERROR_TAIL.search(body)
        assert tail is not None, body[-300:]
        error = json.loads(tail.group(1))["error"]
        assert error["code"] == 502
        before = body[: tail.start()]
        assert EVENT_BOUNDARY.search(before), before[-100:]
        if not hidden:
            # Relayed as it came; a blank line closes an event cut half-way before the error.
            assert answer.body.startswith(before) or answer.body.startswith(before[:-2])
        return 502
    if hidden:
        assert len(body) <= len(answer.body)
    else:
        assert body == answer.body
    return 200


def check_any_answer(live: Live, answer: Answer, stream: bool, include_usage: bool | None) -> None:
    case = f"case-{next(live.cases)}"
    live.backend.answers[case] = answer
    request: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if include_usage is not None:
        request["stream_options"] = {"include_usage": include_usage}
    try:
        r, before = post(
            live, json.dumps(request).encode(), {"x-fuzz-case": case, "x-program-id": case}
        )
    finally:
        del live.backend.answers[case]
    relayed = r.headers.get("x-fuzz-echo") == case
    if relayed:
        for name, value in answer.headers:
            assert value in r.headers.get_list(name), (name, value, r.headers.get_list(name))
    is_sse = "text/event-stream" in answer.content_type
    event(f"stream relayed: {stream and answer.status == 200 and is_sse}, cut: {answer.cut}")
    if stream and answer.status == 200 and is_sse:
        assert relayed
        assert r.status_code == 200
        expected_status = check_stream(answer, r.content, hidden=include_usage is not True)
    elif relayed:
        assert not answer.cut
        assert r.status_code == answer.status
        assert r.content == answer.body
        expected_status = answer.status
    else:
        assert answer.cut, r.text
        check_proxy_error(r)
        assert r.status_code == 502
        expected_status = 502
    check_alive(live)
    check_audit(live, before)
    rows = query(live.db, "SELECT status, prompt_tokens FROM steps WHERE program_id = ?", case)
    assert [row["status"] for row in rows] == [expected_status], (
        query(live.db, "SELECT program_id, status, error FROM steps ORDER BY id DESC LIMIT 3"),
        query(live.db, "SELECT * FROM rejections ORDER BY id DESC LIMIT 3"),
        live.client.get("/metrics").json()["audit"],
    )
    tokens = rows[0]["prompt_tokens"]
    assert tokens is None or 0 <= tokens <= 2**31
    # The agent is done with its program, as agents are; a new one takes its place.
    released = live.client.post("/programs/release", json={"program_id": case})
    assert released.status_code == 200


exchanges = st.booleans().flatmap(
    lambda stream: st.tuples(st.just(stream), answers(stream=stream), st.none() | st.booleans())
)


@EXAMPLES
@given(exchange=exchanges)
def test_any_answer(live: Live, exchange: tuple[bool, Answer, bool | None]) -> None:
    stream, answer, include_usage = exchange
    check_any_answer(live, answer, stream, include_usage)


@pytest.mark.fuzz
@LONG
@given(exchange=exchanges)
def test_any_answer_long(live: Live, exchange: tuple[bool, Answer, bool | None]) -> None:
    stream, answer, include_usage = exchange
    check_any_answer(live, answer, stream, include_usage)


def test_fuzz_values_reach_the_edges() -> None:
    """The strategies do produce what the suite is about (a strategy that lost them would pass
    everything and prove nothing)."""
    assert math.isnan(float(json.loads('{"a": NaN}')["a"]))
    seen = {"surrogate": False, "nan": False}

    @settings(max_examples=300, database=None)
    @given(value=wild_values)
    def probe(value: Any) -> None:
        text = json.dumps(value)
        seen["surrogate"] |= "\\ud" in text
        seen["nan"] |= "NaN" in text

    probe()
    assert all(seen.values()), seen
