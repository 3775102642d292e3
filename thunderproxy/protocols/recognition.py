"""Which program a call belongs to, for agents that send no ``program_id``.

Sources are tried in this order; the first that names a program wins, and the result says which:

1. ``explicit``: ``program_id`` in the body, in ``extra_body``, or the ``X-Program-Id`` header;
2. ``session_header``: ``X-Session-ID`` (ThunderAgent's header; OpenCode sends it too);
3. ``claude_code``: Claude Code's ``X-Claude-Code-Session-Id`` header (``X-Claude-Code-Agent-Id``
   for a subagent, which is a chain of its own), else the session id inside Anthropic
   ``metadata.user_id`` (``user_<hash>_account_<uuid>_session_<uuid>``, or since v2.1.78 a JSON
   string with ``session_id``);
4. ``codex``: the ``session-id`` (or ``session_id``) header of OpenAI's Codex CLI;
5. ``litellm``: ``X-LiteLLM-Session-Id``, body ``litellm_session_id`` or
   ``metadata.litellm_session_id``;
6. ``previous_response``: a Responses ``previous_response_id`` continues the program of the
   response it names (``remember_response`` fills that map);
7. ``prompt_cache_key``: OpenAI's per-conversation cache key;
8. ``user``: OpenAI's ``user`` (off by default: it names an end user, whose tasks differ);
9. ``prefix``: the prompt extends a tracked program's last prompt plus its answer;
10. ``prompt_prefix``: the prompt extends a tracked program's last *prompt* with that call's
    answer left out and the client's own messages (user messages, tool outputs) appended, what
    mini-swe-agent does when a reply has no tool call: it drops the reply and adds a user
    message saying so;
11. ``edited_prefix``: the prompt extends a tracked program's last prompt up to, not including,
    that call's last user message, then carries that message edited (paragraphs added or taken
    off its end) and the call's answer right after it. aider appends a formatting reminder to
    its newest user message and drops it on the next turn, where it also moves the pair of
    messages that stands for its files (up to ``MAX_SKIPPED`` of the last prompt's messages
    before the user message) behind the answer;
12. ``new`` (``auto-<hash>``) when prefix tracking could have followed the request, else
    ``default`` (the single shared program, as before recognition existed).

Prefix continuation stores no text. Each prompt is a list of normalised messages (see each
protocol's ``chain_elements``); element i is hashed together with the hash of element i-1, so one
hash names a whole prefix. After a call, the hash of its prompt plus its answer becomes the
program's head (one per program). A later request computes its own chain, O(prompt), and looks
each link up. Two tasks with one system prompt share links only up to their first user message,
which never ends a stored prompt-plus-answer chain, so they never merge. Heads are kept in LRU
order, bounded, and expire after ``head_ttl_s`` without use.

A program's last prompt alone is kept too (one per program, with the same bounds), for
``prompt_prefix``. At each length the prompt-plus-answer head is tried first, and the longest
match wins, so a program that took its answer back is found only where nothing that kept the
answer claims the request. The prompt must be strictly extended (a request equal to it, a parallel
sample of the same prompt, starts a program of its own), a prompt of one element (a system prompt
alone) is never kept, and a prompt that two live programs both sent last (samples of one prompt,
or two runs of one task) names neither, and no shorter match is tried past it: such a request
starts a new program. What this rule can merge wrongly is a task whose whole first prompt (system
prompt and task text) another program sent last, then extended without the answer: in practice a
second run of the same task that does not keep its first answer, which then shares the other
run's cached prefix anyway.

``edited_prefix`` is tried only when nothing above names the request. Its key is the link of
the history before the edited message together with the hash of the answer that follows it, so
it stores no text either: for the message, the hashes of its text cut at each paragraph break
(``_EditPrint``). Two programs that share a system prompt and a first question stay apart by
their answers; where two gave the very same answer to the same history, the key names neither
and the request starts a new program.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from typing import Protocol as TypingProtocol

from ..errors import InvalidRequest
from . import Protocol, answer_elements, chain_elements
from .base import load_embedded

DEFAULT_PROGRAM = "default"
MAX_PROGRAM_ID_CHARS = 256
#: A client's own id longer than this is replaced by its hash (the source prefix is kept).
_MAX_CLIENT_ID_CHARS = 200
#: ``edited_prefix``: messages of the last prompt, between the history and its last user
#: message, that the next prompt may move behind the answer (aider's files pair, and its images
#: pair).
MAX_SKIPPED = 4
#: Paragraph breaks of a user message whose cuts are kept for ``edited_prefix``.
MAX_CUTS = 64
_LEGACY_USER_ID = re.compile(r"_session_([0-9A-Za-z-]+)$")


class HeaderItems(TypingProtocol):
    """Request headers: a dict, or werkzeug's ``Headers`` (names in any case)."""

    def items(self) -> Iterable[tuple[str, str]]: ...


