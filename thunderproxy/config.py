"""Settings, declared once: each field of :class:`Settings` (and of the nested
:class:`PolicyConfig`) carries its help, flag and checks in its ``setting(...)`` metadata, and
everything else is derived from those fields: the ``SETTINGS`` table, the click flags, their
``THUNDERPROXY_<NAME>`` environment variables, the README's flags table and the top-level keys of
a ``--config`` TOML file. Structured configuration (``[[backends]]``, ``[aliases]``) is read by the
section parsers registered in ``SECTIONS`` (docs/CONFIG.md).

Precedence: defaults < config file < environment variables < flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from .admission.spec import LimitsSpec, check_served, parse_limits
from .errors import ConfigError
from .http.guard import DEFAULT_PASSTHROUGH, parse_prefixes
from .urls import redact_url
from .where import Where

ENV_PREFIX = "THUNDERPROXY_"
SECONDS = 1.0
BYTES = 1

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

#: A per-setting check: the problem with a value, or None when it is fine.
Check = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class _Meta:
    help: str
    choices: tuple[str, ...] | None
    secret: bool
    flag: str | None
    check: Check | None


def setting(
    default: T,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
    flag: str | None = None,
    check: Check | None = None,
) -> T:
    """Declare one setting as a dataclass field: its default, its help text, and optionally its
    allowed values, whether it is a secret (never shown, logged or stored), its flag (default:
    the field name with dashes) and an extra check of its value."""
    meta = _Meta(help, choices, secret, flag, check)
    field: T = dataclasses.field(default=default, repr=not secret, metadata={"setting": meta})
    return field


def _group(cls: Callable[[], T]) -> T:
    """A nested dataclass of settings; its fields become top-level flags."""
    field: T = dataclasses.field(default_factory=cls, metadata={"group": True})
    return field


def _positive(value: Any) -> str | None:
    return None if value > 0 else "must be > 0 seconds"


#: The recognition sources a setting may name, in the order they are tried.
RECOGNITION_SOURCES = (
    "explicit",
    "session_header",
    "claude_code",
    "codex",
    "litellm",
    "previous_response",
    "prompt_cache_key",
    "user",
    "prefix",
)
RECOGNITION_DEFAULT = tuple(s for s in RECOGNITION_SOURCES if s != "user")


def recognition_sources(value: str) -> frozenset[str]:
    """The sources named in the ``recognition`` setting (empty: every source off)."""
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def _recognition_sources(value: Any) -> str | None:
    unknown = sorted(recognition_sources(str(value)) - set(RECOGNITION_SOURCES))
    if unknown:
        return (
            f"names unknown sources {', '.join(unknown)}; known: {', '.join(RECOGNITION_SOURCES)}"
        )
    return None


def _tcp_port(value: Any) -> str | None:
    return None if 0 <= value <= 65535 else "is not a TCP port: use 1-65535, or 0 for any free port"


def _passthrough(value: Any) -> str | None:
    try:
        parse_prefixes(value)
    except ConfigError as exc:
        return f"has a bad entry: {exc.message}"
    return None


def _workers(value: Any) -> str | None:
    return None if 1 <= value <= 256 else "must be from 1 to 256 processes"


def _fraction(value: Any) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


class FrozenMap(Mapping[K, V]):
    """An immutable, hashable mapping, so that :class:`Settings` stays frozen and hashable."""

    __slots__ = ("_data",)

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._data: dict[K, V] = dict(items)

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


@dataclass(frozen=True)
class BackendSpec:
    """One backend: its base URL, the model names it serves (None: ask its /v1/models), and an
    optional name for logs."""

    url: str
    models: tuple[str, ...] | None = None
    name: str | None = None


@dataclass(frozen=True)
class PolicyConfig:
    """The tr policy's constants (docs/SCHEDULING.md explains each); every one is a ``serve``
    setting with its own flag."""

    decode_buffer: int = setting(
        256,
        "tr: tokens reserved for decoding per reasoning program (DECODE_BUFFER in ThunderAgent's "
        "router).",
    )
    pause_cooldown_s: float = setting(
        5.0 * SECONDS,
        "tr: seconds between two pause rounds on one backend (PAUSE_COOLDOWN in ThunderAgent's "
        "router).",
        flag="--pause-cooldown",
    )
    resume_cooldown_s: float = setting(
        5.0 * SECONDS,
        "tr: seconds between two resume rounds on one backend (RESUME_COOLDOWN in ThunderAgent's "
        "router).",
        flag="--resume-cooldown",
    )
    tool_coefficient: float = setting(
        1.0,
        "tr: weight of an acting program's tokens in the capacity model (TOOL_COEFFICIENT in "
        "ThunderAgent's router).",
    )
    acting_half_life_s: float = setting(
        5.0 * SECONDS,
        "tr: half-life of an acting program's tokens in the capacity model (0: no decay).",
        flag="--acting-half-life",
    )
    admission_half_life_s: float = setting(
        30.0 * SECONDS,
        "tr: half-life of an idle program's claim when a new program's first call asks to fit "
        "(longer than --acting-half-life: newcomers wait at their boundary unless the programs "
        "under way can still make their next calls).",
        flag="--admission-half-life",
    )
    max_wait_s: float = setting(
        120.0 * SECONDS,
        "tr: the longest a call waits for capacity: at half of it, it reserves the next free "
        "capacity and idle programs are paused to make room for it; at the bound it is "
        "resumed, capacity or not.",
        flag="--max-wait",
    )
    mid_program_head_start_s: float = setting(
        60.0 * SECONDS,
        "tr: seconds of waiting credited to a program's later calls over new programs' first "
        "calls in the resume order (new programs wait at their boundary; aging still serves "
        "them within --max-wait).",
        flag="--mid-program-head-start",
    )
    hold: str = setting(
        "auto",
        "tr: hold programs back for capacity: auto (while what it saves in recompute exceeds "
        "what it costs in waiting, as measured), always, or never (proxy like default).",
        choices=("auto", "always", "never"),
    )
    make_room_at_once: bool = setting(
        False,
        "tr: room for a call past half of --max-wait is made whenever a call ends, not only "
        "in pause rounds spaced by --pause-cooldown: shorter waits, more pauses.",
    )
    idle_claims: str = setting(
        "break_even",
        "tr: how an idle program's cache counts against capacity: decay (halving every "
        "--acting-half-life) or break_even (whole while its tool is expected to end sooner "
        "than the engine takes to prefill a full cache, nothing after).",
        choices=("decay", "break_even"),
    )
    return_evidence: bool = setting(
        True,
        "tr with --hold auto: programs are held back on a backend only once at least half of "
        "the programs whose call ended there came back within the horizon (nothing is held "
        "before the first return); off: holding starts at once.",
    )
    resume_protection_s: float = setting(
        30.0 * SECONDS,
        "tr: seconds a force-resumed program is protected from being paused again.",
        flag="--resume-protection",
    )
    idle_lease_s: float = setting(
        600.0 * SECONDS,
        "Seconds without a request after which a program is retired (0: never).",
        flag="--idle-lease",
    )
    target_fill: float = setting(
        0.9,
        "tr: fraction of each backend's KV capacity that new and resumed programs may fill; "
        "running programs are moved only past the full capacity.",
        check=_fraction,
    )
    #: 0: newcomers always queue; else a newcomer expected to wait longer is refused (429).
    max_queue_wait_s: float = setting(
        0.0 * SECONDS,
        "tr: a new program whose estimated wait for capacity exceeds this many seconds is "
        "answered 429 with Retry-After instead of queuing (0: always queue).",
        flag="--max-queue-wait",
    )
    #: A returning program whose call would overflow its backend waits for room.
    gate_returns: bool = setting(
        True,
        "tr: an acting program whose next call would overflow its backend waits for room "
        "instead of pushing the engine into preemptions.",
    )
    #: With a CPU KV tier (vLLM's offloading connector), idle programs may live there.
    tier_max_load_share: float = setting(
        0.5,
        "tr: with a CPU KV tier, idle programs may live in it while its reloads keep the "
        "CPU->GPU link busy less than this share of the time (0: schedule on the GPU alone).",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]",
    )
    tier_reload_window_s: float = setting(
        60.0 * SECONDS,
        "tr: the CPU tier counts as capacity for at most what its link reloads in this many "
        "seconds at the measured bandwidth.",
        flag="--tier-reload-window",
        check=_positive,
    )


@dataclass(frozen=True)
class CouncilSettings:
    """The LLM council at /council/ (docs/COUNCIL.md); every one is a ``serve`` setting."""

    models: str = setting(
        "",
        "Comma-separated model names that sit on the council at /council/ (empty: no council "
        "jobs can run).",
        flag="--council-models",
    )
    chairman: str = setting(
        "",
        "Model that synthesises the council's answer (empty: the first member).",
        flag="--council-chairman",
    )
    title_model: str = setting(
        "",
        "Model that titles a new conversation (empty: the chairman).",
        flag="--council-title-model",
    )
    member_timeout: float = setting(
        300.0 * SECONDS,
        "Seconds one council member may take for one stage before it is left out.",
        flag="--council-member-timeout",
        check=_positive,
    )
    max_tokens: int = setting(
        0,
        "Most tokens a council member may write per answer (0: the backend's default).",
        flag="--council-max-tokens",
    )
    tools: bool = setting(
        False,
        "Offer council members the fetch_url (and, with --council-search-url, web_search) "
        "tools in stage 1; the backends must accept OpenAI tool calls.",
        flag="--council-tools",
    )
    tool_rounds: int = setting(
        5,
        "Rounds of tool calls a member may make before it must answer.",
        flag="--council-tool-rounds",
    )
    tools_allow_private: bool = setting(
        False,
        "Let fetch_url read addresses that are not globally routable (private, loopback, "
        "link-local, carrier-grade NAT; off: refused).",
        flag="--council-tools-allow-private",
    )
    max_jobs: int = setting(
        16,
        "Council jobs that may run at once, from all clients together; a new one past it is "
        "refused with 429 (each job makes several LLM calls per member and outlives its "
        "request).",
        flag="--council-max-jobs",
        check=lambda v: None if v >= 1 else "must be >= 1",
    )
    max_jobs_per_client: int = setting(
        4,
        "Council jobs one client address may have running at once; a new one past it is "
        "refused with 429.",
        flag="--council-max-jobs-per-client",
        check=lambda v: None if v >= 1 else "must be >= 1",
    )
    search_url: str = setting(
        "",
        "Search endpoint for web_search, called as GET URL?q=... and answering JSON "
        "(SearXNG's format=json, Brave's web search, or {results: [{title, url, snippet}]}); "
        "empty: no web_search.",
        flag="--council-search-url",
    )
    search_key: str = setting(
        "", "API key sent to the search endpoint.", secret=True, flag="--council-search-key"
    )
    keepalive: float = setting(
        15.0 * SECONDS,
        "Seconds between keepalive comments on a quiet council event stream.",
        flag="--council-keepalive",
        check=_positive,
    )


@dataclass(frozen=True)
class Settings:
    """Validated configuration of one proxy run. Build with :func:`load_settings`."""

    config: str = setting(
        "",
        "TOML file with any of these settings plus [[backends]] and [aliases] sections "
        "(docs/CONFIG.md); environment variables and flags override it.",
    )
    host: str = setting(
        "127.0.0.1", "Interface to listen on; 0.0.0.0 exposes the proxy to the network."
    )
    port: int = setting(8300, "TCP port to listen on.", check=_tcp_port)
    backends: tuple[str, ...] = setting(
        (),
        "Comma-separated OpenAI-compatible backend base URLs (vLLM or SGLang). "
        "Empty: start an embedded simulated vLLM.",
    )
    router: str = setting(
        "tr",
        "Scheduling mode: 'tr' pauses and resumes whole programs to keep KV cache, "
        "'default' only proxies.",
        choices=("default", "tr"),
    )
    profile: bool = setting(
        True, "Serve per-program timing profiles at /profiles and in /programs."
    )
    recognition: str = setting(
        ",".join(RECOGNITION_DEFAULT),
        "Where the program of a call is read from, comma-separated, tried in this order: "
        + ", ".join(RECOGNITION_SOURCES)
        + " (docs/PROTOCOLS.md). Leave one out to switch it off; 'user' is off by default "
        "because it names an end user, not a task.",
        check=_recognition_sources,
    )
    metrics: bool = setting(True, "Poll each backend's /metrics for KV capacity and usage.")
    metrics_interval: float = setting(
        5.0 * SECONDS, "Seconds between backend metrics polls.", check=_positive
    )
    db: str = setting("thunderproxy.db", "SQLite file that receives every transition and step.")
    shutdown_grace: float = setting(
        10.0 * SECONDS, "Seconds in-flight requests may take to finish after SIGINT/SIGTERM/SIGHUP."
    )
    connect_timeout: float = setting(
        10.0 * SECONDS, "Seconds to wait for a backend TCP connection."
    )
    first_byte_timeout: float = setting(
        600.0 * SECONDS,
        "Seconds a backend may take to start its response (prefill of a long prompt included).",
    )
    read_timeout: float = setting(
        300.0 * SECONDS, "Seconds a backend may stay silent in the middle of a response."
    )
    max_connections: int = setting(
        1024, "Connections kept open to each backend; one shared pool per backend."
    )
    audit_queue: int = setting(10_000, "Audit rows buffered in memory before rows are dropped.")
    policy: PolicyConfig = _group(PolicyConfig)
    monitor_interval: float = setting(
        1.0 * SECONDS,
        "Seconds between runs of the resume monitor (resumes, forced resumes, idle leases).",
        check=_positive,
    )
    restore: bool = setting(True, "Restore the program registry from the audit db at startup.")
    datasette: bool = setting(
        True, "Serve Datasette, read-only, at /datasette/ on the same port to explore the audit db."
    )
    ready_timeout: float = setting(
        30.0 * SECONDS,
        "Seconds to wait at startup for the backends to answer /health (LLM calls are answered "
        "503 meanwhile) before serving anyway.",
    )
    max_body_bytes: int = setting(32 * 1024 * 1024 * BYTES, "Largest request body accepted (413).")
    max_header_bytes: int = setting(
        64 * 1024 * BYTES, "Largest request head (request line and headers) accepted."
    )
    client_timeout: float = setting(
        60.0 * SECONDS,
        "Seconds a client may take to send its request, and an idle connection is kept.",
    )
    admin_token: str = setting(
        "",
        "Bearer token required by state-changing endpoints (/programs/release) and Datasette; "
        "empty: no token needed.",
        secret=True,
    )
    log_level: str = setting(
        "info", "Log verbosity.", choices=("debug", "info", "warning", "error")
    )
    log_format: str = setting(
        "text",
        "Log lines as text, or as one JSON object per line (time, level, logger, message, "
        "exception) for a log collector.",
        choices=("text", "json"),
    )
    passthrough: str = setting(
        ",".join(DEFAULT_PASSTHROUGH),
        "Comma-separated path prefixes relayed to the backends as they are (the inference and "
        "read-only API); any other path needs --admin-token, and is refused (403) when none is "
        "set. '*': every path.",
        check=_passthrough,
    )
    protect_reads: bool = setting(
        False,
        "Require --admin-token for /programs, /profiles, /metrics and /health's detail "
        "(/health's status stays open for load balancers).",
    )
    council: CouncilSettings = _group(CouncilSettings)
    report_addr: str = setting(
        "",
        "Worker mode (Vast.ai serverless): comma-separated autoscaler addresses to report load "
        "to and fetch the signing key from; empty: the platform's REPORT_ADDR, else worker "
        "mode is off.",
    )
    unsecured: bool = setting(
        False,
        "Worker mode, local development only: accept requests without the autoscaler's "
        "signature (PyWorker's UNSECURED).",
    )
    max_wait_time: float = setting(
        10.0 * SECONDS,
        "Worker mode: a request whose estimated wait (pending workload / measured throughput) "
        "exceeds this is answered 429 with Retry-After.",
    )
    parallel: bool = setting(
        True,
        "Worker mode: forward requests concurrently; --no-parallel serves them one at a time, "
        "in arrival order (PyWorker's ALLOW_PARALLEL=false).",
    )
    benchmark: str = setting(
        "",
        "Worker mode: throughput benchmark as module:function (async, called with the backend "
        "URL and an httpx.AsyncClient on it); empty: the built-in chat-completions tokens/s.",
    )
    benchmark_cache: str = setting(
        "thunderproxy-benchmark.json",
        "Worker mode: JSON file caching benchmark results per backend URL and model, so a "
        "restart skips the benchmark.",
    )
    worker_ready_timeout: float = setting(
        1200.0 * SECONDS,
        "Worker mode: seconds the backend may take to answer /health before the worker reports "
        "it failed and stays up as a beacon (PyWorker's 20 min).",
    )
    program_tokens: int = setting(
        20_000,
        "Worker mode: tokens of KV cache a typical agent program holds, to report how many "
        "programs the backend fits.",
    )
    redis: str = setting(
        "",
        "Redis URL (redis://host:6379/0) through which instances share [limits] (global window "
        "counters, each instance's share) and the KV tokens their programs claim on each "
        "backend; empty: limits and KV are this instance's alone.",
        secret=True,
    )
    redis_heartbeat: float = setting(
        1.0 * SECONDS,
        "Seconds within which an instance that stopped is counted out and its share of the "
        "limits goes to the others, and its KV claims stop counting for tr (each instance beats "
        "eight times a heartbeat).",
        check=_positive,
    )
    workers: int = setting(
        1,
        "Serve processes behind the one --port (SO_REUSEPORT: the kernel spreads connections "
        "among them); more than 1 needs --redis, through which they share limits, KV claims and "
        "program affinity. Each writes its own audit db: --db with .wK before its suffix "
        "(docs/DEPLOY.md).",
        check=_workers,
    )
    http_front: str = setting(
        "fast",
        "Who reads the clients' connections: 'fast' serves the streamed LLM routes on trio's "
        "sockets and hands every other request to Hypercorn (docs/ARCHITECTURE.md); "
        "'hypercorn' serves everything through Hypercorn. With --certfile, Hypercorn.",
        choices=("fast", "hypercorn"),
    )
    certfile: str = setting(
        "", "TLS certificate (PEM) to serve HTTPS with; needs --keyfile. Empty: plain HTTP."
    )
    keyfile: str = setting("", "TLS private key (PEM) matching --certfile.")
    sim: Mapping[str, Any] = setting(
        FrozenMap[str, Any](),
        "A setting of the simulator started when no --backends are given, as NAME=VALUE "
        "(repeatable): any `thunderproxy sim` option by its field name, e.g. --sim "
        "max_model_len=262144 or --sim time_scale=0.5 (`thunderproxy sim --help` lists them; "
        "docs/SIMULATOR.md). THUNDERPROXY_SIM_<NAME> variables and a [sim] table in the --config "
        "file set them too.",
        flag="--sim",
    )
    # Structured configuration: from a --config file's sections, not from single flags.
    #: Every backend with what the file says about it; ``--backends`` gives URL-only specs.
    backend_specs: tuple[BackendSpec, ...] = ()
    #: Public model name -> served model names: the first is the target, the rest fallbacks.
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=FrozenMap)
    #: Rate limits per model and program class (``[limits]``, docs/LIMITS.md); None: no limits.
    limits: LimitsSpec | None = None

    def __post_init__(self) -> None:
        # backends (URLs, what existing code reads) and backend_specs always agree.
        if self.backend_specs and not self.backends:
            object.__setattr__(self, "backends", tuple(b.url for b in self.backend_specs))
        elif self.backends and not self.backend_specs:
            specs = tuple(BackendSpec(url) for url in self.backends)
            object.__setattr__(self, "backend_specs", specs)
        elif tuple(b.url for b in self.backend_specs) != tuple(self.backends):
            raise ConfigError("backends and backend_specs name different URLs; pass only one.")
        if not isinstance(self.aliases, FrozenMap):
            object.__setattr__(self, "aliases", FrozenMap(self.aliases))
        if self.limits is not None and self.limits.backends:
            known = {b.url for b in self.backend_specs} | {
                b.name for b in self.backend_specs if b.name
            }
            for name in self.limits.backends:
                if name not in known:
                    raise ConfigError(
                        f"limits.backends.{name}: no configured backend has this URL or name; "
                        "name one of: " + (", ".join(sorted(known)) or "(none: add --backends)")
                    )
        if bool(self.certfile) != bool(self.keyfile):
            raise ConfigError("--certfile and --keyfile go together; pass both or neither.")

    def value(self, name: str) -> Any:
        """The value of the setting called ``name`` (its flag without dashes)."""
        return SETTINGS_BY_NAME[name].get(self)

    def public(self) -> dict[str, Any]:
        """Every setting by name, secrets redacted: what may be logged or stored."""
        values: dict[str, Any] = {}
        for item in SETTINGS:
            value = item.get(self)
            values[item.name] = "<redacted>" if item.secret and value else value
        # Credentials in a backend URL go to that backend only, never to a log or the db.
        values["backends"] = [redact_url(url) for url in self.backends]
        values["backend_specs"] = [
            {**dataclasses.asdict(b), "url": redact_url(b.url)} for b in self.backend_specs
        ]
        values["aliases"] = {name: list(targets) for name, targets in self.aliases.items()}
        values["limits"] = None if self.limits is None else self.limits.public()
        # The simulator's api_key is a credential like any other.
        values["sim"] = {k: "<redacted>" if k == "api_key" else v for k, v in self.sim.items()}
        return values


@dataclass(frozen=True)
class Setting:
    """One row of the settings table, derived from a field's ``setting(...)`` declaration."""

    #: The flag without dashes, with underscores: click's parameter name and the TOML key.
    name: str
    #: Attribute path in :class:`Settings`, e.g. ``("policy", "pause_cooldown_s")``.
    path: tuple[str, ...]
    default: Any
    help: str
    flag: str
    choices: tuple[str, ...] | None = None
    #: Never shown as a default, logged or written to the audit db.
    secret: bool = False
    check: Check | None = None

    @property
    def envvar(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def get(self, settings: Settings) -> Any:
        value: Any = settings
        for part in self.path:
            value = getattr(value, part)
        return value


def _table(cls: type[Any], path: tuple[str, ...] = ()) -> Iterator[Setting]:
    for f in dataclasses.fields(cls):
        if f.metadata.get("group"):
            assert f.default_factory is not dataclasses.MISSING
            yield from _table(type(f.default_factory()), (*path, f.name))
            continue
        meta = f.metadata.get("setting")
        if meta is None:
            continue
        flag = meta.flag or "--" + f.name.replace("_", "-")
        yield Setting(
            name=flag[2:].replace("-", "_"),
            path=(*path, f.name),
            default=f.default,
            help=meta.help,
            flag=flag,
            choices=meta.choices,
            secret=meta.secret,
            check=meta.check,
        )


SETTINGS: tuple[Setting, ...] = tuple(_table(Settings))
SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
#: Settings fields filled from config-file sections rather than single flags.
STRUCTURED = ("backend_specs", "aliases", "limits")


# --- config-file sections -------------------------------------------------------------------


#: Parses one top-level section of a config file into Settings field values.
SectionParser = Callable[[Any, Where], Mapping[str, Any]]
#: Section name -> parser. A new section registers here (and adds its Settings field).
SECTIONS: dict[str, SectionParser] = {}


def section(name: str) -> Callable[[SectionParser], SectionParser]:
    def register(parser: SectionParser) -> SectionParser:
        SECTIONS[name] = parser
        return parser

    return register


def _suggest(key: str, known: Iterable[str]) -> str:
    known = list(known)
    if key.replace("-", "_") in known:
        return f"did you mean {key.replace('-', '_')!r} (underscores, not dashes)?"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "known keys: " + ", ".join(sorted(known))


def _unknown_keys(table: Mapping[str, Any], known: Iterable[str], where: Where) -> None:
    known = list(known)
    for key in table:
        if key not in known:
            raise where.dot(key).error("unknown key", _suggest(key, known))


def _type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _string(value: Any, where: Where, remedy: str) -> str:
    if not isinstance(value, str) or not value.strip():
        shown = repr(value) if isinstance(value, str) else _type_name(value)
        raise where.error(f"expected a non-empty string, got {shown}", remedy)
    return value.strip()


def _strings(value: Any, where: Where, remedy: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        shown = "an empty array" if value == [] else _type_name(value)
        raise where.error(f"expected a non-empty array of strings, got {shown}", remedy)
    items: list[str] = []
    for index, item in enumerate(value):
        text = _string(item, where.at(index), remedy)
        if text in items:
            raise where.at(index).error(f"{text!r} is listed twice", "list each name once")
        items.append(text)
    return tuple(items)


def _url(value: Any, where: Where) -> str:
    remedy = 'write it like url = "http://127.0.0.1:8000"'
    url = _string(value, where, remedy).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise where.error(f"{url!r} is not an http(s) URL", remedy)
    return url


_BACKEND_KEYS = ("url", "models", "name")


@section("backends")
def _backends_section(value: Any, where: Where) -> Mapping[str, Any]:
    """``[[backends]]`` tables (url, models, name), or simply URLs: a comma-separated string
    or an array of strings."""
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        raise where.error(
            f"expected [[backends]] tables, got {_type_name(value)}",
            'write one [[backends]] table per backend, with url = "http://host:port"',
        )
    specs: list[BackendSpec] = []
    for index, item in enumerate(value):
        here = where.at(index)
        if isinstance(item, str):
            spec = BackendSpec(_url(item, here))
        elif isinstance(item, dict):
            _unknown_keys(item, _BACKEND_KEYS, here)
            if "url" not in item:
                raise here.dot("url").error(
                    "missing", 'every [[backends]] table needs url = "http://host:port"'
                )
            models = item.get("models")
            name = item.get("name")
            spec = BackendSpec(
                url=_url(item["url"], here.dot("url")),
                models=None
                if models is None
                else _strings(
                    models,
                    here.dot("models"),
                    "list the served model names, or leave models out to read them from the "
                    "backend's /v1/models",
                ),
                name=None
                if name is None
                else _string(name, here.dot("name"), 'write name = "gpu0", or leave it out'),
            )
        else:
            raise here.error(
                f"expected a table, got {_type_name(item)}",
                'write [[backends]] with url = "http://host:port"',
            )
        for other, earlier in enumerate(specs):
            if earlier.url == spec.url:
                raise here.dot("url").error(
                    f"{spec.url!r} is already backends[{other}]", "list each backend once"
                )
            if spec.name is not None and earlier.name == spec.name:
                raise here.dot("name").error(
                    f"{spec.name!r} is already the name of backends[{other}]",
                    "give each backend its own name",
                )
        specs.append(spec)
    return {"backend_specs": tuple(specs)}


@section("aliases")
def _aliases_section(value: Any, where: Where) -> Mapping[str, Any]:
    """``[aliases]``: public model name -> served model names (first the target, then the
    fallbacks)."""
    if not isinstance(value, dict):
        raise where.error(
            f"expected a table, got {_type_name(value)}",
            'write [aliases] with lines like coder = ["qwen-32b"]',
        )
    aliases = {
        name: _strings(
            targets,
            where.dot(name),
            f'write {name} = ["served-model-name", ...]: the first is the target, the rest '
            "fallbacks",
        )
        for name, targets in value.items()
    }
    return {"aliases": FrozenMap(aliases)}


# [limits]: the parser sits beside the values it builds (admission/spec.py, docs/LIMITS.md).
section("limits")(parse_limits)


def _check_aliases(settings: Settings, where: Where) -> None:
    """Alias targets must be served, when every backend lists its models (otherwise the models
    are only known once the backends answer /v1/models)."""
    specs = settings.backend_specs
    if not specs or any(b.models is None for b in specs):
        return
    served = [m for b in specs for m in b.models or ()]
    for name, targets in settings.aliases.items():
        for index, target in enumerate(targets):
            if target not in served:
                raise (
                    where.dot(name)
                    .at(index)
                    .error(
                        f"{target!r} is served by no backend (served: {', '.join(served)})",
                        "add it to a [[backends]] models list or correct the name",
                    )
                )


@dataclass(frozen=True)
class ConfigFile:
    """A parsed config file: top-level settings by name, and section values by field."""

    path: str
    settings: Mapping[str, Any]
    fields: Mapping[str, Any]


def read_config_file(path: str) -> ConfigFile:
    """Read and check a ``--config`` TOML file; every problem is a ConfigError naming the key."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--config {path!r} is a directory; pass the path of a TOML file.")
    try:
        with target.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(
            f"--config {path!r}: no such file; pass the path of a TOML file "
            "(docs/CONFIG.md has an example)."
        ) from None
    except OSError as exc:
        raise ConfigError(f"--config {path!r} cannot be read: {exc.strerror}.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{path}: invalid TOML: {exc}; fix that line (docs/CONFIG.md shows the format)."
        ) from None
    settings: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for key, value in data.items():
        here = Where(path, key)
        if key == "config":
            raise here.error("a config file cannot name another", "remove this key")
        if key in SECTIONS:
            fields.update(SECTIONS[key](value, here))
        elif key in SETTINGS_BY_NAME:
            settings[key] = _from_toml(SETTINGS_BY_NAME[key], value, here)
        else:
            known = [*(n for n in SETTINGS_BY_NAME if n != "config"), *SECTIONS]
            raise here.error("unknown key", _suggest(key, known))
    return ConfigFile(path, settings, fields)


def _from_toml(item: Setting, value: Any, where: Where) -> Any:
    """A TOML value checked against the setting's type (TOML is typed; flags arrive typed)."""
    default = item.default
    if isinstance(default, Mapping):
        if not isinstance(value, dict):
            raise where.error(
                f"expected a table, got {_type_name(value)}",
                "write [sim] with lines like max_model_len = 262144",
            )
        return sim_overrides(value, str(where.file) + ": sim")
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        expected = "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str)
        expected = "a string"
    if not ok:
        raise where.error(
            f"expected {expected}, got {_type_name(value)} {value!r}",
            f"see `{item.flag}` in `thunderproxy serve --help`",
        )
    return value


# --- the embedded simulator's settings -----------------------------------------------------

#: The prefix of the ``thunderproxy sim`` variables, which ``serve`` reads for its simulator.
SIM_ENV_PREFIX = ENV_PREFIX + "SIM_"


def sim_overrides(value: Any, origin: str) -> FrozenMap[str, Any]:
    """The embedded simulator's settings, by ``SimConfig`` field name, from ``NAME=VALUE``
    pairs (flags, variables) or a mapping (a ``[sim]`` table, code); every problem is a
    ConfigError naming where it came from and what the setting takes."""
    # Imported here: the simulator's package is large and only this check needs it.
    from .sim.config import EMBEDDED, SimConfig, knob_value

    pairs: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        for pair in (value,) if isinstance(value, str) else value:
            name, sep, raw = str(pair).partition("=")
            if not sep:
                raise ConfigError(
                    f"{origin} {pair!r}: expected NAME=VALUE, e.g. --sim max_model_len=262144."
                )
            pairs.append((name, raw.strip()))
    known = [f.name for f in dataclasses.fields(SimConfig)]
    out: dict[str, Any] = {}
    for name, raw in pairs:
        key = name.strip().replace("-", "_")
        if key not in known:
            raise ConfigError(
                f"{origin}: {name!r} is not a `thunderproxy sim` setting; {_suggest(key, known)}"
            )
        try:
            out[key] = knob_value(key, raw)
        except ValueError as exc:
            raise ConfigError(f"{origin}: {exc}.") from None
    try:
        SimConfig(**{**EMBEDDED, **out})
    except ValueError as exc:
        raise ConfigError(f"{origin}: {exc}.") from None
    return FrozenMap(out)


def sim_environment(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The ``THUNDERPROXY_SIM_<NAME>`` variables that name simulator settings, as ``NAME=VALUE``
    pairs (``thunderproxy sim``'s own HOST and PORT are not settings of the simulator)."""
    from .sim.config import SimConfig

    known = {f.name for f in dataclasses.fields(SimConfig)}
    pairs = []
    for variable, value in sorted(environ.items()):
        name = variable.removeprefix(SIM_ENV_PREFIX).lower()
        if variable.startswith(SIM_ENV_PREFIX) and name in known:
            pairs.append(f"{name}={value}")
    return tuple(pairs)


# --- loading --------------------------------------------------------------------------------


def _parse_backends(value: str | Iterable[str], origin: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = []
    for raw in items:
        url = raw.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{origin}: backend {raw!r} is not an http(s) URL; pass e.g. "
                "--backends http://127.0.0.1:8000"
            )
        urls.append(url)
    return tuple(urls)


def _check(item: Setting, value: Any, origin: str) -> None:
    numeric = isinstance(item.default, (int, float)) and not isinstance(item.default, bool)
    problem = item.check(value) if item.check else None
    if problem is None and item.choices and value not in item.choices:
        problem = f"is not one of: {', '.join(item.choices)}"
    if problem is None and numeric and value < 0:
        problem = "must be >= 0"
    if problem:
        raise ConfigError(f"{origin}: {value!r} {problem}.")


def load_settings(
    values: Mapping[str, Any] | None = None,
    *,
    origins: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Validate raw values (from flags, env or code, by setting name) into :class:`Settings`.

    ``None`` means "not given". When ``config`` names a TOML file, its values sit under the
    given ones (defaults < file < given). ``origins`` names where a given value came from
    (e.g. an environment variable) for error messages; the default is its flag.
    """
    raw: dict[str, Any] = {
        k: v for k, v in {**(values or {}), **overrides}.items() if v is not None
    }
    known = [*SETTINGS_BY_NAME, *STRUCTURED]
    for name in raw:
        if name not in known:
            raise ConfigError(
                f"Unknown setting {name!r} (`thunderproxy serve --help` lists them); "
                + _suggest(name, known)
            )
    given_origin = {**{s.name: s.flag for s in SETTINGS}, **(origins or {})}
    file = read_config_file(raw["config"]) if raw.get("config") else None
    merged: dict[str, tuple[Any, str]] = {}
    file_sim = None if file is None else file.settings.get("sim")
    if file is not None:
        for name, value in file.settings.items():
            merged[name] = (value, f"{file.path}: {name}")
    for name, value in raw.items():
        if name == "sim":
            # One simulator setting at a time: the file's table, then variables, then flags.
            value = sim_overrides(value, given_origin[name])
            if name in merged:
                value = FrozenMap({**merged[name][0], **value})
        if name in SETTINGS_BY_NAME:
            merged[name] = (value, given_origin[name])
    fields: dict[str, Any] = dict(file.fields) if file is not None else {}
    fields.update({k: v for k, v in raw.items() if k in STRUCTURED})
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, (value, origin) in merged.items():
        item = SETTINGS_BY_NAME[name]
        if name == "backends":
            value = _parse_backends(value, origin)
            if "backends" in raw:
                # A --backends flag or env var replaces the file's backends, models and all.
                fields["backend_specs"] = tuple(BackendSpec(url) for url in value)
        _check(item, value, origin)
        groups.setdefault(item.path[:-1], {})[item.path[-1]] = value
    if "backend_specs" in fields:
        groups.setdefault((), {}).pop("backends", None)
    kwargs = groups.get((), {})
    for path, group_values in groups.items():
        if path:
            # Only one level of nesting today: Settings.policy.
            (name,) = path
            kwargs[name] = dataclasses.replace(getattr(Settings(), name), **group_values)
    settings = Settings(**kwargs, **fields)
    if settings.sim and settings.backends:
        if given_origin.get("sim") == SIM_ENV_PREFIX + "*" and file_sim is None:
            # Variables left in the shell for a `thunderproxy sim` that --backends points at.
            settings = dataclasses.replace(settings, sim=FrozenMap())
        else:
            raise ConfigError(
                "--sim (or a [sim] table) sets the simulator that serve starts when no "
                "--backends are given; remove it, or the backends."
            )
    if file is not None:
        _check_aliases(settings, Where(file.path, "aliases"))
        specs = settings.backend_specs
        if settings.limits is not None and specs and all(b.models is not None for b in specs):
            served = {m for b in specs for m in b.models or ()}
            check_served(settings.limits, served, Where(file.path, "limits"))
    if settings.protect_reads and not settings.admin_token:
        raise ConfigError("--protect-reads needs --admin-token: set the token readers must send.")
    if settings.workers > 1 and not settings.redis:
        raise ConfigError(
            f"--workers {settings.workers} needs --redis: processes behind one port see each "
            "other's programs and limits only through Redis; pass --redis "
            "redis://host:6379/0, or --workers 1."
        )
    if settings.workers > 1 and not settings.backends:
        raise ConfigError(
            f"--workers {settings.workers} needs --backends: each process would start an "
            "embedded simulator of its own; pass --backends URL, or --workers 1."
        )
    return settings


def given_values(
    ctx: click.Context, values: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The values a user set (in the environment or as flags), leaving out click's defaults so
    a config file can supply them; and where each came from, for error messages."""
    given: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if source in (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP):
            continue
        given[name] = value
        if source is click.core.ParameterSource.ENVIRONMENT:
            origins[name] = SETTINGS_BY_NAME[name].envvar
    if "sim" in values:
        # The simulator's variables are `thunderproxy sim`'s own, one per setting; flags win.
        from_env = sim_environment(os.environ)
        if from_env and "sim" not in given:
            origins["sim"] = SIM_ENV_PREFIX + "*"
        if from_env:
            given["sim"] = (*from_env, *given.get("sim", ()))
    return given, origins


def settings_options(settings: Iterable[Setting] = SETTINGS) -> Callable[[F], F]:
    """Decorate a click command with one option per setting, each also read from its env var."""

    def decorate(fn: F) -> F:
        for item in reversed(tuple(settings)):
            default = item.default
            kwargs: dict[str, Any] = {
                "help": item.help,
                # Each reads THUNDERPROXY_<NAME>; the command's help says so once.
                "envvar": item.envvar,
                # An empty default says nothing worth a line.
                "show_default": not item.secret and item.default not in ("", ()),
            }
            if isinstance(default, Mapping):
                # NAME=VALUE pairs, repeatable; their variables are THUNDERPROXY_SIM_<NAME>.
                kwargs.update(multiple=True, metavar="NAME=VALUE", envvar=None, show_default=False)
                decls = [item.flag, item.name]
                default = ()
            elif isinstance(default, bool):
                decls = [f"{item.flag}/--no-{item.flag[2:]}", item.name]
            else:
                decls = [item.flag, item.name]
                if item.choices:
                    kwargs["type"] = click.Choice(item.choices)
                elif isinstance(default, float):
                    kwargs["type"] = float
                elif isinstance(default, int):
                    kwargs["type"] = int
                elif isinstance(default, tuple):
                    # A list on the command line is one comma-separated value.
                    default = ",".join(default)
            kwargs["default"] = default
            fn = click.option(*decls, **kwargs)(fn)
        return fn

    return decorate


#: How ``serve --help`` groups the settings: the common ones first, then one section per area.
#: A setting no section names is listed under "Other options" (and test_config says so).
HELP_SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Common options", ("backends", "port", "host", "db", "config", "router", "sim", "log_level")),
    (
        "Backends",
        ("metrics", "metrics_interval", "connect_timeout", "first_byte_timeout", "read_timeout",
         "max_connections", "ready_timeout"),
    ),
    (
        "Programs and scheduling (docs/SCHEDULING.md)",
        ("recognition", "profile", "restore", "monitor_interval", "decode_buffer",
         "pause_cooldown", "resume_cooldown", "tool_coefficient", "acting_half_life",
         "admission_half_life", "max_wait", "mid_program_head_start", "hold",
         "make_room_at_once", "idle_claims", "return_evidence", "resume_protection",
         "idle_lease", "target_fill", "max_queue_wait", "gate_returns", "tier_max_load_share",
         "tier_reload_window"),
    ),
    (
        "Serving, access and the audit log",
        ("admin_token", "passthrough", "protect_reads", "datasette", "http_front", "certfile",
         "keyfile", "max_body_bytes", "max_header_bytes", "client_timeout", "shutdown_grace",
         "audit_queue", "log_format"),
    ),
    ("Several processes or instances (docs/DEPLOY.md)", ("workers", "redis", "redis_heartbeat")),
    (
        "LLM council (docs/COUNCIL.md)",
        ("council_models", "council_chairman", "council_title_model", "council_member_timeout",
         "council_max_tokens", "council_tools", "council_tool_rounds",
         "council_tools_allow_private", "council_search_url", "council_search_key",
         "council_keepalive", "council_max_jobs", "council_max_jobs_per_client"),
    ),
    (
        "Serverless worker mode (docs/WORKER.md)",
        ("report_addr", "unsecured", "max_wait_time", "parallel", "benchmark", "benchmark_cache",
         "worker_ready_timeout", "program_tokens"),
    ),
)  # fmt: skip


class SettingsCommand(click.Command):
    """A command whose ``--help`` lists its options in the sections of ``HELP_SECTIONS``."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and param.name is not None:
                records[param.name] = record
        for title, names in HELP_SECTIONS:
            rows = [records.pop(name) for name in names if name in records]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        if records:
            with formatter.section("Other options"):
                formatter.write_dl(list(records.values()))


def settings_table() -> str:
    """The README's ``serve`` flags table, generated from the settings table."""

    def shown(item: Setting) -> str:
        value = item.default
        if isinstance(value, bool):
            return "on" if value else "off"
        if value in ("", ()) or (isinstance(value, Mapping) and not value):
            return "(empty)"
        return f"`{value}`"

    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for item in SETTINGS:
        flag = item.flag
        if isinstance(item.default, bool):
            flag = f"{item.flag}/--no-{item.flag[2:]}"
        elif isinstance(item.default, Mapping):
            flag = f"{item.flag} NAME=VALUE"
        rows.append(f"| `{flag}` | {shown(item)} | {item.help} |")
    return "\n".join(rows) + "\n"
