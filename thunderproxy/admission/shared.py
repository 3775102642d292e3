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
from dataclasses import dataclass, field
from typing import Any

import trio

from ..urls import redact_url
from .limiter import DAY, MINUTE, Reservation, window_index
from .spec import ModelLimits

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


KV_PREFIX = "thunderproxy:kv"
#: Least seconds between two publications of an instance's KV claims (one round trip each).
NUDGE_GAP_S = 0.005

# What every KV script starts with. KEYS: live instances zset, this instance's hash of backend ->
# tokens. ARGV: instance, now, stale before, ttl ms, hash prefix, seq. Refreshes the caller's
# beat, counts out the instances whose last beat is older than LIVE heartbeats (their claims
# vanish with them: only live instances' hashes are summed), sums the other live instances'
# claims per backend and counts those instances, and tells whether this write is newer than the
# one Redis holds: writes may arrive out of the order they were computed in (each command takes
# a connection of the pool), and the newest computed must win, not the last arrived. Every
# answer ends with the backend, tokens pairs and the pair '#others', the live others' count.
KV_READ = """
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
local sums = {}
local live = 0
for _, other in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if other ~= ARGV[1] then
    live = live + 1
    local h = redis.call('HGETALL', ARGV[5] .. other)
    for i = 1, #h, 2 do
      if string.sub(h[i], 1, 1) ~= '#' then
        sums[h[i]] = (sums[h[i]] or 0) + tonumber(h[i + 1])
      end
    end
  end
end
local newer = tonumber(ARGV[6]) > (tonumber(redis.call('HGET', KEYS[2], '#seq')) or -1)
local function write(first)
  if newer then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[2], '#seq', ARGV[6])
    if #ARGV >= first then
      redis.call('HSET', KEYS[2], unpack(ARGV, first))
    end
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
local function answer(heads)
  local out = heads
  for backend, tokens in pairs(sums) do
    out[#out + 1] = backend
    out[#out + 1] = tostring(tokens)
  end
  out[#out + 1] = '#others'
  out[#out + 1] = tostring(live)
  return out
end
"""

# ARGV after the common ones: backend, tokens pairs. Replaces this instance's claims; returns
# 1 followed, flattened, by each backend and the tokens all other live instances claim there.
PUBLISH_KV = (
    KV_READ
    + """
write(7)
return answer({1})
"""
)

# ARGV after the common ones: n, then n claims in the order they were asked (each: the backend, this
# instance's demand on it, i.e. its claims there with the call that asks as the policy's rule counts
# them, the fill the rule targets there, and 1 where the call may go out unchecked while no other
# instance is live, else 0), then this instance's claims on every backend with the calls (backend,
# tokens pairs). Grants a claim only when the other live instances' claims on its backend plus its
# demand fit its target, or, for a call of the last kind, when no other instance is live: the same
# test as tr's (scheduling/claims.py, ``fits``), made where no other instance can claim in between;
# writes the claims when any is granted. Each demand already counts the calls asked before it (the
# instance counts a call before asking), so a refused claim only makes the ones after it safer.
# Returns n, a 1 (granted) or 0 per claim, then the sums as PUBLISH_KV does.
CLAIM_KV = (
    KV_READ
    + """
local n = tonumber(ARGV[7])
local out = {n}
local any = false
for i = 0, n - 1 do
  local at = 8 + 4 * i
  if (ARGV[at + 3] == '1' and live == 0)
      or (sums[ARGV[at]] or 0) + tonumber(ARGV[at + 1]) <= tonumber(ARGV[at + 2]) then
    out[#out + 1] = 1
    any = true
  else
    out[#out + 1] = 0
  end
end
if any then
  write(8 + 4 * n)
else
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return answer(out)
"""
)


@dataclass
class _Claim:
    """One call's claim waiting for its batch's answer."""

    backend: str
    demand: int
    whole: int
    alone: bool
    asked_at: float
    done: trio.Event = field(default_factory=trio.Event)
    granted: bool = True


