"""What the tr rules (``tr.py``) read and return, as plain values: a program's and a
backend's view, and a ``Decision`` with its ``Action``. ``views.py`` builds the views;
``scheduler.py`` applies the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..programs import ProgramStatus
from .classes import BATCH


class Action(StrEnum):
    ADMIT = "admit"
    QUEUE = "queue"
    PAUSE = "pause"
    MARK = "mark"
    RESUME = "resume"
    MIGRATE = "migrate"
    FORCE_RESUME = "force_resume"
    RETIRE = "retire"
    CANCEL = "cancel"
    REJECT = "reject"


@dataclass(frozen=True)
class ProgramView:
    program_id: str
    status: ProgramStatus
    backend: str | None
    tokens: int
    created_at: float
    acting_since: float | None = None
    paused_since: float | None = None
    #: When the request that waits for this program arrived (None: no request waits).
    waiting_since: float | None = None
    marked: bool = False
    protected_until: float = 0.0
    last_activity: float = 0.0
    in_flight: int = 0
    #: The backends that serve the program's model (None: any); it never moves off them.
    eligible: frozenset[str] | None = None
    #: Calls begun so far: 0 while its first call waits at admission.
    steps: int = 0
    #: How long its last tool ran (None: unknown); predicts how long its current one runs.
    tool_s: float | None = None
    #: Seconds its calls have waited in the proxy so far, the waits of calls already sent.
    waited_total_s: float = 0.0
    #: Its latency class (classes.py): an interactive program's calls wait at most
    #: ``interactive_max_wait_s``, and room is made for them from batch programs first.
    program_class: str = BATCH
    #: The configured client whose program it is (None without ``[clients]``): where programs
    #: of several clients share a backend, tr pauses the client holding the most KV first.
    client: str | None = None
    #: Calls of it held back because another context of it would not fit (none go out before
    #: the program's earlier held ones).
    held: int = 0
    #: When its calls that ended while others of it ran ended (their contexts still cached).
    ended: tuple[float, ...] = ()


@dataclass(frozen=True)
class BackendView:
    url: str
    healthy: bool
    #: None while the backend's metrics have never shown a KV capacity: not scheduled.
    capacity_tokens: int | None
    shared_prefix_tokens: int = 0
    #: Shrinks when the engine preempts (the model was optimistic), recovers when it stops.
    capacity_factor: float = 1.0
    last_pause_at: float | None = None
    last_resume_at: float | None = None
    #: KV tokens other instances' programs claim here (shared through Redis; 0 without it).
    others_tokens: int = 0
    #: Whether holding programs back pays here (``costs.HoldLedger``; True until measured).
    hold: bool = True
    #: The measurements behind ``hold``, logged with the decisions that depend on it.
    hold_inputs: dict[str, float] = field(default_factory=dict)
    #: With a CPU KV tier in the capacity: the GPU's own tokens (tiers.py; None: GPU only).
    gpu_tokens: int | None = None
    #: The engine's fastest prefill per uncached token lately (costs.py; None: not measured).
    prefill_s_per_token: float | None = None
    #: The rule a call let through without holding is logged under: ``hold_does_not_pay``
    #: (measured), or ``few_returns`` (fewer than half the programs come back: costs.py).
    unheld_rule: str = "hold_does_not_pay"
    #: How long the backend's calls take lately (learners.CallTime; None: none ended yet).
    call_s: float | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    program_id: str
    rule: str
    backend: str | None
    target_backend: str | None = None
    capacity_tokens: int | None = None
    used_tokens: int | None = None
    program_tokens: int | None = None
    idle_s: float | None = None
    waited_s: float | None = None
    queue_position: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)
