"""The one builder of ``rejections`` rows, which the gateway and both HTTP paths use: a refusal's
status, type and reason come from the one table (errors.py), whoever refused."""

from __future__ import annotations

from thunderproxy.audit.records import RejectionRecord
from thunderproxy.errors import ModelNotFound, NotReady, ThunderproxyError


def test_a_refusal_is_told_by_its_error() -> None:
    error = NotReady("starting", retry_after_s=1.0)
    record = RejectionRecord.refused(
        error, at=2.0, method="POST", path="/v1/messages", program_id="p", client="team-a"
    )
    assert record == RejectionRecord(
        at=2.0,
        method="POST",
        path="/v1/messages",
        status=503,
        error_type="service_unavailable",
        message="starting",
        program_id="p",
        reason="not_ready",
        client="team-a",
    )
    # The reason is counted by the metrics, not stored.
    assert record.row(lambda t: t + 100.0) == {
        "at": 102.0,
        "method": "POST",
        "path": "/v1/messages",
        "status": 503,
        "error_type": "service_unavailable",
        "message": "starting",
        "program_id": "p",
        "client": "team-a",
    }


def test_an_error_of_no_class_of_ours_is_a_fault_of_ours() -> None:
    class Odd(ThunderproxyError):
        pass

    record = RejectionRecord.refused(
        Odd("odd"), at=0.0, method="GET", path="/x", program_id=None, client=None
    )
    assert (record.status, record.reason) == (500, "thunderproxy_error")
    unknown = RejectionRecord.refused(
        ModelNotFound("nope", ["m"]), at=0.0, method="POST", path="/v1/chat/completions",
        program_id=None, client=None,
    )  # fmt: skip
    assert (unknown.status, unknown.reason) == (404, "model_not_found")
