"""Model groups: which backends a call for a model may go to."""

from __future__ import annotations

import logging

import pytest

from thunderproxy.backends import BackendPool
from thunderproxy.backends.mock import MockBackend
from thunderproxy.backends.pool import MAX_CACHED_ROUTES
from thunderproxy.errors import ModelNotFound


def pool() -> BackendPool:
    p = BackendPool(aliases={"coder": ["qwen-32b", "qwen-8b"], "ghost": ["nowhere"]})
    p.attach("http://a", MockBackend(), models=["qwen-32b"])
    p.attach("http://b", MockBackend(), models=["qwen-8b", "llama-8b"])
    p.attach("http://c", MockBackend(), models=["llama-8b"])
    return p


def test_a_served_name_goes_to_the_nodes_that_serve_it() -> None:
    route = pool().route("llama-8b")
    assert route.served == "llama-8b"
    assert route.urls == {"http://b", "http://c"}


def test_an_alias_takes_its_first_target_with_a_healthy_node() -> None:
    p = pool()
    assert p.route("coder").served == "qwen-32b"
    p.get("http://a").health.down("test")  # type: ignore[union-attr]
    route = p.route("coder")
    assert (route.served, route.urls) == ("qwen-8b", {"http://b"})


def test_an_alias_with_no_healthy_target_still_names_its_first() -> None:
    p = pool()
    for node in p:
        node.health.down("test")
    assert p.route("coder").served == "qwen-32b"


def test_an_unknown_model_lists_what_is_served() -> None:
    with pytest.raises(ModelNotFound) as caught:
        pool().route("gpt-9")
    assert "llama-8b, qwen-32b, qwen-8b, coder" in caught.value.message
    with pytest.raises(ModelNotFound):
        pool().route("ghost")  # an alias whose targets nobody serves


def test_before_its_models_are_known_a_node_serves_anything() -> None:
    p = BackendPool()
    p.attach("http://x", MockBackend())
    assert p.route("anything").urls == {"http://x"}
    assert p.route(None).urls == {"http://x"}


def test_served_models_are_the_union_over_healthy_nodes_and_their_aliases() -> None:
    p = pool()
    p.get("http://a").health.down("test")  # type: ignore[union-attr]
    assert p.served_models() == ["llama-8b", "qwen-8b", "coder"]


def test_a_model_resolved_before_follows_the_nodes_and_what_they_serve() -> None:
    # Each call resolves its model; what was resolved before must not outlive a change.
    p = pool()
    assert p.route("llama-8b").urls == {"http://b", "http://c"}
    node = p.get("http://c")
    assert node is not None
    node.models = frozenset({"qwen-8b"})  # as the poller replaces them
    assert p.route("llama-8b").urls == {"http://b"}
    assert p.route("qwen-8b").urls == {"http://b", "http://c"}
    p.attach("http://d", MockBackend(), models=["llama-8b"])
    assert p.route("llama-8b").urls == {"http://b", "http://d"}
    replaced = p.attach("http://d", MockBackend(), models=["llama-8b"])  # the same name, a new node
    assert replaced in p.route("llama-8b").nodes
    node.models = frozenset()
    with pytest.raises(ModelNotFound):
        p.route("nothing-serves-this")
    # An alias's choice still follows health on every call.
    assert p.route("coder").served == "qwen-32b"
    p.get("http://a").health.down("test")  # type: ignore[union-attr]
    assert p.route("coder").served == "qwen-8b"
    p.get("http://a").health.ok()  # type: ignore[union-attr]
    assert p.route("coder").served == "qwen-32b"


def test_names_made_up_by_clients_do_not_grow_the_resolved_set_without_bound() -> None:
    p = BackendPool()
    p.attach("http://x", MockBackend())  # serves any name until its models are known
    for i in range(3 * MAX_CACHED_ROUTES):
        assert p.route(f"model-{i}").served == f"model-{i}"
    assert len(p._groups) <= MAX_CACHED_ROUTES


# --- names nothing serves: alias patterns, default_model, the only model served ----------------


def test_an_alias_pattern_takes_names_nothing_serves_most_specific_first() -> None:
    p = BackendPool(
        aliases={"claude-*": ["llama-8b"], "claude-3-*": ["qwen-32b"], "coder": ["qwen-8b"]}
    )
    p.attach("http://a", MockBackend(), models=["qwen-32b", "qwen-8b", "llama-8b"])
    opus = p.route("claude-opus-4-8")
    assert (opus.requested, opus.served, opus.fallback) == (
        "claude-opus-4-8",
        "llama-8b",
        "alias 'claude-*'",
    )
    assert p.route("claude-3-haiku").served == "qwen-32b"
    # A served name and an exact alias are never taken by a pattern.
    assert p.route("llama-8b").fallback is None
    assert p.route("coder").served == "qwen-8b"
    # A pattern is no model: /v1/models does not list it.
    assert "claude-*" not in p.served_models()
    with pytest.raises(ModelNotFound):
        p.route("gpt-9")


def test_default_model_takes_every_name_nothing_serves(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "thunderproxy.backends")
    p = BackendPool(default_model="qwen-8b")
    p.attach("http://a", MockBackend(), models=["qwen-32b", "qwen-8b"])
    for _ in range(3):
        route = p.route("claude-opus-4-8")
        assert (route.served, route.fallback) == ("qwen-8b", "default_model")
    p.route("gpt-9")
    assert p.route("qwen-32b").served == "qwen-32b"
    told = [r.getMessage() for r in caplog.records if r.name == "thunderproxy.backends"]
    # One line per name, however many calls: it says where the name goes and how to change it.
    assert len(told) == 2, told
    assert "'claude-opus-4-8' is served by no backend; its calls go to 'qwen-8b'" in told[0]
    assert "--default-model" in told[0]
    assert "'gpt-9'" in told[1]
    assert p.unknown_names_go_to() == ("qwen-8b", "default_model")


def test_with_one_model_served_and_nothing_set_unknown_names_go_to_it() -> None:
    p = BackendPool()
    p.attach("http://a", MockBackend(), models=["qwen3-coder"])
    p.attach("http://b", MockBackend(), models=["qwen3-coder"])
    assert p.unknown_names_go_to() == ("qwen3-coder", "the only model served")
    route = p.route("claude-haiku-4-5")
    assert (route.served, route.fallback, route.urls) == (
        "qwen3-coder",
        "the only model served",
        {"http://a", "http://b"},
    )
    # Two models: which one a made-up name meant is not the proxy's guess.
    p.attach("http://c", MockBackend(), models=["llama-8b"])
    assert p.unknown_names_go_to() is None
    with pytest.raises(ModelNotFound) as caught:
        p.route("claude-haiku-4-5")
    assert "--default-model" in caught.value.message


def test_default_model_none_refuses_names_nothing_serves_even_with_one_model() -> None:
    p = BackendPool(default_model="none")
    p.attach("http://a", MockBackend(), models=["qwen3-coder"])
    assert p.unknown_names_go_to() is None
    with pytest.raises(ModelNotFound):
        p.route("claude-opus-4-8")
