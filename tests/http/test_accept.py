"""An accept loop out of file descriptors retries every 0.1 s while it lasts, and says so once
a minute, not ten times a second; every failure is counted for /health."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
import trio
import trio.testing

from tests.exhaust import exhausted_descriptors
from thunderproxy import descriptors
from thunderproxy.http import front


class Refusing:
    """Stands in for the front: no connection may be accepted while descriptors are out."""

    async def handle(self, sock: socket.socket) -> None:
        sock.close()
        raise AssertionError("a connection was accepted with no descriptor left")


async def test_accept_without_descriptors_is_logged_once_a_minute(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    # Connections the kernel completes and queues: each accept() would need a descriptor.
    waiting = [socket.create_connection(listener.getsockname()) for _ in range(4)]
    caplog.set_level(logging.INFO)
    try:
        with exhausted_descriptors():
            async with trio.open_nursery() as nursery:
                refusing: Any = Refusing()
                nursery.start_soon(front._accept, refusing, listener, nursery)
                await trio.sleep(125)  # virtual: 1,250 tries at 0.1 s
                nursery.cancel_scope.cancel()
    finally:
        for sock in waiting:
            sock.close()
        listener.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    # At 0 s, then with the count at about 60 s and 120 s.
    assert len(errors) == 3, [r.getMessage() for r in errors]
    assert "out of file descriptors" in errors[0].getMessage()
    assert "ulimit -n" in errors[0].getMessage()
    assert "failures in the last 60 s" in errors[1].getMessage()
    record = descriptors.current()
    assert record.refused >= 1000
    problem = record.problem(trio.current_time(), None)
    assert problem is not None
    assert "accepting a connection" in problem


async def test_hypercorns_accept_loop_without_descriptors_is_told_once_a_minute(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # ``--http-front hypercorn`` accepts through trio's serve_listeners, which logs an ERROR
    # with a traceback every 0.1 s while accept() fails; the runtime routes those lines here.
    descriptors.quiet_trio_accept_log()
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    sock.listen()
    listener = trio.SocketListener(sock)
    waiting = [socket.create_connection(sock.getsockname()) for _ in range(4)]
    caplog.set_level(logging.INFO)

    async def refuse(stream: trio.SocketStream) -> None:
        raise AssertionError("a connection was accepted with no descriptor left")

    try:
        with exhausted_descriptors():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, refuse, [listener])
                await trio.sleep(65)
                nursery.cancel_scope.cancel()
    finally:
        for client in waiting:
            client.close()
        await listener.aclose()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, [r.getMessage() for r in errors]
    assert all("out of file descriptors" in r.getMessage() for r in errors)
    assert descriptors.current().refused >= 600
