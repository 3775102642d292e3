"""URLs as they may be shown: without the credentials a backend URL can carry."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit


def redact_url(url: str) -> str:
    """``url`` without its userinfo: what may be shown, logged or stored. Credentials in a
    backend URL are sent to that backend and nowhere else."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


def redact_url_secrets(url: str) -> str:
    """``url`` as it may be stored: no userinfo, and every query value replaced by
    ``<redacted>`` (names kept). A search API's key is commonly a query parameter
    (``?key=...``, ``?token=...``), and ``runs.settings`` is readable in the explorer."""
    bare = redact_url(url)
    parts = urlsplit(bare)
    if not parts.query:
        return bare
    names = [(name, "<redacted>") for name, _ in parse_qsl(parts.query, keep_blank_values=True)]
    query = urlencode(names, safe="<>")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))
