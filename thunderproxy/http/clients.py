"""Client keys at the edge (``[clients]``, docs/CONFIG.md): who is calling, and what that scopes.

With clients configured, every LLM, council and passthrough request must carry a client's key
(``Authorization: Bearer <key>``, ``x-api-key: <key>``, or HTTP Basic with the key as password,
for a browser on the council's page); one without is refused with ``ClientUnauthorized`` (401)
in its route's error shape. The client's name then

- scopes its program ids (``program_id``): ``alice:task-42`` and ``bob:task-42`` are two
  programs, so no client can pause, extend or be charged for another's, and each client's
  calls are recognised only among its own programs (a recognizer per client);
- is recorded on each of its steps and rejections, and counts its council jobs;
- never reaches a backend with its key: the key headers are withheld from what is forwarded,
  unless the backend is listed in ``forward_key_to`` (a backend's own credentials, from its
  URL, are sent to it by the backend client).

Without clients none of this applies: program ids, recognition and forwarding are as they were.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from typing import Any

from ..config.clients import ClientsSpec
from ..errors import ClientUnauthorized
from ..protocols.recognition import ProgramRecognizer

#: The ASGI scope key the identified client's name is kept under for the rest of the exchange.
CLIENT_KEY = "thunderproxy.client"
#: The headers a client's key may come in; withheld from backends when clients are configured.
KEY_HEADERS = frozenset({"authorization", "x-api-key"})
#: Between a client's name and its own program id (names hold no ``:``).
SCOPE_SEPARATOR = ":"


def _candidates(items: Iterable[tuple[str, str]]) -> Iterable[str]:
    """The keys a request presents, in the headers' order."""
    for name, value in items:
        lower = name.lower()
        if lower == "x-api-key":
            yield value.strip()
        elif lower == "authorization":
            scheme, _, presented = value.strip().partition(" ")
            presented = presented.strip()
            if scheme.lower() == "bearer":
                yield presented
            elif scheme.lower() == "basic":
                # A browser asked for credentials: any user name, the key as password.
                try:
                    decoded = base64.b64decode(presented, validate=True).decode()
                except (binascii.Error, ValueError, UnicodeDecodeError):
                    continue
                yield decoded.partition(":")[2]


class Clients:
    """The ``[clients]`` gate: identifies a request's client, scopes its program ids, and
    holds a program recognizer per client (``shared`` is the one for calls with no client)."""

    def __init__(self, spec: ClientsSpec | None, shared: ProgramRecognizer) -> None:
        self.spec = spec
        self.shared = shared
        self._recognizers: dict[str, ProgramRecognizer] = {}

    @property
    def enabled(self) -> bool:
        return self.spec is not None

    def identify(self, items: Iterable[tuple[str, str]]) -> str | None:
        """The calling client's name; None when no clients are configured. Raises
        ClientUnauthorized when they are and the request carries none of their keys."""
        spec = self.spec
        if spec is None:
            return None
        presented = False
        for key in _candidates(items):
            presented = True
            client = spec.client_of(key)
            if client is not None:
                return client
        raise ClientUnauthorized(
            (
                "The key sent is no configured client's"
                if presented
                else "This proxy serves configured clients only, and the request carries no key"
            )
            + ": send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') with the key the "
            "proxy's operator gave you ([clients] in its config)."
        )

    def recognizer(self, client: str | None) -> ProgramRecognizer:
        """The recognizer of ``client``'s calls: its own, so that no call of another client
        is ever tied to one of its programs by a session id, a response id or a prompt."""
        if client is None:
            return self.shared
        found = self._recognizers.get(client)
        if found is None:
            found = self._recognizers[client] = ProgramRecognizer(self.shared.config)
        return found

    def forget(self, program_id: str) -> None:
        """Forget a released program (by the id it is tracked by) in its client's recognizer,
        so that a later call continuing it starts a new program."""
        if self.spec is None:
            self.shared.forget(program_id)
            return
        client, _, own = program_id.partition(SCOPE_SEPARATOR)
        found = self._recognizers.get(client)
        if found is not None and own:
            found.forget(own)

    def withheld(
        self, items: Iterable[tuple[str, str]]
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """``items`` split into what may be forwarded and the key headers kept back (all of
        them, the client's key among them, when clients are configured; none otherwise)."""
        if self.spec is None:
            return list(items), []
        sent: list[tuple[str, str]] = []
        kept: list[tuple[str, str]] = []
        for item in items:
            (kept if item[0].lower() in KEY_HEADERS else sent).append(item)
        return sent, kept


def scoped(client: str | None, program_id: str) -> str:
    """The id a client's program is tracked and recorded by: its name, ``:``, the id it sent
    (the id itself when there is no client)."""
    return program_id if client is None else client + SCOPE_SEPARATOR + program_id


def client_of(scope: dict[str, Any] | Any) -> str | None:
    """The client identified for this exchange's ASGI scope (None: none, or no clients)."""
    value = scope.get(CLIENT_KEY) if hasattr(scope, "get") else None
    return value if isinstance(value, str) else None


__all__: Sequence[str] = ["CLIENT_KEY", "Clients", "KEY_HEADERS", "client_of", "scoped"]
