"""Workloads made up from a seed rather than read from a trace, for the shapes of traffic the
shipped traces do not have: LLM councils (``--trace council``) and one-shot calls from clients
that name no program (``--trace oneshot``). Pure: a seed in, a :class:`Workload` out.

Programs of a workload are independent of each other (the bench has no way to make one wait
for another), so a council's stages are timed rather than joined: a member's review is sent
when the slowest member's answer would have ended on an idle engine, or when its own answer
ended, whichever is later; the chairman arrives when the slowest review would have ended.
"""

from __future__ import annotations

import hashlib

from .workload import (
    SCHEMA_TOKENS,
    ProgramSpec,
    StepSpec,
    Workload,
    _program_rng,
    poisson_arrivals,
)

#: Seconds per decoded token of one call alone on the engine (the glm45-swe profile decodes a
#: lone short call at about 40 tokens/s): only used to time a council's stages.
IDLE_DECODE_S = 0.025
#: Tokens of the council's instructions that every member's and the chairman's prompt starts with.
COUNCIL_SYSTEM_TOKENS = 600
#: Tokens of the instructions appended for the peer review, and for the chairman.
REVIEW_TOKENS = 150
CHAIRMAN_TOKENS = 200

COUNCILS = 48
#: Mean seconds between two councils' questions (Poisson).
COUNCIL_SPACING_S = 5.0
ONESHOT_CALLS = 400
#: One-shot calls per simulated second (Poisson).
ONESHOT_RATE = 1.0

SYNTHETIC = ("council", "oneshot")


def council(
    *, councils: int = COUNCILS, spacing_s: float = COUNCIL_SPACING_S, seed: int = 0
) -> Workload:
    """``councils`` councils, each 3 or 4 members and a chairman, asked at Poisson times.

    Every member is a program of two calls: its answer to the question, then its review of
    every answer (its own prompt, its answer, the others' answers and the review instructions:
    the prompt extends what it sent before, so its cache is worth keeping between the two).
    The chairman is a program of one call whose prompt holds every answer and review."""
    rng = _program_rng(seed, "council")
    starts = poisson_arrivals(councils, 1.0 / spacing_s, seed)
    programs: list[ProgramSpec] = []
    for k, start in enumerate(starts):
        members = rng.choice((3, 4))
        question = rng.randint(80, 400)
        answers = [rng.randint(250, 900) for _ in range(members)]
        reviews = [rng.randint(150, 450) for _ in range(members)]
        first = COUNCIL_SYSTEM_TOKENS + question
        review_at = max(answers) * IDLE_DECODE_S
        for i in range(members):
            others = sum(answers) - answers[i]
            steps = (
                StepSpec(prompt_tokens=first, output_tokens=answers[i], at_s=0.0),
                StepSpec(
                    prompt_tokens=first + answers[i] + others + REVIEW_TOKENS,
                    output_tokens=reviews[i],
                    at_s=review_at,
                ),
            )
            programs.append(ProgramSpec(f"council:{k}:member{i}", steps, arrival_s=start))
        chairman_at = start + review_at + max(reviews) * IDLE_DECODE_S
        prompt = first + sum(answers) + sum(reviews) + CHAIRMAN_TOKENS
        chairman = StepSpec(prompt_tokens=prompt, output_tokens=rng.randint(500, 1200), at_s=0.0)
        programs.append(ProgramSpec(f"council:{k}:chairman", (chairman,), arrival_s=chairman_at))
    programs.sort(key=lambda p: (p.arrival_s, p.program_id))
    notes = (
        f"council (synthetic, seed {seed}): {councils} councils of 3 or 4 members and a "
        f"chairman, questions at Poisson times {spacing_s:g} s apart on average",
        "member = program of two calls (answer; review of every answer, extending its own "
        "prompt); chairman = program of one call over every answer and review",
        f"stages are timed, not joined: reviews go when the slowest answer would have ended "
        f"alone ({IDLE_DECODE_S * 1000:.0f} ms a token) or when the member's own answer ended, "
        "whichever is later; the chairman when the slowest review would have",
        f"shared prefix = the council's {COUNCIL_SYSTEM_TOKENS} instruction tokens",
    )
    return Workload(
        name="council",
        programs=tuple(programs),
        system_tokens=COUNCIL_SYSTEM_TOKENS,
        natural_arrivals="trace",
        notes=notes,
    )


def oneshot(*, calls: int = ONESHOT_CALLS, rate: float = ONESHOT_RATE, seed: int = 0) -> Workload:
    """``calls`` single calls at Poisson times from clients that send no program id: each is a
    program of its own (the proxy's recognition names it ``auto-<hash>``) that nobody
    releases, so the proxy learns it ended from its idle lease alone."""
    rng = _program_rng(seed, "oneshot")
    starts = poisson_arrivals(calls, rate, seed)
    programs = []
    for n, start in enumerate(starts):
        # Mostly short questions, a few long documents: prompt lengths spread over 30x.
        fresh = int(min(24_000, 300 * rng.lognormvariate(1.2, 0.9)))
        digest = hashlib.blake2b(f"oneshot:{seed}:{n}".encode(), digest_size=6).hexdigest()
        step = StepSpec(
            prompt_tokens=SCHEMA_TOKENS + fresh,
            output_tokens=rng.randint(40, 700),
            at_s=0.0,
        )
        programs.append(ProgramSpec(f"auto-{digest}", (step,), arrival_s=start))
    notes = (
        f"one-shot traffic (synthetic, seed {seed}): {calls} single calls at Poisson times, "
        f"{rate:g} a second, none naming a program: each is a new auto program, never released",
        f"prompt = a {SCHEMA_TOKENS}-token system prompt every call shares + a fresh question "
        "(log-normal, median about 1,000 tokens, at most 24,000)",
    )
    return Workload(
        name="oneshot",
        programs=tuple(programs),
        system_tokens=SCHEMA_TOKENS,
        natural_arrivals="trace",
        notes=notes,
    )


def synthetic(name: str, *, seed: int) -> Workload:
    if name == "council":
        return council(seed=seed)
    if name == "oneshot":
        return oneshot(seed=seed)
    raise ValueError(f"no synthetic workload named {name!r} (one of {', '.join(SYNTHETIC)})")
