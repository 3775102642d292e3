"""The KV claim a call makes against other instances' claims (several processes in front of the
same backends, sharing through Redis: docs/DEPLOY.md), pure.

tr decides whether a call fits a backend on its own view, in which what the other instances
claim is a figure one publication old (``BackendView.others_tokens``). When a call that was not
running goes out (a program's first call, or one that waited), the same test is made again
where no other instance can claim in between, in one Redis script
(``admission.shared.CLAIM_KV``): ``fits`` with the other instances' claims as Redis sums them
at that instant. ``ask`` gives the two figures the script needs, from the views the policy
sees once the call is counted in them; ``refused`` is the decision logged when the script says
no, after which the program waits exactly as if its own view had found the backend full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .policy import (
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
    #: instances claim comes off (``policy.limit`` without the others).
    whole: int


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
    None where the policy lets it go without a fit test (capacity not known yet, or holding
    programs back does not pay there). A program's first call is counted as at admission
    (``admission_used``), a later one as the resumes count it (``used_tokens``); the target is
    ``target_fill`` of the capacity, or ``fill`` of it (1.0 for a returning call: the gate on
    returns lets a running program grow into the whole capacity)."""
    whole = limit(b, cfg, fill=fill, others=False)
    if whole is None or not b.hold:
        return None
    demand = (admission_used if first else used_tokens)(b, programs, cfg, now)
    return Ask(b.url, demand, whole)


def fits(ask: Ask, others: int) -> bool:
    """The policy's test, with ``others`` the tokens every other live instance claims on the
    backend: the one Redis makes in CLAIM_KV."""
    return others + ask.demand <= ask.whole


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
