"""Limits shared across instances through Redis (docs/LIMITS.md, "Several instances").

Each instance keeps counting locally (the pure limiter, on its share of every model's
capacity: 1/n of the n live instances, then split among classes locally) and, for a model with
window limits, also reserves in Redis: one Lua script checks the global minute and day counters
against the model's whole limits and increments them in one round trip, so the sum over
instances cannot pass a limit even while the instance count changes. Settlements (refunds,
overages) go to the same counters from a queue, off the call's path.

Each instance beats ``BEATS`` times per ``heartbeat_s`` into a sorted set scored by the time of
its last beat, and counts as live while its last beat is younger than ``LIVE`` heartbeats. The
count of live instances sets the local share; it is read with every beat and also in the same
round trip as every reservation (which refreshes the caller's own beat too), so a killed
instance is counted out within one heartbeat of its death, and at once by the next reservation
after that under load. When
Redis cannot be reached the instance keeps serving alone on a conservative share (capacity
divided by the last count it knew), says so in /health and the log, and rejoins at the first
heartbeat that succeeds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from ..config.limits import ModelLimits
from ..urls import redact_url
from .limiter import DAY, MINUTE, Reservation, window_index

log = logging.getLogger("thunderproxy.admission.redis")


def quiet_client_logs() -> None:
    """Keep the Redis client's own logging below WARNING: it logs every retry of every
    command at INFO (dozens of lines a second while Redis is away, and a "No matching script"
    retry for each script's first run). ``RedisLink`` says what an operator needs, once. A
    level set explicitly (``logging.getLogger("coredis").setLevel``) is left as it is."""
    client = logging.getLogger("coredis")
    if client.level == logging.NOTSET:
        client.setLevel(logging.WARNING)


#: What each part of an instance shares through Redis, for the log.
SHARED = {"limits": "limits", "kv": "KV claims"}


class RedisLink:
    """Whether this instance reaches Redis, as every part that uses it sees it (the shared
    limits, the shared KV claims): one line when the first part loses it, one when the last
    part has it back, nothing for each failed command between."""

    def __init__(self, url: str) -> None:
        self.url = redact_url(url)
        #: What each part does while Redis is away, by part, for the line that says it is lost.
        self._fallbacks: dict[str, Callable[[], str]] = {}
        self._down: set[str] = set()
        #: None until the first answer or failure; then whether the last line said reachable.
        self._up: bool | None = None
        self._lost_at = 0.0

    def join(self, part: str, fallback: Callable[[], str]) -> None:
        self._fallbacks[part] = fallback

    def lost(self, part: str, exc: BaseException) -> None:
        self._down.add(part)
        if self._up is False:
            return
        self._up = False
        self._lost_at = trio.current_time()
        fallbacks = "; ".join(f() for f in self._fallbacks.values())
        # A timeout has no message of its own: its name says it.
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.warning(
            "Redis at %s is unreachable (%s); until it returns: %s",
            self.url,
            why,
            fallbacks or "this instance works alone",
        )

    def answered(self, part: str) -> None:
        self._down.discard(part)
        if self._up is True or self._down:
            return
        shared = " and ".join(SHARED.get(p, p) for p in self._fallbacks)
        if self._up is None:
            log.info("Redis at %s reachable; %s shared with the other instances", self.url, shared)
        else:
            log.info(
                "Redis at %s is reachable again after %.1f s; %s shared with the other "
                "instances again",
                self.url,
                trio.current_time() - self._lost_at,
                shared,
            )
        self._up = True


#: Seconds a Redis command may take before the instance treats Redis as away.
COMMAND_TIMEOUT_S = 0.5
PREFIX = "thunderproxy:limits"

#: Beats per heartbeat, and how many heartbeats old an instance's last beat may be while it
#: counts as live: six beats in a row may be missed or late (a busy event loop) before an
#: instance is counted out, and the others, reading at least once a beat, see it gone within
#: one heartbeat of its last beat.
BEATS = 8
LIVE = 7 / BEATS

# The live count after refreshing the caller's own beat. KEYS[3]: instances zset. ARGV[8..10]:
# instance, now, stale before.
LIVENESS = """
redis.call('ZADD', KEYS[3], ARGV[9], ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[10])
local live = redis.call('ZCARD', KEYS[3])
"""

# KEYS: minute hash, day hash, instances zset. ARGV: tokens, rpm, tpm, rpd, tpd (-1: none),
# minute ttl, day ttl, then the liveness arguments. Returns {1, live} when counted, else
# {0, live, dimension, used}.
RESERVE = (
    LIVENESS
    + """
local m = redis.call('HMGET', KEYS[1], 'r', 't')
local d = redis.call('HMGET', KEYS[2], 'r', 't')
local used = {tonumber(m[1]) or 0, tonumber(m[2]) or 0, tonumber(d[1]) or 0, tonumber(d[2]) or 0}
local need = tonumber(ARGV[1])
local names = {'rpm', 'tpm', 'rpd', 'tpd'}
local wants = {1, need, 1, need}
for i = 1, 4 do
  local limit = tonumber(ARGV[i + 1])
  if limit >= 0 and used[i] + wants[i] > limit then
    return {0, live, names[i], used[i]}
  end
end
redis.call('HINCRBY', KEYS[1], 'r', 1)
redis.call('HINCRBY', KEYS[1], 't', need)
redis.call('HINCRBY', KEYS[2], 'r', 1)
redis.call('HINCRBY', KEYS[2], 't', need)
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return {1, live}
"""
)

# KEYS: minute hash, day hash (an empty name: that window is closed). ARGV: token delta,
# minute ttl, day ttl.
SETTLE = """
for i = 1, 2 do
  if KEYS[i] ~= '' then
    redis.call('HINCRBY', KEYS[i], 't', ARGV[1])
    redis.call('EXPIRE', KEYS[i], ARGV[i + 1])
  end
end
return 1
"""

# KEYS: instances zset. ARGV: instance, now, stale before. Returns the live count.
HEARTBEAT = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
return redis.call('ZCARD', KEYS[1])
"""

INSTANCES = f"{PREFIX}:instances"


@dataclass(frozen=True)
class Global:
    """What Redis answered for one reservation."""

    admitted: bool
    dimension: str | None = None
    used: int | None = None


def minute_key(model: str, index: int) -> str:
    return f"{PREFIX}:{model}:m:{index}"


def day_key(model: str, index: int) -> str:
    return f"{PREFIX}:{model}:d:{index}"


class SharedLimits:
    """The Redis side of the limits of one instance; ``serve`` runs its heartbeat."""

    def __init__(
        self,
        url: str,
        instance: str,
        *,
        heartbeat_s: float = 1.0,
        link: RedisLink | None = None,
    ) -> None:
        import coredis  # only an instance configured with --redis needs the client

        quiet_client_logs()
        #: Shown and logged without the credentials a Redis URL may carry.
        self.url = redact_url(url)
        #: Logs Redis lost and back, once for every part of this instance that uses it.
        self.link = link or RedisLink(url)
        self.link.join(
            "limits", lambda: f"limits on a local share of 1/{self.instances} of every limit"
        )
        self.instance = instance
        self.heartbeat_s = heartbeat_s
        self.client: Any = coredis.Redis.from_url(url, decode_responses=True)
        self._reserve = self.client.register_script(RESERVE)
        self._heartbeat = self.client.register_script(HEARTBEAT)
        self._settle = self.client.register_script(SETTLE)
        self.instances = 1
        #: When the live count last changed (trio time), for /health.
        self.counted_at: float | None = None
        #: Told the share whenever the live count changes (set by ``serve``).
        self._on_share: Callable[[float], None] = lambda share: None
        self.reachable = False
        self.away_since: float | None = None
        self.last_error: str | None = None
        self.round_trips = 0
        self._settle_send, self._settle_receive = trio.open_memory_channel[
            tuple[str, int, int, int]
        ](10_000)

    @property
    def share(self) -> float:
        return 1.0 / max(1, self.instances)

    async def reserve(self, model: str, limits: ModelLimits, tokens: int, unix: float) -> Global:
        """Check and count one call in the global windows; admits (and counts nothing) when
        Redis is away, the local share then being the only bound."""
        if not self.reachable or not any((limits.rpm, limits.tpm, limits.rpd, limits.tpd)):
            return Global(True)
        m, d = window_index(unix, MINUTE), window_index(unix, DAY)

        def arg(value: int | None) -> int:
            return -1 if value is None else value

        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                self.round_trips += 1
                answer: Any = await self._reserve(
                    keys=[minute_key(model, m), day_key(model, d), INSTANCES],
                    args=[
                        tokens,
                        arg(limits.rpm),
                        arg(limits.tpm),
                        arg(limits.rpd),
                        arg(limits.tpd),
                        int(2 * MINUTE),
                        int(2 * DAY),
                        *self._liveness(unix),
                    ],
                )
        except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001 - any failure: away
            self._away(exc)
            return Global(True)
        self._count(int(answer[1]))
        if int(answer[0]) == 1:
            return Global(True)
        return Global(False, str(answer[2]), int(answer[3]))

    def _liveness(self, unix: float) -> list[Any]:
        return [self.instance, unix, unix - LIVE * self.heartbeat_s]

    def _count(self, live: int) -> None:
        """The live count just read: a change moves this instance's share at once."""
        live = max(1, live)
        if live != self.instances:
            self.instances = live
            self.counted_at = trio.current_time()
            self._on_share(self.share)

    def settle(self, reservation: Reservation, delta: int, unix: float) -> None:
        """Queue a settlement: ``delta`` tokens to the reservation's windows if still open,
        else (an overage) to the open ones. Dropped when Redis is away: those windows are
        counted locally then."""
        if not delta or not self.reachable:
            return
        m, d = window_index(unix, MINUTE), window_index(unix, DAY)
        if m != reservation.minute and delta < 0:
            m = -1  # no refund into a closed minute
        if d != reservation.day and delta < 0:
            d = -1
        try:
            self._settle_send.send_nowait((reservation.model, m, d, delta))
        except trio.WouldBlock:
            log.warning("Redis settlement queue full; a settlement of %d tokens is lost", delta)

    def _away(self, exc: BaseException) -> None:
        if self.reachable:
            self.away_since = trio.current_time()
        self.link.lost("limits", exc)
        self.reachable = False
        self.last_error = f"{type(exc).__name__}: {exc}"

    async def beat(self, unix: float) -> None:
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                self.round_trips += 1
                count: Any = await self._heartbeat(keys=[INSTANCES], args=self._liveness(unix))
        except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001 - any failure: away
            self._away(exc)
            return
        self.link.answered("limits")
        self.reachable = True
        self.away_since = None
        self._count(int(count))

    async def serve(
        self,
        offset: float,
        on_share: Callable[[float], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Heartbeat and settlements until cancelled. Ready after the first heartbeat, whether
        or not Redis answered it (an instance starts even while Redis is away)."""
        # coredis' connection pool lives in this context (it reconnects by itself after Redis
        # returns; entering does not need Redis to be up).
        self._on_share = on_share
        async with self.client, trio.open_nursery() as nursery:
            await self.beat(trio.current_time() + offset)
            on_share(self.share)
            nursery.start_soon(self._settlements)
            task_status.started()
            while True:
                await trio.sleep(self.heartbeat_s / BEATS)
                await self.beat(trio.current_time() + offset)

    async def _settlements(self) -> None:
        async for model, m, d, delta in self._settle_receive:
            try:
                with trio.fail_after(COMMAND_TIMEOUT_S):
                    self.round_trips += 1
                    await self._settle(
                        keys=[
                            minute_key(model, m) if m >= 0 else "",
                            day_key(model, d) if d >= 0 else "",
                        ],
                        args=[delta, int(2 * MINUTE), int(2 * DAY)],
                    )
            except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001
                self._away(exc)

    def statistics(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "reachable": self.reachable,
            "instances": self.instances,
            "away_since_s": None
            if self.away_since is None
            else math.floor(trio.current_time() - self.away_since),
            "last_error": self.last_error,
            "round_trips": self.round_trips,
            # How long ago the live count last changed: when an instance was counted in or out.
            "counted_s_ago": None
            if self.counted_at is None
            else round(trio.current_time() - self.counted_at, 3),
        }
