"""The ``[clients]`` config section as values: who may call the proxy, by the hashes of their
keys (docs/CONFIG.md, "Client keys").

Without the section the proxy serves anyone who reaches it, as a workstation's proxy does. With
it, every LLM, council and passthrough call must carry the key of a client named here, and the
client's name scopes its program ids, so that two clients sending the same ``program_id`` are
two programs. Only SHA-256 digests of the keys are kept: a key is 32 random bytes
(``thunderproxy client-key``), so a salted, slow hash would add nothing a guess could defeat, and
a digest is looked up in one dictionary access per call.

sections.py registers :func:`parse_clients` under ``[clients]``; http/clients.py checks the keys.
Every problem is a ConfigError that names the key and the remedy.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..urls import redact_url
from ..where import Where

#: How a key's digest is written: the algorithm, then 64 hex digits.
HASH_PREFIX = "sha256:"
_HASH = re.compile(r"sha256:[0-9a-f]{64}\Z")
#: A client's name: it prefixes the client's program ids (``alice:task-42``), so it holds no
#: ``:`` and nothing a log or a URL would have to quote.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
SECTION_KEYS = ("keys", "keys_file", "forward_key_to")
_REMEDY = (
    "make a key and its line with `thunderproxy client-key NAME` (or write "
    '"sha256:" followed by the hex SHA-256 of the key)'
)


def key_digest(key: str) -> str:
    """What the config holds for ``key``: ``sha256:`` and its hex digest."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A fresh client key: 32 random bytes, URL-safe base64, with a prefix that says what it
    is when it turns up in a shell history or a leaked file."""
    return "tp-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ClientsSpec:
    """The configured clients: each key's digest with its client's name, and the backends that
    are sent the client's own key (none by default: it is the proxy's credential)."""

    #: (digest, client name) pairs; a client may hold several keys (one being rotated out).
    keys: tuple[tuple[str, str], ...]
    #: Backend names or URLs that receive the client's key headers as the client sent them.
    forward_key_to: tuple[str, ...] = ()
    #: The file the keys were read from, if any (shown in the settings, never the digests).
    keys_file: str | None = field(default=None)

    @cached_property
    def _by_digest(self) -> dict[str, str]:
        return dict(self.keys)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted({name for _, name in self.keys}))

    def client_of(self, key: str) -> str | None:
        """The client holding ``key``, or None. The lookup is by the key's digest, so what a
        refused guess can time is a hash of the guess, never the configured key."""
        return self._by_digest.get(key_digest(key))

    def receiving(self, backends: Sequence[tuple[str, str | None]]) -> frozenset[str]:
        """The shown URLs (credentials removed, as the pool shows them) of the backends in
        ``forward_key_to``; ``backends``: each backend's configured (URL, name)."""
        wanted = set(self.forward_key_to)
        return frozenset(
            redact_url(url) for url, name in backends if url in wanted or name in wanted
        )

    def public(self) -> dict[str, Any]:
        """What the ``runs`` row may store: the names, never a digest."""
        return {
            "clients": list(self.names),
            "keys_file": self.keys_file,
            "forward_key_to": [redact_url(name) for name in self.forward_key_to],
        }


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a client, or None."""
    if _NAME.match(name):
        return None
    return (
        f"{name!r} is not a usable client name: use 1-64 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    )


def _digests(value: Any, where: Where) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise where.error("expected a key digest, got an empty array", _REMEDY)
    found = []
    for index, item in enumerate(items):
        here = where.at(index) if isinstance(value, list) else where
        if not isinstance(item, str) or not _HASH.match(item.strip().lower()):
            shown = repr(item) if isinstance(item, str) else type(item).__name__
            if isinstance(item, str) and not item.startswith(HASH_PREFIX):
                shown = "a value that is not a digest (a key in clear must never be written here)"
            raise here.error(f"expected sha256:<64 hex digits>, got {shown}", _REMEDY)
        found.append(item.strip().lower())
    return found


def _add(
    keys: list[tuple[str, str]], owner: dict[str, str], name: str, digests: list[str], where: Where
) -> None:
    problem = name_problem(name)
    if problem is not None:
        raise where.error(problem, "rename it")
    for digest in digests:
        if digest in owner:
            raise where.error(
                f"this key is already {owner[digest]!r}'s", "give each client keys of its own"
            )
        owner[digest] = name
        keys.append((digest, name))


def read_keys_file(path: Path, where: Where) -> list[tuple[str, list[str]]]:
    """A keys file: one ``name sha256:<hex>`` per line; blank lines and ``#`` comments are
    skipped. Relative paths are read from the config file's folder."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise where.error(
            f"{str(path)!r} cannot be read ({exc.strerror})", "name a readable keys file"
        ) from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        here = Where(str(path), f"line {number}")
        if len(parts) != 2:
            raise here.error("expected `name sha256:<hex>`", _REMEDY)
        entries.append((parts[0], _digests(parts[1], here)))
    return entries


