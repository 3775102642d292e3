"""Limits of single clients (``[limits.clients.<name>]``) on trio's MockClock: a client over
its own limit waits apart and is refused while another client's calls pass, its limit counts
every model together, a call of its that ends wakes its calls of any model, and no fallback is
tried for it. With Redis, the client's window is global like a model's."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from tests.admission.conftest import RedisServer
from tests.admission.test_service import decisions
from thunderproxy.admission.service import AdmissionService, Ticket, client_key
from thunderproxy.admission.shared import SharedLimits
from thunderproxy.audit import AuditLog
from thunderproxy.audit.records import AuditRecord
from thunderproxy.backends import BackendPool
from thunderproxy.config.limits import ClassSpec, LimitsSpec, ModelLimits
from thunderproxy.errors import RateLimited
from thunderproxy.gateway import Call
from thunderproxy.http.sse import OPENAI

BIG, SMALL = "qwen-32b", "qwen-8b"


def service(
    clients: dict[str, ModelLimits], *, max_wait: float = 5.0, shared: SharedLimits | None = None
) -> tuple[AdmissionService, trio.MemoryReceiveChannel[AuditRecord]]:
    send, receive = trio.open_memory_channel[AuditRecord](1000)
    pool = BackendPool(aliases={"coder": (BIG, SMALL)})
    pool.add("http://gpu0:8000", models=[BIG])
    pool.add("http://gpu1:8000", models=[SMALL])
    spec = LimitsSpec(
        {}, (ClassSpec("default", 1.0, max_wait_s=max_wait),), "default", clients=clients
    )
    audit = AuditLog(send, 1)
    return AdmissionService(spec, pool=pool, audit=audit, instance="i0", shared=shared), receive


def call(program: str, client: str | None, model: str = BIG) -> Call:
    return Call(
        program_id=program,
        endpoint="/v1/chat/completions",
        body={"model": model, "max_tokens": 10},
        wire=OPENAI,
        arrived_at=trio.current_time(),
        model=model,
        context_chars=40,
        client=client,
    )


async def test_a_client_over_its_limit_waits_apart_while_another_clients_calls_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, receive = service({"alice": ModelLimits(concurrent=1)})
    first = await adm.admit(call("a1", "alice"), trio.current_time())
    passed: list[float] = []
    refused: list[RateLimited] = []

    async def alice_again() -> None:
        try:
            await adm.admit(call("a2", "alice"), trio.current_time())
        except RateLimited as exc:
            refused.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(alice_again)
        await trio.sleep(1.0)
        # alice's call waits at the head of a queue of its own: bob's go straight through.
        for n in range(3):
            await adm.admit(call(f"b{n}", "bob"), trio.current_time())
            passed.append(trio.current_time())
    assert passed == [pytest.approx(1.0)] * 3
    assert trio.current_time() == pytest.approx(5.0)
    (error,) = refused
    assert "client alice" in error.message
    assert "limits.clients.alice.concurrent" in error.message
    assert error.retry_after_s == pytest.approx(1.0)
    rows = decisions(receive)
    held = [(p, a, d.get("client"), d.get("limited_by")) for p, a, d in rows if p == "a2"]
    assert held == [("a2", "queue", "alice", "client"), ("a2", "reject", "alice", "client")]
    assert isinstance(first, Ticket)
    assert first.reservation is not None
    assert first.reservation.client == "alice"
    stats = adm.statistics(trio.current_time())["clients"]["alice"]
    assert stats["used"]["concurrent"] == 1
    assert stats["limits"]["concurrent"] == 1


async def test_a_clients_limit_counts_every_model_and_its_ended_call_wakes_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, _ = service({"alice": ModelLimits(concurrent=1)}, max_wait=30.0)
    first = await adm.admit(call("a1", "alice", BIG), trio.current_time())
    admitted_at: list[float] = []

    async def other_model() -> None:
        await adm.admit(call("a2", "alice", SMALL), trio.current_time())
        admitted_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_model)
        await trio.sleep(3.0)
        assert admitted_at == []  # held by alice's call of the other model
        adm.done(first, None, 200, trio.current_time())
    # Woken when alice's call of qwen-32b ended, not at the end of its 30 s wait.
    assert admitted_at == [pytest.approx(3.0)]


async def test_a_call_over_its_clients_limit_is_not_moved_down_a_fallback_chain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    adm, receive = service({"alice": ModelLimits(rpm=1)}, max_wait=0.0)
    await adm.admit(call("a1", "alice", "coder"), trio.current_time())
    with pytest.raises(RateLimited, match="client alice"):
        await adm.admit(call("a2", "alice", "coder"), trio.current_time())
    assert [a for p, a, _ in decisions(receive) if p == "a2"] == ["reject"]
    # A call with no client, or another client, is not limited by alice's limits at all.
    await adm.admit(call("x", None, "coder"), trio.current_time())
    await adm.admit(call("b", "bob", "coder"), trio.current_time())


async def test_a_clients_window_is_shared_through_redis(redis_server: RedisServer) -> None:
    """Two instances, each with alice at rpm 2: the second instance refuses alice's third call
    of the minute, counted in Redis under the client's own key, while bob's pass."""
    limits = {"alice": ModelLimits(rpm=2)}
    links = [SharedLimits(redis_server.url, f"i{n}", heartbeat_s=60.0) for n in range(2)]
    offset = time.time() - trio.current_time()
    async with links[0].client, links[1].client:
        for link in links:
            await link.beat(trio.current_time() + offset)
        one, _ = service(limits, max_wait=0.0, shared=links[0])
        two, _ = service(limits, max_wait=0.0, shared=links[1])
        one.offset = two.offset = offset
        await one.admit(call("a1", "alice"), trio.current_time())
        await two.admit(call("a2", "alice"), trio.current_time())
        with pytest.raises(RateLimited, match="client alice"):
            await two.admit(call("a3", "alice"), trio.current_time())
        await two.admit(call("b1", "bob"), trio.current_time())
        keys = await links[0].client.keys("thunderproxy:limits:" + client_key("alice") + ":*")
    assert len(keys) == 2  # the minute's window and the day's
