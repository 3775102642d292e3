"""The autoscaler's signature format, checked with a real RSA key, and the replay guard."""

from __future__ import annotations

import json

import pytest

from tests.worker.autoscaler import Autoscaler
from thunderproxy.worker.auth import (
    AuthData,
    AuthDataError,
    ReplayGuard,
    load_public_key,
    signature_valid,
)


def test_signed_message_is_the_sorted_indented_json_of_five_fields() -> None:
    auth = AuthData(cost="500", endpoint="ep", reqnum=7, request_idx=3, url="u", signature="s")
    expected = json.dumps(
        {"url": "u", "request_idx": 3, "reqnum": 7, "endpoint": "ep", "cost": "500"},
        indent=4,
        sort_keys=True,
    )
    assert auth.message() == expected.encode()
    assert auth.message().startswith(b'{\n    "cost": "500",\n    "endpoint": "ep"')


def test_a_valid_signature_verifies_and_any_changed_field_does_not() -> None:
    scaler = Autoscaler()
    key = load_public_key(scaler.public_pem)
    raw = scaler.auth_data(cost=250)
    assert signature_valid(key, AuthData.from_json(raw))
    changes = [("cost", 251), ("cost", "250"), ("reqnum", raw["reqnum"] + 1),
               ("request_idx", 99), ("endpoint", "other"), ("url", "http://evil")]  # fmt: skip
    for name, value in changes:
        assert not signature_valid(key, AuthData.from_json({**raw, name: value})), name
    assert not signature_valid(key, AuthData.from_json({**raw, "signature": "not base64!"}))


def test_query_parameters_restore_the_signed_types() -> None:
    scaler = Autoscaler()
    key = load_public_key(scaler.public_pem)
    for cost in (3, 2.5):
        raw = scaler.auth_data(cost=cost)
        params = {f"serverless_{k}": str(v) for k, v in raw.items()}
        auth = AuthData.from_query(params)
        assert auth.cost == cost
        assert type(auth.cost) is type(cost)
        assert signature_valid(key, auth)


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        pytest.param({"cost": 1}, "lacks endpoint", id="missing"),
        pytest.param({"cost": 1, "endpoint": "e", "reqnum": "1", "request_idx": 1, "url": "u",
                      "signature": "s"}, "reqnum must be an integer", id="reqnum-text"),
        pytest.param({"cost": "lots", "endpoint": "e", "reqnum": 1, "request_idx": 1, "url": "u",
                      "signature": "s"}, "not a number", id="cost-text"),
        pytest.param({"cost": -1, "endpoint": "e", "reqnum": 1, "request_idx": 1, "url": "u",
                      "signature": "s"}, ">= 0", id="cost-negative"),
        pytest.param([], "JSON object", id="not-an-object"),
    ],
)  # fmt: skip
def test_malformed_auth_data_is_named(raw: object, complaint: str) -> None:
    with pytest.raises(AuthDataError, match=complaint):
        AuthData.from_json(raw)


def test_replay_guard_refuses_repeats_and_stays_bounded() -> None:
    guard = ReplayGuard(capacity=3)
    for n in (10, 11, 12):
        assert guard.check(n) is None
        guard.add(n)
    assert "already served" in (guard.check(11) or "")
    guard.add(13)  # forgets 10, the oldest
    assert len(guard) == 3
    assert guard.floor == 10
    assert "older than" in (guard.check(10) or "")
    assert "older than" in (guard.check(9) or "")
    assert guard.check(14) is None
    # Out of order but newer than anything forgotten: still accepted once.
    guard.add(20)
    assert guard.floor == 11
    assert guard.check(12) is not None  # remembered
    assert guard.check(15) is None
