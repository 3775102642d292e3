"""Workloads: recorded agentic traces turned into programs the bench replays, pure.

A :class:`Workload` is a list of :class:`ProgramSpec`, each a list of :class:`StepSpec` (one LLM
call: the prompt it must have, how many tokens it decodes, and the tool or think time before
it). Builders take already-parsed rows, so they run without files; ``load_workload`` in
``traces.py`` reads the files and picks the builder.

How each trace maps (and what is imputed) is written down in ``Workload.notes``, which the
bench prints and stores with every result:

- ThunderAgent SWE-agent calls: a program per ``program_id``, its steps in ``step`` order; the
  prompt of step *k* is the recorded ``input_tokens`` plus a shared tool-schema block (the trace
  leaves it out); the decode length is ``output_tokens`` plus the tool-call arguments, sampled
  from the recorded estimates where the trace has none; the tool gap is ``gap_after_s``. Two
  optional fields describe the prompts' shape where a trace knows it: ``shared_prefix_tokens``
  (the head of every prompt all programs share, counted in ``input_tokens``) and
  ``carry_answer`` (whether, or which fraction of, the call's answer the next prompt carries).
- Mooncake traces with reconstructed sessions: a program per session; each request's prompt is
  the trace's 512-token ``hash_ids`` blocks (equal ids, equal tokens), so prefix sharing is the
  trace's own; turns are sent at their recorded time or when the previous turn ended, whichever
  is later.
- A thunderproxy audit db: a program per ``program_id`` of the ``steps`` table, prompts and
  decode lengths as the backend reported them, tool gaps from ``tool_s``.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: Tokens of the tool-schema block every SWE-agent prompt carries but ``input_tokens`` leaves
#: out (the trace's README: "a constant of the order of 1-2k tokens"); imputed as 1,500.
SCHEMA_TOKENS = 1_500
#: Tokens at the head of step 1 that every SWE-agent program shares (system prompt and the
#: fixed part of the task template). The shortest recorded step-1 prompt is 338 tokens, so the
#: shared part is at most that; 300 is used.
TEMPLATE_TOKENS = 300
#: Mooncake ``hash_ids`` blocks are this many tokens.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class StepSpec:
    """One LLM call of a program.

    ``prompt_tokens`` is the prompt length the call should have. For append-only programs the
    conversation grows to it by one new user message (tool output) after the previous answer;
    for block programs (``blocks`` set) the prompt is rebuilt from those blocks.
    """

    prompt_tokens: int
    output_tokens: int
    #: Tool or think time between the end of the previous call and this one (seconds).
    gap_before_s: float = 0.0
    #: Open-loop timing: the earliest send time, in seconds after the program arrived.
    at_s: float | None = None
    #: Block prompts (Mooncake): the ids of the prompt's blocks, ``block_tokens`` each.
    blocks: tuple[int, ...] | None = None
    #: Tokens of this call's answer that the next prompt carries, the last ones (a reasoning
    #: model's thinking comes first and is not sent back). None: the whole answer.
    carried_tokens: int | None = None

    @property
    def carried(self) -> int:
        return self.output_tokens if self.carried_tokens is None else self.carried_tokens


@dataclass(frozen=True)
class ProgramSpec:
    program_id: str
    steps: tuple[StepSpec, ...]
    #: Open-loop arrival, seconds after the workload starts (trace or Poisson arrivals).
    arrival_s: float = 0.0

    @property
    def context_tokens(self) -> int:
        """The most KV the program holds at once: its longest prompt plus that call's answer."""
        return max((s.prompt_tokens + s.output_tokens for s in self.steps), default=0)


