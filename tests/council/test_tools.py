"""fetch_url and web_search against local servers on loopback (with private addresses
allowed, as the proxy's setting can), the address checks, and the tool loop's budget."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from tests.council.fakes import ScriptedClient
from thunderproxy.council import special_addresses, tools
from thunderproxy.council.llm import ToolCall
from thunderproxy.council.tools import Toolbox, ToolSettings
from thunderproxy.sim.api.asgi import lifespan

PAGE = (
    b"<html><head><title>The Page</title><style>p{color:red}</style>"
    b"<script>var secret = 1;</script></head><body><h1>Heading</h1><p>First &amp; "
    b"foremost.</p><ul><li>one</li><li>two</li></ul></body></html>"
)
Send = Callable[[dict[str, Any]], Awaitable[None]]


class LocalSite:
    """Pages, a redirect, a large body, a search stand-in and a barrier that answers only
    once two requests wait on it (it proves tool calls run in parallel)."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.waiting = 0
        self.both_arrived = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        path = scope["path"]
        self.hits.append(path)
        query = parse_qs(scope["query_string"].decode())
        if path == "/page":
            await self._send(send, 200, PAGE, "text/html; charset=utf-8")
        elif path == "/moved":
            await self._send(send, 302, b"", "text/plain", [(b"location", b"/page")])
        elif path == "/big":
            await self._send(send, 200, b"x" * 3_000_000, "text/plain")
        elif path == "/search":
            q = query.get("q", [""])[0]
            body = {"results": [{"title": f"About {q}", "url": "http://example.org/a",
                                 "content": "An   answer."}]}  # fmt: skip
            await self._send(send, 200, json.dumps(body).encode(), "application/json")
        elif path.startswith("/barrier"):
            self.waiting += 1
            if self.waiting >= 2:
                self.both_arrived.set()
            await self.both_arrived.wait()
            await self._send(send, 200, path.encode(), "text/plain")
        else:
            await self._send(send, 404, b"no", "text/plain")

    @staticmethod
    async def _send(
        send: Send, status: int, body: bytes, ctype: str, extra: list[Any] | None = None
    ) -> None:
        headers = [(b"content-type", ctype.encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def site(nursery: trio.Nursery) -> tuple[LocalSite, str]:
    app = LocalSite()
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    urls = await nursery.start(serve, app, config)
    return app, urls[0]


ALLOWED = ToolSettings(allow_private=True, fetch_max_chars=5_000, fetch_max_bytes=10_000)


def test_html_becomes_readable_text_without_scripts_or_styles() -> None:
    text = tools.html_to_text(PAGE.decode())
    assert text == "The Page\n\nHeading\nFirst & foremost.\none\ntwo"


#: (address, the registry block it falls in, refused): at least one case for every entry of
#: ``special_addresses``, the block its most specific one (None: in no registry). The comment
#: names the entry; "reachable" is the registry's Globally Reachable column.
ADDRESS_CASES: list[tuple[str, str | None, bool]] = [
    # Ordinary addresses: in no registry, globally reachable.
    ("93.184.215.14", None, False),
    ("2606:4700::1111", None, False),
    # IANA IPv4 Special-Purpose Address Registry.
    ("0.1.2.3", "0.0.0.0/8", True),  # "This network"
    ("0.0.0.0", "0.0.0.0/32", True),  # "This host on this network"
    ("10.1.2.3", "10.0.0.0/8", True),  # Private-Use
    ("100.64.0.1", "100.64.0.0/10", True),  # Shared Address Space (carrier-grade NAT)
    ("100.100.100.200", "100.64.0.0/10", True),  # where some clouds put metadata services
    ("127.0.0.1", "127.0.0.0/8", True),  # Loopback
    ("169.254.169.254", "169.254.0.0/16", True),  # Link Local
    ("172.16.5.4", "172.16.0.0/12", True),  # Private-Use
    ("192.0.0.200", "192.0.0.0/24", True),  # IETF Protocol Assignments
    ("192.0.0.1", "192.0.0.0/29", True),  # IPv4 Service Continuity Prefix
    ("192.0.0.8", "192.0.0.8/32", True),  # IPv4 dummy address
    ("192.0.0.9", "192.0.0.9/32", False),  # Port Control Protocol Anycast: reachable
    ("192.0.0.10", "192.0.0.10/32", False),  # TURN Anycast: reachable
    ("192.0.0.170", "192.0.0.170/32", True),  # NAT64/DNS64 Discovery
    ("192.0.0.171", "192.0.0.171/32", True),  # NAT64/DNS64 Discovery
    ("192.0.2.1", "192.0.2.0/24", True),  # Documentation (TEST-NET-1)
    ("192.31.196.1", "192.31.196.0/24", False),  # AS112-v4: reachable
    ("192.52.193.1", "192.52.193.0/24", False),  # AMT: reachable
    ("192.88.99.1", "192.88.99.0/24", True),  # Deprecated (6to4 Relay Anycast): N/A
    ("192.88.99.2", "192.88.99.2/32", True),  # 6a44-relay anycast address
    ("192.168.0.1", "192.168.0.0/16", True),  # Private-Use
    ("192.175.48.6", "192.175.48.0/24", False),  # Direct Delegation AS112 Service: reachable
    ("198.18.0.1", "198.18.0.0/15", True),  # Benchmarking
    ("198.51.100.7", "198.51.100.0/24", True),  # Documentation (TEST-NET-2)
    ("203.0.113.9", "203.0.113.0/24", True),  # Documentation (TEST-NET-3)
    ("240.0.0.1", "240.0.0.0/4", True),  # Reserved
    ("255.255.255.255", "255.255.255.255/32", True),  # Limited Broadcast
    # IPv4 Multicast Address Space Registry.
    ("224.0.1.1", "224.0.0.0/4", True),  # Multicast
    # IANA IPv6 Special-Purpose Address Registry.
    ("::1", "::1/128", True),  # Loopback Address
    ("::", "::/128", True),  # Unspecified Address
    # IPv4-mapped Address: judged as the IPv4 address it maps.
    ("::ffff:127.0.0.1", "::ffff:0:0/96", True),
    ("::ffff:100.64.0.1", "::ffff:0:0/96", True),
    ("::ffff:8.8.8.8", "::ffff:0:0/96", False),
    # IPv4-IPv6 Translat. (NAT64, RFC 6052): reachable, and so must its IPv4 address be.
    ("64:ff9b::7f00:1", "64:ff9b::/96", True),  # of 127.0.0.1
    ("64:ff9b::a9fe:a9fe", "64:ff9b::/96", True),  # of 169.254.169.254
    ("64:ff9b::808:808", "64:ff9b::/96", False),  # of 8.8.8.8
    ("64:ff9b:1::1", "64:ff9b:1::/48", True),  # IPv4-IPv6 Translat. (RFC 8215, local use)
    ("100::1", "100::/64", True),  # Discard-Only Address Block
    ("100:0:0:1::1", "100:0:0:1::/64", True),  # Dummy IPv6 Prefix
    ("2001:5::1", "2001::/23", True),  # IETF Protocol Assignments
    # TEREDO: reachability N/A, so refused whatever server and client it names.
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "2001::/32", True),  # client 127.0.0.1
    ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", "2001::/32", True),  # client 8.8.8.8
    ("2001:1::1", "2001:1::1/128", False),  # Port Control Protocol Anycast: reachable
    ("2001:1::2", "2001:1::2/128", False),  # TURN Anycast: reachable
    ("2001:1::3", "2001:1::3/128", False),  # DNS-SD SRP Anycast: reachable
    ("2001:2::1", "2001:2::/48", True),  # Benchmarking
    ("2001:3::1", "2001:3::/32", False),  # AMT: reachable
    ("2001:4:112::1", "2001:4:112::/48", False),  # AS112-v6: reachable
    ("2001:10::1", "2001:10::/28", True),  # Deprecated (previously ORCHID): N/A
    ("2001:20::1", "2001:20::/28", False),  # ORCHIDv2: reachable
    ("2001:30::1", "2001:30::/28", False),  # Drone Remote ID DETs Prefix: reachable
    ("2001:db8::1", "2001:db8::/32", True),  # Documentation
    # 6to4: reachability N/A; judged by the IPv4 address it carries.
    ("2002:7f00:1::1", "2002::/16", True),  # of 127.0.0.1
    ("2002:a9fe:a9fe::1", "2002::/16", True),  # of 169.254.169.254
    ("2002:808:808::1", "2002::/16", False),  # of 8.8.8.8
    ("2620:4f:8000::42", "2620:4f:8000::/48", False),  # Direct Delegation AS112: reachable
    ("3fff::1", "3fff::/20", True),  # Documentation
    ("5f00::1", "5f00::/16", True),  # Segment Routing (SRv6) SIDs
    ("fd00::1", "fc00::/7", True),  # Unique-Local
    ("fe80::1%eth0", "fe80::/10", True),  # Link-Local Unicast
    # IPv6 Multicast Address Space Registry.
    ("ff0e::1", "ff00::/8", True),  # Multicast (global scope)
    # IPv4-compatible (deprecated, in no registry): judged by the IPv4 address it carries.
    ("::127.0.0.1", None, True),
]


@pytest.mark.parametrize(
    ("address", "block", "refused"),
    ADDRESS_CASES,
    ids=[f"{address}-{refused}" for address, _, refused in ADDRESS_CASES],
)
def test_private_and_local_addresses_are_refused(
    address: str, block: str | None, refused: bool
) -> None:
    """Decided from the project's copy of the IANA registries, so the same on every Python
    (``ipaddress``'s ``is_global`` for 2002:808:808::1 differs between 3.11 patch releases)."""
    entry = special_addresses.entry_for(ipaddress.ip_address(address.split("%")[0]))
    assert (str(entry.block) if entry else None) == block
    assert tools.address_refused(address) is refused


def test_every_registry_entry_has_an_address_case() -> None:
    blocks = [str(entry.block) for entry in special_addresses.ENTRIES]
    assert len(set(blocks)) == len(blocks)
    assert set(blocks) == {block for _, block, _ in ADDRESS_CASES if block is not None}


async def test_fetch_url_refuses_loopback_unless_allowed(site: tuple[LocalSite, str]) -> None:
    app, url = site
    async with httpx.AsyncClient() as client:
        with pytest.raises(tools.ToolFailed, match="private or local address"):
            await tools.fetch_url(client, url + "/page", ToolSettings())
        with pytest.raises(tools.ToolFailed, match="not an http"):
            await tools.fetch_url(client, "file:///etc/passwd", ToolSettings())
        assert app.hits == []
        text = await tools.fetch_url(client, url + "/page", ALLOWED)
    assert text.startswith("The Page\n\nHeading")


async def test_fetch_url_follows_redirects_and_bounds_the_size(
    site: tuple[LocalSite, str],
) -> None:
    app, url = site
    async with httpx.AsyncClient() as client:
        assert "Heading" in await tools.fetch_url(client, url + "/moved", ALLOWED)
        big = await tools.fetch_url(client, url + "/big", ALLOWED)
        with pytest.raises(tools.ToolFailed, match="HTTP 404"):
            await tools.fetch_url(client, url + "/missing", ALLOWED)
    assert app.hits[:2] == ["/moved", "/page"]
    assert big == "x" * 5_000 + "\n[truncated]"


async def test_web_search_uses_the_configured_endpoint_and_is_off_without_one(
    site: tuple[LocalSite, str],
) -> None:
    _app, url = site
    async with httpx.AsyncClient() as client:
        box = Toolbox(client, ToolSettings(search_url=url + "/search"))
        assert [t["function"]["name"] for t in box.definitions()] == ["fetch_url", "web_search"]
        found = await box.execute(ToolCall("c1", "web_search", '{"query": "trio"}'))
        assert found == "1. About trio\nhttp://example.org/a\nAn answer."
        off = Toolbox(client, ToolSettings())
        assert [t["function"]["name"] for t in off.definitions()] == ["fetch_url"]
        refused = await off.execute(ToolCall("c2", "web_search", '{"query": "trio"}'))
        assert refused == "Error: There is no tool named 'web_search'."
        bad = await off.execute(ToolCall("c3", "fetch_url", "{not json"))
        assert bad == "Error: fetch_url: arguments are not valid JSON."
        # Before: RecursionError out of a tool call that "never raises".
        deep = await off.execute(ToolCall("c4", "fetch_url", "[" * 5_000 + "]" * 5_000))
        assert deep == "Error: fetch_url: arguments nest too deep; send a flat JSON object."


async def test_the_tool_loop_runs_calls_in_parallel_and_forces_an_answer_after_the_budget(
    site: tuple[LocalSite, str],
) -> None:
    _app, url = site

    def script(model: str, messages: list[dict[str, Any]], offered: Any) -> Any:
        if offered is None:
            return "final answer"
        # Two calls per round that each wait for the other: sequential execution would hang.
        n = sum(1 for m in messages if m["role"] == "tool")
        return tuple(
            ToolCall(f"c{n + i}", "fetch_url", json.dumps({"url": f"{url}/barrier/{n + i}"}))
            for i in range(2)
        )

    client = ScriptedClient(script)
    seen_tools: list[tuple[int, str, str]] = []
    texts: list[str] = []

    async def on_tool(round_: int, call: ToolCall, result: str) -> None:
        seen_tools.append((round_, call.id, result))

    async def on_text(text: str) -> None:
        texts.append(text)

    async with httpx.AsyncClient() as http:
        box = Toolbox(http, ALLOWED)
        with trio.fail_after(10):
            answer = await tools.answer_with_tools(
                client, model="m", messages=[{"role": "user", "content": "q"}],
                program_id="p", toolbox=box, on_text=on_text, on_tool=on_tool, max_rounds=1,
            )  # fmt: skip
    assert answer == "final answer "
    assert "".join(texts) == answer
    assert len(client.calls) == 2
    assert client.calls[0]["tools"] is not None
    last = client.calls[1]
    assert last["tools"] is None
    assert last["messages"][-1] == {"role": "user", "content": tools.FINAL_ANSWER_NOTE}
    results = [m for m in last["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [
        ("c0", "/barrier/0"),
        ("c1", "/barrier/1"),
    ]
    assert sorted(seen_tools) == [(1, "c0", "/barrier/0"), (1, "c1", "/barrier/1")]


async def test_the_tool_loop_stops_at_five_rounds_by_default(autojump_clock: Any) -> None:
    def script(model: str, messages: list[dict[str, Any]], offered: Any) -> Any:
        if offered is None:
            return "done"
        return (ToolCall("c", "no_such_tool", "{}"),)

    client = ScriptedClient(script)

    async def ignore(*_: Any) -> None:
        pass

    async with httpx.AsyncClient() as http:
        answer = await tools.answer_with_tools(
            client, model="m", messages=[{"role": "user", "content": "q"}], program_id="p",
            toolbox=Toolbox(http, ToolSettings()), on_text=ignore, on_tool=ignore,
        )  # fmt: skip
    assert answer == "done "
    assert [c["tools"] is not None for c in client.calls] == [True] * 5 + [False]


async def test_fetch_url_connects_to_the_address_it_checked(
    site: tuple[LocalSite, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that resolves to an allowed address when checked and to a refused one when the
    client connects (DNS rebinding) is read from the address checked. Here 127.0.0.1 stands in
    for a public address and 10.255.255.1 for the private one it must not reach."""
    app, url = site
    port = int(url.rsplit(":", 1)[1])
    answers = iter(["127.0.0.1"] + ["10.255.255.1"] * 10)

    class Rebinding(trio.abc.HostnameResolver):
        async def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            assert host in (b"rebind.test", "rebind.test")
            return [(trio.socket.AF_INET, trio.socket.SOCK_STREAM, 6, "", (next(answers), port))]

        async def getnameinfo(self, sockaddr: Any, flags: int) -> Any:
            raise NotImplementedError

    monkeypatch.setattr(tools, "address_refused", lambda address: address != "127.0.0.1")
    trio.socket.set_custom_hostname_resolver(Rebinding())
    try:
        with trio.fail_after(10):
            async with httpx.AsyncClient() as client:
                text = await tools.fetch_url(
                    client, f"http://rebind.test:{port}/page", ToolSettings(timeout_s=5)
                )
    finally:
        trio.socket.set_custom_hostname_resolver(None)
    assert text.startswith("The Page")
    assert app.hits == ["/page"]


async def test_fetch_url_checks_the_resolved_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name is judged by what it resolves to, not by how it looks."""

    class CarrierNat(trio.abc.HostnameResolver):
        async def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            return [
                (trio.socket.AF_INET, trio.socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
                (trio.socket.AF_INET, trio.socket.SOCK_STREAM, 6, "", ("100.64.0.1", port)),
            ]

        async def getnameinfo(self, sockaddr: Any, flags: int) -> Any:
            raise NotImplementedError

    trio.socket.set_custom_hostname_resolver(CarrierNat())
    try:
        async with httpx.AsyncClient() as client:
            with pytest.raises(tools.ToolFailed, match=r"private or local address \(100.64.0.1\)"):
                await tools.fetch_url(client, "http://metadata.test/", ToolSettings())
    finally:
        trio.socket.set_custom_hostname_resolver(None)
