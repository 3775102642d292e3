"""Each instance's KV claims per backend, shared through Redis for tr (docs/LIMITS.md,
"Several instances"; SCHEDULING.md): ``SharedBackends`` publishes what this instance's programs
hold on each backend and reads what the other live instances claim, in one round trip, and
keeps program -> backend affinity across instances. It rides the same ``RedisLink`` and
liveness set as the shared limits (``shared.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..urls import redact_url
from .shared import BEATS, COMMAND_TIMEOUT_S, LIVE, RedisLink, log, quiet_client_logs

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
