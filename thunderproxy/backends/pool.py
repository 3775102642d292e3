"""The backends of one run and the model groups they form.

A :class:`BackendNode` is one server as the proxy tracks it: how it is reached (a
:class:`~.base.Backend`), its health, its latest metrics, the models it serves. The
:class:`BackendPool` holds them and answers which nodes serve a model: each public model name
(a served name, or an alias from the config file) resolves to a group, and a call goes only to
nodes of its group.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from operator import is_
from typing import Any

from ..config.settings import NO_DEFAULT_MODEL
from ..errors import ModelNotFound, NoBackendAvailable
from ..urls import redact_url
from .base import Backend
from .health import Health
from .http import HttpBackend
from .metrics import EngineSnapshot

log = logging.getLogger("thunderproxy.backends")

#: Model names whose groups are kept resolved (``BackendPool.route``).
MAX_CACHED_ROUTES = 1024
#: The characters that make an alias a pattern (``fnmatch``'s): ``"claude-*" = "qwen3-coder"``.
PATTERN_CHARS = frozenset("*?[")


def is_pattern(name: str) -> bool:
    return not PATTERN_CHARS.isdisjoint(name)


def pattern_order(patterns: Sequence[str]) -> list[str]:
    """Patterns most specific first (most characters that are not wildcards), else in the
    order written: ``claude-3-*`` is tried before ``claude-*``, and both before ``*``."""
    literal = {p: sum(c not in PATTERN_CHARS for c in p) for p in patterns}
    return sorted(patterns, key=lambda p: -literal[p])


@dataclass
class BackendNode:
    #: The backend's URL with any credentials removed: how it is shown, logged and stored.
    url: str
    backend: Backend
    health: Health = field(default_factory=Health)
    snapshot: EngineSnapshot | None = None
    last_poll_at: float | None = None
    in_flight: int = 0
    #: Served model names: from the config file, else from the backend's /v1/models (None
    #: until known; such a node is taken to serve any model, as a lone backend does).
    models: frozenset[str] | None = None
    #: True when ``models`` came from the config file, so polls do not replace them.
    models_configured: bool = False
    #: The backend's own ``/v1/models`` entries, by id, as its last poll returned them.
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.health.backend = self.url

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @property
    def last_error(self) -> str | None:
        return self.health.last_error

    @property
    def capacity_tokens(self) -> int | None:
        return None if self.snapshot is None else self.snapshot.capacity_tokens

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models


@dataclass(frozen=True)
class Route:
    """Where a call for a public model name may go: the served name to send, and the nodes."""

    requested: str | None
    served: str | None
    nodes: tuple[BackendNode, ...]
    #: For a name nothing serves, what sent it to ``served``: ``alias 'claude-*'``,
    #: ``default_model``, ``the only model served``. None for a served name or an exact alias.
    fallback: str | None = None

    @property
    def urls(self) -> frozenset[str]:
        return frozenset(n.url for n in self.nodes)


class BackendPool:
    """The backends of one run; open with :func:`open_backend_pool`."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        max_connections: int = 1024,
        aliases: Mapping[str, Sequence[str]] | None = None,
        default_model: str = "",
    ) -> None:
        self.nodes: dict[str, BackendNode] = {}
        every = {k: tuple(v) for k, v in (aliases or {}).items()}
        #: Exact public names, and the patterns tried (most specific first) for any other name.
        self.aliases: dict[str, tuple[str, ...]] = {
            k: v for k, v in every.items() if not is_pattern(k)
        }
        self.patterns: dict[str, tuple[str, ...]] = {
            k: every[k] for k in pattern_order([k for k in every if is_pattern(k)])
        }
        #: Where a name nothing serves goes: a model, "" (the only model served, if just one)
        #: or ``NO_DEFAULT_MODEL`` (nowhere: 404).
        self.default_model = default_model
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        #: Per public model name: (the nodes, their served models, the groups) when it was last
        #: resolved. Every call resolves its model; the groups change only with those.
        self._groups: dict[str, tuple[tuple[BackendNode, ...], tuple[Any, ...], list[Route]]] = {}
        #: Names nothing serves whose calls were sent elsewhere, and where: logged once each.
        self._told: dict[str, str] = {}

    def add(self, url: str, *, models: Sequence[str] | None = None) -> BackendNode:
        """Track the HTTP backend at ``url`` (with one shared client)."""
        backend = HttpBackend(
            url, connect_timeout=self._connect_timeout, max_connections=self._max_connections
        )
        return self.attach(backend.name, backend, models=models)

    def attach(
        self, name: str, backend: Backend, *, models: Sequence[str] | None = None
    ) -> BackendNode:
        """Track any :class:`Backend` under ``name``."""
        node = BackendNode(url=redact_url(name), backend=backend)
        if models is not None:
            node.models = frozenset(models)
            node.models_configured = True
        self.nodes[node.url] = node
        return node

    async def aclose(self) -> None:
        for node in self.nodes.values():
            close = getattr(node.backend, "aclose", None)
            if close is not None:
                await close()

    def __iter__(self) -> Iterator[BackendNode]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def urls(self) -> list[str]:
        return list(self.nodes)

    def get(self, url: str | None) -> BackendNode | None:
        return None if url is None else self.nodes.get(url)

    def healthy(self) -> list[BackendNode]:
        return [n for n in self.nodes.values() if n.healthy]

    def first_healthy(self) -> BackendNode:
        healthy = self.healthy()
        if not healthy:
            raise NoBackendAvailable(
                "No healthy backend: every backend failed its last health check "
                f"({', '.join(self.nodes) or 'none configured'}); check that they are running."
            )
        return healthy[0]

    # -- model groups ---------------------------------------------------------------------------

    def served_models(self, *, healthy_only: bool = True) -> list[str]:
        """Every model name a (healthy) node serves, then the aliases that reach one, sorted
        within each kind."""
        names: set[str] = set()
        for node in self.nodes.values():
            if node.models is not None and (node.healthy or not healthy_only):
                names |= node.models
        aliases = {a for a, targets in self.aliases.items() if any(t in names for t in targets)}
        return sorted(names) + sorted(aliases - names)

    def unknown_names_go_to(self) -> tuple[str, str] | None:
        """Where a call naming a model nothing serves (nor any alias) goes, and why: the
        ``default_model``, else the one model the backends serve when they serve just one
        (clients such as Claude Code ask for their own model names); None: it is refused."""
        if self.default_model == NO_DEFAULT_MODEL:
            return None
        if self.default_model:
            return self.default_model, "default_model"
        served = {m for n in self.nodes.values() if n.models is not None for m in n.models}
        if len(served) == 1 and all(n.models is not None for n in self.nodes.values()):
            return next(iter(served)), "the only model served"
        return None

    def chain(self, model: str) -> tuple[str, ...]:
        """The served names a call for ``model`` may be sent as, first the target: an exact
        alias's targets, the name itself where a node serves it, else what a name nothing
        serves goes to (so ``[limits]`` of the served model count its calls too)."""
        exact = self.aliases.get(model)
        if exact is not None:
            return exact
        if any(n.serves(model) for n in self.nodes.values()):
            return (model,)
        fallback = self._fallback(model)
        return (model,) if fallback is None else fallback[0]

    def _fallback(self, model: str) -> tuple[tuple[str, ...], str] | None:
        """The targets a name nothing serves is sent to: the first alias pattern it matches,
        else :meth:`unknown_names_go_to`'s model."""
        for pattern, targets in self.patterns.items():
            if fnmatchcase(model, pattern):
                return targets, f"alias {pattern!r}"
        default = self.unknown_names_go_to()
        return None if default is None else ((default[0],), default[1])

    def _tell(self, route: Route) -> None:
        """One line per name sent elsewhere (and again only if where it goes changes): a
        client asking for a model by another name is normal, a line per call would be noise."""
        name = route.requested
        if name is None or route.served is None or self._told.get(name) == route.served:
            return
        if len(self._told) >= MAX_CACHED_ROUTES:
            self._told.clear()  # names clients make up: the memory stays bounded
        self._told[name] = route.served
        log.info(
            "model %r is served by no backend; its calls go to %r (%s), and their steps record "
            "both names. Name it in [aliases], or set --default-model, to send it elsewhere.",
            name,
            route.served,
            route.fallback,
        )

    def route(self, model: str | None) -> Route:
        """The group for ``model``: the nodes that serve it or an exact alias's targets; for a
        name nothing serves, an alias pattern's or the default model's. Raises
        :class:`ModelNotFound` when there is none, listing what is served."""
        nodes = tuple(self.nodes.values())
        if model is None:
            return Route(None, None, nodes)
        # The groups depend only on the nodes themselves and the models each serves (from the
        # config file, or its polls): resolved again only when either changed.
        served_by = tuple([n.models for n in nodes])
        cached = self._groups.get(model)
        if cached is not None and cached[1] == served_by and all(map(is_, cached[0], nodes)):
            routes = cached[2]
        else:
            routes = [
                Route(model, served, group)
                for served in self.aliases.get(model, (model,))
                if (group := tuple(n for n in nodes if n.serves(served)))
            ]
            if not routes:
                routes = self._fallback_routes(model, nodes)
            if not routes:
                raise ModelNotFound(model, self.served_models(healthy_only=False))
            if len(self._groups) >= MAX_CACHED_ROUTES:
                self._groups.clear()  # a node that serves any name: names clients make up
            self._groups[model] = (nodes, served_by, routes)
        if len(routes) == 1:
            chosen = routes[0]
        else:
            # An alias's first target with a healthy node; else its first target at all (the
            # call then fails as that group's backends do, naming them).
            chosen = next((r for r in routes if any(n.healthy for n in r.nodes)), routes[0])
        if chosen.fallback is not None:
            self._tell(chosen)
        return chosen

    def _fallback_routes(self, model: str, nodes: tuple[BackendNode, ...]) -> list[Route]:
        fallback = self._fallback(model)
        if fallback is None:
            return []
        targets, why = fallback
        return [
            Route(model, served, group, fallback=why)
            for served in targets
            if (group := tuple(n for n in nodes if n.serves(served)))
        ]


@asynccontextmanager
async def open_backend_pool(
    urls: Sequence[str] = (),
    *,
    connect_timeout: float = 10.0,
    max_connections: int = 1024,
    aliases: Mapping[str, Sequence[str]] | None = None,
    default_model: str = "",
) -> AsyncIterator[BackendPool]:
    """A pool with one HTTP backend per URL (more may be added); every one closed on exit."""
    pool = BackendPool(
        connect_timeout=connect_timeout,
        max_connections=max_connections,
        aliases=aliases,
        default_model=default_model,
    )
    try:
        for url in urls:
            pool.add(url)
        yield pool
    finally:
        await pool.aclose()
