"""The proxy's record of its own file descriptors: how /health tells it is out of them, pure
(the time and the count passed in), and the count read for real."""

from __future__ import annotations

import errno
import logging

import pytest

from tests.exhaust import exhausted_descriptors
from thunderproxy.descriptors import RECENT_S, RESERVE, Descriptors, Usage, out_error, usage

EMFILE = OSError(errno.EMFILE, "Too many open files")


def test_out_of_descriptors_is_degraded_while_recent_or_nearly_so() -> None:
    record = Descriptors()
    assert record.problem(10.0, Usage(100, 1024)) is None
    record.out("accepting a connection", EMFILE, 10.0)
    problem = record.problem(10.5, Usage(1024, 1024))
    assert problem is not None
    assert "(1024 of 1024 open)" in problem
    assert "EMFILE 0.5 s ago accepting a connection" in problem
    assert "ulimit -n" in problem
    # Over once the failures stop and descriptors are free again.
    assert record.problem(10.0 + RECENT_S, Usage(200, 1024)) is None
    # Nearly out with no failure yet: the next burst of connections will fail.
    nearly = record.problem(100.0, Usage(1024 - RESERVE + 1, 1024))
    assert nearly is not None
    assert "nearly out" in nearly
    assert record.as_dict(100.0, None)["refused"] == 1


def test_the_log_tells_it_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    record = Descriptors()
    with caplog.at_level(logging.ERROR, logger="thunderproxy.descriptors"):
        for tenth in range(1300):  # 130 s of an accept loop retrying every 0.1 s
            record.out("accepting a connection", EMFILE, tenth / 10)
    assert len(caplog.records) == 3
    assert "600 failures in the last 60 s" in caplog.records[1].getMessage()
    assert record.refused == 1300


def test_wrapped_and_grouped_errors_are_recognised() -> None:
    # As trio's open_tcp_stream raises when every address failed.
    outer = OSError("all attempts to connect failed")
    outer.__cause__ = ExceptionGroup("attempts", [ConnectionRefusedError(), EMFILE])
    assert out_error(outer) is EMFILE
    assert out_error(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is None


async def test_usage_reads_the_limit_reached() -> None:
    found = usage()
    assert found is not None
    assert found.open < found.limit
    with exhausted_descriptors():
        out = usage()
    assert out is not None
    assert out.left < RESERVE
