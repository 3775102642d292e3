"""Program recognition: the order of sources, each client's identifiers, the off switches,
previous_response_id chains, prefix continuation (interleaved tasks never merge), and memory."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from werkzeug.datastructures import Headers

from thunderproxy.errors import InvalidRequest
from thunderproxy.protocols import ChatTap, MessagesTap, Protocol, ResponsesTap, chain_elements
from thunderproxy.protocols.recognition import (
    DEFAULT_PROGRAM,
    ProgramRecognizer,
    Recognised,
    RecognitionConfig,
    Source,
    claude_code_session,
    without_program_id,
)

from .streams import chat_events, messages_events, responses_events

SYSTEM = "You are a coding agent. Use the tools to solve the task."
SESSION_UUID = "5d2c1c5e-8f0a-4f5e-9a53-3b1f7c0d2e11"


def recognizer(**switches: Any) -> ProgramRecognizer:
    return ProgramRecognizer(RecognitionConfig(**switches), salt=b"test")


# --- the order of sources ----------------------------------------------------------------------

#: A Responses request that carries every identifier at once; each source removed in turn must
#: hand over to the next one in the documented order.
EVERYTHING_BODY = {
    "program_id": "task-1",
    "input": "hi",
    "previous_response_id": "resp_known",
    "prompt_cache_key": "conv-7",
    "user": "alice",
    "litellm_session_id": "ll-body",
}
EVERYTHING_HEADERS = {
    "X-Session-ID": "ta-session",
    "X-Claude-Code-Session-Id": SESSION_UUID,
    "session-id": "codex-uuid",
}
ORDER = [
    (Source.EXPLICIT, "task-1", "explicit"),
    (Source.SESSION_HEADER, "ta-session", "session_header"),
    (Source.CLAUDE_CODE, f"claude-code:{SESSION_UUID}", "claude_code"),
    (Source.CODEX, "codex:codex-uuid", "codex"),
    (Source.LITELLM, "litellm:ll-body", "litellm"),
    (Source.PREVIOUS_RESPONSE, "earlier-program", "previous_response"),
    (Source.PROMPT_CACHE_KEY, "cache-key:conv-7", "prompt_cache_key"),
    (Source.USER, "user:alice", "user"),
]


@pytest.mark.parametrize("position", range(len(ORDER)), ids=[s.value for s, _, _ in ORDER])
def test_sources_are_tried_in_the_documented_order(position: int) -> None:
    switches = {flag: False for _, _, flag in ORDER[:position]}
    switches.setdefault("user", True)
    r = recognizer(**switches)
    r.remember_response("resp_known", "earlier-program", now=0.0)
    found = r.recognise(Protocol.RESPONSES, EVERYTHING_BODY, EVERYTHING_HEADERS, now=1.0)
    source, program_id, _ = ORDER[position]
    assert found == Recognised(program_id, source)


def test_with_every_named_source_off_the_prompt_decides() -> None:
    switches = {flag: False for _, _, flag in ORDER}
    found = recognizer(**switches).recognise(
        Protocol.RESPONSES, EVERYTHING_BODY, EVERYTHING_HEADERS, now=1.0
    )
    assert found.source is Source.NEW
    assert found.program_id.startswith("auto-")


def test_without_prefix_tracking_unnamed_calls_share_the_default_program() -> None:
    found = recognizer(prefix=False).recognise(
        Protocol.CHAT, {"messages": [{"role": "user", "content": "hi"}]}, {}, now=0.0
    )
    assert found == Recognised(DEFAULT_PROGRAM, Source.DEFAULT)


def test_user_is_off_by_default_because_it_names_a_person_not_a_task() -> None:
    assert not RecognitionConfig().user
    found = recognizer().recognise(Protocol.CHAT, chat_request(["hi"], user="alice"), {}, now=0.0)
    assert found.source is Source.NEW


@pytest.mark.parametrize(
    ("body", "header"),
    [
        pytest.param(
            {"program_id": "from-body", "extra_body": {"program_id": "x"}}, "y", id="body"
        ),
        pytest.param({"extra_body": {"program_id": "from-extra"}}, "y", id="extra_body"),
        pytest.param({}, "from-header", id="header"),
    ],
)
def test_explicit_program_id_sources_in_order(body: dict[str, Any], header: str) -> None:
    found = recognizer().recognise(
        Protocol.CHAT, {"messages": [], **body}, {"x-program-id": header}, now=0.0
    )
    assert found.source is Source.EXPLICIT
    assert found.program_id.startswith("from-")


@pytest.mark.parametrize("bad", [5, "", "   ", "x" * 257])
def test_a_malformed_explicit_program_id_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidRequest, match="program_id"):
        recognizer().recognise(Protocol.CHAT, {"program_id": bad, "messages": []}, {}, now=0.0)


def test_program_id_is_stripped_before_forwarding() -> None:
    body = {"program_id": "p", "extra_body": {"program_id": "p"}, "messages": []}
    assert without_program_id(body) == {"messages": []}
    kept = {"extra_body": {"program_id": "p", "top_k": 3}}
    assert without_program_id(kept) == {"extra_body": {"top_k": 3}}
    assert body["program_id"] == "p"  # the client's body is not changed


# --- what real clients send --------------------------------------------------------------------


@pytest.mark.parametrize(
    "user_id",
    [
        pytest.param(
            f"user_{'ab' * 32}_account_{'1' * 8}-aaaa-bbbb-cccc-{'2' * 12}_session_{SESSION_UUID}",
            id="legacy",
        ),
        pytest.param(f"user_{'ab' * 32}_account__session_{SESSION_UUID}", id="legacy-no-account"),
        pytest.param(
            json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SESSION_UUID}),
            id="json-string",
        ),
        pytest.param({"session_id": SESSION_UUID}, id="object"),
    ],
)
def test_claude_code_session_from_metadata_user_id(user_id: Any) -> None:
    assert claude_code_session(user_id) == SESSION_UUID
    body = anthropic_request(["hi"]) | {"metadata": {"user_id": user_id}}
    found = recognizer().recognise(Protocol.MESSAGES, body, {}, now=0.0)
    assert found == Recognised(f"claude-code:{SESSION_UUID}", Source.CLAUDE_CODE)


@pytest.mark.parametrize("user_id", ["alice", "user_123", '{"device_id": "x"}', "{not json"])
def test_a_user_id_without_a_session_names_no_program(user_id: str) -> None:
    assert claude_code_session(user_id) is None


def test_a_claude_code_subagent_is_a_program_of_its_own() -> None:
    headers = {"X-Claude-Code-Session-Id": SESSION_UUID, "X-Claude-Code-Agent-Id": "agent-3"}
    found = recognizer().recognise(Protocol.MESSAGES, anthropic_request(["hi"]), headers, now=0.0)
    assert found == Recognised(f"claude-code:{SESSION_UUID}/agent-3", Source.CLAUDE_CODE)


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        pytest.param({}, {"X-LiteLLM-Session-Id": "s1"}, id="header"),
        pytest.param({"litellm_session_id": "s1"}, {}, id="body"),
        pytest.param({"metadata": {"litellm_session_id": "s1"}}, {}, id="metadata"),
    ],
)
def test_litellm_session_ids(body: dict[str, Any], headers: dict[str, str]) -> None:
    found = recognizer().recognise(Protocol.CHAT, chat_request(["hi"]) | body, headers, now=0.0)
    assert found == Recognised("litellm:s1", Source.LITELLM)


@pytest.mark.parametrize("name", ["session-id", "session_id"])
def test_codex_session_header(name: str) -> None:
    found = recognizer().recognise(Protocol.RESPONSES, {"input": "hi"}, {name: "u-1"}, now=0.0)
    assert found == Recognised("codex:u-1", Source.CODEX)


def test_a_client_id_too_long_for_a_program_id_is_hashed_not_cut() -> None:
    r = recognizer()
    a = r.recognise(Protocol.CHAT, chat_request(["x"], prompt_cache_key="k" * 300 + "a"), {}, 0.0)
    b = r.recognise(Protocol.CHAT, chat_request(["x"], prompt_cache_key="k" * 300 + "b"), {}, 0.0)
    assert a.source is Source.PROMPT_CACHE_KEY
    assert len(a.program_id) < 64
    assert a.program_id != b.program_id


def test_unprintable_client_ids_are_ignored() -> None:
    found = recognizer().recognise(
        Protocol.CHAT, chat_request(["hi"]), {"x-session-id": "a\x00b"}, 0.0
    )
    assert found.source is Source.NEW


# --- previous_response_id chains ---------------------------------------------------------------


def test_a_previous_response_id_chain_stays_one_program() -> None:
    r = recognizer()
    first = r.recognise(Protocol.RESPONSES, {"input": "Fix the bug."}, {}, now=0.0)
    assert first.source is Source.NEW
    r.remember_response("resp_1", first.program_id, now=1.0)
    for turn in range(2, 6):
        body = {"input": f"tool output {turn}", "previous_response_id": f"resp_{turn - 1}"}
        found = r.recognise(Protocol.RESPONSES, body, {}, now=float(turn))
        assert found == Recognised(first.program_id, Source.PREVIOUS_RESPONSE)
        r.remember_response(f"resp_{turn}", found.program_id, now=float(turn))


def test_an_unknown_previous_response_falls_through() -> None:
    body = {"input": "more", "previous_response_id": "resp_from_before_a_restart"}
    assert recognizer().recognise(Protocol.RESPONSES, body, {}, now=0.0).source is Source.NEW


def test_the_response_map_is_bounded() -> None:
    r = recognizer(max_responses=3)
    for i in range(10):
        r.remember_response(f"resp_{i}", f"p{i}", now=float(i))
    assert r.tracked_responses == 3
    old = {"input": "x", "previous_response_id": "resp_0"}
    new = {"input": "x", "previous_response_id": "resp_9"}
    assert r.recognise(Protocol.RESPONSES, old, {}, now=10.0).source is Source.NEW
    assert r.recognise(Protocol.RESPONSES, new, {}, now=10.0).program_id == "p9"


# --- prefix continuation -----------------------------------------------------------------------


def chat_request(users: list[str], **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}] + [
        {"role": "user", "content": u} for u in users
    ]
    return {"model": "m", "messages": messages, **extra}


def anthropic_request(users: list[str]) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 100,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": u} for u in users],
    }


class ChatAgent:
    """A chat agent as clients write them: each turn resends the history with the answer it got
    (arguments re-serialised, as SDKs do) and the tool's output."""

    def __init__(self, task: str) -> None:
        self.task = task
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task},
        ]

    def request(self) -> dict[str, Any]:
        return {"model": "m", "messages": list(self.messages), "stream": True}

    def answer(self, turn: int) -> dict[str, Any]:
        arguments = json.dumps({"path": f"{self.task}-{turn}.py", "lines": [1, 2]})
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "read", "arguments": arguments},
        }
        return {"role": "assistant", "content": f"Reading file {turn}.", "tool_calls": [call]}

    def continue_with(self, answer: dict[str, Any], turn: int) -> None:
        echoed = json.loads(json.dumps(answer))
        for call in echoed.get("tool_calls", []):
            args = json.loads(call["function"]["arguments"])
            call["function"]["arguments"] = json.dumps(dict(reversed(args.items())), indent=1)
        echoed["content"] = echoed["content"] + "\n"  # some clients keep a trailing newline
        self.messages.append(echoed)
        self.messages.append(
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"output {turn}"}
        )


