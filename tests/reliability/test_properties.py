"""Property-based tests over the HTTP boundary (hypothesis): whatever a client sends, the proxy
answers with a well-formed response, never a 500 of its own, and forwards only what it should."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakebackend import FakeBackend, proxy_in_thread, serve_fake_backend

Live = tuple[httpx.Client, FakeBackend]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text()}),
    max_size=3,
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """A fake backend and a proxy in front of it, for the whole module."""
    db = tmp_path_factory.mktemp("props") / "audit.db"
    backend = FakeBackend()
    with (
        proxy_in_thread(serve_fake_backend, backend, db, max_body_bytes=16_384) as proxy,
        httpx.Client(base_url=proxy.url, timeout=10) as client,
    ):
        yield client, backend


def check_error_shape(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == r.status_code
        assert "Traceback" not in r.text


EXAMPLES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@EXAMPLES
@given(body=st.binary(max_size=2048))
def test_any_bytes_get_a_well_formed_answer(live: Live, body: bytes) -> None:
    client, _ = live
    r = client.post("/v1/chat/completions", content=body)
    check_error_shape(r)


@EXAMPLES
@given(body=json_values)
def test_any_json_is_either_forwarded_cleanly_or_refused(live: Live, body: Any) -> None:
    client, backend = live
    before = len(backend.received)
    r = client.post("/v1/chat/completions", content=json.dumps(body))
    check_error_shape(r)
    valid = isinstance(body, dict) and isinstance(body.get("messages"), list)
    if r.status_code == 200:
        assert valid
        forwarded = backend.received[-1]
        assert "program_id" not in forwarded
    else:
        assert len(backend.received) == before


@EXAMPLES
@given(program_id=json_values, msgs=messages)
def test_program_ids_are_validated(live: Live, program_id: Any, msgs: list[Any]) -> None:
    client, _ = live
    r = client.post("/v1/chat/completions", json={"messages": msgs, "program_id": program_id})
    check_error_shape(r)
    valid_id = isinstance(program_id, str) and program_id.strip() and len(program_id) <= 256
    # A chat call needs at least one message (protocols.openai_chat), whatever its program id.
    ok = valid_id and msgs
    assert (r.status_code == 200) == bool(ok)
    if ok:
        assert program_id in client.get("/programs").json()


@EXAMPLES
@given(header=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=300))
def test_program_id_header(live: Live, header: str) -> None:
    client, _ = live
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Program-Id": header})
    check_error_shape(r)
    assert (r.status_code == 200) == (0 < len(header) <= 256)


@EXAMPLES
@given(body=json_values)
def test_release_never_fails_with_a_500(live: Live, body: Any) -> None:
    client, _ = live
    check_error_shape(client.post("/programs/release", content=json.dumps(body)))
