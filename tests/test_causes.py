"""CauseLog, pure: which refusals the log tells, on times passed in."""

from __future__ import annotations

from thunderproxy.causes import MAX_DETAILS, CauseLog, Told


def test_the_first_of_a_cause_is_told_at_once_then_a_minute_later_with_the_count() -> None:
    log = CauseLog()
    assert log.note("model", "a", 0.0) == Told("model", 1, None, (("a", 1),))
    assert [log.note("model", name, t) for t, name in ((10.0, "a"), (20.0, "b"), (59.9, "a"))] == [
        None
    ] * 3
    told = log.note("model", "b", 61.0)
    assert told == Told("model", 4, 61.0, (("a", 2), ("b", 2)))
    # The next minute starts from that line.
    assert log.note("model", "a", 100.0) is None
    assert log.note("model", "a", 121.0) == Told("model", 2, 60.0, (("a", 2),))


def test_causes_are_told_apart() -> None:
    log = CauseLog()
    assert log.note("one", "x", 0.0) is not None
    assert log.note("two", "x", 1.0) is not None
    assert log.note("one", "x", 2.0) is None


def test_memory_is_bounded_in_causes_and_details() -> None:
    log = CauseLog(max_causes=3)
    for i in range(10):
        assert log.note(i, "x", float(i)) is not None
    assert log.note(9, "x", 9.5) is None  # still remembered
    assert log.note(0, "x", 9.5) is not None  # forgotten: told again, as new
    many = CauseLog()
    many.note("c", "first", 0.0)
    for i in range(100):
        many.note("c", f"name {i}", 1.0)
    told = many.note("c", "name 0", 61.0)
    assert told is not None
    assert told.count == 101
    assert len(told.details) == MAX_DETAILS