class Source(enum.StrEnum):
    """Where a program id came from, in the order the sources are tried."""

    EXPLICIT = "explicit"
    SESSION_HEADER = "session_header"
    CLAUDE_CODE = "claude_code"
    CODEX = "codex"
    LITELLM = "litellm"
    PREVIOUS_RESPONSE = "previous_response"
    PROMPT_CACHE_KEY = "prompt_cache_key"
    USER = "user"
    PREFIX = "prefix"
    PROMPT_PREFIX = "prompt_prefix"
    EDITED_PREFIX = "edited_prefix"
    NEW = "new"
    DEFAULT = "default"


@dataclass(frozen=True)
class RecognitionConfig:
    """One switch per source (``explicit`` off ignores program ids), and the memory bounds."""

    explicit: bool = True
    session_header: bool = True
    claude_code: bool = True
    codex: bool = True
    litellm: bool = True
    previous_response: bool = True
    prompt_cache_key: bool = True
    #: Off by default: OpenAI documents ``user`` as a stable end-user id, so it would merge every
    #: task of one user into one program.
    user: bool = False
    prefix: bool = True
    #: Chain heads kept (one per program that answered); about 200 bytes each.
    max_heads: int = 50_000
    #: response id -> program entries kept for ``previous_response_id``.
    max_responses: int = 50_000
    #: A head or response id unused this long no longer matches.
    head_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_heads < 1 or self.max_responses < 1 or self.head_ttl_s <= 0:
            raise ValueError(
                "RecognitionConfig needs max_heads >= 1, max_responses >= 1 and head_ttl_s > 0; "
                "switch a source off with its flag instead."
            )


@dataclass(frozen=True)
class Recognised:
    program_id: str
    source: Source
    #: For ``prefix`` and ``prompt_prefix``: how many prompt elements (messages) matched. Not
    #: part of what names the program, so not compared.
    matched: int | None = field(default=None, compare=False)

    @property
    def by_prompt(self) -> bool:
        """Whether only the prompt ties this call to its program, so the next call can only be
        recognised if this one's answer is observed (``observe_answer``)."""
        return self.source in (
            Source.PREFIX,
            Source.PROMPT_PREFIX,
            Source.EDITED_PREFIX,
            Source.NEW,
        )


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _element_bytes(element: Any) -> bytes:
    text = json.dumps(
        element, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str
    )
    return text.encode("utf-8", "surrogatepass")


def chain(protocol: Protocol, elements: list[Any]) -> list[bytes]:
    """The hash chain of a prompt: link i names elements 0..i (and the protocol)."""
    link = _digest(protocol.value.encode())
    links = []
    for element in elements:
        link = _digest(link + _element_bytes(element))
        links.append(link)
    return links


#: The kinds of prompt element (chain_elements' first item) that the client adds itself.
CLIENT_TURNS = frozenset({"user", "tool", "function_call_output"})


def _kind(element: Any) -> Any:
    return element[0] if isinstance(element, list) and element else None


def _seed(protocol: Protocol) -> bytes:
    """The link before a prompt's first element (``chain``'s start)."""
    return _digest(protocol.value.encode())


