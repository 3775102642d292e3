"""The autoscaler's signature format, checked with a real RSA key, and the replay guard."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import query
from tests.worker.autoscaler import Autoscaler
from thunderproxy.audit.writer import open_database
from thunderproxy.worker.auth import (
    AuthData,
    AuthDataError,
    ReplayGuard,
    load_public_key,
    signature_valid,
)
from thunderproxy.worker.seen import load_seen


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


def test_seen_numbers_are_read_back_newest_first_and_older_ones_pruned(tmp_path: Path) -> None:
    db = str(tmp_path / "audit.db")
    open_database(db).close()  # migrated
    conn = sqlite3.connect(db)
    with conn:
        conn.executemany(
            "INSERT INTO worker_seen (at, reqnum, request_idx, path) VALUES (0, ?, ?, '/x')",
            [(n, n) for n in (5, 1, 9, 7, 3, 8)],
        )
    conn.close()
    numbers, floor = load_seen(db, 3)
    assert (numbers, floor) == ([9, 8, 7], 5)
    guard = ReplayGuard(3)
    guard.restore(numbers, floor)
    assert "already served" in (guard.check(8) or "")
    assert "older than" in (guard.check(5) or "")
    assert "older than" in (guard.check(4) or "")
    assert guard.check(6) is None
    assert guard.check(10) is None
    # Rows below the floor are gone; the floor's row stays, to be the floor next time too.
    assert query(tmp_path / "audit.db", "select reqnum from worker_seen order by reqnum") == [
        {"reqnum": n} for n in (5, 7, 8, 9)
    ]
    assert load_seen(db, 3) == ([9, 8, 7], 5)
    assert load_seen(db, 10) == ([9, 8, 7, 5], None)
    assert load_seen("", 3) == ([], None)