def test_interleaved_tasks_with_one_system_prompt_never_merge() -> None:
    r = recognizer()
    rng = random.Random(7)
    agents = [ChatAgent(f"task number {i}") for i in range(8)]
    programs: dict[int, str] = {}
    turns = {i: 0 for i in range(len(agents))}
    now = 0.0
    for _ in range(80):
        i = rng.randrange(len(agents))
        agent = agents[i]
        now += 1.0
        found = r.recognise(Protocol.CHAT, agent.request(), {}, now)
        if i not in programs:
            assert found.source is Source.NEW
            programs[i] = found.program_id
        else:
            assert found == Recognised(programs[i], Source.PREFIX)
        answer = agent.answer(turns[i])
        r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), answer, now)
        agent.continue_with(answer, turns[i])
        turns[i] += 1
    assert len(set(programs.values())) == len(programs)
    assert r.tracked_heads == len(programs)


def test_samples_of_one_prompt_stay_apart_once_their_answers_differ() -> None:
    """Parallel rollouts send the very same first prompt; each is its own program."""
    r = recognizer()
    prompt = chat_request(["Solve it."])
    first = [r.recognise(Protocol.CHAT, prompt, {}, now=0.0) for _ in range(4)]
    assert len({f.program_id for f in first}) == 4
    for k, found in enumerate(first):
        r.observe_answer(found.program_id, Protocol.CHAT, prompt, f"attempt {k}", now=1.0)
    for k, found in enumerate(first):
        body = chat_request(["Solve it."])
        body["messages"] += [
            {"role": "assistant", "content": f"attempt {k}"},
            {"role": "user", "content": "go on"},
        ]
        assert r.recognise(Protocol.CHAT, body, {}, now=2.0) == Recognised(
            found.program_id, Source.PREFIX
        )