def parse_clients(value: Any, where: Where) -> Mapping[str, Any]:
    """``[clients]``: ``keys`` (client name -> digest, or an array of digests), ``keys_file``
    (a file of ``name digest`` lines, for keys kept apart from the config) and
    ``forward_key_to`` (backend names or URLs that are sent the client's key)."""
    if not isinstance(value, dict):
        raise where.error(
            f"expected a table, got {type(value).__name__}",
            'write [clients.keys] with lines like alice = "sha256:..."',
        )
    for key in value:
        if key not in SECTION_KEYS:
            raise where.dot(key).error(
                "unknown key",
                "known keys: " + ", ".join(SECTION_KEYS) + "; clients go under [clients.keys]",
            )
    keys: list[tuple[str, str]] = []
    owner: dict[str, str] = {}
    table = value.get("keys", {})
    if not isinstance(table, dict):
        raise where.dot("keys").error(
            f"expected a table, got {type(table).__name__}",
            'write [clients.keys] with lines like alice = "sha256:..."',
        )
    for name, digests in table.items():
        here = where.dot("keys").dot(name)
        _add(keys, owner, name, _digests(digests, here), here)
    keys_file = value.get("keys_file")
    if keys_file is not None:
        if not isinstance(keys_file, str) or not keys_file.strip():
            raise where.dot("keys_file").error(
                "expected a file name", 'write keys_file = "clients.keys"'
            )
        path = Path(where.file).parent / keys_file.strip()
        for name, digests in read_keys_file(path, where.dot("keys_file")):
            _add(keys, owner, name, digests, Where(str(path), name))
    if not keys:
        raise where.error(
            "names no client",
            "add [clients.keys] entries or a keys_file, or remove [clients] to serve anyone",
        )
    forward = value.get("forward_key_to", [])
    if not isinstance(forward, list) or not all(isinstance(f, str) and f for f in forward):
        raise where.dot("forward_key_to").error(
            "expected an array of backend names or URLs",
            'write forward_key_to = ["gpu0"], or leave it out so no backend gets client keys',
        )
    return {
        "clients": ClientsSpec(
            tuple(keys),
            tuple(f.rstrip("/") for f in forward),
            keys_file=None if keys_file is None else keys_file.strip(),
        )
    }


def check_forwarding(spec: ClientsSpec, backends: Sequence[tuple[str, str | None]]) -> str | None:
    """Why ``forward_key_to`` names something that is no configured backend, or None.
    ``backends``: each backend's (URL, name)."""
    known = {url for url, _ in backends} | {name for _, name in backends if name}
    for name in spec.forward_key_to:
        if name not in known:
            return (
                f"clients.forward_key_to: {redact_url(name)!r} is no configured backend's URL or "
                "name; name one of: " + (", ".join(sorted(map(redact_url, known))) or "(none)")
            )
    return None
