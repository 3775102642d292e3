"""Settings, declared once: each field of :class:`Settings` (and of the nested
:class:`PolicyConfig` and :class:`CouncilSettings`) carries its help, flag and checks in its
``setting(...)`` metadata, and everything else is derived from those fields: the ``SETTINGS``
table here, the click flags and help (``help.py``), their ``THUNDERPROXY_<NAME>`` environment
variables and the top-level keys of a ``--config`` TOML file (``loading.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ConfigError
from ..urls import redact_url, redact_url_secrets
from .clients import ClientsSpec, check_forwarding
from .limits import LimitsSpec
from .passthrough import DEFAULT_PASSTHROUGH, parse_prefixes

ENV_PREFIX = "THUNDERPROXY_"
#: ``default_model`` that sends no name anywhere: a model nothing serves is answered 404.
NO_DEFAULT_MODEL = "none"
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
#: The latency classes a program may be in (scheduling/classes.py says what each means).
PROGRAM_CLASSES = ("batch", "interactive")


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
        "router), or one of its calls' length where they are shorter.",
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
    max_wait_share: float = setting(
        0.25,
        "tr: a batch call of a program long under way may wait this share of the program's run "
        "so far where that is longer than --max-wait, up to five times --max-wait (0: every "
        "batch call waits at most --max-wait).",
        flag="--max-wait-share",
        check=lambda v: None if 0 <= v <= 1 else "must be a share between 0 and 1",
    )
    interactive_max_wait_s: float = setting(
        3.0 * SECONDS,
        "tr: the longest a call of an interactive program waits for capacity (batch programs "
        "wait up to --max-wait): room is made for it from batch programs at once, and at the "
        "bound it goes out, capacity or not.",
        flag="--interactive-max-wait",
        check=lambda v: None if v >= 0 else "must be >= 0 seconds",
    )
    default_program_class: str = setting(
        "batch",
        "The latency class of a program whose calls name none (program_class, X-Program-Class) "
        "and that is not recognised as Claude Code, Codex or aider: batch (its calls held up to "
        "--max-wait) or interactive (up to --interactive-max-wait).",
        choices=PROGRAM_CLASSES,
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
    default_model: str = setting(
        "",
        "Model that calls naming a model no backend serves (nor any [aliases] entry) are sent "
        "to, logged once per name, the step recording both names; empty: the one model the "
        "backends serve when they serve just one (so clients that ask for their own model "
        "names, such as Claude Code, work as they are), else such calls are answered 404; "
        f"'{NO_DEFAULT_MODEL}': always 404.",
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
    #: Who may call (``[clients]``, docs/CONFIG.md); None: anyone, as before keys existed.
    clients: ClientsSpec | None = None

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
        if self.limits is not None and self.limits.clients:
            names = () if self.clients is None else self.clients.names
            for name in self.limits.clients:
                if name not in names:
                    raise ConfigError(
                        f"limits.clients.{name}: no configured client has this name; "
                        + (
                            "name one of: " + ", ".join(names)
                            if names
                            else "client limits need client keys: add [clients.keys] (CONFIG.md, "
                            '"Client keys"), or remove [limits.clients]'
                        )
                        + "."
                    )
        if self.clients is not None:
            problem = check_forwarding(self.clients, [(b.url, b.name) for b in self.backend_specs])
            if problem is not None:
                raise ConfigError(problem + ".")
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
            if isinstance(value, str) and "://" in value:
                # Any URL setting may carry a token, in its userinfo or its query.
                value = redact_url_secrets(value)
            values[item.name] = "<redacted>" if item.secret and value else value
        # Credentials in a backend URL go to that backend only, never to a log or the db.
        values["backends"] = [redact_url(url) for url in self.backends]
        values["backend_specs"] = [
            {**dataclasses.asdict(b), "url": redact_url(b.url)} for b in self.backend_specs
        ]
        values["aliases"] = {name: list(targets) for name, targets in self.aliases.items()}
        values["limits"] = None if self.limits is None else self.limits.public()
        values["clients"] = None if self.clients is None else self.clients.public()
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
STRUCTURED = ("backend_specs", "aliases", "limits", "clients")


def _suggest(key: str, known: Iterable[str]) -> str:
    known = list(known)
    if key.replace("-", "_") in known:
        return f"did you mean {key.replace('-', '_')!r} (underscores, not dashes)?"
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return "known keys: " + ", ".join(sorted(known))