def test_a_retry_after_a_failure_continues_the_program() -> None:
    r = recognizer()
    agent = ChatAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    answer = agent.answer(0)
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), answer, 1.0)
    agent.continue_with(answer, 0)
    # The next call fails (nothing observed) and is sent again: same program both times.
    for now in (2.0, 3.0):
        assert r.recognise(Protocol.CHAT, agent.request(), {}, now).program_id == found.program_id


def test_a_streamed_chat_answer_continues_like_the_client_echoes_it() -> None:
    r = recognizer()
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "Read a.py."}],
        "stream": True,
    }
    found = r.recognise(Protocol.CHAT, request, {}, 0.0)
    tap = ChatTap(hide_usage_chunk=True, collect_answer=True)
    for event in chat_events():
        tap.feed(event)
    r.observe_answer(found.program_id, Protocol.CHAT, request, tap.answer(), 1.0)
    echoed = {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read_file", "arguments": '{"path":"a.py"}'},
            }
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}
    follow = {**request, "messages": request["messages"] + [echoed, tool]}
    assert r.recognise(Protocol.CHAT, follow, {}, 2.0) == Recognised(
        found.program_id, Source.PREFIX
    )


def test_claude_code_turns_continue_despite_its_per_request_noise() -> None:
    """The billing header changes every call, cache_control moves to the newest block, and
    thinking blocks come and go: none of that is the conversation."""
    r = recognizer(claude_code=False)

    def request(turn: int, history: list[dict[str, Any]]) -> dict[str, Any]:
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1; cch={turn:08x};",
            },
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ]
        messages = json.loads(json.dumps(history))
        messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        return {"model": "m", "max_tokens": 100, "system": system, "messages": messages}

    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Read a.py."}]}
    ]
    found = r.recognise(Protocol.MESSAGES, request(0, history), {}, 0.0)
    tap = MessagesTap(collect_answer=True)
    for event in messages_events():
        tap.feed(event)
    r.observe_answer(found.program_id, Protocol.MESSAGES, request(0, history), tap.answer(), 1.0)
    answer = tap.answer()
    answer["content"].insert(0, {"type": "thinking", "thinking": "hmm", "signature": "s"})
    history += [
        answer,
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"}],
        },
    ]
    assert r.recognise(Protocol.MESSAGES, request(1, history), {}, 2.0) == Recognised(
        found.program_id, Source.PREFIX
    )


