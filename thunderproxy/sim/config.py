"""Every simulator knob in one frozen dataclass, plus the named timing profiles.

The CLI (`sim/cli.py`) builds its options from the field metadata below, so a knob added
here shows up as `--flag` and `THUNDERPROXY_SIM_<NAME>` without further wiring.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

COMPAT_VERSIONS = ("current", "0.8", "0.9", "0.10", "0.11")
PERSONALITIES = ("vllm", "sglang")
FAULT_TYPES = ("500", "503", "stream", "hang", "slow")

# The vLLM version each compat level pretends to be (what /version and system_fingerprint say).
COMPAT_VERSION_STRING = {
    "current": "0.33.0",
    "0.8": "0.8.5",
    "0.9": "0.9.2",
    "0.10": "0.10.2",
    "0.11": "0.11.0",
}


@dataclass(frozen=True)
class TimingProfile:
    """Constants of the step-time formula (docs/SIMULATOR.md, "Timing") plus the KV size they
    imply."""

    name: str
    t_fixed_ms: float
    t_w_ms: float
    c_tok_us: float
    n0: int
    c_kv_ns: float
    c_attn_ns: float
    kv_capacity_tokens: int
    block_size: int = 16
    description: str = ""
    # Frontend cost per prompt token (tokenization, template rendering) before a request
    # reaches the engine; 0 in the profiles but the fitted one, which model the GPU only.
    c_prep_us: float = 0.0
    # KV bytes one token takes over all layers and TP ranks (2 x layers x KV heads x
    # head dim x dtype bytes); sizes the CPU tier and its transfers.
    kv_bytes_per_token: int = 131_072

    def scaled(self, factor: float) -> TimingProfile:
        """The same engine ``factor`` times slower (every time constant times it; the
        compute-bound threshold ``n0`` and the sizes unchanged)."""
        return dataclasses.replace(
            self,
            t_fixed_ms=self.t_fixed_ms * factor,
            t_w_ms=self.t_w_ms * factor,
            c_tok_us=self.c_tok_us * factor,
            c_kv_ns=self.c_kv_ns * factor,
            c_attn_ns=self.c_attn_ns * factor,
            c_prep_us=self.c_prep_us * factor,
        )


def _profile(
    name: str,
    t_fixed_ms: float,
    t_w_ms: float,
    c_tok_us: float,
    n0: int,
    c_kv_ns: float,
    c_attn_ns: float,
    kv_capacity_tokens: int,
    description: str,
    c_prep_us: float = 0.0,
    kv_bytes_per_token: int = 131_072,
) -> TimingProfile:
    return TimingProfile(
        name, t_fixed_ms, t_w_ms, c_tok_us, n0, c_kv_ns, c_attn_ns, kv_capacity_tokens,
        description=description, c_prep_us=c_prep_us, kv_bytes_per_token=kv_bytes_per_token,
    )  # fmt: skip


PROFILES: dict[str, TimingProfile] = {
    p.name: p
    for p in (
        # name          t_fixed  t_w  c_tok  n0   c_kv  c_attn  KV tokens
        # KV bytes/token = 2 (K,V) x layers x KV heads x head dim x 2 (BF16 cache).
        _profile("h100-8b",    0.8,  5.7, 24.0, 128, 50.0, 1.3,   432_000,
                 "Llama-3.1-8B BF16 on one H100", kv_bytes_per_token=2 * 32 * 8 * 128 * 2),
        _profile("h100x2-32b", 1.0, 15.0, 55.0, 128, 50.0, 1.6,   310_000,
                 "Qwen2.5-32B BF16, TP2 on H100", kv_bytes_per_token=2 * 64 * 8 * 128 * 2),
        _profile("h100x4-70b", 1.0, 20.0, 58.0, 128, 31.0, 1.6,   450_000,
                 "Llama-3.1-70B BF16, TP4 on H100", kv_bytes_per_token=2 * 80 * 8 * 128 * 2),
        _profile("h100x8-70b", 1.0, 13.0, 33.0, 128, 16.0, 0.8, 1_300_000,
                 "Llama-3.1-70B BF16, TP8 on H100", kv_bytes_per_token=2 * 80 * 8 * 128 * 2),
        # Fitted by `python -m thunderproxy.sim.calibrate` to the ThunderAgent SWE-agent
        # runs (GLM-4.5-FP8 on vLLM at 1/4/32 agents); docs/SIMULATOR.md has the fit.
        _profile("glm45-swe",  2.0, 14.2, 16.9, 128, 80.0, 1.4, 1_500_000,
                 "fitted to the ThunderAgent SWE-agent trace (GLM-4.5-FP8)", c_prep_us=5.3,
                 kv_bytes_per_token=2 * 92 * 8 * 128 * 2),
    )
}  # fmt: skip

#: Profiles fitted to a real engine by ``thunderproxy bench --calibrate``, shipped as JSON files
#: beside this module (``profiles/NAME.json``); each names the command that measured it.
PROFILE_DIR = Path(__file__).with_name("profiles")
PROFILE_FIELDS = frozenset(f.name for f in dataclasses.fields(TimingProfile))


def load_profile(path: Path) -> TimingProfile:
    """A timing profile from a JSON file: TimingProfile's fields, anything else ignored (the
    measurements the calibration keeps beside them)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    return TimingProfile(**{k: v for k, v in doc.items() if k in PROFILE_FIELDS})


