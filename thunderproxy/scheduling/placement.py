"""Backend placement, pure: sticky to the program's backend while it is healthy, otherwise the
least-loaded healthy backend (fewest active tokens, then fewest programs, then list order)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    url: str
    healthy: bool
    active_tokens: int
    programs: int


def choose_backend(current: str | None, candidates: Sequence[Candidate]) -> str | None:
    """The backend a program should use, or None when no backend is healthy."""
    healthy = [c for c in candidates if c.healthy]
    if current is not None and any(c.url == current for c in healthy):
        return current
    if not healthy:
        return None
    order = {c.url: i for i, c in enumerate(candidates)}
    return min(healthy, key=lambda c: (c.active_tokens, c.programs, order[c.url])).url
