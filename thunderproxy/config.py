"""Settings: one declarative table feeds the frozen ``Settings``, the CLI flags, their
``THUNDERPROXY_<NAME>`` environment variables and the settings table in the README."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from .errors import ConfigError
from .scheduling.policy import PolicyConfig

ENV_PREFIX = "THUNDERPROXY_"
SECONDS = 1.0
BYTES = 1

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Setting:
    """One tunable: its name (a ``Settings`` field), default, help text and, for text
    settings with a fixed vocabulary, the allowed values."""

    name: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    #: Never shown as a default, logged or written to the audit db.
    secret: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def envvar(self) -> str:
        return ENV_PREFIX + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "host", "127.0.0.1", "Interface to listen on; 0.0.0.0 exposes the proxy to the network."
    ),
    Setting("port", 8300, "TCP port to listen on."),
    Setting(
        "backends",
        "",
        "Comma-separated OpenAI-compatible backend base URLs (vLLM or SGLang). "
        "Empty: start an embedded simulated vLLM.",
    ),
    Setting(
        "router",
        "tr",
        "Scheduling mode: 'tr' pauses and resumes whole programs to keep KV cache, "
        "'default' only proxies.",
        choices=("default", "tr"),
    ),
    Setting("profile", True, "Serve per-program timing profiles at /profiles and in /programs."),
    Setting("metrics", True, "Poll each backend's /metrics for KV capacity and usage."),
    Setting("metrics_interval", 5.0 * SECONDS, "Seconds between backend metrics polls."),
    Setting("db", "thunderproxy.db", "SQLite file that receives every transition and step."),
    Setting(
        "shutdown_grace",
        10.0 * SECONDS,
        "Seconds in-flight requests may take to finish after SIGINT/SIGTERM.",
    ),
    Setting("connect_timeout", 10.0 * SECONDS, "Seconds to wait for a backend TCP connection."),
    Setting(
        "first_byte_timeout",
        600.0 * SECONDS,
        "Seconds a backend may take to start its response (prefill of a long prompt included).",
    ),
    Setting(
        "read_timeout",
        300.0 * SECONDS,
        "Seconds a backend may stay silent in the middle of a response.",
    ),
    Setting(
        "max_connections",
        1024,
        "Connections kept open to each backend; one shared pool per backend.",
    ),
    Setting("audit_queue", 10_000, "Audit rows buffered in memory before rows are dropped."),
    Setting(
        "decode_buffer",
        256,
        "tr: tokens reserved for decoding per reasoning program (seed DECODE_BUFFER).",
    ),
    Setting(
        "pause_cooldown",
        5.0 * SECONDS,
        "tr: seconds between two pause rounds on one backend (seed PAUSE_COOLDOWN).",
    ),
    Setting(
        "resume_cooldown",
        5.0 * SECONDS,
        "tr: seconds between two resume rounds on one backend (seed RESUME_COOLDOWN).",
    ),
    Setting(
        "tool_coefficient",
        1.0,
        "tr: weight of an acting program's tokens in the capacity model (seed TOOL_COEFFICIENT).",
    ),
    Setting(
        "acting_half_life",
        5.0 * SECONDS,
        "tr: half-life of an acting program's tokens in the capacity model (0: no decay).",
    ),
    Setting(
        "max_wait",
        300.0 * SECONDS,
        "tr: a paused program with a waiting request is resumed after this long, capacity "
        "or not; at half of it, it reserves the next free capacity.",
    ),
    Setting(
        "resume_protection",
        30.0 * SECONDS,
        "tr: seconds a force-resumed program is protected from being paused again.",
    ),
    Setting(
        "idle_lease",
        600.0 * SECONDS,
        "Seconds without a request after which a program is retired (0: never).",
    ),
    Setting(
        "target_fill",
        0.9,
        "tr: fraction of each backend's KV capacity that new and resumed programs may fill; "
        "running programs are moved only past the full capacity.",
    ),
    Setting(
        "gate_returns",
        True,
        "tr: an acting program whose next call would overflow its backend waits for room "
        "instead of pushing the engine into preemptions.",
    ),
    Setting(
        "monitor_interval",
        1.0 * SECONDS,
        "Seconds between runs of the resume monitor (resumes, forced resumes, idle leases).",
    ),
    Setting(
        "restore",
        True,
        "Restore the program registry from the audit db at startup.",
    ),
    Setting(
        "datasette",
        True,
        "Serve Datasette, read-only, at /datasette/ on the same port to explore the audit db.",
    ),
    Setting(
        "ready_timeout",
        30.0 * SECONDS,
        "Seconds to wait at startup for the backends to answer /health before serving anyway.",
    ),
    Setting(
        "max_queue_wait",
        0.0 * SECONDS,
        "tr: a new program whose estimated wait for capacity exceeds this many seconds is "
        "answered 429 with Retry-After instead of queuing (0: always queue).",
    ),
    Setting("max_body_bytes", 32 * 1024 * 1024 * BYTES, "Largest request body accepted (413)."),
    Setting(
        "max_header_bytes",
        64 * 1024 * BYTES,
        "Largest request head (request line and headers) accepted.",
    ),
    Setting(
        "client_timeout",
        60.0 * SECONDS,
        "Seconds a client may take to send its request, and an idle connection is kept.",
    ),
    Setting(
        "admin_token",
        "",
        "Bearer token required by state-changing endpoints (/programs/release) and Datasette; "
        "empty: no token needed.",
        secret=True,
    ),
    Setting("log_level", "info", "Log verbosity.", choices=("debug", "info", "warning", "error")),
    Setting(
        "council_models",
        "",
        "Comma-separated model names that sit on the council at /council/ (empty: no council "
        "jobs can run).",
    ),
    Setting(
        "council_chairman",
        "",
        "Model that synthesises the council's answer (empty: the first member).",
    ),
    Setting(
        "council_title_model", "", "Model that titles a new conversation (empty: the chairman)."
    ),
    Setting(
        "council_member_timeout",
        300.0 * SECONDS,
        "Seconds one council member may take for one stage before it is left out.",
    ),
    Setting(
        "council_max_tokens",
        0,
        "Most tokens a council member may write per answer (0: the backend's default).",
    ),
    Setting(
        "council_tools",
        False,
        "Offer council members the fetch_url (and, with --council-search-url, web_search) "
        "tools in stage 1; the backends must accept OpenAI tool calls.",
    ),
    Setting(
        "council_tool_rounds", 5, "Rounds of tool calls a member may make before it must answer."
    ),
    Setting(
        "council_tools_allow_private",
        False,
        "Let fetch_url read private, loopback and link-local addresses (off: refused).",
    ),
    Setting(
        "council_search_url",
        "",
        "Search endpoint for web_search, called as GET URL?q=... and answering JSON "
        "(SearXNG's format=json, Brave's web search, or {results: [{title, url, snippet}]}); "
        "empty: no web_search.",
    ),
    Setting("council_search_key", "", "API key sent to the search endpoint.", secret=True),
    Setting(
        "council_keepalive",
        15.0 * SECONDS,
        "Seconds between keepalive comments on a quiet council event stream.",
    ),
)

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Settings:
    """Validated configuration of one proxy run. Build with :func:`load_settings`."""

    host: str = "127.0.0.1"
    port: int = 8300
    backends: tuple[str, ...] = ()
    router: str = "tr"
    profile: bool = True
    metrics: bool = True
    metrics_interval: float = 5.0
    db: str = "thunderproxy.db"
    shutdown_grace: float = 10.0
    connect_timeout: float = 10.0
    first_byte_timeout: float = 600.0
    read_timeout: float = 300.0
    max_connections: int = 1024
    audit_queue: int = 10_000
    decode_buffer: int = 256
    pause_cooldown: float = 5.0
    resume_cooldown: float = 5.0
    tool_coefficient: float = 1.0
    acting_half_life: float = 5.0
    max_wait: float = 300.0
    resume_protection: float = 30.0
    idle_lease: float = 600.0
    target_fill: float = 0.9
    gate_returns: bool = True
    monitor_interval: float = 1.0
    restore: bool = True
    datasette: bool = True
    ready_timeout: float = 30.0
    max_queue_wait: float = 0.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    client_timeout: float = 60.0
    admin_token: str = dataclasses.field(default="", repr=False)
    log_level: str = "info"
    council_models: str = ""
    council_chairman: str = ""
    council_title_model: str = ""
    council_member_timeout: float = 300.0
    council_max_tokens: int = 0
    council_tools: bool = False
    council_tool_rounds: int = 5
    council_tools_allow_private: bool = False
    council_search_url: str = ""
    council_search_key: str = dataclasses.field(default="", repr=False)
    council_keepalive: float = 15.0

    def public(self) -> dict[str, Any]:
        """Every setting, secrets redacted: what may be logged or stored."""
        values = dataclasses.asdict(self)
        for setting in SETTINGS:
            if setting.secret and values.get(setting.name):
                values[setting.name] = "<redacted>"
        return values

    def policy(self) -> PolicyConfig:
        return PolicyConfig(
            decode_buffer=self.decode_buffer,
            pause_cooldown_s=self.pause_cooldown,
            resume_cooldown_s=self.resume_cooldown,
            tool_coefficient=self.tool_coefficient,
            acting_half_life_s=self.acting_half_life,
            max_wait_s=self.max_wait,
            resume_protection_s=self.resume_protection,
            idle_lease_s=self.idle_lease,
            target_fill=self.target_fill,
            max_queue_wait_s=self.max_queue_wait,
            gate_returns=self.gate_returns,
        )


def _parse_backends(value: str | Iterable[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = []
    for raw in items:
        url = raw.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"Backend {raw!r} is not an http(s) URL; pass e.g. --backends http://127.0.0.1:8000"
            )
        urls.append(url)
    return tuple(urls)


def load_settings(values: Mapping[str, Any] | None = None, **overrides: Any) -> Settings:
    """Validate raw values (from flags, env or code) into :class:`Settings`."""
    raw: dict[str, Any] = {**(values or {}), **overrides}
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"Unknown setting(s) {', '.join(unknown)}; see `thunderproxy serve --help`."
        )
    if "backends" in raw:
        raw["backends"] = _parse_backends(raw["backends"])
    for setting in SETTINGS:
        value = raw.get(setting.name)
        if value is None:
            continue
        if setting.choices and value not in setting.choices:
            raise ConfigError(
                f"{setting.flag} {value!r} is not one of: {', '.join(setting.choices)}."
            )
        numeric = isinstance(setting.default, (int, float)) and not isinstance(
            setting.default, bool
        )
        if numeric and value < 0:
            raise ConfigError(f"{setting.flag} must be >= 0, got {value!r}.")
    for name in ("metrics_interval", "monitor_interval"):
        if raw.get(name, 1.0) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds.")
    if not 0 < raw.get("target_fill", 0.9) <= 1:
        raise ConfigError("--target-fill must be in (0, 1].")
    return Settings(**{k: v for k, v in raw.items() if v is not None})


def settings_options(settings: Iterable[Setting] = SETTINGS) -> Callable[[F], F]:
    """Decorate a click command with one option per setting, each also read from its env var."""

    def decorate(fn: F) -> F:
        for setting in reversed(tuple(settings)):
            kwargs: dict[str, Any] = {
                "default": setting.default,
                "help": setting.help,
                "envvar": setting.envvar,
                "show_envvar": True,
                "show_default": not setting.secret,
            }
            if isinstance(setting.default, bool):
                decls = [f"{setting.flag}/--no-{setting.flag[2:]}", setting.name]
            else:
                decls = [setting.flag, setting.name]
                if setting.choices:
                    kwargs["type"] = click.Choice(setting.choices)
                elif isinstance(setting.default, float):
                    kwargs["type"] = float
                elif isinstance(setting.default, int):
                    kwargs["type"] = int
            fn = click.option(*decls, **kwargs)(fn)
        return fn

    return decorate