def test_responses_without_previous_response_id_continue_by_prefix() -> None:
    r = recognizer()
    request = {
        "model": "m",
        "instructions": SYSTEM,
        "input": [{"role": "user", "content": "Read a.py."}],
    }
    found = r.recognise(Protocol.RESPONSES, request, {}, 0.0)
    tap = ResponsesTap()
    for event in responses_events():
        tap.feed(event)
    r.observe_answer(found.program_id, Protocol.RESPONSES, request, tap.answer(), 1.0)
    echoed = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "read_file",
            "arguments": '{"path":"a.py"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"},
    ]
    follow = {**request, "input": request["input"] + echoed}
    assert r.recognise(Protocol.RESPONSES, follow, {}, 2.0) == Recognised(
        found.program_id, Source.PREFIX
    )


def test_a_different_answer_in_the_history_is_a_different_program() -> None:
    r = recognizer()
    agent = ChatAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), agent.answer(0), 1.0)
    agent.continue_with(agent.answer(1), 0)  # not what the model said
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 2.0).source is Source.NEW


def test_only_the_latest_head_of_a_program_is_kept() -> None:
    r = recognizer()
    agent = ChatAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    early = agent.request()
    r.observe_answer(found.program_id, Protocol.CHAT, early, agent.answer(0), 1.0)
    agent.continue_with(agent.answer(0), 0)
    stale = {**agent.request()}
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), agent.answer(1), 2.0)
    assert r.tracked_heads == 1
    assert r.recognise(Protocol.CHAT, stale, {}, 3.0).source is Source.NEW


def test_heads_are_bounded_least_recently_used_first() -> None:
    r = recognizer(max_heads=5)
    agents = [ChatAgent(f"task {i}") for i in range(12)]
    programs = []
    for i, agent in enumerate(agents):
        found = r.recognise(Protocol.CHAT, agent.request(), {}, float(i))
        r.observe_answer(
            found.program_id, Protocol.CHAT, agent.request(), agent.answer(0), float(i)
        )
        agent.continue_with(agent.answer(0), 0)
        programs.append(found.program_id)
    assert r.tracked_heads == 5
    assert r.recognise(Protocol.CHAT, agents[0].request(), {}, 20.0).source is Source.NEW
    assert r.recognise(Protocol.CHAT, agents[-1].request(), {}, 20.0).program_id == programs[-1]


def test_heads_unused_past_their_lifetime_no_longer_match() -> None:
    r = recognizer(head_ttl_s=60.0)
    agent = ChatAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), agent.answer(0), 0.0)
    agent.continue_with(agent.answer(0), 0)
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 59.0).source is Source.PREFIX
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 120.0).source is Source.NEW
    assert r.tracked_heads == 0


def test_forget_drops_a_released_program() -> None:
    r = recognizer()
    agent = ChatAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), agent.answer(0), 0.0)
    r.forget(found.program_id)
    assert r.tracked_heads == 0


def test_prefix_switched_off_learns_nothing() -> None:
    r = recognizer(prefix=False)
    agent = ChatAgent("t")
    r.observe_answer("p", Protocol.CHAT, agent.request(), agent.answer(0), 0.0)
    assert r.tracked_heads == 0


def test_config_refuses_bounds_that_would_disable_tracking_silently() -> None:
    with pytest.raises(ValueError, match="max_heads"):
        RecognitionConfig(max_heads=0)
    assert replace(RecognitionConfig(), prefix=False).max_heads > 0


def test_request_headers_of_the_web_framework_are_read_in_any_case() -> None:
    headers = Headers([("X-CLAUDE-CODE-SESSION-ID", SESSION_UUID)])
    found = recognizer().recognise(Protocol.MESSAGES, anthropic_request(["hi"]), headers, 0.0)
    assert found.source is Source.CLAUDE_CODE


