"""The tr capacity rules, pure: it takes snapshots of programs and backends plus ``now`` and
returns decisions; ``scheduler.py`` applies them. Nothing here reads a clock or does I/O.

The model (ThunderAgent's router's, with its known defects fixed; docs/SCHEDULING.md has the
full story):

    used(backend) = Σ REASONING (tokens + decode_buffer) · calls    marked programs credited
                  + Σ ACTING   tokens · tool_coefficient · 2^(-idle / half_life)
                  − (contexts − 1) · shared_prefix_tokens            cross-context prefix credit
    a program not running yet fits when used ≤ capacity_tokens · capacity_factor · target_fill;
    running programs are moved only when used > capacity_tokens · capacity_factor

Over capacity, ACTING programs are paused, the longest idle first (their cache is the coldest
and their return the least imminent); if that is not enough, REASONING programs are marked and
paused when their call ends, the youngest program first. Paused programs whose request waits are
resumed oldest wait first, on the backend where they fit (migrating if theirs is full); a
program that has waited ``max_wait_s`` is resumed regardless and protected from re-pausing.
Each call in flight is a context of its own: a call of a program that already has calls in
flight goes out only where one more context fits (``on_call``), else it is held until one does.
Where programs of several clients share a backend, the client holding the most KV there gives
way first (``client_use``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from ..config import PolicyConfig as PolicyConfig
from ..programs import ProgramStatus
from .classes import INTERACTIVE
from .tiers import assumed_tier
from .values import Action as Action
from .values import BackendView as BackendView
from .values import Decision as Decision
from .values import ProgramView as ProgramView


def decay(idle_s: float, half_life_s: float) -> float:
    if half_life_s <= 0:
        return 1.0
    return math.pow(2.0, -max(0.0, idle_s) / half_life_s)


#: The longest an idle program's cache is kept by ``break_even`` claims, whatever the engine.
MAX_KEEP_S = 120.0


def keep_horizon(b: BackendView, cfg: PolicyConfig) -> float | None:
    """With ``idle_claims = break_even``: how long an idle program's cache is worth keeping on
    ``b`` (None: decayed claims instead). Keeping ``c`` idle tokens for ``t`` seconds takes
    ``c·t`` token-seconds from the calls that could run in their place; letting them go costs
    their prefill, ``c·prefill_s_per_token`` seconds during which every call on the cache
    waits, ``c·prefill_s_per_token·capacity`` token-seconds. The two are equal at
    ``t = prefill_s_per_token · capacity``, whatever ``c``: the time the engine takes to
    prefill a full cache (seconds on a small cache, more on a large one)."""
    if cfg.idle_claims != "break_even" or b.prefill_s_per_token is None:
        return None
    tokens = b.gpu_tokens if b.gpu_tokens is not None else b.capacity_tokens
    if tokens is None:
        return None
    return min(MAX_KEEP_S, b.prefill_s_per_token * tokens * b.capacity_factor)


def remaining_tool(p: ProgramView, now: float) -> float:
    """How much longer an acting program's tool is expected to run: what is left of its last
    tool's time, or, once it has run past that (or nothing is known), as long again as it has
    run so far."""
    idle = 0.0 if p.acting_since is None else now - p.acting_since
    if p.tool_s is not None and idle < p.tool_s:
        return p.tool_s - idle
    return idle


def contexts(p: ProgramView) -> int:
    """The contexts a REASONING program holds on its backend: one per call in flight. Calls
    of one program sent at once (sub-agents, a client's threads) each hold a prompt of their
    own in the engine; counted as one, twelve calls sent under one program id took a cache
    that held seven programs, and every call on it slowed tenfold. Each is counted at the
    program's footprint (its largest context known), and shares only the common prefix."""
    return max(1, p.in_flight)


def weight(
    p: ProgramView,
    cfg: PolicyConfig,
    now: float,
    half_life_s: float | None = None,
    *,
    horizon_s: float | None = None,
) -> int:
    """The program's expected claim on KV tokens right now (an idle program's claim halving
    every ``half_life_s``, by default ``acting_half_life_s``; with a ``horizon_s``
    (``keep_horizon``), whole while its tool is expected to end within it, else nothing)."""
    if p.status is ProgramStatus.PAUSED:
        return 0
    left = sum(ended_claim(p, t, cfg, now, half_life_s, horizon_s) for t in p.ended)
    if p.status is ProgramStatus.REASONING:
        return contexts(p) * (p.tokens + cfg.decode_buffer) + left
    if p.status is ProgramStatus.ACTING and p.waiting_since is not None:
        # An acting program whose request waits was just resumed: its call is about to go out.
        return p.tokens + cfg.decode_buffer + left
    return left + _idle_weight(p, cfg, now, half_life_s, horizon_s)


def ended_claim(
    p: ProgramView,
    ended_at: float,
    cfg: PolicyConfig,
    now: float,
    half_life_s: float | None = None,
    horizon_s: float | None = None,
) -> int:
    """The claim of a context one of ``p``'s calls left when it ended while others of it ran,
    weighed as an idle program's (``weight``): whole within the keep horizon, else decayed.
    Counted, it keeps the room that call leaves for the program's next call, which comes as
    the client's answer does; not counted, a held call of the program took it first, and with
    twelve threads on room for five each call found its context evicted."""
    idle = max(0.0, now - ended_at)
    if horizon_s is not None and half_life_s is None:
        return int(p.tokens * cfg.tool_coefficient) if idle <= horizon_s else 0
    half_life = cfg.acting_half_life_s if half_life_s is None else half_life_s
    return int(p.tokens * cfg.tool_coefficient * decay(idle, half_life))


def _idle_weight(
    p: ProgramView,
    cfg: PolicyConfig,
    now: float,
    half_life_s: float | None,
    horizon_s: float | None,
) -> int:
    """An acting program's claim while its tool runs (``weight``)."""
    if p.status is ProgramStatus.ACTING and horizon_s is not None and half_life_s is None:
        if remaining_tool(p, now) > horizon_s:
            return 0
        return int(p.tokens * cfg.tool_coefficient)
    if p.status is ProgramStatus.ACTING:
        idle = 0.0 if p.acting_since is None else now - p.acting_since
        half_life = cfg.acting_half_life_s if half_life_s is None else half_life_s
        return int(p.tokens * cfg.tool_coefficient * decay(idle, half_life))
    return 0


def limit(
    b: BackendView, cfg: PolicyConfig, *, fill: float | None = None, others: bool = True
) -> int | None:
    """Tokens the policy lets programs claim on ``b``: ``target_fill`` of the capacity for
    programs that are not running yet, all of it (``fill=1``) before running ones are moved.
    The gap between the two absorbs the prompts' growth from step to step, so a program let
    in is not pushed out again by the next growth of its neighbours.

    What other instances' programs claim comes off, except (``others=False``) when deciding
    whether to pause this instance's idle programs: every instance sees the same overflow at
    the same heartbeat, and if each paused its own for it they would all pause at once, then
    all resume, and the cache would churn more than without sharing (measured: the hit rate
    fell to that of two instances that share nothing, in two runs of four)."""
    if b.capacity_tokens is None:
        return None
    whole = b.capacity_tokens * b.capacity_factor * (cfg.target_fill if fill is None else fill)
    return max(0, int(whole) - (b.others_tokens if others else 0))


def used_tokens(
    b: BackendView,
    programs: Iterable[ProgramView],
    cfg: PolicyConfig,
    now: float,
    half_life_s: float | None = None,
) -> int:
    """Projected KV use of a backend; marked programs are credited (they leave at their next
    step end), and every context with a claim past the first (a call in flight, an idle
    program's cache) shares the common prefix (an idle program whose claim has decayed to
    nothing holds no prefix either)."""
    total = 0
    active = 0
    horizon = keep_horizon(b, cfg)
    for p in programs:
        if p.backend != b.url or p.marked:
            continue
        w = weight(p, cfg, now, half_life_s, horizon_s=horizon)
        if p.status is ProgramStatus.REASONING:
            active += contexts(p)
            total += w
        elif p.status is ProgramStatus.ACTING and w > 0:
            active += 1
            total += w
    return max(0, total - max(0, active - 1) * b.shared_prefix_tokens)


def admission_used(
    b: BackendView, programs: Iterable[ProgramView], cfg: PolicyConfig, now: float
) -> int:
    """KV use as a new program's first call sees it: idle programs' claims decay with the
    longer ``admission_half_life_s``. A newcomer is let in only where the programs under way
    can still make their next calls; otherwise it would be they who wait, mid-task, for it."""
    half_life = max(cfg.acting_half_life_s, cfg.admission_half_life_s)
    if cfg.acting_half_life_s <= 0:
        half_life = 0.0  # no decay at all already counts every claim whole
    return used_tokens(b, programs, cfg, now, half_life)


def waited(p: ProgramView, now: float) -> float | None:
    """Seconds the program's waiting request has waited (None: no request waits)."""
    return None if p.waiting_since is None else now - p.waiting_since


def priority(p: ProgramView, cfg: PolicyConfig, now: float) -> float:
    """Resume order, highest first: the wait so far (aging: it grows with the wait, so nobody
    is passed over for ever), plus what the program's earlier calls waited (``credit``), plus
    ``mid_program_head_start_s`` for a program already under way. New programs wait at their
    boundary rather than running programs mid-task: a paused program holds nothing but its
    place, while a program cut off mid-task has its history evicted and its whole run
    stretched."""
    since = p.waiting_since if p.waiting_since is not None else p.paused_since
    wait = 0.0 if since is None else now - since
    head_start = cfg.mid_program_head_start_s if p.steps > 0 else 0.0
    return wait + credit(p, cfg) + head_start


def interactive(p: ProgramView) -> bool:
    return p.program_class == INTERACTIVE


#: A batch call's bound grows with its program's run up to this many times ``max_wait_s``.
LONG_RUN_BOUND_FACTOR = 5.0


def bound(p: ProgramView, cfg: PolicyConfig) -> float:
    """The longest ``p``'s call waits in the proxy: its class's bound (classes.py)."""
    since = p.waiting_since if p.waiting_since is not None else p.created_at
    return call_bound(p.program_class, p.created_at, since, cfg)


def call_bound(program_class: str | None, created_at: float, since: float,
               cfg: PolicyConfig) -> float:  # fmt: skip
    """The longest a call that began waiting at ``since`` waits, for a program of
    ``program_class`` that began at ``created_at``. An interactive call: its class's bound. A
    batch call: ``max_wait_s``, or ``max_wait_share`` of its program's run so far where that
    is longer, up to ``LONG_RUN_BOUND_FACTOR`` times ``max_wait_s``. A wait is what a program's
    run is made longer by, and 120 s is half the run of a program of a dozen calls but a
    twentieth of an SWE-agent's: with one bound for both, the long programs' calls were forced
    out at it and evicted what the programs that ran had cached (SWE-agent, 64 agents, 432K:
    977 pauses, a prefix hit rate of 0.43, 0.71 of the free-reload bound's steps/min). A 300 s
    bound for every call made that 0.87 and the short programs' p99 program time 1.26x
    default's; a quarter of each program's run makes it 0.875 and leaves programs younger
    than eight minutes, the short ones among them, at 120 s (docs/BENCHMARKS.md)."""
    if program_class == INTERACTIVE:
        return cfg.interactive_max_wait_s
    share = cfg.max_wait_share * max(0.0, since - created_at)
    return min(LONG_RUN_BOUND_FACTOR * cfg.max_wait_s, max(cfg.max_wait_s, share))


def urgent(p: ProgramView, cfg: PolicyConfig, now: float) -> bool:
    """Whether room is made for ``p``'s waiting call now, and it reserves the next free room:
    a batch call once it has waited half its bound, an interactive one at once (its bound is
    seconds: room that happens to free itself within them would be luck)."""
    if p.waiting_since is None:
        return False
    return interactive(p) or now - p.waiting_since >= bound(p, cfg) / 2


def rank(p: ProgramView, cfg: PolicyConfig, now: float, use: int = 0) -> tuple[bool, int, float]:
    """Resume order, first first: interactive programs' calls before batch ones (a person
    waits on them), then those of the client holding the least KV on the backend (``use``,
    from ``client_use``; the same for all without clients), then by ``priority``."""
    return (not interactive(p), use, -priority(p, cfg, now))


def client_use(
    b: BackendView, programs: Iterable[ProgramView], cfg: PolicyConfig, now: float
) -> dict[str | None, int]:
    """The KV tokens each client's programs claim on ``b``, as ``used_tokens`` weighs them
    (prefix credit aside). Where programs of several clients share a backend, the one holding
    the most gives way first: its programs are paused and marked first, and the others' calls
    are resumed first. Without it, which programs tr paused when a client's twelve programs
    and another's one overflowed the cache was the order they came in: the lone program ran
    for 15 s in one run and was held for all of it in the next. Without clients every program
    is None's, and nothing is reordered."""
    horizon = keep_horizon(b, cfg)
    use: dict[str | None, int] = {}
    for p in programs:
        if p.backend == b.url and not p.marked:
            use[p.client] = use.get(p.client, 0) + weight(p, cfg, now, horizon_s=horizon)
    return use


def credit(p: ProgramView, cfg: PolicyConfig) -> float:
    """What a program's earlier calls waited, counted in its resume priority up to half the
    bound (``max_wait_s``). A program's run is the sum of its waits: ordered by the current
    wait alone, the same programs were passed over call after call and made the tail of
    program times (32 programs of 12 calls, 80K: the slowest waited 69, 28 and 70 s for three
    of its calls and took 333 s, default's slowest 322 s). Capped, because the bound is each
    call's own: counted whole (thousands of seconds on a long program), credit reordered the
    calls near their bound and 779 calls were forced out at it instead of 119 (SWE-agent,
    32 agents, 432K)."""
    return min(p.waited_total_s, cfg.max_wait_s / 2)


def need(p: ProgramView, b: BackendView, used: int, cfg: PolicyConfig) -> int:
    """Tokens ``p``'s next call adds to a backend already using ``used``."""
    return p.tokens + cfg.decode_buffer - (b.shared_prefix_tokens if used else 0)


def due(
    b: BackendView, programs: Iterable[ProgramView], cfg: PolicyConfig, now: float
) -> ProgramView | None:
    """The waiting program of ``b`` room is made for: the first by ``rank`` of those that are
    ``urgent`` (a batch call that waited half its bound, any interactive call). Making room
    then, rather than resuming it over capacity at the bound, keeps the bound without
    overloading the engine."""
    heads = [
        p
        for p in programs
        if p.status is ProgramStatus.PAUSED and p.backend == b.url and urgent(p, cfg, now)
    ]
    if not heads:
        return None
    use = client_use(b, programs, cfg, now)
    return min(heads, key=lambda p: rank(p, cfg, now, use.get(p.client, 0)))


def tool_estimate(p: ProgramView, now: float) -> float:
    """How long an acting program's current tool is expected to run in all: as long as its
    last one, or at least as long as it has run already."""
    idle = 0.0 if p.acting_since is None else now - p.acting_since
    return max(idle, p.tool_s or 0.0)


#: Rules whose ``used`` counts the program they move.
_ENFORCED = frozenset({"over_capacity", "calls_exceed_capacity"})


def _decision(
    action: Action,
    p: ProgramView,
    rule: str,
    b: BackendView | None,
    cfg: PolicyConfig,
    now: float,
    used: int | None,
    *,
    cap: int | None = None,
    **extra: Any,
) -> Decision:
    """A decision with its inputs; ``cap`` is the limit the rule compared against (by default
    the limit for programs not running yet)."""
    idle = None if p.acting_since is None else round(now - p.acting_since, 6)
    since = p.waiting_since if p.waiting_since is not None else p.paused_since
    # The claims the rule weighed: ``used`` already holds the program when it was enforced on.
    claims = used if used is None or rule in _ENFORCED else used + p.tokens
    tier = None if b is None else assumed_tier(b.gpu_tokens, b.capacity_factor, claims)
    if b is not None and tier is not None:
        extra["detail"] = {**extra.get("detail", {}), "tier": tier, "gpu_tokens": b.gpu_tokens}
    return Decision(
        action=action,
        program_id=p.program_id,
        rule=rule,
        backend=p.backend if b is None else b.url,
        capacity_tokens=cap if cap is not None or b is None else limit(b, cfg),
        used_tokens=used,
        program_tokens=p.tokens,
        idle_s=idle,
        waited_s=None if since is None else round(now - since, 6),
        **extra,
    )


def admit(
    p: ProgramView,
    b: BackendView,
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
) -> Decision:
    """May a new program's first call go out now on backend ``b``, or must it queue? An
    interactive newcomer is weighed against the usual view, not the admission one (it does
    not wait at its boundary for batch programs under way), and only interactive programs
    already waiting go before it."""
    cap = limit(b, cfg)
    if interactive(p):
        used = used_tokens(b, programs, cfg, now)
    else:
        used = admission_used(b, programs, cfg, now)
    if cap is None:
        return _decision(Action.ADMIT, p, "capacity_unknown", b, cfg, now, used)
    if not b.hold:
        # Holding newcomers back costs them more than the recompute it saves (costs.py): the
        # engine's own queue serves them as default would.
        return _decision(
            Action.ADMIT, p, b.unheld_rule, b, cfg, now, used, detail=dict(b.hold_inputs)
        )
    waiting = [
        q
        for q in programs
        if q.waiting_since is not None
        and q.program_id != p.program_id
        and (interactive(q) or not interactive(p))
    ]
    if waiting:
        # Fairness: newcomers do not overtake programs already waiting for capacity.
        return _decision(
            Action.QUEUE, p, "programs_waiting", b, cfg, now, used, queue_position=len(waiting)
        )
    if used + need(p, b, used, cfg) > cap:
        return _decision(Action.QUEUE, p, "capacity_full", b, cfg, now, used, queue_position=0)
    return _decision(Action.ADMIT, p, "fits", b, cfg, now, used)


def admit_without_sum(
    p: ProgramView, b: BackendView, bound: int | None, waiting: int, cfg: PolicyConfig, now: float
) -> Decision | None:
    """``admit``'s decision where it needs no sum of the programs' claims; None where only the
    sum can tell. Where the capacity is unknown or tr does not hold on ``b`` the newcomer goes
    out whatever the others claim; where nobody waits (``waiting``: requests waiting for a
    resume) and ``bound`` (at least what ``admission_used`` counts on ``b``) leaves room for
    the whole call, it fits. Without it, every first call summed every program still claiming
    KV: plain SDK traffic, where each call is a new program, paid for every call of the last
    two minutes on each new one. The decision carries no ``used_tokens``: it was not summed
    (``detail.used_at_most`` has the bound)."""
    cap = limit(b, cfg)
    detail: dict[str, Any] = {}
    if bound is not None:
        detail["used_at_most"] = bound
        # The tier it assumed (tiers.assumed_tier) is known from the bound where the claims
        # fit the GPU; past it only the sum can tell.
        if assumed_tier(b.gpu_tokens, b.capacity_factor, bound + p.tokens) == "gpu":
            detail |= {"tier": "gpu", "gpu_tokens": b.gpu_tokens}
    if cap is None:
        return _decision(Action.ADMIT, p, "capacity_unknown", b, cfg, now, None, detail=detail)
    if not b.hold:
        detail |= b.hold_inputs
        return _decision(Action.ADMIT, p, b.unheld_rule, b, cfg, now, None, detail=detail)
    if waiting or bound is None:
        return None
    # need() is at most the call's own tokens: the shared prefix only takes off.
    if bound + max(0, p.tokens + cfg.decode_buffer) > cap:
        return None
    if b.gpu_tokens is not None and "tier" not in detail:
        return None  # the sum says which tier it reaches
    return _decision(Action.ADMIT, p, "fits", b, cfg, now, None, detail=detail)


def on_return(
    p: ProgramView,
    b: BackendView,
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
) -> Decision:
    """An acting program's next call arrived: may it reason now, or does it wait for room?

    Letting every returning program through is how the engine ends up preempting: programs
    that were idle at the same time come back at the same time. A program that would overflow
    the backend waits like a paused one (its wait counts from now, so it is served in order).
    """
    cap = limit(b, cfg, fill=1.0)
    if cap is not None and p.protected_until <= now and not b.hold:
        # Not holding here: the call goes out, and the others' claims are not summed (an
        # admitted return is not logged, and the sum costs every program's view).
        return _decision(
            Action.ADMIT,
            p,
            b.unheld_rule,
            b,
            cfg,
            now,
            None,
            cap=cap,
            detail=dict(b.hold_inputs),
        )
    others = [q for q in programs if q.program_id != p.program_id]
    used = used_tokens(b, others, cfg, now)
    if cap is None:
        return _decision(Action.ADMIT, p, "capacity_unknown", b, cfg, now, used, cap=cap)
    if p.protected_until > now:
        return _decision(Action.ADMIT, p, "protected", b, cfg, now, used, cap=cap)
    if used + need(p, b, used, cfg) <= cap:
        return _decision(Action.ADMIT, p, "fits", b, cfg, now, used, cap=cap)
    if within_share(p, b, programs, cfg, now, cap):
        # The overflow is another client's doing: its programs give way (enforce).
        return _decision(Action.ADMIT, p, "fair_share", b, cfg, now, used, cap=cap)
    return _decision(Action.PAUSE, p, "no_room_on_return", b, cfg, now, used, cap=cap)


def within_share(
    p: ProgramView,
    b: BackendView,
    programs: Iterable[ProgramView],
    cfg: PolicyConfig,
    now: float,
    cap: int,
) -> bool:
    """Whether ``p``'s client, ``p``'s next call included, claims at most an equal share of
    ``cap`` among the clients with programs on ``b`` (False without clients, or with one).
    Such a call is not held for the overflow: the clients past their share give way. Held,
    a client's one program waited whenever another client's twelve came back before it."""
    if p.client is None:
        return False
    use = client_use(b, programs, cfg, now)
    clients = {c for c, tokens in use.items() if tokens > 0} | {p.client}
    if len(clients) < 2:
        return False
    mine = sum(
        weight(q, cfg, now, horizon_s=keep_horizon(b, cfg))
        for q in programs
        if q.client == p.client and q.backend == b.url and q.program_id != p.program_id
    )
    return mine + p.tokens + cfg.decode_buffer <= cap / len(clients)


def spared(use: dict[str | None, int], cap: int) -> frozenset[str | None]:
    """The clients (``client_use``) that ``enforce`` leaves alone: those claiming at most an
    equal share of ``cap``, where another client claims more than its share. The overflow is
    that client's doing, and its programs give way; ordering by use alone was not enough,
    since a client's program whose calls are all held has nothing to pause or mark, and the
    one program of the client beside it was paused instead: an attacker's twelve threads under
    one program id cut the victim's calls by half (``tests/reliability/test_spoofing.py``).
    Empty without clients, with one, or where nobody is past an equal share."""
    clients = [c for c, tokens in use.items() if c is not None and tokens > 0]
    if len(clients) < 2:
        return frozenset()
    share = cap / len(clients)
    if all(use[c] <= share for c in clients):
        return frozenset()
    return frozenset(c for c in clients if use[c] <= share)


def enforce(
    b: BackendView, programs: Sequence[ProgramView], cfg: PolicyConfig, now: float
) -> list[Decision]:
    """Pause or mark programs on ``b`` until its projected use fits its capacity, and, for a
    waiting program past half its bound (``due``), until that program fits too."""
    cap = limit(b, cfg, fill=1.0, others=False)
    if cap is None or not b.healthy or not b.hold:
        return []
    mine = [p for p in programs if p.backend == b.url]
    head = due(b, mine, cfg, now)
    # The cooldown spaces rounds of pauses (pausing and resuming at every step churned the
    # cache). With ``make_room_at_once``, room for a call past half its bound is made whenever
    # a call ends: it waits less, and more programs are paused for it. Room for an interactive
    # call is always made at once: its bound is shorter than a cooldown.
    cooling = b.last_pause_at is not None and now - b.last_pause_at < cfg.pause_cooldown_s
    for_person = head is not None and interactive(head)
    if cooling and (head is None or not (cfg.make_room_at_once or for_person)):
        return []
    used = used_tokens(b, mine, cfg, now)
    room = cap
    if head is not None:
        target = limit(b, cfg)
        assert target is not None
        room = min(cap, target - need(head, b, used, cfg))
    if used <= room:
        return []
    extra: dict[str, Any] = {}
    rule = "over_capacity"
    if used <= cap and head is not None:
        # Room for a call about to reach its bound: a time slice taken from the others.
        rule = "make_room"
        head_wait = round(now - head.waiting_since, 6) if head.waiting_since is not None else 0.0
        extra = {"detail": {"for": head.program_id, "waited_s": head_wait}}
    elif cooling and not for_person:
        return []
    decisions: list[Decision] = []
    use = client_use(b, mine, cfg, now)
    # A client within its share is not moved for an overflow another client makes.
    kept = spared(use, cap)
    movable = [
        p for p in mine if not p.marked and p.protected_until <= now and p.client not in kept
    ]
    # Batch programs go first: an interactive program's next call is a person waiting. Then
    # those of the client holding the most KV here (client_use), then the program whose tool
    # is expected to run the longest: its cache is the coldest, its return the least imminent,
    # and its pause the most likely to end before it wanted to call again (a pause that costs
    # nothing).
    acting = sorted(
        (
            p
            for p in movable
            if p.status is ProgramStatus.ACTING and p.in_flight == 0 and p.waiting_since is None
        ),
        key=lambda p: (interactive(p), -use.get(p.client, 0), -tool_estimate(p, now), -p.tokens),
    )
    if rule == "make_room":
        assert head is not None
        acting = [p for p in acting if gives_way(p, head, cfg, now)]
    horizon = keep_horizon(b, cfg)
    for p in acting:
        credit = weight(p, cfg, now, horizon_s=horizon)
        if credit <= 0:
            continue
        decisions.append(_decision(Action.PAUSE, p, rule, b, cfg, now, used, cap=room, **extra))
        used -= credit
        if used <= room:
            return decisions
    if cooling:
        return decisions
    # Marking is for what pausing idle programs cannot fix: calls in flight that alone exceed
    # the cache, which the engine would answer with preemptions. An overflow made of idle
    # programs' decayed claims is left to them: marking a busy program for it costs that
    # program a wait and saves nobody's cache. Nor are running calls marked to make room for a
    # waiting one: such time slices evicted a running program's cache at every turn.
    busy = [
        p
        for p in mine
        if p.status is ProgramStatus.REASONING
        or (p.status is ProgramStatus.ACTING and p.waiting_since is not None)
    ]
    reasoning_used = used_tokens(b, busy, cfg, now)
    reasoning = sorted(
        (p for p in movable if p.status is ProgramStatus.REASONING),
        key=lambda p: (interactive(p), -use.get(p.client, 0), -p.created_at),
    )
    for p in reasoning:
        if reasoning_used <= cap:
            break
        decisions.append(
            _decision(Action.MARK, p, "calls_exceed_capacity", b, cfg, now, used, cap=cap)
        )
        reasoning_used -= weight(p, cfg, now)
        used -= weight(p, cfg, now)
    return decisions


#: Until a batch call has waited this share of its bound, room is made for it only from
#: programs that have waited less in all (``gives_way``); from then on, from any.
GIVE_WAY_UNTIL = 0.9


def gives_way(p: ProgramView, head: ProgramView, cfg: PolicyConfig, now: float) -> bool:
    """Whether the idle program ``p`` may be paused to make room for ``head``'s waiting call:
    for a person's call, any program (``enforce`` takes batch ones first); for a batch call,
    only a program whose calls have waited less in all than ``head``'s have (its earlier
    calls' waits and half its current one), until the call has waited ``GIVE_WAY_UNTIL`` of
    its bound, and then any program.

    A time slice moves a wait from the head to the program paused for it, which then waits
    about as long for its own turn. Taken from whoever's tool was expected to run the longest,
    it took the same programs again and again, and they made the tail of program times: on the
    short programs at 80K, the slowest but one waited 78, 45 and 47 s for three of its 12
    calls, paused twice for programs that had waited less in all. Near its bound the call
    takes room from anyone, because at the bound it goes out into a full cache and evicts what
    the running programs keep: with no such fallback, SWE-agent at 64 agents went from 0.87 of
    the free-reload bound to 0.82 (calls waited up to 588 s for their bound). From three
    quarters of the bound the fallback still fell on programs that had waited more (short-s1's
    slowest program, 141 s of waits behind it, was paused for a call at 104 s of its 120 s and
    waited 70 s more); from 0.9, over 51 timing draws of the three short cells, tr's steps/min is
    1.081x default's (1.072x from 3/4) at the same p99 program time on average (0.957x against
    0.959x), and SWE-agent reaches 0.956 and 0.875 of the bound at 32 and 64 agents (0.93, 0.86)
    (docs/BENCHMARKS.md, "Whom room is made from" and "From what share of its bound room comes
    from anyone")."""
    if interactive(head):
        return True
    current = waited(head, now) or 0.0
    if current >= GIVE_WAY_UNTIL * bound(head, cfg):
        return True
    return p.waited_total_s < head.waited_total_s + current / 2


def settled(b: BackendView, bound: int | None, cfg: PolicyConfig, now: float) -> bool:
    """Whether ``enforce`` on ``b`` decides nothing, known without summing the programs:
    given that no program is paused (so none waits at half its bound: no ``due`` head) and
    ``bound`` at least what ``used_tokens`` counts on ``b`` (None: not known). Each test
    here is one ``enforce`` makes before it returns nothing."""
    cap = limit(b, cfg, fill=1.0, others=False)
    if cap is None or not b.healthy or not b.hold:
        return True
    if b.last_pause_at is not None and now - b.last_pause_at < cfg.pause_cooldown_s:
        return True  # cooling, and no head to make room for
    return bound is not None and bound <= cap


def resume_cooldown(b: BackendView, cfg: PolicyConfig) -> float:
    """Seconds between two resume rounds on ``b``: ``resume_cooldown_s``, or one call's length
    where the backend's calls are shorter. Rounds are spaced so that a round's resumes show in
    the engine before the next round looks, and they show within a call. Councils' calls last
    about a second: spaced by the full 5 s, the cache stood nearly empty for seconds while
    their returning members waited for the next round."""
    if b.call_s is None:
        return cfg.resume_cooldown_s
    return min(cfg.resume_cooldown_s, b.call_s)


def fits_on_return(
    p: ProgramView, b: BackendView, bound: int, cfg: PolicyConfig, now: float
) -> Decision | None:
    """``on_return``'s ``fits``, where ``bound`` (at least what ``used_tokens`` counts on
    ``b`` for the other programs) shows it without the sum; None where the bound does not
    show it, and ``on_return`` decides. The decision carries no ``used_tokens``: it was not
    summed (an admitted return is not logged)."""
    cap = limit(b, cfg, fill=1.0)
    if cap is None or p.protected_until > now or not b.hold:
        return None  # on_return's own answer, not "fits"
    # need() is at most the call's own tokens: the shared prefix only takes off.
    if bound + max(0, p.tokens + cfg.decode_buffer) > cap:
        return None
    return _decision(Action.ADMIT, p, "fits", b, cfg, now, None, cap=cap)


def _fits(p: ProgramView, b: BackendView, used: int, cfg: PolicyConfig) -> bool:
    cap = limit(b, cfg)
    if cap is None:
        return True
    return used + need(p, b, used, cfg) <= cap


def resume(
    backends: Sequence[BackendView],
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
) -> list[Decision]:
    """Which paused programs go back, and where.

    Waiting programs first, by ``rank`` (interactive programs first, then the longest wait,
    programs under way ahead of new ones). An ``urgent`` waiting program (a batch one that has
    waited half of ``max_wait_s``, any interactive one) that does not fit reserves the next
    freed capacity (no one behind it may pass); at its class's ``bound`` it is resumed
    regardless of capacity. On a backend where holding programs back does not pay
    (``BackendView.hold``), waiting programs go back at once. Paused programs whose tool still
    runs are resumed only into room left over.
    """
    healthy = [b for b in backends if b.healthy]
    if not healthy:
        return []
    ready = {
        b.url
        for b in healthy
        if b.last_resume_at is None or now - b.last_resume_at >= resume_cooldown(b, cfg)
    }
    # Each backend's use is summed once; resumes decided in this round are added as they
    # come (one pass over the programs per backend, not one per candidate: this runs on every
    # step end, with up to thousands of programs).
    room = _Room(healthy, programs, cfg, now)
    decisions: list[Decision] = []
    blocked = False
    #: Backends where a paused program's call waits unplaced: no held call passes it there.
    stalled: set[str] = set()
    for position, p in enumerate(_resume_order(healthy, programs, cfg, now)):
        if p.status is not ProgramStatus.PAUSED:
            decisions += _release_held(p, healthy, stalled, room.used, cfg, now)
            continue
        waited = now - (p.waiting_since if p.waiting_since is not None else p.paused_since or now)
        group = healthy if p.eligible is None else [b for b in healthy if b.url in p.eligible]
        if not group:
            continue  # no healthy backend serves its model: it waits for one
        own = next((b for b in group if b.url == p.backend), None)
        if p.waiting_since is not None and own is not None and not own.hold:
            decisions.append(
                _decision(Action.RESUME, p, own.unheld_rule, own, cfg, now, room.used[own.url],
                          target_backend=own.url, queue_position=position,
                          detail=dict(own.hold_inputs))
            )  # fmt: skip
            room.take(own, p)
            continue
        if p.waiting_since is not None and waited >= bound(p, cfg):
            target = own or min(group, key=lambda b: room.used[b.url])
            decisions.append(
                _decision(Action.FORCE_RESUME, p, "max_wait", target, cfg, now,
                          room.used[target.url], target_backend=target.url,
                          queue_position=position)
            )  # fmt: skip
            room.take(target, p)
            continue
        if blocked:
            continue
        pressing = urgent(p, cfg, now)
        placed = _place(p, group, own, ready, pressing, room, position, cfg, now)
        if placed is not None:
            decisions.append(placed)
        elif p.waiting_since is not None:
            stalled.add(p.backend or "")
        if placed is None and pressing:
            blocked = True  # aging: the head reserves the next free capacity
    return decisions


class _Room:
    """``resume``'s running count of each healthy backend's use: as ``used_tokens`` counts it
    (``used``), and as a new program's first call is weighed (``admit``: ``admission_used``,
    where a first call waits), each grown by the programs resumed so far."""

    def __init__(
        self,
        healthy: Sequence[BackendView],
        programs: Sequence[ProgramView],
        cfg: PolicyConfig,
        now: float,
    ) -> None:
        self.cfg = cfg
        self.used = {b.url: used_tokens(b, programs, cfg, now) for b in healthy}
        newcomers = any(
            p.steps == 0 and p.status is ProgramStatus.PAUSED and p.waiting_since is not None
            for p in programs
        )
        self.admit = {
            b.url: admission_used(b, programs, cfg, now) if newcomers else self.used[b.url]
            for b in healthy
        }

    def take(self, b: BackendView, p: ProgramView) -> None:
        self.used[b.url] += p.tokens + self.cfg.decode_buffer
        self.admit[b.url] += p.tokens + self.cfg.decode_buffer


def _resume_order(
    healthy: Sequence[BackendView],
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
) -> list[ProgramView]:
    """``resume``'s candidates in order: paused programs with a waiting call, then running
    programs' held calls (both by ``rank``, the client holding the least KV first where there
    are clients), then paused programs whose tool still runs, interactive ones first."""
    paused = [p for p in programs if p.status is ProgramStatus.PAUSED]
    uses: dict[str, dict[str | None, int]] = {}
    if any(p.client is not None for p in programs):
        uses = {b.url: client_use(b, programs, cfg, now) for b in healthy}

    def order(p: ProgramView) -> tuple[bool, int, float, float]:
        use = uses.get(p.backend or "", {}).get(p.client, 0)
        return (*rank(p, cfg, now, use), p.waiting_since or 0.0)

    waiting = sorted((p for p in paused if p.waiting_since is not None), key=order)
    held = sorted(
        (p for p in programs if p.held and not p.marked and p.status is not ProgramStatus.PAUSED),
        key=order,
    )
    idle = sorted(
        (p for p in paused if p.waiting_since is None),
        key=lambda p: (not interactive(p), p.paused_since or 0.0),
    )
    return [*waiting, *held, *idle]


def _place(
    p: ProgramView,
    group: Sequence[BackendView],
    own: BackendView | None,
    ready: set[str],
    pressing: bool,
    room: _Room,
    position: int,
    cfg: PolicyConfig,
    now: float,
) -> Decision | None:
    """Where paused ``p`` fits in ``group``, its own backend first, then the least used (a
    resume there, or a migration); None where it fits nowhere. A backend still cooling from
    its last resume round is passed over unless ``p`` is ``pressing``."""
    candidates = ([own] if own else []) + sorted(
        (b for b in group if b is not own), key=lambda b: room.used[b.url]
    )
    for b in candidates:
        if b.url not in ready and not pressing:
            continue  # a call past half its bound takes its room without a cooldown
        used = room.used[b.url]
        first = p.steps == 0 and not interactive(p)  # weighed as ``admit`` weighs it
        if not _fits(p, b, room.admit[b.url] if first else used, cfg):
            continue
        if b is own or p.backend is None:
            action, rule = Action.RESUME, "capacity_free"
        elif own is None:
            action, rule = Action.MIGRATE, "backend_unhealthy"
        else:
            action, rule = Action.MIGRATE, "own_backend_full"
        room.take(b, p)
        return _decision(action, p, rule, b, cfg, now, used, target_backend=b.url,
                         queue_position=position)  # fmt: skip
    return None


def _release_held(
    p: ProgramView,
    healthy: Sequence[BackendView],
    stalled: set[str],
    used_by: dict[str, int],
    cfg: PolicyConfig,
    now: float,
) -> list[Decision]:
    """``resume``'s part for a running program's held calls (``on_call``): as many as fit on
    its backend go out, each one more context, unless a paused program's call waits there
    unplaced (held calls do not pass it). An acting program (its other calls ended meanwhile)
    already counts its next call in ``used_by``."""
    b = next((b for b in healthy if b.url == p.backend), None)
    if b is None or b.url in stalled:
        return []
    decisions = []
    acting = p.status is ProgramStatus.ACTING
    used = used_by[b.url] - (p.tokens + cfg.decode_buffer if acting else 0)
    for _ in range(p.held):
        if not _fits(p, b, used, cfg):
            break
        decisions.append(_decision(Action.ADMIT, p, "room_for_call", b, cfg, now, used))
        used += p.tokens + cfg.decode_buffer
    used_by[b.url] = max(used_by[b.url], used)
    return decisions


def on_call(
    p: ProgramView,
    b: BackendView,
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
) -> Decision:
    """A call of ``p`` while calls of it are in flight (or held): it adds a context of its own
    on ``b`` (``contexts``), so it goes out only where one more fits under the limit for new
    claims (``target_fill``), and never before a paused program's call waiting on ``b``, nor
    while ``p`` is marked; otherwise it is held (``QUEUE``, ``no_room_for_call``) until
    ``resume`` finds it room (``ADMIT``, ``room_for_call``) or it reaches its class's bound.
    Let through unchecked, one program's calls sent at once filled the cache alone.

    A new call may pass the program's held ones, and held ones go newest first: a call that
    comes as another of the program's calls ends mostly continues the context that call left
    in the cache, where the calls held longest have had theirs evicted. Let go oldest first,
    twelve threads of one program took turns on a cache that held five of their contexts, and
    every call recomputed its whole prompt (none of 80 calls found a cached token, against
    5,800 of 6,011 for each of five programs tr kept running whole). Like paused programs,
    the calls held longest wait up to their bound."""
    cap = limit(b, cfg)
    if cap is None:
        return _decision(Action.ADMIT, p, "capacity_unknown", b, cfg, now, None)
    if not b.hold:
        return _decision(
            Action.ADMIT, p, b.unheld_rule, b, cfg, now, None, detail=dict(b.hold_inputs)
        )
    if p.protected_until > now:
        return _decision(Action.ADMIT, p, "protected", b, cfg, now, None)
    used = used_tokens(b, programs, cfg, now)
    waiting = [
        q
        for q in programs
        if q.status is ProgramStatus.PAUSED and q.waiting_since is not None and q.backend == b.url
    ]
    if p.marked:
        # Marked, it is credited as gone (``used_tokens``): it is, once its calls in flight
        # end, and its new ones wait for its resume instead of keeping it running for ever.
        return _decision(Action.QUEUE, p, "marked", b, cfg, now, used, queue_position=p.held)
    if waiting:
        return _decision(
            Action.QUEUE, p, "no_room_for_call", b, cfg, now, used, queue_position=len(waiting)
        )
    if p.ended:
        # It takes over the context its program's last ended call left (ended_claim).
        used -= ended_claim(p, max(p.ended), cfg, now, horizon_s=keep_horizon(b, cfg))
    if used + need(p, b, used, cfg) <= cap:
        return _decision(Action.ADMIT, p, "fits", b, cfg, now, used)
    return _decision(Action.QUEUE, p, "no_room_for_call", b, cfg, now, used, queue_position=0)


def call_fits(
    p: ProgramView, b: BackendView, bound: int | None, waiting: int, cfg: PolicyConfig
) -> bool:
    """Whether ``on_call`` lets ``p``'s call through, known without the sum: nobody waits
    (``waiting``: programs with a request waiting, held calls included), and ``bound`` (at
    least what ``used_tokens`` counts on ``b``, ``p``'s calls in flight included) leaves room
    for one more context."""
    cap = limit(b, cfg)
    if cap is None or not b.hold or waiting or bound is None or p.marked:
        return False
    return bound + max(0, p.tokens + cfg.decode_buffer) <= cap


def force_resume(
    p: ProgramView,
    backends: Sequence[BackendView],
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
) -> Decision | None:
    """A waiting program at its bound (``max_wait_s``) goes back whether it fits or not: on its
    own backend while that is healthy, else on the least used healthy one of its group (None:
    none is healthy, it waits for one). The scheduler calls this when the request's deadline
    passes, so no call waits past the bound whatever the monitor's rhythm."""
    group = [b for b in backends if b.healthy and (p.eligible is None or b.url in p.eligible)]
    if not group:
        return None
    used = {b.url: used_tokens(b, programs, cfg, now) for b in group}
    own = next((b for b in group if b.url == p.backend), None)
    target = own or min(group, key=lambda b: used[b.url])
    return _decision(
        Action.FORCE_RESUME,
        p,
        "max_wait",
        target,
        cfg,
        now,
        used[target.url],
        target_backend=target.url,
    )


def expected_wait(
    position: int, resume_times: Sequence[float], cfg: PolicyConfig, now: float
) -> float:
    """Seconds a newcomer at ``position`` in the queue can expect to wait: the recent rate of
    resumes, or the forced-resume bound when there is no recent rate to go by."""
    recent = [t for t in resume_times if now - t <= 60.0]
    if len(recent) < 2:
        return cfg.max_wait_s
    rate = (len(recent) - 1) / max(1e-6, recent[-1] - recent[0])
    return min(cfg.max_wait_s, (position + 1) / rate)


def retire(programs: Sequence[ProgramView], cfg: PolicyConfig, now: float) -> list[Decision]:
    """Programs idle past the lease are retired, so never-released programs stop counting."""
    if cfg.idle_lease_s <= 0:
        return []
    return [
        _decision(Action.RETIRE, p, "idle_lease", None, cfg, now, None)
        for p in programs
        if p.status in (ProgramStatus.ACTING, ProgramStatus.PAUSED)
        and p.in_flight == 0
        and p.waiting_since is None
        and now - p.last_activity >= cfg.idle_lease_s
    ]
