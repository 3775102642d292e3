"""Placement within a group, pure: sticky while healthy, else the least loaded."""

from __future__ import annotations

from thunderproxy.scheduling.placement import Candidate, choose_backend


def test_sticky_while_healthy() -> None:
    candidates = [Candidate("a", True, 900, 9), Candidate("b", True, 0, 0)]
    assert choose_backend("a", candidates) == "a"


def test_least_active_tokens_then_fewest_programs_then_list_order() -> None:
    assert choose_backend(None, [Candidate("a", True, 5, 1), Candidate("b", True, 4, 9)]) == "b"
    assert choose_backend(None, [Candidate("a", True, 4, 2), Candidate("b", True, 4, 1)]) == "b"
    assert choose_backend(None, [Candidate("a", True, 4, 1), Candidate("b", True, 4, 1)]) == "a"


def test_an_unhealthy_current_backend_is_left_and_none_when_all_are_down() -> None:
    candidates = [Candidate("a", False, 0, 0), Candidate("b", True, 100, 3)]
    assert choose_backend("a", candidates) == "b"
    assert choose_backend("a", [Candidate("a", False, 0, 0)]) is None
