"""The council's pure parts: ranking parsing, aggregation, anonymized labels, histories."""

from __future__ import annotations

import pytest

from thunderproxy.council import deliberation
from thunderproxy.council.deliberation import MemberAnswer, MemberRanking, Standing, Turn

LABELS = ["Response A", "Response B", "Response C"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "A is fine.\nB is better.\n\nFINAL RANKING:\n1. Response B\n2. Response C\n"
            "3. Response A",
            ("Response B", "Response C", "Response A"),
            id="numbered",
        ),
        pytest.param(
            "FINAL RANKING:\n1) **Response C**\n2) Response A.\n3) Response B",
            ("Response C", "Response A", "Response B"),
            id="parenthesis-and-bold",
        ),
        pytest.param(
            "Response A is first in my eyes. FINAL RANKING: Response C, then Response A, "
            "then Response B",
            ("Response C", "Response A", "Response B"),
            id="header-without-numbers",
        ),
        pytest.param(
            "Example:\nFINAL RANKING:\n1. Response A\n\nMy answer:\nFINAL RANKING:\n"
            "1. Response B\n2. Response A",
            ("Response B", "Response A"),
            id="last-header-wins",
        ),
        pytest.param(
            "final ranking:\n1. Response C\n2. Response B",
            ("Response C", "Response B"),
            id="header-in-lower-case",
        ),
        pytest.param(
            "I prefer Response B over Response A, and Response B over Response C.",
            ("Response B", "Response A", "Response C"),
            id="no-header-first-mentions",
        ),
        pytest.param(
            "FINAL RANKING:\n1. Response B\n2. Response B\n3. Response Q\n4. Response A",
            ("Response B", "Response A"),
            id="repeats-and-unknown-labels-dropped",
        ),
        pytest.param(
            "FINAL RANKING: 1. Response C (beats Response A) 2. Response B 3. Response A",
            ("Response C", "Response B", "Response A"),
            id="numbered-on-one-line-with-asides",
        ),
        pytest.param("No opinion at all.", (), id="nothing"),
    ],
)
def test_rankings_are_parsed_from_the_formats_models_write(
    text: str, expected: tuple[str, ...]
) -> None:
    assert deliberation.parse_ranking(text, known=LABELS) == expected


def test_anonymize_labels_answers_in_order_and_keeps_the_mapping() -> None:
    answers = [MemberAnswer("m1", "one"), MemberAnswer("m2", "two"), MemberAnswer("m3", "3")]
    label_to_model, text = deliberation.anonymize(answers)
    assert label_to_model == {"Response A": "m1", "Response B": "m2", "Response C": "m3"}
    assert text == "Response A:\none\n\nResponse B:\ntwo\n\nResponse C:\n3"
    assert "m1" not in text
    with pytest.raises(ValueError, match="at most 26"):
        deliberation.anonymize([MemberAnswer(f"m{i}", "x") for i in range(27)])


def test_the_stage2_prompt_asks_for_the_parseable_format() -> None:
    prompt = deliberation.stage2_prompt("Why?", "Response A:\nx")
    assert "Question: Why?" in prompt
    assert "FINAL RANKING:" in prompt
    assert '"1. Response A"' in prompt


def test_aggregate_averages_positions_and_counts_first_places() -> None:
    label_to_model = {"Response A": "m1", "Response B": "m2", "Response C": "m3"}
    rankings = [
        MemberRanking("m1", "", ("Response B", "Response A", "Response C")),
        MemberRanking("m2", "", ("Response B", "Response C", "Response A")),
        MemberRanking("m3", "", ("Response A", "Response B")),  # left Response C out
        MemberRanking("m4", "", ("Response Z",)),  # a label nobody had
    ]
    assert deliberation.aggregate(rankings, label_to_model) == [
        Standing("m2", 1.33, 3, 2),
        Standing("m1", 2.0, 3, 1),
        Standing("m3", 2.5, 2, 0),
    ]
    assert deliberation.aggregate([], label_to_model) == []


def test_ties_are_broken_by_first_places_then_name() -> None:
    label_to_model = {"Response A": "m1", "Response B": "m2"}
    rankings = [
        MemberRanking("x", "", ("Response A", "Response B")),
        MemberRanking("y", "", ("Response B", "Response A")),
    ]
    assert [s.model for s in deliberation.aggregate(rankings, label_to_model)] == ["m1", "m2"]


def test_histories_give_each_member_its_own_earlier_answers() -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {
            "role": "assistant",
            "stage1": [{"model": "m1", "response": "m1 said"}],
            "stage3": {"model": "m1", "response": "final 1"},
        },
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "stage1": None, "stage3": None, "status": "error"},
    ]
    turns = deliberation.turns_from_messages(messages)
    assert turns == [Turn("Q1", {"m1": "m1 said"}, "final 1")]
    assert deliberation.stage1_history(turns, "m1", "Q3") == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "m1 said"},
        {"role": "user", "content": "Q3"},
    ]
    # A member that did not answer then sees the council's final answer instead.
    assert deliberation.stage1_history(turns, "m2", "Q3")[1]["content"] == "final 1"
    assert deliberation.stage3_history(turns, "PROMPT")[-2:] == [
        {"role": "assistant", "content": "final 1"},
        {"role": "user", "content": "PROMPT"},
    ]


@pytest.mark.parametrize(
    ("raw", "title"),
    [
        ('"Why The Sky Is Blue."', "Why The Sky Is Blue"),
        ("Title: Rust vs Go\nBecause...", "Rust vs Go"),
        ("", "New conversation"),
        ("x" * 80, "x" * 59 + "…"),
    ],
)
def test_titles_are_cleaned_to_one_short_line(raw: str, title: str) -> None:
    assert deliberation.clean_title(raw) == title