@dataclass(frozen=True)
class Workload:
    name: str
    programs: tuple[ProgramSpec, ...]
    #: Tokens of the system message every append-only program starts with (shared prefix).
    system_tokens: int = 0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    #: Arrivals the trace was recorded with: "closed" (a worker pool) or "trace" (open loop).
    natural_arrivals: str = "closed"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def steps(self) -> int:
        return sum(len(p.steps) for p in self.programs)

    @property
    def max_context_tokens(self) -> int:
        return max((p.context_tokens for p in self.programs), default=0)

    def no_eviction_tokens(self) -> int:
        """KV that holds every token the workload ever computes, so nothing is ever evicted:
        the shared prefix once, each append-only program's whole context beyond it (plus every
        answer the next prompt does not carry whole: its KV is computed but never reused), and
        each distinct block of block prompts (plus the answers, likewise never reused)."""
        total = self.system_tokens
        blocks: set[int] = set()
        for program in self.programs:
            if program.steps and program.steps[0].blocks is not None:
                for step in program.steps:
                    blocks.update(step.blocks or ())
                    total += step.output_tokens
            else:
                total += max(0, program.context_tokens - self.system_tokens)
                total += sum(s.output_tokens for s in program.steps if s.carried < s.output_tokens)
        return total + len(blocks) * self.block_tokens

    def mean_context_tokens(self) -> float:
        """The KV footprint of one running program, averaged over its calls (call-weighted)."""
        sizes = [s.prompt_tokens + s.output_tokens for p in self.programs for s in p.steps]
        return statistics.fmean(sizes) if sizes else 0.0

    def sample(self, fraction: float, seed: int = 0) -> Workload:
        """A seeded random ``fraction`` of the programs, in their order: thins an open-loop
        trace's load while keeping its arrival pattern and its sessions whole."""
        if not 0 < fraction <= 1:
            raise ValueError("the sample fraction must be in (0, 1]")
        if fraction == 1:
            return self
        rng = _program_rng(seed, "sample")
        kept = tuple(p for p in self.programs if rng.random() < fraction)
        note = f"sample: {len(kept)} of {len(self.programs)} programs (fraction {fraction})"
        return replace(self, programs=kept, notes=(*self.notes, note))

    def reshape(
        self, *, shared_prefix_tokens: int | None = None, carry_answer: float | None = None
    ) -> Workload:
        """The same programs with another prompt shape, for every program of the workload:

        - ``shared_prefix_tokens``: the head every program's prompt shares (system prompt and
          tool schemas) has this many tokens; each prompt grows (or shrinks) by the difference
          with the recorded one, so what each program adds of its own is unchanged;
        - ``carry_answer``: the fraction of each answer's tokens the next prompt carries (0: none,
          as a reasoning model's thinking; 1: all). Each later prompt grows or shrinks by what
          the answers before it carry more or less than recorded; the decode lengths and the
          observations stay as recorded.

        Append-only programs only: block prompts (Mooncake) say themselves what they share."""
        if shared_prefix_tokens is None and carry_answer is None:
            return self
        if any(p.steps and p.steps[0].blocks is not None for p in self.programs):
            raise ValueError(
                f"{self.name} has block prompts, whose sharing is the trace's own; a shared "
                "prefix length or answer carry applies to append-only traces (ThunderAgent "
                "calls, audit dbs)."
            )
        if shared_prefix_tokens is not None and shared_prefix_tokens < 0:
            raise ValueError("the shared prefix must be >= 0 tokens")
        if carry_answer is not None and not 0 <= carry_answer <= 1:
            raise ValueError("the carried fraction of an answer must be in [0, 1]")
        grow = 0 if shared_prefix_tokens is None else shared_prefix_tokens - self.system_tokens
        programs = tuple(
            replace(p, steps=_reshape_steps(p.steps, grow, carry_answer)) for p in self.programs
        )
        notes = list(self.notes)
        if shared_prefix_tokens is not None:
            notes.append(
                f"shared prefix: {shared_prefix_tokens} tokens instead of {self.system_tokens}; "
                f"every prompt {'+' if grow >= 0 else '-'}{abs(grow)} tokens"
            )
        if carry_answer is not None:
            notes.append(
                f"answers carried into the next prompt: the last {carry_answer:g} of each "
                "answer's tokens; later prompts shrink by what is not carried"
            )
        return replace(
            self,
            programs=programs,
            system_tokens=self.system_tokens
            if shared_prefix_tokens is None
            else shared_prefix_tokens,
            notes=tuple(notes),
        )

    def subset(self, programs: int | None = None, max_steps: int | None = None) -> Workload:
        """The first ``programs`` programs, each cut to its first ``max_steps`` calls."""
        chosen = self.programs if programs is None else self.programs[:programs]
        if max_steps is not None:
            chosen = tuple(replace(p, steps=p.steps[:max_steps]) for p in chosen)
        notes = self.notes
        if programs is not None or max_steps is not None:
            cut = "" if max_steps is None else f", at most {max_steps} steps each"
            notes = (*notes, f"subset: {len(chosen)} programs{cut}")
        return replace(self, programs=tuple(chosen), notes=notes)


def _reshape_steps(
    steps: Sequence[StepSpec], grow: int, carry: float | None
) -> tuple[StepSpec, ...]:
    out = []
    dropped = 0  # answer tokens the reshaped history holds fewer than the recorded one
    for step in steps:
        carried = step.carried_tokens if carry is None else round(carry * step.output_tokens)
        out.append(
            replace(
                step,
                prompt_tokens=max(1, step.prompt_tokens + grow - dropped),
                carried_tokens=carried,
            )
        )
        if carried is not None:
            dropped += step.carried - carried
    return tuple(out)


