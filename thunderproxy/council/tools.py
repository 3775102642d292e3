"""Tools a council member may call while answering: ``fetch_url`` and ``web_search``, and the
loop that runs a model with them (at most ``max_rounds`` rounds of tool calls, each round's
calls run in parallel, then a final answer without tools).

``fetch_url`` refuses every address that the IANA special-purpose registries do not call
globally reachable (``special_addresses``), and IPv6 addresses that carry such an IPv4 address
(every address the host resolves to is checked, the connection goes to a checked one, and each
redirect is checked again) unless the allow-private setting says otherwise: a model must not be
able to make the proxy read its own network.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import trio

from .errors import ToolFailed
from .llm import ChatClient, ChatRequest, Finished, TextDelta, ToolCall, closing
from .special_addresses import entry_for

#: Redirects followed by ``fetch_url``, each checked like the first address.
MAX_REDIRECTS = 5
#: Results of a web search handed to the model.
SEARCH_RESULTS = 5
FINAL_ANSWER_NOTE = (
    "You have used all your tool calls. Answer the question now from what you have found."
)

FETCH_URL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "fetch_url",
        "description": "Fetch a web page and return its text.",
        "parameters": {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "http(s) URL to read"}},
            "required": ["url"],
        },
    },
}
WEB_SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "web_search",
        "description": "Search the web; returns titles, URLs and snippets of the top results.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to search for"}},
            "required": ["query"],
        },
    },
}


@dataclass(frozen=True)
class ToolSettings:
    """Limits of the tools; ``search_url`` empty switches ``web_search`` off."""

    fetch_max_bytes: int = 2_000_000
    fetch_max_chars: int = 20_000
    timeout_s: float = 20.0
    allow_private: bool = False
    search_url: str = ""
    search_key: str = ""


# --- HTML to text ----------------------------------------------------------------------------

_SKIP = frozenset({"script", "style", "noscript", "template", "svg", "head"})
_BLOCK = frozenset(
    {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article",
     "header", "footer", "pre", "blockquote", "table", "ul", "ol", "title", "hr"}
)  # fmt: skip


class _TextParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title = ""
        self._skipping = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        elif tag in _SKIP:
            self._skipping += 1
        elif tag in _BLOCK:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in _SKIP:
            self._skipping = max(0, self._skipping - 1)
        elif tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skipping:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    """Readable text of an HTML page: its title, then the visible text, one block per line."""
    parser = _TextParser()
    parser.feed(html)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    body = "\n".join(line for line in lines if line)
    title = " ".join(parser.title.split())
    return f"{title}\n\n{body}" if title else body


# --- address checks --------------------------------------------------------------------------


#: Entries judged by the IPv4 address they carry instead of by their column: 6to4 (N/A, for a
#: 6to4 address reaches what its IPv4 address reaches) and IPv4-mapped (False, as no packet
#: carries one, but a socket given one connects to the IPv4 address it maps).
_SIXTOFOUR = ipaddress.ip_network("2002::/16")
_IPV4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
#: NAT64's well-known prefix (RFC 6052): its last 32 bits are the IPv4 address reached.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
#: IPv4-compatible IPv6 (deprecated, RFC 4291, in no registry): ``::a.b.c.d``.
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, 6to4, NAT64, IPv4-compatible):
    a packet to it may end up there, so it is judged as well. Teredo's are not read: the
    registry leaves Teredo's reachability N/A, so every Teredo address is refused."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    return None


def address_refused(address: str) -> bool:
    """True for every address the IANA special-purpose registries do not call globally
    reachable (``special_addresses``: private, loopback, link-local, carrier-grade NAT
    100.64.0.0/10, documentation, benchmarking, reserved, unspecified, and the N/A entries such
    as Teredo), multicast, and any IPv6 address that carries a refused IPv4 address (6to4,
    NAT64, IPv4-compatible); IPv4-mapped IPv6 and 6to4 are judged by the IPv4 they carry.
    Decided from the project's table, not the interpreter's ``is_global``, which changed
    between patch releases."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    entry = entry_for(ip)
    if (
        entry is not None
        and entry.block not in (_SIXTOFOUR, _IPV4_MAPPED)
        and not entry.globally_reachable
    ):
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        return inner is not None and address_refused(str(inner))
    return False