def test_only_calls_tied_by_their_prompt_need_their_answer_observed() -> None:
    assert Recognised("auto-1", Source.NEW).by_prompt
    assert Recognised("p", Source.PREFIX).by_prompt
    assert not Recognised("p", Source.EXPLICIT).by_prompt
    assert not Recognised("default", Source.DEFAULT).by_prompt


def test_a_stateless_previous_response_is_not_a_whole_prompt() -> None:
    r = recognizer()
    body = {"input": [{"role": "user", "content": "more"}], "previous_response": {"id": "r"}}
    r.observe_answer("p", Protocol.RESPONSES, body, "ok", 0.0)
    assert r.tracked_heads == 0


def test_recognising_hashes_each_byte_of_the_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice the history costs twice the hashing, not four times: links are chained, never
    recomputed from the start."""
    from thunderproxy.protocols import recognition

    hashed = 0
    real = recognition._digest

    def counting(data: bytes) -> bytes:
        nonlocal hashed
        hashed += len(data)
        return real(data)

    monkeypatch.setattr(recognition, "_digest", counting)

    def cost(turns: int) -> int:
        nonlocal hashed
        agent = ChatAgent("t")
        for turn in range(turns):
            agent.continue_with(agent.answer(turn), turn)
        hashed = 0
        recognizer().recognise(Protocol.CHAT, agent.request(), {}, 0.0)
        return hashed

    assert cost(200) <= 2.1 * cost(100)


def test_a_response_without_an_id_is_not_remembered() -> None:
    r = recognizer()
    r.remember_response(None, "p", 0.0)
    r.remember_response("", "p", 0.0)
    assert r.tracked_responses == 0


def test_tool_calls_match_by_id_whatever_their_arguments_became() -> None:
    """Cut off at max_tokens, a tool call's input is not valid JSON; each SDK echoes its own
    reading of it (the Python SDK sends {}). The id, which the client must send back, decides."""
    r = recognizer()
    request = anthropic_request(["Run the tests."])
    found = r.recognise(Protocol.MESSAGES, request, {}, 0.0)
    truncated = {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_9", "name": "bash", "input": '{"command": "pyt'}
        ],
    }
    r.observe_answer(found.program_id, Protocol.MESSAGES, request, truncated, 1.0)
    echoed = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_9", "name": "bash", "input": {}}],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}],
    }
    follow = {**request, "messages": request["messages"] + [echoed, result]}
    assert r.recognise(Protocol.MESSAGES, follow, {}, 2.0) == Recognised(
        found.program_id, Source.PREFIX
    )


def test_without_ids_tool_calls_match_by_their_arguments_as_values() -> None:
    def with_call(arguments: str) -> dict[str, Any]:
        call = {"type": "function", "function": {"name": "ls", "arguments": arguments}}
        return chat_request(["x"]) | {"messages": [{"role": "assistant", "tool_calls": [call]}]}

    same = chain_elements(Protocol.CHAT, with_call('{"a": 1, "b": [2]}'))
    assert chain_elements(Protocol.CHAT, with_call('{"b":[2],"a":1}')) == same
    assert chain_elements(Protocol.CHAT, with_call('{"a": 2, "b": [2]}')) != same


@settings(max_examples=60, deadline=None)
@given(
    tasks=st.integers(min_value=2, max_value=6),
    order=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=40),
    same_task=st.booleans(),
)
def test_no_interleaving_ever_merges_two_agents(
    tasks: int, order: list[int], same_task: bool
) -> None:
    """Any order of turns; with ``same_task`` every agent even starts from the very same
    messages (parallel samples), so only the answers tell them apart."""
    r = recognizer()
    agents = [ChatAgent("one task" if same_task else f"task {i}") for i in range(tasks)]
    programs: dict[int, str] = {}
    turns = dict.fromkeys(range(tasks), 0)
    for now, pick in enumerate(order):
        i = pick % tasks
        agent = agents[i]
        found = r.recognise(Protocol.CHAT, agent.request(), {}, float(now))
        if i in programs:
            assert found == Recognised(programs[i], Source.PREFIX)
        else:
            assert found.source is Source.NEW
            assert found.program_id not in programs.values()
            programs[i] = found.program_id
        answer = agent.answer(turns[i])
        answer["tool_calls"][0]["id"] += f"-{i}"  # the server gives every call its own id
        r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), answer, float(now))
        agent.continue_with(answer, turns[i])
        turns[i] += 1


# --- prompt continuation: the answer dropped ---------------------------------------------------


class DroppingAgent(ChatAgent):
    """mini-swe-agent's way: a reply without a tool call is dropped from the history and a user
    message saying so is appended, so the next prompt continues the previous *prompt*."""

    def drop(self, turn: int) -> None:
        self.messages.append({"role": "user", "content": f"Tool call error {turn}: no tool call."})


def test_a_prompt_continued_without_its_answer_joins_its_program() -> None:
    r = recognizer()
    agent = DroppingAgent("fix the bug")
    first = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    answer = agent.answer(0)
    r.observe_answer(first.program_id, Protocol.CHAT, agent.request(), answer, 1.0)
    agent.continue_with(answer, 0)
    second = r.recognise(Protocol.CHAT, agent.request(), {}, 2.0)
    assert second == Recognised(first.program_id, Source.PREFIX)
    assert second.matched == len(agent.messages) - 1
    prompt = agent.request()
    r.observe_answer(second.program_id, Protocol.CHAT, prompt, "I think it is fixed.", 3.0)
    agent.drop(1)  # that reply had no tool call
    third = r.recognise(Protocol.CHAT, agent.request(), {}, 4.0)
    assert third == Recognised(first.program_id, Source.PROMPT_PREFIX)
    assert third.matched == len(prompt["messages"])
    assert third.by_prompt
    # Twice in a row, and then back to ordinary turns: still the one program.
    r.observe_answer(third.program_id, Protocol.CHAT, agent.request(), "Done.", 5.0)
    agent.drop(2)
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 6.0).program_id == first.program_id
    answer = agent.answer(3)
    r.observe_answer(first.program_id, Protocol.CHAT, agent.request(), answer, 7.0)
    agent.continue_with(answer, 3)
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 8.0) == Recognised(
        first.program_id, Source.PREFIX
    )


def test_the_same_prompt_again_is_not_a_continuation() -> None:
    """A request equal to a program's last prompt (a parallel sample) extends nothing."""
    r = recognizer()
    prompt = chat_request(["Solve it."])
    first = r.recognise(Protocol.CHAT, prompt, {}, 0.0)
    r.observe_answer(first.program_id, Protocol.CHAT, prompt, "an answer", 1.0)
    again = r.recognise(Protocol.CHAT, prompt, {}, 2.0)
    assert again.source is Source.NEW
    assert again.program_id != first.program_id


