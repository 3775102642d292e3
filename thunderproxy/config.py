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
        "report_addr",
        "",
        "Worker mode (Vast.ai serverless): comma-separated autoscaler addresses to report load "
        "to and fetch the signing key from; empty: the platform's REPORT_ADDR, else worker "
        "mode is off.",
    ),
    Setting(
        "unsecured",
        False,
        "Worker mode, local development only: accept requests without the autoscaler's "
        "signature (the seed's UNSECURED).",
    ),
    Setting(
        "max_wait_time",
        10.0 * SECONDS,
        "Worker mode: a request whose estimated wait (pending workload / measured throughput) "
        "exceeds this is answered 429 with Retry-After.",
    ),
    Setting(
        "parallel",
        True,
        "Worker mode: forward requests concurrently; --no-parallel serves them one at a time, "
        "in arrival order (the seed's ALLOW_PARALLEL=false).",
    ),
    Setting(
        "benchmark",
        "",
        "Worker mode: throughput benchmark as module:function (async, called with the backend "
        "URL and an httpx.AsyncClient on it); empty: the built-in chat-completions tokens/s.",
    ),
    Setting(
        "benchmark_cache",
        "thunderproxy-benchmark.json",
        "Worker mode: JSON file caching benchmark results per backend URL and model, so a "
        "restart skips the benchmark.",
    ),
    Setting(
        "worker_ready_timeout",
        1200.0 * SECONDS,
        "Worker mode: seconds the backend may take to answer /health before the worker reports "
        "it failed and stays up as a beacon (the seed's 20 min).",
    ),
    Setting(
        "program_tokens",
        20_000,
        "Worker mode: tokens of KV cache a typical agent program holds, to report how many "
        "programs the backend fits.",
    ),
    Setting(
        "certfile",
        "",
        "TLS certificate (PEM) to serve HTTPS with; needs --keyfile. Empty: plain HTTP.",
    ),
    Setting("keyfile", "", "TLS private key (PEM) matching --certfile."),
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
    report_addr: str = ""
    unsecured: bool = False
    max_wait_time: float = 10.0
    parallel: bool = True
    benchmark: str = ""
    benchmark_cache: str = "thunderproxy-benchmark.json"
    worker_ready_timeout: float = 1200.0
    program_tokens: int = 20_000
    certfile: str = ""
    keyfile: str = ""

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
    if bool(raw.get("certfile")) != bool(raw.get("keyfile")):
        raise ConfigError("--certfile and --keyfile go together; pass both or neither.")
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
