"""The program state machine, pure: every function takes ``now`` and returns the
transition it made, so the registry can log it and tests can drive it without a clock.

    (new) -> REASONING -> ACTING -> REASONING -> ... -> STOPPED
                 ^           |
                 +- PAUSED <-+     (tr mode only: paused while acting, resumed before its next call)

A program may have several requests in flight (the catch-all ``default`` program usually does):
it is REASONING while any is, and becomes ACTING when the last one ends, whatever its outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..steps import ProgramStatus, StepUsage, Transition

__all__ = [
    "Program",
    "ProgramStatus",
    "StepUsage",
    "Transition",
    "begin_step",
    "create",
    "end_step",
    "pause",
    "resume",
    "stop",
]


@dataclass
class Program:
    """Everything the proxy knows about one program. Times are trio clock readings."""

    program_id: str
    created_at: float
    status: ProgramStatus = ProgramStatus.REASONING
    backend: str | None = None
    #: The model name its calls ask for; it stays on backends that serve it.
    model: str | None = None
    step_count: int = 0
    #: Characters of the last request's messages: the context size ``/programs`` shows, as
    #: ``context_chars`` and, divided by ``chars_per_token``, as ``context_len``.
    context_len: int = 0
    #: KV footprint in tokens: the last step's prompt + completion as the backend reported them,
    #: or a characters/4 estimate until the first usage arrives.
    total_tokens: int = 0
    tool_finished: bool = False
    acting_since: float | None = None
    last_activity: float = 0.0
    in_flight: int = 0
    marked_for_pause: bool = False
    #: Tool (acting) time that preceded the step now running, for the step's audit row.
    last_tool_s: float | None = None
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    cached_tokens_total: int = 0
    usage_missing_steps: int = 0
    #: Learned from the backend's usage; turns a new request's characters into a token estimate.
    chars_per_token: float = 4.0
    #: Scheduling (tr): since when the program is paused, and since when a request of it waits.
    paused_since: float | None = None
    waiting_since: float | None = None
    #: After a forced resume the program may not be paused again before this time.
    protected_until: float = 0.0
    #: Calls of it held back while others of it are in flight: each would be one more context
    #: on its backend, and goes out when it fits (scheduling/scheduler.py).
    held_calls: int = 0
    #: Held calls let go because they fit, not yet begun: contexts already, as if in flight.
    granted_calls: int = 0
    #: When its calls that ended while others of it ran ended: their contexts stay in the
    #: engine's cache for the program's next calls, which take them over one by one.
    ended_contexts: list[float] = field(default_factory=list)
    #: The configured client whose calls it is (``[clients]``); None without clients.
    client: str | None = None
    #: How its first call was recognised (recognition's Source value); None if not told.
    source: str | None = None
    #: Its latency class (scheduling/classes.py), set by the scheduler from its calls.
    program_class: str | None = None
    #: The longest tool (acting) time it has shown between two calls.
    longest_tool_s: float = 0.0
    #: Acting, and silent for longer than its tool gaps explain (``ending.py``): counted as
    #: released for capacity until a call of it comes back. Set and cleared by the registry.
    presumed_ended: bool = False

    def _move(self, to: ProgramStatus, reason: str, now: float) -> Transition:
        transition = Transition(
            program_id=self.program_id,
            from_status=self.status,
            to_status=to,
            reason=reason,
            backend=self.backend,
            step=self.step_count,
            at=now,
        )
        self.status = to
        return transition


def create(
    program_id: str,
    now: float,
    *,
    status: ProgramStatus = ProgramStatus.REASONING,
    reason: str = "first request",
    source: str | None = None,
) -> tuple[Program, Transition]:
    """A program seen for the first time: REASONING (its first call is going out) or, when the
    scheduler queues it at admission, PAUSED."""
    program = Program(
        program_id=program_id, created_at=now, last_activity=now, status=status, source=source
    )
    if status is ProgramStatus.PAUSED:
        program.paused_since = now
    return program, Transition(program_id, None, status, reason, None, 0, now, source)


def begin_step(
    program: Program, now: float, *, context_chars: int, arrived_at: float | None = None
) -> list[Transition]:
    """A new LLM call of this program is about to be sent (after any pause it waited through).

    ``arrived_at`` is when the call reached the proxy; tool time ends there, not after a pause.
    """
    transitions = []
    if program.status is ProgramStatus.ACTING:
        program.tool_finished = True
        tool_end = now if arrived_at is None else arrived_at
        since = program.acting_since
        program.last_tool_s = None if since is None else max(0.0, tool_end - since)
        if program.last_tool_s is not None:
            program.longest_tool_s = max(program.longest_tool_s, program.last_tool_s)
        transitions.append(program._move(ProgramStatus.REASONING, "tool finished", now))
    elif program.status is ProgramStatus.PAUSED:
        raise ValueError(f"program {program.program_id!r} is paused; resume it before a step")
    elif program.status is ProgramStatus.STOPPED:
        raise ValueError(f"program {program.program_id!r} is stopped")
    else:
        program.last_tool_s = None
    program.in_flight += 1
    program.step_count += 1
    program.acting_since = None
    program.last_activity = now
    program.context_len = context_chars
    # The new prompt holds the whole context so far plus the tool's output: estimate its tokens
    # from its characters until the backend reports the real count at the end of the step.
    program.total_tokens = max(program.total_tokens, int(context_chars / program.chars_per_token))
    return transitions


def end_step(program: Program, now: float, usage: StepUsage, *, reason: str) -> list[Transition]:
    """One LLM call of this program ended, in any way: success, error or disconnect."""
    program.in_flight = max(0, program.in_flight - 1)
    program.last_activity = now
    if usage.known:
        assert usage.prompt_tokens is not None
        completion = usage.completion_tokens or 0
        program.total_tokens = usage.prompt_tokens + completion
        program.prompt_tokens_total += usage.prompt_tokens
        program.completion_tokens_total += completion
        program.cached_tokens_total += usage.cached_tokens or 0
        if program.context_len and usage.prompt_tokens:
            program.chars_per_token = max(0.5, program.context_len / usage.prompt_tokens)
    else:
        program.usage_missing_steps += 1
    if program.in_flight or program.status is not ProgramStatus.REASONING:
        return []
    program.acting_since = now
    program.tool_finished = False
    return [program._move(ProgramStatus.ACTING, reason, now)]


def pause(program: Program, now: float, *, reason: str) -> Transition:
    program.marked_for_pause = False
    program.paused_since = now
    return program._move(ProgramStatus.PAUSED, reason, now)


def resume(program: Program, now: float, *, backend: str | None, reason: str) -> Transition:
    """Back from PAUSED to ACTING (its tool may still run); its next call may then go out."""
    program.backend = backend
    program.paused_since = None
    return program._move(ProgramStatus.ACTING, reason, now)


def stop(program: Program, now: float, *, reason: str) -> Transition:
    program.in_flight = 0
    program.last_activity = now
    return program._move(ProgramStatus.STOPPED, reason, now)