def test_a_prompt_two_programs_sent_last_names_neither() -> None:
    r = recognizer()
    prompt = chat_request(["Solve it."])
    samples = [r.recognise(Protocol.CHAT, prompt, {}, 0.0) for _ in range(2)]
    for k, found in enumerate(samples):
        r.observe_answer(found.program_id, Protocol.CHAT, prompt, f"attempt {k}", 1.0)
    dropped = chat_request(["Solve it.", "Tool call error: no tool call."])
    found = r.recognise(Protocol.CHAT, dropped, {}, 2.0)
    assert found.source is Source.NEW
    assert found.program_id not in {s.program_id for s in samples}


def test_another_task_with_the_same_system_prompt_does_not_join() -> None:
    r = recognizer()
    a = chat_request(["task A"])
    found = r.recognise(Protocol.CHAT, a, {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, a, "no tool call", 1.0)
    other = r.recognise(Protocol.CHAT, chat_request(["task B", "more"]), {}, 2.0)
    assert other.source is Source.NEW


def test_a_prompt_of_one_element_is_never_continued_without_its_answer() -> None:
    r = recognizer()
    alone = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}]}
    found = r.recognise(Protocol.CHAT, alone, {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, alone, "hello", 1.0)
    assert r.recognise(Protocol.CHAT, chat_request(["any task"]), {}, 2.0).source is Source.NEW


def test_a_dropped_answer_after_the_lifetime_no_longer_matches() -> None:
    r = recognizer(head_ttl_s=10.0)
    agent = DroppingAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), "no tool", 1.0)
    agent.drop(0)
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 20.0).source is Source.NEW


def test_forget_drops_the_last_prompt_too() -> None:
    r = recognizer()
    agent = DroppingAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), "no tool", 1.0)
    r.forget(found.program_id)
    agent.drop(0)
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 2.0).source is Source.NEW


@settings(max_examples=60, deadline=None)
@given(
    tasks=st.integers(min_value=2, max_value=6),
    order=st.lists(
        st.tuples(st.integers(min_value=0, max_value=5), st.booleans()), min_size=1, max_size=40
    ),
    same_task=st.booleans(),
)
def test_agents_that_drop_answers_are_never_merged(
    tasks: int, order: list[tuple[int, bool]], same_task: bool
) -> None:
    """Any order of turns, any reply dropped. Distinct tasks always stay their own program; runs
    of one task may be split where their prompts cannot tell them apart, never merged."""
    r = recognizer()
    agents = [DroppingAgent("one task" if same_task else f"task {i}") for i in range(tasks)]
    programs: dict[int, str] = {}
    owner: dict[str, int] = {}
    turns = dict.fromkeys(range(tasks), 0)
    for now, (pick, dropped) in enumerate(order):
        i = pick % tasks
        agent = agents[i]
        found = r.recognise(Protocol.CHAT, agent.request(), {}, float(now))
        assert owner.setdefault(found.program_id, i) == i, "two agents merged"
        if i in programs and not same_task:
            assert found.program_id == programs[i]
        programs[i] = found.program_id
        answer = agent.answer(turns[i])
        answer["tool_calls"][0]["id"] += f"-{i}"
        if dropped:
            answer = {"role": "assistant", "content": f"no tool call {i}-{turns[i]}"}
        r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), answer, float(now))
        if dropped:
            agent.drop(turns[i])
        else:
            agent.continue_with(answer, turns[i])
        turns[i] += 1