def carried_fraction(value: Any) -> float:
    """A call's ``carry_answer`` field: true, false or a fraction of the answer's tokens."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    fraction = float(value)
    if not 0 <= fraction <= 1:
        raise ValueError(f"carry_answer must be true, false or a fraction in [0, 1], got {value!r}")
    return fraction


def _program_rng(seed: int, *key: object) -> random.Random:
    return random.Random(":".join(str(k) for k in (seed, *key)))


def thunderagent(
    rows: Iterable[Mapping[str, Any]],
    *,
    seed: int = 0,
    schema_tokens: int = SCHEMA_TOKENS,
    template_tokens: int = TEMPLATE_TOKENS,
    shuffle: bool = True,
) -> Workload:
    """The ThunderAgent SWE-agent calls file as programs (see the module docstring)."""
    by_program: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        by_program[str(row["program_id"])].append(row)
    shared = _recorded_shared_prefix(by_program.values())
    if shared is not None:
        # The trace says what its prompts share: input_tokens is the whole prompt, nothing
        # is imputed around it.
        schema_tokens, template_tokens = 0, shared
    known_args = sorted(
        int(r["tool_call_arg_tokens_est"])
        for calls in by_program.values()
        for r in calls
        if r.get("tool_call_arg_tokens_est") is not None
    )
    imputed = 0
    total = 0
    carried = 0
    programs = []
    for program_id, calls in by_program.items():
        calls = sorted(calls, key=lambda r: int(r["step"]))
        rng = _program_rng(seed, "args", program_id)
        steps = []
        gap = 0.0
        for call in calls:
            args = call.get("tool_call_arg_tokens_est")
            total += 1
            if args is None:
                # Sampled from the calls whose arguments were measured (48 programs): keeps
                # their skew (p50 26, p99 1.8k) rather than adding a flat 2.1x to every call.
                args = rng.choice(known_args) if known_args else 0
                imputed += 1
            decode = max(1, int(call["output_tokens"]) + int(args))
            carry = call.get("carry_answer")
            if carry is not None:
                carried += 1
            steps.append(
                StepSpec(
                    prompt_tokens=int(call["input_tokens"]) + schema_tokens,
                    output_tokens=decode,
                    gap_before_s=gap,
                    carried_tokens=None
                    if carry is None
                    else round(carried_fraction(carry) * decode),
                )
            )
            gap = float(call.get("gap_after_s") or 0.0)
        programs.append(ProgramSpec(program_id, tuple(steps)))
    if shuffle:
        # A seeded shuffle, so that "the first N programs" is a fair sample of the three runs
        # rather than the five bs1 programs followed by bs4's.
        _program_rng(seed, "order").shuffle(programs)
    shape: tuple[str, ...]
    if shared is None:
        shape = (
            f"prompt = input_tokens + {schema_tokens} tool-schema tokens (left out of the "
            "trace; imputed constant)",
            f"shared prefix = the {schema_tokens} schema tokens + the first {template_tokens} "
            "tokens of step 1 (every program's step 1 is >= 338 tokens)",
        )
    else:
        shape = (
            "prompt = input_tokens",
            f"shared prefix = {shared} tokens (the trace's shared_prefix_tokens)",
        )
    if carried:
        shape = (
            *shape,
            f"answers carried into the next prompt: as the trace's carry_answer says on "
            f"{carried} of {total} calls (the whole answer on the others)",
        )
    notes = (
        "ThunderAgent SWE-agent (GLM-4.5): program = program_id, steps in step order, "
        "append-only prompts",
        *shape,
        f"decode = output_tokens + tool-call argument tokens; {imputed} of {total} calls had "
        f"no estimate and drew one from the {len(known_args)} measured ones (seed {seed})",
        "tool gap before step k+1 = gap_after_s of step k; env_prepare_s is not replayed",
        f"program order: {'seeded shuffle' if shuffle else 'file order'} (seed {seed})",
    )
    return Workload(
        name="thunderagent",
        programs=tuple(programs),
        system_tokens=schema_tokens + template_tokens,
        natural_arrivals="closed",
        notes=notes,
    )


def _recorded_shared_prefix(programs: Iterable[Sequence[Mapping[str, Any]]]) -> int | None:
    """The ``shared_prefix_tokens`` a calls file gives: one value for the whole trace (a prefix
    shared across programs has one length), on every call or on none."""
    values = {r.get("shared_prefix_tokens") for calls in programs for r in calls}
    if values == {None}:
        return None
    if None in values or len(values) != 1:
        raise ValueError(
            "shared_prefix_tokens is the length of the prefix every program shares: give one "
            f"value on every call or leave it out (found {sorted(map(str, values))})."
        )
    shared = int(next(v for v in values if v is not None))
    if shared < 0:
        raise ValueError(f"shared_prefix_tokens must be >= 0, got {shared}")
    return shared


def mooncake(
    requests: Sequence[Mapping[str, Any]],
    sessions: Iterable[Mapping[str, Any]],
    *,
    name: str = "mooncake",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """A Mooncake trace with its reconstructed sessions: one program per session."""
    turns: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for row in sessions:
        turns[str(row["session_id"])].append((int(row["turn"]), int(row["idx"])))
    programs = []
    for session_id, members in turns.items():
        members.sort()
        first = requests[members[0][1]]
        start_s = float(first["timestamp"]) / 1000.0
        steps = []
        for _turn, idx in members:
            req = requests[idx]
            steps.append(
                StepSpec(
                    prompt_tokens=int(req["input_length"]),
                    output_tokens=max(1, int(req["output_length"])),
                    at_s=float(req["timestamp"]) / 1000.0 - start_s,
                    blocks=tuple(int(h) for h in req["hash_ids"]),
                )
            )
        programs.append(ProgramSpec(f"{name}/{session_id}", tuple(steps), arrival_s=start_s))
    programs.sort(key=lambda p: (p.arrival_s, p.program_id))
    multi = sum(1 for p in programs if len(p.steps) > 1)
    notes = (
        f"Mooncake {name}: program = reconstructed session ({len(programs)} sessions, "
        f"{multi} multi-turn), steps in turn order",
        f"prompt = the trace's hash_ids blocks of {block_tokens} tokens (equal id, equal "
        "tokens), cut to input_length: prefix sharing is the trace's own",
        "a turn is sent at its recorded time or when the previous turn ended, whichever is "
        "later; answers are not part of later prompts (the trace's blocks say what is)",
        "program order: arrival order; --programs N keeps the first N sessions to arrive",
    )
    return Workload(
        name=name,
        programs=tuple(programs),
        block_tokens=block_tokens,
        natural_arrivals="trace",
        notes=notes,
    )


def from_audit_steps(
    rows: Iterable[Mapping[str, Any]], *, name: str = "audit", min_new_tokens: int = 1
) -> Workload:
    """Programs rebuilt from an audit db's ``steps`` rows: "what if this history had run under
    other settings?". Only calls that succeeded and reported usage are replayed."""
    by_program: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("status") != 200 or row.get("prompt_tokens") is None:
            continue
        by_program[str(row["program_id"])].append(row)
    first_cached: list[int] = []
    programs = []
    origin = min(
        (float(r["arrived_at"]) for calls in by_program.values() for r in calls), default=0.0
    )
    for program_id, calls in by_program.items():
        calls = sorted(calls, key=lambda r: (int(r["step"]), float(r["arrived_at"])))
        if calls[0].get("cached_tokens") is not None and int(calls[0]["step"]) == 1:
            first_cached.append(int(calls[0]["cached_tokens"]))
        start = float(calls[0]["arrived_at"])
        steps = []
        for call in calls:
            tool = call.get("tool_s")
            steps.append(
                StepSpec(
                    prompt_tokens=max(min_new_tokens, int(call["prompt_tokens"])),
                    output_tokens=max(1, int(call.get("completion_tokens") or 1)),
                    gap_before_s=0.0 if tool is None else float(tool),
                )
            )
        programs.append(ProgramSpec(program_id, tuple(steps), arrival_s=start - origin))
    programs.sort(key=lambda p: (p.arrival_s, p.program_id))
    # What the backend reported as cached on first calls is the prefix programs share.
    shared = int(statistics.median(first_cached)) if first_cached else 0
    notes = (
        f"audit db replay: {len(programs)} programs from the steps table (status 200 with "
        "usage only), prompts and decode lengths as the backend reported them",
        f"shared prefix = median cached tokens of first calls = {shared} tokens",
        "tool gap before a call = its tool_s (the agent's own time, not the old latencies); "
        "trace arrivals start each program at its recorded first arrival",
    )
    return Workload(
        name=name,
        programs=tuple(programs),
        system_tokens=shared,
        natural_arrivals="trace",
        notes=notes,
    )


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival offsets of ``n`` programs from a Poisson process of ``rate_per_s``."""
    if rate_per_s <= 0:
        raise ValueError("the Poisson arrival rate must be > 0")
    rng = _program_rng(seed, "poisson")
    times = []
    now = 0.0
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate_per_s)
    return times