async def check_url(url: str, *, allow_private: bool) -> str | None:
    """Refuse anything but http(s) to a host whose every address is globally routable; the
    address to connect to (the first one resolved, all checked), None when private ones are
    allowed (the client resolves the host itself)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ToolFailed(f"fetch_url: {url!r} is not an http(s) URL.")
    if allow_private:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await trio.socket.getaddrinfo(parts.hostname, port, type=trio.socket.SOCK_STREAM)
    except OSError as exc:
        raise ToolFailed(f"fetch_url: cannot resolve {parts.hostname!r}: {exc}.") from None
    addresses = [str(info[4][0]) for info in infos]
    refused = sorted({a for a in addresses if address_refused(a)})
    if refused or not addresses:
        raise ToolFailed(
            f"fetch_url: {parts.hostname!r} resolves to a private or local address "
            f"({', '.join(refused) or 'none'}); such addresses are refused unless the proxy "
            "runs with --council-tools-allow-private."
        )
    return addresses[0]


def _pinned(url: str, address: str | None) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    """The request for ``url`` sent to ``address``, the one checked: a host that resolves
    again when the client connects could answer a private address the second time (DNS
    rebinding). ``Host`` and TLS's server name stay the URL's host."""
    target = httpx.URL(url)
    if address is None:
        return target, {}, {}
    host = target.host
    headers = {"host": target.netloc.decode("ascii")}
    extensions: dict[str, Any] = {"sni_hostname": host} if target.scheme == "https" else {}
    return target.copy_with(host=address), headers, extensions


async def fetch_url(client: httpx.AsyncClient, url: str, settings: ToolSettings) -> str:
    """The text of a web page, at most ``fetch_max_chars`` characters of it."""
    for _ in range(MAX_REDIRECTS + 1):
        address = await check_url(url, allow_private=settings.allow_private)
        target, headers, extensions = _pinned(url, address)
        try:
            async with client.stream(
                "GET", target, headers=headers, extensions=extensions, follow_redirects=False
            ) as response:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code >= 400:
                    raise ToolFailed(f"fetch_url: {url} answered HTTP {response.status_code}.")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) >= settings.fetch_max_bytes:
                        del body[settings.fetch_max_bytes :]
                        break
                ctype = response.headers.get("content-type", "")
                charset = response.charset_encoding or "utf-8"
        except httpx.HTTPError as exc:
            raise ToolFailed(f"fetch_url: {url} could not be read: {exc!r}.") from None
        try:
            text = body.decode(charset, "replace")
        except LookupError:
            text = body.decode("utf-8", "replace")
        if "html" in ctype or text.lstrip()[:1] == "<":
            text = html_to_text(text)
        if len(text) > settings.fetch_max_chars:
            text = text[: settings.fetch_max_chars] + "\n[truncated]"
        return text
    raise ToolFailed(f"fetch_url: more than {MAX_REDIRECTS} redirects from {url}.")


def search_results(body: Any) -> list[dict[str, str]]:
    """Results from the common JSON shapes: ``{"results": [...]}`` (SearXNG and simple
    services) or Brave's ``{"web": {"results": [...]}}``; each with title, url, snippet."""
    items: Any = []
    if isinstance(body, dict):
        items = body.get("results")
        if items is None and isinstance(body.get("web"), dict):
            items = body["web"].get("results")
    results = []
    for item in items or ():
        if not isinstance(item, dict):
            continue
        snippet = item.get("snippet") or item.get("description") or item.get("content") or ""
        results.append(
            {
                "title": str(item.get("title", "")),
                "url": str(item.get("url", "")),
                "snippet": " ".join(str(snippet).split()),
            }
        )
    return results[:SEARCH_RESULTS]