def test_another_answer_in_place_of_the_dropped_one_is_a_fork_not_a_continuation() -> None:
    r = recognizer()
    prompt = chat_request(["Solve it."])
    found = r.recognise(Protocol.CHAT, prompt, {}, 0.0)
    r.observe_answer(found.program_id, Protocol.CHAT, prompt, "what the model said", 1.0)
    fork = chat_request(["Solve it."])
    fork["messages"] += [
        {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "go on"},
    ]
    assert r.recognise(Protocol.CHAT, fork, {}, 2.0).source is Source.NEW


@pytest.mark.parametrize("protocol", [Protocol.MESSAGES, Protocol.RESPONSES])
def test_dropped_answers_are_followed_on_messages_and_responses(protocol: Protocol) -> None:
    r = recognizer()
    if protocol is Protocol.MESSAGES:
        prompt: dict[str, Any] = anthropic_request(["Solve it."])
        dropped = anthropic_request(["Solve it.", "Tool call error: no tool call."])
    else:
        prompt = {"model": "m", "instructions": SYSTEM, "input": [_item("Solve it.")]}
        dropped = prompt | {"input": [_item("Solve it."), _item("Tool call error.")]}
    found = r.recognise(protocol, prompt, {}, 0.0)
    r.observe_answer(found.program_id, protocol, prompt, "no tool call here", 1.0)
    assert r.recognise(protocol, dropped, {}, 2.0) == Recognised(
        found.program_id, Source.PROMPT_PREFIX
    )


def _item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def test_past_a_prompt_two_programs_share_no_shorter_prompt_is_tried() -> None:
    """Two runs of one task reach the same prompt; a third run's first prompt is shorter. A
    request extending the shared prompt names none of them (found by the property test)."""
    r = recognizer()
    task = chat_request(["Solve it."])
    dropped = chat_request(["Solve it.", "Tool call error 0."])
    first, second = (r.recognise(Protocol.CHAT, task, {}, 0.0) for _ in range(2))
    for found in (first, second):
        r.observe_answer(found.program_id, Protocol.CHAT, task, "no tool call", 1.0)
        assert r.recognise(Protocol.CHAT, dropped, {}, 2.0).program_id == found.program_id
        r.observe_answer(found.program_id, Protocol.CHAT, dropped, "no tool call", 3.0)
    third = r.recognise(Protocol.CHAT, task, {}, 4.0)
    r.observe_answer(third.program_id, Protocol.CHAT, task, "an answer", 5.0)
    further = chat_request(["Solve it.", "Tool call error 0.", "Tool call error 1."])
    assert r.recognise(Protocol.CHAT, further, {}, 6.0).source is Source.NEW


# --- a newest message edited: aider's reminder ---------------------------------------------------

#: aider 0.86's formatting reminder, appended to the newest user message (models whose settings
#: say reminder "user", the default), paragraphs apart.
REMINDER = "# *SEARCH/REPLACE block* Rules:\n\nEvery block starts with the path.\n\nNo other text."
#: The pair aider sends for the files in the chat; it follows the done turns, so on each turn it
#: moves behind the newest answer.
FILES = [
    {"role": "user", "content": "I am not sharing any files that you can edit yet."},
    {"role": "assistant", "content": "Ok."},
]


class AiderAgent:
    """aider's chat as it sends it (``format_chat_chunks``): system prompt, done turns, the files
    pair, the newest user message with the reminder; the next turn drops the reminder."""

    def __init__(self, task: str) -> None:
        self.done: list[dict[str, Any]] = []
        self.current = task

    def request(self) -> dict[str, Any]:
        newest = {"role": "user", "content": f"{self.current}\n\n{REMINDER}"}
        messages = [{"role": "system", "content": SYSTEM}, *self.done, *FILES, newest]
        return {"model": "m", "messages": messages, "stream": True}

    def continue_with(self, answer: dict[str, Any], turn: int) -> None:
        self.done += [{"role": "user", "content": self.current}, answer]
        self.current = f"Now do step {turn + 1}."


