"""The KV claim a call makes against other instances' claims (several processes in front of the
same backends, sharing through Redis: docs/DEPLOY.md), pure.

tr decides whether a call fits a backend on its own view, in which what the other instances
claim is a figure one publication old (``BackendView.others_tokens``). Every call that adds KV
beyond what this instance's published claim already covers (a program's first call, one that
waited, a returning call let through) makes the same test again where no other instance can
claim in between, in one Redis script (``admission.shared_kv.CLAIM_KV``): ``fits`` with the other
instances' claims as Redis sums them at that instant. ``ask`` gives the figures the script
needs, from the views the policy sees once the call is counted in them; ``refused`` is the
decision logged when the script says no, after which the program waits exactly as if its own
view had found the backend full.

Where this instance's hold ledger found that holding programs back does not pay
(``costs.HoldLedger``), ``holds`` keeps tr holding while other live instances share the
backends, and the script grants such a call unchecked only while no other instance is live
(``Ask.alone``): see ``holds`` for why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tr import (
    Action,
    BackendView,
    Decision,
    PolicyConfig,
    ProgramView,
    admission_used,
    limit,
    used_tokens,
)


@dataclass(frozen=True)
class Ask:
    """What a call's claim is checked with on one backend."""

    backend: str
    #: This instance's claims on the backend, the call's included, as the policy counts them.
    demand: int
    #: The claims the policy lets programs not yet running reach there, before what the other
    #: instances claim comes off (``tr.limit`` without the others).
    whole: int
    #: This instance's view found it alone in front of the backends and its ledger found
    #: that holding does not pay there: the call is granted whatever ``demand`` while no other
    #: instance is live, and tested like any other once one is (``holds``).
    alone: bool = False


def holds(ledger: bool, shared: bool) -> bool:
    """Whether tr holds programs back on a backend with ``hold = auto``: where its ledger
    (``ledger``) measured that holding pays, and whenever other live instances share the
    backends (``shared``), whatever the ledger says.

    The ledger weighs only this instance's calls: the waits holding costs them against the
    recompute of their own history it saves. In front of shared backends, what a call let
    through without a fit test overfills is the others' room as much as its own: their
    running calls are preempted, their next calls refused until it drains, and none of it
    reaches this ledger. Nor can the claims cover such calls: they exist to be tested, and a
    call the policy lets through past the capacity fails the test. Measured at 256 streams
    through two workers (docs/BENCHMARKS.md, "Scale-out"): with the ledger deciding, 445 calls
    of 768 went out under ``hold_does_not_pay`` and every call running beside each of the 5
    preemptions was one of them; checking those calls in Redis but granting them while the
    other worker claimed nothing still left 5 to 8 (four runs), each worker in turn filling a
    backend two to three times over while the other was idle. So while others are live, tr
    holds, as under ``hold = always``: the fit test against the shared sums (``tr.limit``
    takes the others' claims off), the gate on returns, the resumes in order. Alone (one
    instance with Redis, or Redis away), the ledger decides as without Redis."""
    return ledger or shared


def ask(
    b: BackendView,
    programs: Sequence[ProgramView],
    cfg: PolicyConfig,
    now: float,
    *,
    first: bool,
    fill: float | None = None,
) -> Ask | None:
    """The check for a call about to go out on ``b``, with ``programs`` already counting it;
    None where the policy lets it go without a fit test whatever the others claim (capacity
    not known yet, or ``hold = never``). Where holding does not pay on ``b`` (``b.hold``
    false: this instance saw no other live instance), the check is still made, ``alone``:
    the view may be a publication behind another instance's start. A program's first
    call is counted as at admission (``admission_used``), a later one as the resumes count it
    (``used_tokens``); the target is ``target_fill`` of the capacity, or ``fill`` of it (1.0
    for a returning call: the gate on returns lets a running program grow into the whole
    capacity)."""
    whole = limit(b, cfg, fill=fill, others=False)
    # Never holding, a refused call would be resumed at once, refused again, and so on: the
    # claim is checked only where a refusal leaves a view that holds (``holds``).
    if whole is None or cfg.hold == "never":
        return None
    demand = (admission_used if first else used_tokens)(b, programs, cfg, now)
    return Ask(b.url, demand, whole, alone=not b.hold)


def fits(ask: Ask, others: int, *, shared: bool = True) -> bool:
    """The policy's test, with ``others`` the tokens every other live instance claims on the
    backend and ``shared`` whether any other instance is live: the one Redis makes in
    CLAIM_KV."""
    return (ask.alone and not shared) or others + ask.demand <= ask.whole


def refused(p: ProgramView, ask: Ask, others: int) -> Decision:
    """The decision for a call whose claim Redis refused: a first call queues, a later one
    pauses, as tr's own rules do on a full backend."""
    first = p.steps == 0
    return Decision(
        Action.QUEUE if first else Action.PAUSE,
        p.program_id,
        "claim_refused",
        ask.backend,
        capacity_tokens=max(0, ask.whole - others),
        used_tokens=ask.demand,
        program_tokens=p.tokens,
        queue_position=0 if first else None,
        detail={"others_tokens": others, "target_tokens": ask.whole},
    )