class SharedBackends:
    """What the instances in front of the same backends tell each other through Redis: the KV
    tokens each one's programs claim on every backend (so tr on one instance leaves room for
    the programs of the others) and which backend holds each program's cache.

    ``BEATS`` times per ``heartbeat_s`` the instance replaces its own hash of backend -> tokens
    and reads the sum of the other live instances' hashes, in one round trip; an instance whose
    last beat is older than ``LIVE`` heartbeats is counted out, so a dead instance's claims are
    gone from every sum within one heartbeat of its death. When tr lets a call go out that adds
    KV beyond what the instance published (a program's first call, one that waited, a
    returning one), ``claim`` checks its KV tokens against the backend's target with every
    live instance's claims and adds them, in one script: two instances cannot both take the
    last room. Redis away: the claims are not checked (the local view decides alone) and the
    others' tokens are taken as zero after three heartbeats without an answer (each instance
    then schedules alone, as without Redis); /health says so (``statistics``)."""

    def __init__(
        self,
        url: str,
        instance: str,
        *,
        heartbeat_s: float = 1.0,
        affinity_ttl_s: float = 600.0,
        link: RedisLink | None = None,
    ) -> None:
        import coredis

        quiet_client_logs()
        self.url = redact_url(url)
        self.link = link or RedisLink(url)
        self.link.join("kv", lambda: "tr checks no KV claim with the other instances")
        self.instance = instance
        self.heartbeat_s = heartbeat_s
        #: How long a program's backend is remembered after its last call (the idle lease:
        #: past it the program is retired everywhere, and its cache is anyone's to evict).
        self.affinity_ttl_s = affinity_ttl_s
        self._placed_send, self._placed_receive = trio.open_memory_channel[tuple[str, str]](10_000)
        self.client: Any = coredis.Redis.from_url(url, decode_responses=True)
        self._publish = self.client.register_script(PUBLISH_KV)
        self._claim = self.client.register_script(CLAIM_KV)
        self.reachable = False
        self.away_since: float | None = None
        self.last_error: str | None = None
        self.round_trips = 0
        #: Claims checked in Redis and granted, refused there, and let through unchecked
        #: because Redis was away (the local view alone decided).
        self.granted = 0
        self.refused = 0
        self.unchecked = 0
        #: Seconds the checked claims took, from asking to the answer (the round trip, and the
        #: wait for the batch before it).
        self._claim_s = 0.0
        self._claim_s_max = 0.0
        #: Claims asked since the last batch went out, and the signal that there are some.
        self._asked: list[_Claim] = []
        self._asking = trio.Event()
        #: Tokens the other live instances claim on each backend, and how many other instances
        #: are live, from the last answer.
        self._others: dict[str, int] = {}
        self._live_others = 0
        self._others_at: float | None = None
        #: Set when a call was placed: this instance's claims changed, publish them soon.
        self._nudged = trio.Event()
        #: This instance's claims and the Unix offset, once ``serve`` runs.
        self._mine: Callable[[], dict[str, int]] | None = None
        self._offset = 0.0
        #: Orders this instance's writes as they were computed (see KV_READ).
        self._seq = 0

    def others(self, backend: str) -> int:
        """Tokens the other instances' programs claim on ``backend`` (0 when not known for
        three heartbeats: a stale claim would keep this instance's programs paused)."""
        if self._stale():
            return 0
        return self._others.get(backend, 0)

    def shared(self) -> bool:
        """Whether other live instances share the backends (False when not known for three
        heartbeats: this instance then schedules alone, as without Redis)."""
        return not self._stale() and self._live_others > 0

    def _stale(self) -> bool:
        at = self._others_at
        return at is None or trio.current_time() - at > 3 * self.heartbeat_s

    def _args(self, mine: dict[str, int]) -> tuple[list[Any], list[Any]]:
        """The common script arguments for a write computed now, and ``mine`` as pairs."""
        self._seq += 1
        unix = trio.current_time() + self._offset
        head: list[Any] = [
            self.instance,
            unix,
            unix - LIVE * self.heartbeat_s,
            int(3000 * self.heartbeat_s),
            f"{KV_PREFIX}:used:",
            self._seq,
        ]
        pairs: list[Any] = []
        for backend, tokens in mine.items():
            if tokens > 0:
                pairs += [backend, tokens]
        return head, pairs

    def _keys(self) -> list[str]:
        return [f"{KV_PREFIX}:instances", f"{KV_PREFIX}:used:{self.instance}"]

    def _answered(self, answer: Any, heads: int = 1) -> None:
        """Take in a script's answer: ``heads`` values, then backend, tokens pairs, the last
        one the live others' count (KV_READ)."""
        self.link.answered("kv")
        self.reachable = True
        self.away_since = None
        others = {str(answer[i]): int(answer[i + 1]) for i in range(heads, len(answer), 2)}
        self._live_others = others.pop("#others", 0)
        self._others = others
        self._others_at = trio.current_time()

    def _away(self, exc: BaseException) -> None:
        if self.reachable or self.away_since is None:
            self.away_since = trio.current_time()
        self.link.lost("kv", exc)
        self.reachable = False
        self.last_error = f"{type(exc).__name__}: {exc}"

    async def publish(self, mine: dict[str, int]) -> None:
        """Write this instance's claims and read the others' in one round trip."""
        head, pairs = self._args(mine)
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                self.round_trips += 1
                answer: Any = await self._publish(keys=self._keys(), args=head + pairs)
        except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001 - any failure: away
            self._away(exc)
            return
        self._answered(answer)

    async def claim(self, backend: str, demand: int, whole: int, *, alone: bool = False) -> bool:
        """Claim KV on ``backend`` for a call about to go out, atomically with every other
        live instance: granted (and this instance's claims written, the call's included) when
        the others' claims there plus ``demand`` fit ``whole``, or, with ``alone`` (this
        instance's view holds no other live instance and holding does not pay for it there:
        scheduling/claims.py), when no other instance is live; refused otherwise, and the
        others' claims just read are what ``others`` answers from now on. Redis away (or not
        yet answered): granted unchecked, the local view having decided alone.

        Claims asked while a batch is under way go together in the next one (one round trip
        for a burst, not one each: under load the round trips queued behind each other)."""
        if not self.reachable or self._mine is None:
            self.unchecked += 1
            return True
        asked = _Claim(backend, demand, whole, alone, trio.current_time())
        self._asked.append(asked)
        self._asking.set()
        await asked.done.wait()
        return asked.granted

    async def _claims(self) -> None:
        """Send the claims asked, one batch at a time, until cancelled."""
        while True:
            await self._asking.wait()
            self._asking = trio.Event()
            batch, self._asked = self._asked, []
            if batch:
                await self._send(batch)

    async def _send(self, batch: list[_Claim]) -> None:
        assert self._mine is not None
        try:
            if not self.reachable:
                raise ConnectionError("Redis was away when the claims were asked")
            head, pairs = self._args(self._mine())
            asks: list[Any] = [len(batch)]
            for c in batch:
                asks += [c.backend, c.demand, c.whole, int(c.alone)]
            with trio.fail_after(COMMAND_TIMEOUT_S):
                self.round_trips += 1
                answer: Any = await self._claim(keys=self._keys(), args=head + asks + pairs)
        except trio.Cancelled:
            # Stopped with the batch under way: its calls go out unchecked, none hangs.
            for c in batch:
                c.done.set()
            raise
        except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001 - any failure: away
            if self.reachable:
                self._away(exc)
            self.unchecked += len(batch)
            for c in batch:
                c.done.set()
            return
        self._answered(answer, 1 + len(batch))
        now = trio.current_time()
        for c, flag in zip(batch, answer[1 : 1 + len(batch)], strict=True):
            c.granted = int(flag) == 1
            if c.granted:
                self.granted += 1
            else:
                self.refused += 1
            self._claim_s += now - c.asked_at
            self._claim_s_max = max(self._claim_s_max, now - c.asked_at)
            c.done.set()

    async def backend_of(self, program_id: str) -> str | None:
        """The backend another instance placed ``program_id`` on (it holds its cache), or None:
        never placed, forgotten after the idle lease, or Redis away (placement then goes by
        load, as without Redis)."""
        if not self.reachable:
            return None
        try:
            with trio.fail_after(COMMAND_TIMEOUT_S):
                self.round_trips += 1
                found: Any = await self.client.get(f"{KV_PREFIX}:affinity:{program_id}")
        except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001 - any failure: away
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        return None if found is None else str(found)

    def placed(self, program_id: str, backend: str) -> None:
        """Remember ``program_id`` -> ``backend`` for the idle lease; written off the call's
        path (a queue), dropped while Redis is away."""
        if not self.reachable:
            return
        self._nudged.set()
        try:
            self._placed_send.send_nowait((program_id, backend))
        except trio.WouldBlock:
            log.warning("Redis affinity queue full; program %r's backend is not shared", program_id)

    async def _placements(self) -> None:
        ttl_ms = max(1, int(self.affinity_ttl_s * 1000))
        async for program_id, backend in self._placed_receive:
            try:
                with trio.fail_after(COMMAND_TIMEOUT_S):
                    self.round_trips += 1
                    await self.client.set(f"{KV_PREFIX}:affinity:{program_id}", backend, px=ttl_ms)
            except (trio.TooSlowError, OSError, Exception) as exc:  # noqa: BLE001
                self.last_error = f"{type(exc).__name__}: {exc}"

    async def serve(
        self,
        offset: float,
        mine: Callable[[], dict[str, int]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Publish ``mine()`` and read the others' ``BEATS`` times a heartbeat until
        cancelled, and also soon after a call is placed (at most every ``NUDGE_GAP_S``): claims
        that grow or shrink between the checked ones (a program's later calls, its end, its
        pause) reach the other instances within milliseconds. Ready after the first, whether
        or not Redis answered."""
        beat = self.heartbeat_s / BEATS
        gap = min(NUDGE_GAP_S, beat)
        self._offset = offset
        try:
            async with self.client, trio.open_nursery() as nursery:
                await self.publish(mine())
                self._mine = mine
                nursery.start_soon(self._placements)
                nursery.start_soon(self._claims)
                task_status.started()
                while True:
                    with trio.move_on_after(beat - gap):
                        await self._nudged.wait()
                    await trio.sleep(gap)  # calls placed meanwhile go in the same publish
                    self._nudged = trio.Event()
                    await self.publish(mine())
        finally:
            # Stopped (the proxy shuts down): calls still being served claim unchecked, and
            # none waits for a batch that will not go out.
            self._mine = None
            self.unchecked += len(self._asked)
            for asked in self._asked:
                asked.done.set()
            self._asked = []

    def statistics(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "instance": self.instance,
            "reachable": self.reachable,
            "away_since_s": None
            if self.away_since is None
            else math.floor(trio.current_time() - self.away_since),
            "others_tokens": dict(sorted(self._others.items())),
            # Other live instances as last read: while there are any, tr holds (claims.holds).
            "other_instances": self._live_others,
            # Calls whose KV claim Redis checked and granted, refused (the program then waited
            # as on a full backend), and let through unchecked while Redis was away.
            "claims": {
                "granted": self.granted,
                "refused": self.refused,
                "unchecked": self.unchecked,
                "mean_ms": round(1000 * self._claim_s / max(1, self.granted + self.refused), 3),
                "max_ms": round(1000 * self._claim_s_max, 3),
            },
            "last_error": self.last_error,
            "round_trips": self.round_trips,
        }