def test_an_aider_chat_is_one_program_though_each_turn_edits_the_last() -> None:
    """Two turns (and a third) of one aider chat: each prompt drops the reminder from the
    previous newest message and moves the files pair behind the answer (was: a program a
    turn)."""
    r = recognizer()
    agent = AiderAgent("Add a docstring to main.py.")
    first = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    assert first.source is Source.NEW
    for turn in range(3):
        answer = {"role": "assistant", "content": f"Here is step {turn}."}
        r.observe_answer(first.program_id, Protocol.CHAT, agent.request(), answer, turn + 0.5)
        agent.continue_with(answer, turn)
        found = r.recognise(Protocol.CHAT, agent.request(), {}, turn + 1.0)
        assert found == Recognised(first.program_id, Source.EDITED_PREFIX)
        assert found.by_prompt
        # The history up to the edited message, the message and the answer.
        assert found.matched == 1 + 2 * turn + 2


def test_an_edit_is_only_paragraphs_added_or_taken_off_the_end() -> None:
    r = recognizer()
    agent = AiderAgent("Add a docstring to main.py.")
    first = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    answer = {"role": "assistant", "content": "Done."}
    r.observe_answer(first.program_id, Protocol.CHAT, agent.request(), answer, 1.0)
    for newest, joins in [
        ("Add a docstring to main.py.", True),  # the reminder dropped
        (f"Add a docstring to main.py.\n\n{REMINDER}\n\nAnd tests.", True),  # one more
        ("Add a docstring to util.py.", False),  # another question
        ("Add a docstring", False),  # cut mid-paragraph
    ]:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": newest},
            answer,
            {"role": "user", "content": "Go on."},
        ]
        found = r.recognise(Protocol.CHAT, {"model": "m", "messages": messages}, {}, 2.0)
        assert (found.program_id == first.program_id) is joins, newest


def test_two_chats_that_gave_the_same_answer_to_the_same_history_name_neither() -> None:
    r = recognizer()
    chats = [AiderAgent("Same question."), AiderAgent("Same question.")]
    found = [r.recognise(Protocol.CHAT, c.request(), {}, 0.0) for c in chats]
    answer = {"role": "assistant", "content": "Same answer."}
    for chat, f in zip(chats, found, strict=True):
        r.observe_answer(f.program_id, Protocol.CHAT, chat.request(), answer, 1.0)
        chat.continue_with(answer, 0)
    again = r.recognise(Protocol.CHAT, chats[0].request(), {}, 2.0)
    assert again.source is Source.NEW
    assert again.program_id not in {f.program_id for f in found}


def test_forget_drops_the_edit_too() -> None:
    r = recognizer()
    agent = AiderAgent("t")
    found = r.recognise(Protocol.CHAT, agent.request(), {}, 0.0)
    answer = {"role": "assistant", "content": "a"}
    r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), answer, 1.0)
    r.forget(found.program_id)
    agent.continue_with(answer, 0)
    assert r.recognise(Protocol.CHAT, agent.request(), {}, 2.0).source is Source.NEW


@settings(max_examples=80, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["aider", "chat", "dropping"]), min_size=2, max_size=6),
    order=st.lists(
        st.tuples(st.integers(min_value=0, max_value=5), st.booleans()), min_size=1, max_size=40
    ),
    same_task=st.booleans(),
)
def test_agents_that_edit_their_newest_message_are_never_merged(
    kinds: list[str], order: list[tuple[int, bool]], same_task: bool
) -> None:
    """aider chats beside chat agents and agents that drop answers, all with one system prompt
    and, with ``same_task``, one first question: any interleaving, any reply dropped. No two
    agents ever share a program; an aider chat is always one program, and so is every agent of
    a task of its own."""
    r = recognizer()
    task = "one task"
    agents: list[Any] = []
    for i, kind in enumerate(kinds):
        text = task if same_task else f"task {i}"
        agents.append(
            AiderAgent(text)
            if kind == "aider"
            else DroppingAgent(text)
            if kind == "dropping"
            else ChatAgent(text)
        )
    programs: dict[int, str] = {}
    owner: dict[str, int] = {}
    turns = dict.fromkeys(range(len(agents)), 0)
    for now, (pick, dropped) in enumerate(order):
        i = pick % len(agents)
        agent = agents[i]
        found = r.recognise(Protocol.CHAT, agent.request(), {}, float(now))
        assert owner.setdefault(found.program_id, i) == i, "two agents merged"
        if i in programs and (kinds[i] == "aider" or not same_task):
            assert found.program_id == programs[i], (kinds[i], found)
        programs[i] = found.program_id
        if isinstance(agent, AiderAgent):
            answer: dict[str, Any] = {"role": "assistant", "content": f"Answer {turns[i]} of {i}."}
        else:
            answer = agent.answer(turns[i])
            answer["tool_calls"][0]["id"] += f"-{i}"
            if dropped and isinstance(agent, DroppingAgent):
                answer = {"role": "assistant", "content": f"no tool call {i}-{turns[i]}"}
        r.observe_answer(found.program_id, Protocol.CHAT, agent.request(), answer, float(now))
        if isinstance(agent, DroppingAgent) and dropped:
            agent.drop(turns[i])
        else:
            agent.continue_with(answer, turns[i])
        turns[i] += 1