async def web_search(client: httpx.AsyncClient, query: str, settings: ToolSettings) -> str:
    headers = {}
    if settings.search_key:
        headers = {
            "authorization": f"Bearer {settings.search_key}",
            "x-subscription-token": settings.search_key,
        }
    try:
        response = await client.get(settings.search_url, params={"q": query}, headers=headers)
    except httpx.HTTPError as exc:
        raise ToolFailed(
            f"web_search: the search endpoint could not be reached: {exc!r}."
        ) from None
    if response.status_code != 200:
        raise ToolFailed(f"web_search: the search endpoint answered HTTP {response.status_code}.")
    try:
        results = search_results(response.json())
    except ValueError:
        raise ToolFailed("web_search: the search endpoint did not answer JSON.") from None
    if not results:
        return f"No results for {query!r}."
    return "\n\n".join(
        f"{n}. {r['title']}\n{r['url']}\n{r['snippet']}" for n, r in enumerate(results, start=1)
    )


class Toolbox:
    """The tools a member may call, executed by name."""

    def __init__(self, client: httpx.AsyncClient, settings: ToolSettings) -> None:
        self.client = client
        self.settings = settings

    def definitions(self) -> list[dict[str, Any]]:
        tools = [FETCH_URL_TOOL]
        if self.settings.search_url:
            tools.append(WEB_SEARCH_TOOL)
        return tools

    async def execute(self, call: ToolCall) -> str:
        """The tool's result, or the reason it failed, as text for the model; never raises
        for a bad call, so one broken call does not sink the member's answer."""
        try:
            args = json.loads(call.arguments or "{}")
            if not isinstance(args, dict):
                raise ToolFailed(f"{call.name}: arguments must be a JSON object.")
            with trio.fail_after(self.settings.timeout_s):
                if call.name == "fetch_url":
                    return await fetch_url(self.client, str(args.get("url", "")), self.settings)
                if call.name == "web_search" and self.settings.search_url:
                    return await web_search(self.client, str(args.get("query", "")), self.settings)
            raise ToolFailed(f"There is no tool named {call.name!r}.")
        except ToolFailed as exc:
            return f"Error: {exc.message}"
        except ValueError:
            return f"Error: {call.name}: arguments are not valid JSON."
        except RecursionError:  # a model's arguments nested past what Python's parser can
            return f"Error: {call.name}: arguments nest too deep; send a flat JSON object."
        except trio.TooSlowError:
            return f"Error: {call.name} took longer than {self.settings.timeout_s:g} s."


OnText = Callable[[str], Awaitable[None]]
OnTool = Callable[[int, ToolCall, str], Awaitable[None]]


async def answer_with_tools(
    client: ChatClient,
    *,
    model: str,
    messages: list[dict[str, Any]],
    program_id: str,
    toolbox: Toolbox | None,
    on_text: OnText,
    on_tool: OnTool,
    max_rounds: int = 5,
    max_tokens: int | None = None,
) -> str:
    """The model's final answer. While it asks for tools and rounds are left, run its calls
    in parallel and hand back the results; past the budget, ask once more without tools."""
    history = list(messages)
    rounds = 0
    while True:
        offer = toolbox is not None and rounds < max_rounds
        if toolbox is not None and not offer:
            history.append({"role": "user", "content": FINAL_ANSWER_NOTE})
        text: list[str] = []
        finished = Finished(None)
        stream = client.stream_chat(
            ChatRequest(
                model=model,
                messages=history,
                program_id=program_id,
                tools=toolbox.definitions() if offer and toolbox is not None else None,
                max_tokens=max_tokens,
            )
        )
        async with closing(stream) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    text.append(event.text)
                    await on_text(event.text)
                else:
                    finished = event
        if not (offer and toolbox is not None and finished.tool_calls):
            return "".join(text)
        rounds += 1
        history.append(
            {
                "role": "assistant",
                "content": "".join(text) or None,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in finished.tool_calls
                ],
            }
        )
        results: list[str] = [""] * len(finished.tool_calls)
        async with trio.open_nursery() as nursery:
            for index, call in enumerate(finished.tool_calls):
                nursery.start_soon(_run_tool, toolbox, call, index, results, rounds, on_tool)
        for call, result in zip(finished.tool_calls, results, strict=True):
            history.append({"role": "tool", "tool_call_id": call.id, "content": result})


async def _run_tool(
    toolbox: Toolbox, call: ToolCall, index: int, results: list[str], round_: int, on_tool: OnTool
) -> None:
    results[index] = await toolbox.execute(call)
    await on_tool(round_, call, results[index])
