"""A backend's KV tiers as tr learns them from its metrics, and the gate they size, pure.

vLLM's native offloading connector (``--kv-offloading-size``) keeps a copy of every computed
block in a CPU tier; a request whose prefix the GPU lost loads it back over PCIe instead of
recomputing it. tr's capacity model was the GPU's alone, so with a tier it kept pausing idle
programs to save caches that the tier would have kept anyway, and a paused program waits for
a resume where a spilled one only waits for its reload.

:class:`Tiers` is what one backend's polls say: the CPU tier's size (``num_cpu_blocks`` x
``block_size`` of ``vllm:cache_config_info``), the KV bytes of a token
(``kv_cache_memory_bytes`` / ``kv_cache_size_tokens``), the link's bandwidth (bytes over
seconds of ``vllm:kv_offload_total_{bytes,time}_total``, both directions) and how busy the
CPU->GPU copies keep it (the growth of their seconds over the poll's interval).

:func:`gate` turns that into the capacity tr schedules against:

- ``gpu``: no tier, the tier's link has not been measured yet, or loads already keep it
  busy: the GPU's capacity, as without a tier (idle programs are paused to keep their KV).
- ``gpu+cpu``: idle programs may live in the tier. The capacity grows by the tier's tokens,
  bounded by what the link can bring back within ``tier_reload_window_s`` at the measured
  bandwidth, and shrunk from half of ``tier_max_load_share`` of the link's time taken by loads
  to nothing at it (past it reloads queue behind each other and a pause is cheaper again).

Only the GPU part shrinks with preemptions (the capacity factor says the GPU model was
optimistic; with a tier, a preemption costs a reload, not the tier's room).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..backends.metrics import EngineSnapshot
from ..config import PolicyConfig

GPU = "gpu"
GPU_CPU = "gpu+cpu"
#: Weight of the newest poll in the load share's moving average.
LOAD_SHARE_SMOOTHING = 0.3
LOADS = "CPU_to_GPU"


def _total(pairs: tuple[tuple[str, float], ...], kind: str | None = None) -> float:
    return sum(v for k, v in pairs if kind is None or k == kind)


@dataclass(frozen=True)
class Tiers:
    """One backend's KV tiers as its polls showed them."""

    #: Tokens the CPU tier holds (None: the backend has no tier, or has not said).
    cpu_tokens: int | None = None
    bytes_per_token: float | None = None
    #: Bytes per second the tier's copies moved, over everything moved so far.
    bandwidth: float | None = None
    #: Smoothed share of wall time the CPU->GPU copies kept the link busy.
    load_share: float = 0.0
    #: The poll this was read from (a poll is observed once, however often it is offered).
    read_at: float | None = None
    #: The CPU->GPU copies' seconds at that poll (None: not read yet, or counters reset).
    load_seconds: float | None = None

    def observe(self, snapshot: EngineSnapshot | None, at: float) -> Tiers:
        """The tiers after a poll read at ``at``; a poll already seen changes nothing."""
        if snapshot is None or at == self.read_at:
            return self
        moved = _total(snapshot.offload_bytes)
        took = _total(snapshot.offload_seconds)
        bandwidth = moved / took if moved > 0 and took > 0 else self.bandwidth
        loads = _total(snapshot.offload_seconds, LOADS) if snapshot.offload_seconds else None
        share = self.load_share
        if (
            loads is not None
            and self.load_seconds is not None
            and self.read_at is not None
            and at > self.read_at
            and loads >= self.load_seconds
        ):
            busy = min(1.0, (loads - self.load_seconds) / (at - self.read_at))
            share += LOAD_SHARE_SMOOTHING * (busy - share)
        return replace(
            self,
            cpu_tokens=snapshot.cpu_capacity_tokens,
            bytes_per_token=snapshot.kv_bytes_per_token or self.bytes_per_token,
            bandwidth=bandwidth,
            load_share=share,
            read_at=at,
            load_seconds=loads,
        )

    @property
    def reload_s_per_token(self) -> float | None:
        """Seconds the link takes to bring one token's KV back to the GPU."""
        if not self.bandwidth or not self.bytes_per_token:
            return None
        return self.bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class Gate:
    """The capacity tr schedules a backend against, and the tier it assumes."""

    tier: str
    #: What the policy's ``limit`` multiplies by the capacity factor (None: unknown).
    capacity_tokens: int | None
    #: Tokens of it that live in the CPU tier (0: the GPU alone).
    spill_tokens: int = 0


def spill_tokens(tiers: Tiers, cfg: PolicyConfig) -> int:
    """The CPU tier's tokens tr may count on: the tier, bounded by what the link reloads in
    ``tier_reload_window_s``, scaled down as its loads' share nears the bound (0 at it)."""
    if not tiers.cpu_tokens or cfg.tier_max_load_share <= 0 or tiers.bandwidth is None:
        return 0
    room = float(tiers.cpu_tokens)
    per_token = tiers.reload_s_per_token
    if per_token is not None:
        room = min(room, cfg.tier_reload_window_s / per_token)
    # Whole while the loads keep the link busy less than half the bound, none past the bound:
    # a link busy a tenth of the time reloads as fast as an idle one.
    bound = cfg.tier_max_load_share
    headroom = (bound - tiers.load_share) / (bound / 2)
    return max(0, int(room * min(1.0, headroom)))


def gate(gpu_tokens: int | None, tiers: Tiers, capacity_factor: float, cfg: PolicyConfig) -> Gate:
    """The capacity of a backend whose GPU holds ``gpu_tokens`` (see the module's rules)."""
    if gpu_tokens is None:
        return Gate(GPU, None)
    spill = spill_tokens(tiers, cfg)
    if spill <= 0:
        return Gate(GPU, gpu_tokens)
    # limit() multiplies the whole capacity by the factor; the tier's part is not the GPU's
    # model and is given back undivided.
    factor = max(capacity_factor, 1e-6)
    return Gate(GPU_CPU, gpu_tokens + int(spill / factor), spill)


def assumed_tier(gpu_tokens: int | None, capacity_factor: float, used: int | None) -> str | None:
    """The tier a decision assumed: ``gpu`` while the claims it weighed fit the GPU's usable
    capacity, ``cpu`` once they reach into the tier (None: no tier in play)."""
    if gpu_tokens is None or used is None:
        return None
    return GPU if used <= gpu_tokens * capacity_factor else "cpu"