for _path in sorted(PROFILE_DIR.glob("*.json")):
    _loaded = load_profile(_path)
    PROFILES[_loaded.name] = _loaded


def _knob(default: Any, help: str, *, group: str, flag: str | None = None, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group, "flag": flag, **extra})


@dataclass(frozen=True)
class SimConfig:
    """All settings of one simulated backend. Build with keywords; every field has a default."""

    PROFILES: ClassVar[dict[str, TimingProfile]] = PROFILES

    # identity
    served_model_name: str = _knob(
        "meta-llama/Llama-3.1-8B-Instruct",
        "Model name served and used in metric labels.",
        group="identity",
    )
    extra_served_model_names: str = _knob(
        "",
        "Comma list of more model names the same engine answers to (vLLM's --served-model-name "
        "takes several); /v1/models lists them all.",
        group="identity",
    )
    compat: str = _knob(
        "current",
        "vLLM version family to imitate: current (0.12+), 0.8, 0.9, 0.10, 0.11.",
        group="identity",
        choices=COMPAT_VERSIONS,
    )
    personality: str = _knob(
        "vllm", "Which server to imitate: vllm or sglang.", group="identity", choices=PERSONALITIES
    )
    # engine
    max_model_len: int = _knob(
        131_072,
        "Context length in tokens (vLLM's default is the model's own: 131072 for Llama-3.1-8B).",
        group="engine",
    )
    block_size: int | None = _knob(
        None, "Tokens per KV block (default: the profile's, 16).", group="engine"
    )
    num_gpu_blocks: int | None = _knob(
        None,
        "KV blocks in the pool, the null block included (default: profile's KV tokens // "
        "block size).",
        group="engine",
    )
    kv_capacity_tokens: int | None = _knob(
        None, "KV capacity in tokens; sets num_gpu_blocks = this // block_size.", group="engine"
    )
    gpu_memory_utilization: float = _knob(
        0.92, "Reported in vllm:cache_config_info only.", group="engine"
    )
    max_num_seqs: int = _knob(1024, "Most requests in the running batch.", group="engine")
    max_num_batched_tokens: int = _knob(8192, "Token budget of one engine step.", group="engine")
    long_prefill_token_threshold: int = _knob(
        0, "Cap on prefill tokens one request may take per step (0: no cap).", group="engine"
    )
    scheduling_policy: str = _knob(
        "fcfs",
        "fcfs or priority (lower priority value runs first).",
        group="engine",
        choices=("fcfs", "priority"),
    )
    enable_prefix_caching: bool = _knob(
        True, "Automatic prefix caching.", group="engine", negatable=True
    )
    scheduler_reserve_full_isl: bool = _knob(
        True,
        "Admit a waiting request only when its whole prompt fits in the free KV blocks, not "
        "only its first chunk (vLLM 0.32's default); otherwise it waits for capacity. "
        "--no-scheduler-reserve-full-isl: admit on the first chunk and preempt later, as "
        "older vLLM did.",
        group="engine",
        negatable=True,
    )
    kv_offloading_size: float = _knob(
        0.0,
        "CPU KV tier in GiB, over all TP ranks, as vLLM's --kv-offloading-size (native "
        "backend); blocks = GiB * 2**30 // (kv_bytes_per_token * block_size). 0: no tier.",
        group="offload",
    )
    kv_offloading_tokens: int | None = _knob(
        None,
        "CPU KV tier in tokens (overrides kv_offloading_size; rounded down to blocks).",
        group="offload",
    )
    kv_bytes_per_token: int | None = _knob(
        None, "KV bytes per token, all layers (default: the profile's).", group="offload"
    )
    kv_offload_bandwidth_gbps: float = _knob(
        25.0,
        "CPU<->GPU copy bandwidth in GB/s per direction (PCIe 4.0 x16 achieves about 25).",
        group="offload",
    )
    kv_offload_latency_us: float = _knob(
        20.0, "Fixed cost of one transfer (µs): launch and synchronisation.", group="offload"
    )
    max_num_queued_reqs: int | None = _knob(
        None, "Reject with 503 when this many requests already wait.", group="engine"
    )
    max_num_queued_tokens: int | None = _knob(
        None, "Reject with 503 when waiting prompts hold this many tokens.", group="engine"
    )
    # http
    enable_prompt_tokens_details: bool = _knob(
        False, "Report usage.prompt_tokens_details.cached_tokens.", group="http"
    )
    enable_cache_report: bool = _knob(
        False, "SGLang's name for --enable-prompt-tokens-details.", group="http"
    )
    enable_force_include_usage: bool = _knob(
        False, "Send the usage chunk on every stream.", group="http"
    )
    enable_request_id_headers: bool = _knob(False, "Echo X-Request-Id in responses.", group="http")
    api_key: str | None = _knob(None, "Require this bearer token on /v1/*.", group="http")
    dev_mode: bool = _knob(
        False, "Serve /reset_prefix_cache, /sleep, /wake_up, /is_sleeping.", group="http"
    )
    enable_responses_api_store: bool = _knob(
        True,
        "Keep /v1/responses results for previous_response_id (vLLM: "
        "VLLM_ENABLE_RESPONSES_API_STORE, off by default there).",
        group="http",
        negatable=True,
    )
    responses_store_size: int = _knob(
        1000, "Most stored responses; the oldest are forgotten first.", group="http"
    )
    # timing
    profile: str = _knob(
        "h100-8b",
        "Timing profile: " + ", ".join(PROFILES) + ".",
        group="timing",
        choices=tuple(PROFILES),
    )
    t_fixed_ms: float | None = _knob(None, "Fixed cost per step (ms).", group="timing")
    t_w_ms: float | None = _knob(None, "Weight-read floor per step (ms).", group="timing")
    c_tok_us: float | None = _knob(None, "Compute cost per token above n0 (µs).", group="timing")
    n0: int | None = _knob(
        None, "Tokens a step takes before it becomes compute-bound.", group="timing"
    )
    c_kv_ns: float | None = _knob(None, "Decode KV read per context token (ns).", group="timing")
    c_attn_ns: float | None = _knob(None, "Prefill attention per token pair (ns).", group="timing")
    c_prep_us: float | None = _knob(
        None,
        "Frontend delay per prompt token before the engine sees a request (µs).",
        group="timing",
    )
    timing_scale: float = _knob(
        1.0,
        "Every step-time constant times this (1.05: an engine 5% slower than its profile).",
        group="timing",
    )
    time_scale: float = _knob(
        1.0, "Wall seconds per simulated second (0.1 runs ten times faster).", group="timing"
    )
    jitter: float = _knob(
        0.0, "Relative step-time noise; a step takes t*(1+U(-j,j)).", group="timing"
    )
    stream_flush_ms: float = _knob(
        -1.0,
        "Least wall ms between two writes of one stream (-1: 0 at real time, else 20).",
        group="timing",
    )
    # text
    seed: int = _knob(0, "Random seed of generated text, lengths and faults.", group="text")
    chars_per_token: int = _knob(4, "Long words split every this many characters.", group="text")
    vocab_size: int = _knob(
        128_256, "Token ids are stable hashes modulo this.", group="text", flag="--vocab"
    )
    output_len_dist: str = _knob(
        "lognormal:150:0.8",
        "Output length when not fixed: lognormal:MEDIAN:SIGMA, uniform:LO:HI or fixed:N.",
        group="text",
    )
    tool_call_probability: float = _knob(
        0.5,
        "Chance (drawn from the prompt, so a rerun repeats it) that a reply to a request with "
        "tools is a tool call.",
        group="text",
    )
    tool_call_after_result_probability: float = _knob(
        0.25,
        "The same chance when the conversation ends with a tool result (lower, so agent "
        "loops end).",
        group="text",
    )
    # faults
    fail_rate: float = _knob(0.0, "Fraction of requests that fail.", group="faults")
    fail_types: str = _knob(
        "500,503,stream",
        "Comma list drawn from for failures: 500,503,stream,hang,slow.",
        group="faults",
    )
    slow_seconds: float = _knob(
        5.0, "Delay (simulated s) before a 'slow' fault starts the request.", group="faults"
    )

    def __post_init__(self) -> None:
        if self.compat not in COMPAT_VERSIONS:
            raise ValueError(f"compat {self.compat!r} is not one of {COMPAT_VERSIONS}")
        if self.personality not in PERSONALITIES:
            raise ValueError(f"personality {self.personality!r} is not one of {PERSONALITIES}")
        if self.profile not in PROFILES:
            raise ValueError(f"profile {self.profile!r} is not one of {tuple(PROFILES)}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.timing_scale <= 0:
            raise ValueError(f"timing_scale must be > 0, got {self.timing_scale}")
        for kind in self.fault_types():
            if kind not in FAULT_TYPES:
                raise ValueError(f"fail type {kind!r} is not one of {FAULT_TYPES}")
        if self.resolved_num_gpu_blocks() < 2:
            raise ValueError("the KV pool needs at least 2 blocks (one is the null block)")
        if self.kv_offloading_size < 0 or (self.kv_offloading_tokens or 0) < 0:
            raise ValueError("the CPU KV tier cannot have a negative size")
        if self.kv_offload_bandwidth_gbps <= 0:
            raise ValueError("kv_offload_bandwidth_gbps must be > 0")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")

    # Resolved views: the profile supplies whatever was left as None.
    @property
    def timing(self) -> TimingProfile:
        base = PROFILES[self.profile]
        overrides = {
            name: getattr(self, name)
            for name in (
                "t_fixed_ms",
                "t_w_ms",
                "c_tok_us",
                "n0",
                "c_kv_ns",
                "c_attn_ns",
                "c_prep_us",
            )
            if getattr(self, name) is not None
        }
        timing = dataclasses.replace(base, **overrides) if overrides else base
        return timing.scaled(self.timing_scale) if self.timing_scale != 1.0 else timing

    def resolved_block_size(self) -> int:
        return self.block_size if self.block_size is not None else PROFILES[self.profile].block_size

    def resolved_num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        tokens = self.kv_capacity_tokens
        if tokens is None:
            tokens = PROFILES[self.profile].kv_capacity_tokens
        # Like vLLM, capacity is num_gpu_blocks * block_size, the null block included.
        return tokens // self.resolved_block_size()

    def served_model_names(self) -> tuple[str, ...]:
        """Every name a request may ask for: ``served_model_name`` first, then the extra ones."""
        extra = (n.strip() for n in self.extra_served_model_names.split(","))
        return (self.served_model_name, *(n for n in extra if n and n != self.served_model_name))

    def resolved_kv_bytes_per_token(self) -> int:
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        return PROFILES[self.profile].kv_bytes_per_token

    def resolved_num_cpu_blocks(self) -> int:
        """Blocks of the CPU tier (0: no tier), from tokens or else from GiB like vLLM."""
        bs = self.resolved_block_size()
        if self.kv_offloading_tokens is not None:
            return self.kv_offloading_tokens // bs
        size = int(self.kv_offloading_size * 2**30)
        return size // (self.resolved_kv_bytes_per_token() * bs)

    def fault_types(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.fail_types.split(",") if t.strip())

    def cache_report(self) -> bool:
        return self.enable_prompt_tokens_details or self.enable_cache_report

    def version(self) -> str:
        return COMPAT_VERSION_STRING[self.compat]

    def flush_interval(self) -> float:
        """Wall seconds a stream waits between writes, so fast time scales batch chunks."""
        if self.stream_flush_ms >= 0:
            return self.stream_flush_ms / 1000.0
        # At real time a step lasts >= 6.5 ms and every step gets its own write. Faster than
        # real time, per-token writes would cost more CPU than the whole engine, so a stream
        # writes at most every 20 ms of wall time (events stay one per step inside a write).
        return 0.0 if self.time_scale >= 1.0 else 0.02

    def replace(self, **changes: Any) -> SimConfig:
        return dataclasses.replace(self, **changes)


#: What ``serve`` changes from the defaults above in the simulator it starts when no backends
#: are given: a workstation card rather than an H100. A 48 GB card (L40S, RTX 6000 Ada) serving
#: Llama-3.1-8B in BF16 at vLLM's --gpu-memory-utilization 0.9 keeps about 45 GiB x 0.9 - 15 GiB
#: of weights - some 2 GiB of activations = 23.5 GiB for KV, at 128 KiB a token: ~192,000
#: tokens (an estimate from the card's memory, docs/SIMULATOR.md "Embedded in serve"), room for
#: one 131,072-token context. Cached tokens are reported, as vLLM does with
#: --enable-prompt-tokens-details, the flag a deployment behind thunderproxy should run with.
EMBEDDED: dict[str, Any] = {
    "kv_capacity_tokens": 192_000,
    "enable_prompt_tokens_details": True,
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def knob_value(name: str, value: Any) -> Any:
    """``value`` for the knob ``name``, from text (a flag or an environment variable) or typed
    (a TOML value); ValueError says what the knob takes. Only the value's type is checked here:
    ranges and combinations are SimConfig's own checks."""
    fields = {f.name: f for f in dataclasses.fields(SimConfig)}
    if name not in fields:
        raise ValueError(f"{name!r} is not a `thunderproxy sim` setting")
    kind = str(fields[name].type).replace(" | None", "")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"{name} takes true or false, got {value!r}")
    if isinstance(value, bool):
        raise ValueError(f"{name} takes {'a string' if kind == 'str' else 'a number'}, got {value}")
    try:
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError:
        raise ValueError(f"{name} takes {'an integer' if kind == 'int' else 'a number'}, "
                         f"got {value!r}") from None  # fmt: skip
    if not isinstance(value, str):
        raise ValueError(f"{name} takes a string, got {value!r}")
    choices = fields[name].metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{name} is one of {', '.join(choices)}, got {value!r}")
    return value