def _short(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def _last_text(element: Any) -> tuple[Any, str] | None:
    """An element's shape with its last string left blank, and that string: the text of a
    user message (its role and any other part are the shape)."""
    found: list[str] = []

    def blank(value: Any) -> Any:
        if isinstance(value, list):
            return [blank(v) for v in reversed(value)][::-1]
        if isinstance(value, dict):
            items = [(k, blank(value[k])) for k in reversed(sorted(value))]
            return dict(reversed(items))
        if isinstance(value, str) and not found:
            found.append(value)
            return ""
        return value

    shape = blank(element)
    return (shape, found[0]) if found else None


def _cuts(text: str) -> Iterable[bytes]:
    """Hashes of ``text`` cut at each paragraph break (trailing blanks off, as prompts are
    compared stripped), at most ``MAX_CUTS``, then of the whole text; one pass over it."""
    hasher = hashlib.blake2b(digest_size=8)
    done = 0
    start = text.find("\n\n")
    cuts = 0
    while start != -1 and cuts < MAX_CUTS:
        end = start
        while end > done and text[end - 1].isspace():
            end -= 1
        if end > done:
            hasher.update(text[done:end].encode("utf-8", "surrogatepass"))
            done = end
            yield hasher.copy().digest()
            cuts += 1
        start = text.find("\n\n", start + 2)
    hasher.update(text[done:].encode("utf-8", "surrogatepass"))
    yield hasher.digest()


@dataclass(frozen=True)
class _EditPrint:
    """A program's last user message, as ``edited_prefix`` compares it without its text: its
    shape, the hash of its text and the hashes of that text cut at each paragraph break."""

    shape: bytes
    whole: bytes
    cuts: frozenset[bytes]

    @classmethod
    def of(cls, element: Any) -> _EditPrint | None:
        found = _last_text(element)
        if found is None:
            return None
        shape, text = found
        cuts = list(_cuts(text))
        return cls(_short(_element_bytes(shape)), cuts[-1], frozenset(cuts))

    def edited_into(self, element: Any) -> bool:
        """Whether ``element`` is this message with paragraphs taken off its end (aider's
        reminder dropped), or added to it."""
        found = _last_text(element)
        if found is None or _short(_element_bytes(found[0])) != self.shape:
            return False
        cuts = list(_cuts(found[1]))
        return cuts[-1] in self.cuts or self.whole in cuts


def _lower(headers: HeaderItems) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _client_id(value: Any) -> str | None:
    """A client-sent identifier, if it is a usable one."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not text or not text.isprintable():
        return None
    return text


def _named(prefix: str, value: str) -> str:
    if len(value) > _MAX_CLIENT_ID_CHARS:
        value = hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
    return f"{prefix}:{value}"


def explicit_program_id(body: dict[str, Any], headers: HeaderItems) -> str | None:
    """The program id the client named, from the body, ``extra_body`` or ``X-Program-Id`` (in
    that order); InvalidRequest if it is not a usable id."""
    found: list[Any] = []
    if "program_id" in body:
        found.append(body["program_id"])
    extra = body.get("extra_body")
    if isinstance(extra, dict) and "program_id" in extra:
        found.append(extra["program_id"])
    header = _lower(headers).get("x-program-id")
    if header is not None:
        found.append(header)
    if not found:
        return None
    program_id = found[0]
    if not isinstance(program_id, str) or not program_id.strip():
        raise InvalidRequest("program_id must be a non-empty string.", param="program_id")
    if len(program_id) > MAX_PROGRAM_ID_CHARS:
        raise InvalidRequest(
            f"program_id is longer than {MAX_PROGRAM_ID_CHARS} characters; send a shorter id.",
            param="program_id",
        )
    return program_id


def without_program_id(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` without the proxy's own fields, so the backend never sees them."""
    sent = {k: v for k, v in body.items() if k != "program_id"}
    extra = sent.get("extra_body")
    if isinstance(extra, dict) and "program_id" in extra:
        rest = {k: v for k, v in extra.items() if k != "program_id"}
        if rest:
            sent["extra_body"] = rest
        else:
            del sent["extra_body"]
    return sent


def claude_code_session(user_id: Any) -> str | None:
    """The session id Claude Code embeds in Anthropic ``metadata.user_id``: a JSON string (or
    object) with ``session_id`` since v2.1.78, ``user_<hash>_account_<uuid>_session_<uuid>``
    before."""
    if isinstance(user_id, str) and user_id.lstrip().startswith("{"):
        try:
            user_id = load_embedded(user_id)
        except ValueError:  # not JSON, or nested too deep to parse safely
            return None
    if isinstance(user_id, dict):
        return _client_id(user_id.get("session_id"))
    if isinstance(user_id, str):
        match = _LEGACY_USER_ID.search(user_id.strip())
        return match.group(1) if match else None
    return None


class ProgramRecognizer:
    """Names the program of each call (``recognise``) and learns from each answer
    (``observe_answer``, ``remember_response``). Pure: no I/O, no clock (callers pass ``now``)."""

    def __init__(
        self, config: RecognitionConfig | None = None, *, salt: bytes | None = None
    ) -> None:
        self.config = config or RecognitionConfig()
        # Salt for new ids, so a restarted proxy never reuses an id its audit db already holds.
        self._salt = os.urandom(8) if salt is None else salt
        self._created = 0
        self._heads: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._head_of: dict[str, bytes] = {}
        # A program's last prompt without its answer; the owner "" marks a prompt that two
        # live programs sent last, which names neither.
        self._prompts: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._prompt_of: dict[str, bytes] = {}
        # edited_prefix: (history link + answer hash) -> program ("": two programs), and per
        # program its keys and its last user message's print.
        self._edits: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._edit_of: dict[str, tuple[list[bytes], _EditPrint]] = {}
        self._responses: OrderedDict[str, tuple[str, float]] = OrderedDict()

    @property
    def tracked_heads(self) -> int:
        return len(self._heads)

    @property
    def tracked_responses(self) -> int:
        return len(self._responses)

    def recognise(
        self, protocol: Protocol, body: dict[str, Any], headers: HeaderItems, now: float
    ) -> Recognised:
        """The program of this request and the source that named it (see the module docstring
        for the order). Raises InvalidRequest only for a malformed explicit ``program_id``."""
        found = self._named(protocol, body, _lower(headers), now)
        if found is not None:
            return found
        links: list[bytes] = []
        if self.config.prefix:
            elements = chain_elements(protocol, body)
            links = chain(protocol, elements)
            shared = False
            for index in range(len(links) - 1, -1, -1):
                program_id = self._lookup(self._heads, links[index], now)
                if program_id is not None:
                    return Recognised(program_id, Source.PREFIX, matched=index + 1)
                # An earlier prompt is continued without its answer only by what the client
                # says next (a user message, a tool's output); another answer in its place is
                # a fork of that history, not its continuation.
                if index + 1 < len(elements) and _kind(elements[index + 1]) in CLIENT_TURNS:
                    program_id = self._lookup(self._prompts, links[index], now)
                    if program_id == "":
                        # Several live programs sent this prompt last: the request continues a
                        # history they share, and a shorter match would only name one of them
                        # by less of it. It starts a program of its own.
                        shared = True
                        break
                    if program_id is not None:
                        return Recognised(program_id, Source.PROMPT_PREFIX, matched=index + 1)
            if not shared and self._edits:
                edited = self._edited(protocol, elements, links, now)
                if edited is not None:
                    return edited
        if not links:
            return Recognised(DEFAULT_PROGRAM, Source.DEFAULT)
        self._created += 1
        seed = links[0] + self._salt + f"{self._created}:{now!r}".encode()
        return Recognised("auto-" + hashlib.blake2b(seed, digest_size=6).hexdigest(), Source.NEW)

    def _named(
        self, protocol: Protocol, body: dict[str, Any], headers: dict[str, str], now: float
    ) -> Recognised | None:
        config = self.config
        if config.explicit:
            program_id = explicit_program_id(body, headers)
            if program_id is not None:
                return Recognised(program_id, Source.EXPLICIT)
        if config.session_header:
            session = _client_id(headers.get("x-session-id"))
            if session is not None:
                if len(session) > MAX_PROGRAM_ID_CHARS:
                    session = _named("session", session)
                return Recognised(session, Source.SESSION_HEADER)
        if config.claude_code:
            session = self._claude_code(protocol, body, headers)
            if session is not None:
                return Recognised(_named("claude-code", session), Source.CLAUDE_CODE)
        if config.codex:
            session = _client_id(headers.get("session-id") or headers.get("session_id"))
            if session is not None:
                return Recognised(_named("codex", session), Source.CODEX)
        if config.litellm:
            session = _litellm_session(body, headers)
            if session is not None:
                return Recognised(_named("litellm", session), Source.LITELLM)
        if config.previous_response and protocol is Protocol.RESPONSES:
            previous = body.get("previous_response_id")
            if isinstance(previous, str):
                program_id = self._lookup(self._responses, previous, now)
                if program_id is not None:
                    return Recognised(program_id, Source.PREVIOUS_RESPONSE)
        if config.prompt_cache_key and protocol is not Protocol.MESSAGES:
            key = _client_id(body.get("prompt_cache_key"))
            if key is not None:
                return Recognised(_named("cache-key", key), Source.PROMPT_CACHE_KEY)
        if config.user and protocol is not Protocol.MESSAGES:
            user = _client_id(body.get("user"))
            if user is not None:
                return Recognised(_named("user", user), Source.USER)
        return None

    def _edited(
        self, protocol: Protocol, elements: list[Any], links: list[bytes], now: float
    ) -> Recognised | None:
        """``edited_prefix``: the latest user message followed by an answer that, with the
        history before it, is a program's last call edited (the module docstring)."""
        for index in range(len(elements) - 2, -1, -1):
            if _kind(elements[index]) != "user":
                continue
            before = links[index - 1] if index else _seed(protocol)
            key = _digest(before + _digest(_element_bytes(elements[index + 1])))
            entry = self._edits.get(key)
            if entry is None:
                continue
            program_id, used_at = entry
            owned = self._edit_of.get(program_id)
            if now - used_at > self.config.head_ttl_s or (program_id and owned is None):
                del self._edits[key]
                continue
            if owned is None or not owned[1].edited_into(elements[index]):
                # Two programs' (or not this message's edit): no shorter match is tried, as
                # for a prompt two programs sent last.
                return None
            self._edits[key] = (program_id, now)
            self._edits.move_to_end(key)
            return Recognised(program_id, Source.EDITED_PREFIX, matched=index + 2)
        return None

    @staticmethod
    def _claude_code(
        protocol: Protocol, body: dict[str, Any], headers: dict[str, str]
    ) -> str | None:
        session = _client_id(headers.get("x-claude-code-session-id"))
        agent = _client_id(headers.get("x-claude-code-agent-id"))
        if session is None and protocol is Protocol.MESSAGES:
            metadata = body.get("metadata")
            if isinstance(metadata, dict):
                session = claude_code_session(metadata.get("user_id"))
        if agent is not None:
            # A subagent has its own system prompt and history: a program of its own.
            return f"{session}/{agent}" if session is not None else agent
        return session

    def _lookup(
        self, table: OrderedDict[Any, tuple[str, float]], key: Any, now: float
    ) -> str | None:
        entry = table.get(key)
        if entry is None:
            return None
        program_id, used_at = entry
        if now - used_at > self.config.head_ttl_s:
            del table[key]
            if table is self._heads and self._head_of.get(program_id) == key:
                del self._head_of[program_id]
            if table is self._prompts and self._prompt_of.get(program_id) == key:
                del self._prompt_of[program_id]
            return None
        table[key] = (program_id, now)
        table.move_to_end(key)
        return program_id

    def observe_answer(
        self,
        program_id: str,
        protocol: Protocol,
        request_body: dict[str, Any],
        answer: Any,
        now: float,
    ) -> None:
        """Record a finished call: its prompt plus ``answer`` becomes ``program_id``'s head, which
        the program's next request will extend. ``answer`` is the protocol's assistant turn as
        the client sends it back (a chat message or its text, an Anthropic message or its content,
        Responses output items); the taps' ``answer()`` and ``answer_from_body`` give it."""
        if not self.config.prefix:
            return
        if protocol is Protocol.RESPONSES and (
            request_body.get("previous_response_id") or request_body.get("previous_response")
        ):
            return  # its input is only the new items: the earlier response carries the chain
        prompt = chain_elements(protocol, request_body)
        added = answer_elements(protocol, answer)
        if not prompt or not added:
            return
        links = chain(protocol, prompt + added)
        head = links[-1]
        self.forget(program_id)
        owner = self._heads.pop(head, None)
        if owner is not None and self._head_of.get(owner[0]) == head:
            del self._head_of[owner[0]]  # the same history, answered again: the latest owns it
        self._heads[head] = (program_id, now)
        self._head_of[program_id] = head
        _bound(self._heads, self._head_of, self.config.max_heads)
        if len(prompt) > 1:
            self._keep_prompt(program_id, links[len(prompt) - 1], now)
        self._keep_edit(program_id, protocol, prompt, links, added[0], now)

    def _keep_edit(
        self,
        program_id: str,
        protocol: Protocol,
        prompt: list[Any],
        links: list[bytes],
        answer: Any,
        now: float,
    ) -> None:
        """Make the call ``edited_prefix`` can continue: its last user message, edited, then
        its answer, after its history, with up to ``MAX_SKIPPED`` messages before that user
        message moved out of the way."""
        last = next((i for i in range(len(prompt) - 1, -1, -1) if _kind(prompt[i]) == "user"), None)
        if last is None:
            return
        printed = _EditPrint.of(prompt[last])
        if printed is None:
            return
        answered = _digest(_element_bytes(answer))
        keys = []
        for start in range(max(0, last - MAX_SKIPPED), last + 1):
            before = links[start - 1] if start else _seed(protocol)
            key = _digest(before + answered)
            owner = self._edits.get(key)
            if (
                owner is not None
                and owner[0] != program_id
                and now - owner[1] <= self.config.head_ttl_s
            ):
                self._edits[key] = ("", now)  # two live programs: it names neither
            else:
                self._edits[key] = (program_id, now)
                keys.append(key)
            self._edits.move_to_end(key)
        self._edit_of[program_id] = (keys, printed)
        while len(self._edits) > self.config.max_heads * (MAX_SKIPPED + 1):
            old, (owner_id, _) = self._edits.popitem(last=False)
            owned = self._edit_of.get(owner_id)
            if owned is not None and old in owned[0]:
                owned[0].remove(old)
                if not owned[0]:
                    del self._edit_of[owner_id]

    def _keep_prompt(self, program_id: str, link: bytes, now: float) -> None:
        owner = self._prompts.get(link)
        if owner is not None:
            other, used_at = owner
            if other != program_id and now - used_at <= self.config.head_ttl_s:
                # Two live programs sent this prompt last (samples of one prompt, or two runs
                # of one task): it names neither.
                program_id = ""
        self._prompts[link] = (program_id, now)
        self._prompts.move_to_end(link)
        if program_id:
            self._prompt_of[program_id] = link
        _bound(self._prompts, self._prompt_of, self.config.max_heads)

    def remember_response(self, response_id: str | None, program_id: str, now: float) -> None:
        """A Responses answer's id (the tap's ``response_id``, or ``response_id_from_body``): a
        later ``previous_response_id`` naming it continues ``program_id``. None (no id seen) is
        ignored."""
        if not self.config.previous_response or not response_id:
            return
        self._responses[response_id] = (program_id, now)
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.config.max_responses:
            self._responses.popitem(last=False)

    def forget(self, program_id: str) -> None:
        """Drop a program's chain head and last prompt (it was released, or it has newer
        ones)."""
        head = self._head_of.pop(program_id, None)
        if head is not None:
            self._heads.pop(head, None)
        prompt = self._prompt_of.pop(program_id, None)
        if prompt is not None and self._prompts.get(prompt, ("",))[0] == program_id:
            del self._prompts[prompt]
        edits = self._edit_of.pop(program_id, None)
        for key in edits[0] if edits is not None else ():
            if self._edits.get(key, ("",))[0] == program_id:
                del self._edits[key]


def _bound(
    table: OrderedDict[bytes, tuple[str, float]], owned: dict[str, bytes], size: int
) -> None:
    """Drop the least recently used entries past ``size``, and their owners' pointers."""
    while len(table) > size:
        old, (old_program, _) = table.popitem(last=False)
        if owned.get(old_program) == old:
            del owned[old_program]


def _litellm_session(body: dict[str, Any], headers: dict[str, str]) -> str | None:
    session = _client_id(headers.get("x-litellm-session-id"))
    if session is None:
        session = _client_id(body.get("litellm_session_id"))
    metadata = body.get("metadata")
    if session is None and isinstance(metadata, dict):
        session = _client_id(metadata.get("litellm_session_id"))
    return session
