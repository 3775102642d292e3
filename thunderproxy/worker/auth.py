"""The autoscaler's request signatures: what is signed, how it is checked, and replays; the
signer (``sign``, for local tools and tests that play the autoscaler) and the verifier
(``signature_valid``, ``binding_mismatch``) in one place.

The autoscaler signs ``cost, endpoint, reqnum, request_idx, url`` of every request it routes:
RSA PKCS#1 v1.5 over SHA-256 of ``json.dumps(fields, indent=4, sort_keys=True)``, sent base64
in ``signature``. The values are signed as the autoscaler typed them (``cost`` may be a string
or a number), so they are kept exactly as they arrive in a JSON body; in a query string every
value is text, and numbers are restored the way the autoscaler's own client encodes them.

What a signature is good for (``binding_mismatch``): the signed ``url`` must name this worker
(its scheme, host and port: the platform's public address, or the address the request came in
on; never the ``Host`` header, which the sender writes), its path and a path ``endpoint`` the
route requested, and, when the signer includes ``body_sha256`` (the Vast.ai autoscaler does not
yet; the test autoscaler does), the body: a signature for another worker, route or body opens
nothing here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from ..http.guard import normalize_path

#: The signed fields, and the query parameters that carry them on bodiless requests.
SIGNED_FIELDS = ("cost", "endpoint", "reqnum", "request_idx", "url")
QUERY_PREFIX = "serverless_"
QUERY_FIELDS = tuple(QUERY_PREFIX + name for name in (*SIGNED_FIELDS, "signature"))
#: Signed too when the signer includes it: the SHA-256 (hex) of the request's body
#: (``body_digest``). The Vast.ai autoscaler does not send it; where it is absent the body is
#: bound only by the one-use ``reqnum``.
BODY_FIELD = "body_sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
#: The port a URL without one means.
_DEFAULT_PORTS = {"http": 80, "https": 443}


class AuthDataError(ValueError):
    """``auth_data`` is missing a field or has one of the wrong type."""


@dataclass(frozen=True)
class AuthData:
    cost: Any
    endpoint: str
    reqnum: int
    request_idx: int
    url: str
    signature: str
    #: ``BODY_FIELD``: the digest of the body signed for, when the signer bound one.
    body_sha256: str | None = None

    @property
    def workload(self) -> float:
        """The request's workload in the benchmark's units (the autoscaler's ``cost``)."""
        try:
            value = float(self.cost)
        except (TypeError, ValueError):
            raise AuthDataError(f"auth_data.cost {self.cost!r} is not a number") from None
        if value < 0 or value != value:
            raise AuthDataError(f"auth_data.cost {self.cost!r} must be a number >= 0")
        return value

    def message(self) -> bytes:
        """The exact bytes the autoscaler signed."""
        fields = {name: getattr(self, name) for name in SIGNED_FIELDS}
        if self.body_sha256 is not None:
            fields[BODY_FIELD] = self.body_sha256
        return json.dumps(fields, indent=4, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: Any) -> AuthData:
        if not isinstance(raw, Mapping):
            raise AuthDataError("auth_data must be a JSON object")
        missing = [name for name in (*SIGNED_FIELDS, "signature") if name not in raw]
        if missing:
            raise AuthDataError(f"auth_data lacks {', '.join(missing)}")
        for name in ("reqnum", "request_idx"):
            if not isinstance(raw[name], int) or isinstance(raw[name], bool):
                raise AuthDataError(f"auth_data.{name} must be an integer")
        for name in ("endpoint", "url", "signature"):
            if not isinstance(raw[name], str):
                raise AuthDataError(f"auth_data.{name} must be a string")
        auth = cls(
            cost=raw["cost"],
            endpoint=raw["endpoint"],
            reqnum=raw["reqnum"],
            request_idx=raw["request_idx"],
            url=raw["url"],
            signature=raw["signature"],
            body_sha256=_body_field(raw.get(BODY_FIELD), f"auth_data.{BODY_FIELD}"),
        )
        auth.workload  # noqa: B018 - validates cost now, not when it is first counted
        return auth

    @classmethod
    def from_query(cls, params: Mapping[str, str]) -> AuthData:
        missing = [name for name in QUERY_FIELDS if name not in params]
        if missing:
            raise AuthDataError(f"query lacks {', '.join(missing)}")
        cost_text = params[QUERY_PREFIX + "cost"]
        try:
            # The autoscaler's client writes a float cost with a point and an integer without.
            cost: Any = float(cost_text) if "." in cost_text else int(cost_text)
            reqnum = int(params[QUERY_PREFIX + "reqnum"])
            request_idx = int(params[QUERY_PREFIX + "request_idx"])
        except ValueError as exc:
            raise AuthDataError(f"serverless_* query parameter is not a number: {exc}") from None
        auth = cls(
            cost=cost,
            endpoint=params[QUERY_PREFIX + "endpoint"],
            reqnum=reqnum,
            request_idx=request_idx,
            url=params[QUERY_PREFIX + "url"],
            signature=params[QUERY_PREFIX + "signature"],
            body_sha256=_body_field(
                params.get(QUERY_PREFIX + BODY_FIELD), QUERY_PREFIX + BODY_FIELD
            ),
        )
        auth.workload  # noqa: B018
        return auth


def _body_field(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _HEX64.match(value):
        raise AuthDataError(f"{name} must be 64 lower-case hex digits (a SHA-256)")
    return value


def body_digest(body: bytes) -> str:
    """``BODY_FIELD``'s value for a request whose body (the ``payload``'s JSON as the worker
    hands it on, or the query string left once the ``serverless_*`` parameters are removed) is
    ``body``."""
    return hashlib.sha256(body).hexdigest()


def payload_bytes(payload: Any) -> bytes:
    """The body the worker hands the app for a ``{"auth_data", "payload"}`` request: what
    ``body_sha256`` is the digest of."""
    return json.dumps(payload).encode()


def _origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an absolute URL, the host lower case without brackets; None
    when ``url`` names no address (a bare path, a group name, a malformed port)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        return None
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme]


def own_origins(
    public_url: str | None, scheme: str, server: tuple[str, int | None] | None
) -> set[tuple[str, str, int]]:
    """Where this worker may be signed for: the platform's public address, and the address the
    request came in on (the socket's own, which no sender can write)."""
    origins = set()
    public = None if public_url is None else _origin(public_url)
    if public is not None:
        origins.add(public)
    if server is not None and server[0]:
        host = server[0].lower().strip("[]")
        scheme = scheme.lower()
        origins.add((scheme, host, server[1] or _DEFAULT_PORTS.get(scheme, 0)))
    return origins


def binding_mismatch(
    auth: AuthData, *, origins: set[tuple[str, str, int]], path: str, body: bytes
) -> tuple[str, str] | None:
    """Why the request is not what ``auth`` signed, as (worker event, reason), or None when it
    is: the signed ``url`` names one of this worker's ``origins`` (scheme, host and port:
    ``wrong_worker``), the route is the one it names (``route_mismatch``: ``wrong_route``),
    and the body is the one signed for, when a digest was (``wrong_body``)."""
    origin = _origin(auth.url)
    if origin is None:
        why = f"the signature's url {auth.url!r} names no worker address (scheme://host:port)"
        return "wrong_worker", why
    if origin not in origins:
        mine = ", ".join(sorted(f"{s}://{h}:{p}" for s, h, p in origins)) or "(unknown)"
        return "wrong_worker", (
            f"the signature's url {auth.url!r} names another worker ({origin[0]}://{origin[1]}:"
            f"{origin[2]}), not this one ({mine})"
        )
    mismatch = route_mismatch(auth, path)
    if mismatch is not None:
        return "wrong_route", mismatch
    if auth.body_sha256 is not None and body_digest(body) != auth.body_sha256:
        return "wrong_body", "the body is not the one the signature's body_sha256 was made for"
    return None


def signed_routes(auth: AuthData) -> list[tuple[str, str | None]]:
    """The routes the signature names, as (field, normalised path): ``url``'s path when it
    has one past ``/`` (``https://host:port/v1/embeddings``, or a bare ``/v1/embeddings``), and
    ``endpoint`` when it is a path (starts with ``/``). The autoscaler's usual values, the
    worker's address and the endpoint group's name, name no route. None for a path that cannot
    be normalised: it matches no request."""
    routes: list[tuple[str, str | None]] = []
    parts = urlsplit(auth.url)
    if (parts.scheme and parts.netloc) or auth.url.startswith("/"):
        normal = normalize_path(parts.path)
        if normal != "/":
            routes.append(("url", normal))
    if auth.endpoint.startswith("/"):
        routes.append(("endpoint", normalize_path(urlsplit(auth.endpoint).path)))
    return routes


def route_mismatch(auth: AuthData, path: str) -> str | None:
    """Why a request for ``path`` is not what ``auth`` signed, or None when it is: every route
    the signature names must be the request's, both normalised (``http.guard.normalize_path``),
    so a signature for ``/v1/embeddings`` opens nothing else."""
    served = normalize_path(path)
    for name, route in signed_routes(auth):
        if route is None or route != served:
            return (
                f"the signature's {name} {getattr(auth, name)!r} names the route "
                f"{route or '(unreadable)'}, not {served or path!r} which was requested"
            )
    return None


def load_public_key(pem: bytes | str) -> rsa.RSAPublicKey:
    """The autoscaler's key from the PEM its /pubkey/ serves; ValueError if it is not RSA."""
    data = pem.encode() if isinstance(pem, str) else pem
    key = serialization.load_pem_public_key(data.strip())
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError(f"the signing key is {type(key).__name__}, not an RSA public key")
    return key


def signature_valid(key: rsa.RSAPublicKey, auth: AuthData) -> bool:
    try:
        signature = base64.b64decode(auth.signature, validate=True)
    except (binascii.Error, ValueError):
        return False
    try:
        key.verify(signature, auth.message(), padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True


def sign(private_key: rsa.RSAPrivateKey, fields: Mapping[str, Any]) -> str:
    """What the autoscaler does: the base64 signature of ``fields``' signed part (local tools
    and tests use it to play the autoscaler), ``BODY_FIELD`` included when ``fields`` has it."""
    auth = AuthData(
        **{name: fields[name] for name in SIGNED_FIELDS},
        signature="",
        body_sha256=fields.get(BODY_FIELD),
    )
    raw = private_key.sign(auth.message(), padding.PKCS1v15(), hashes.SHA256())
    return base64.b64encode(raw).decode()


class ReplayGuard:
    """Remembers the newest ``capacity`` request numbers seen; memory stays bounded.

    A number seen before is a replay. A number at or below the oldest one forgotten cannot be
    told apart from a replay any more, so it is refused too: the autoscaler numbers requests
    in increasing order, and a request ``capacity`` numbers behind the newest is stale anyway.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._seen: set[int] = set()
        self._heap: list[int] = []
        #: Numbers at or below this were forgotten.
        self.floor: int | None = None

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, reqnum: int) -> str | None:
        """Why ``reqnum`` must be refused, or None when it is new."""
        if reqnum in self._seen:
            return f"reqnum {reqnum} was already served (a replayed request)"
        if self.floor is not None and reqnum <= self.floor:
            return (
                f"reqnum {reqnum} is older than the {self.capacity} newest requests this "
                "worker remembers (a stale or replayed request)"
            )
        return None

    def restore(self, numbers: Iterable[int], floor: int | None) -> None:
        """Remember ``numbers`` accepted before a restart, and refuse everything at or below
        ``floor`` (the numbers that fell out of the window then)."""
        for reqnum in numbers:
            self.add(reqnum)
        if floor is not None:
            self.floor = floor if self.floor is None else max(self.floor, floor)

    def add(self, reqnum: int) -> None:
        """Remember a request whose signature was valid (never an unchecked one: a forged
        number must not push genuine ones out)."""
        if reqnum in self._seen:
            return
        self._seen.add(reqnum)
        heapq.heappush(self._heap, reqnum)
        while len(self._heap) > self.capacity:
            oldest = heapq.heappop(self._heap)
            self._seen.discard(oldest)
            self.floor = oldest if self.floor is None else max(self.floor, oldest)
