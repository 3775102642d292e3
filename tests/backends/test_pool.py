"""Model groups: which backends a call for a model may go to."""

from __future__ import annotations

import pytest

from thunderproxy.backends import BackendPool
from thunderproxy.backends.base import UpstreamRequest
from thunderproxy.backends.pool import MAX_CACHED_ROUTES
from thunderproxy.errors import ModelNotFound


class Unused:
    async def send(self, request: UpstreamRequest) -> None:
        raise AssertionError("routing never sends")


def pool() -> BackendPool:
    p = BackendPool(aliases={"coder": ["qwen-32b", "qwen-8b"], "ghost": ["nowhere"]})
    p.attach("http://a", Unused(), models=["qwen-32b"])
    p.attach("http://b", Unused(), models=["qwen-8b", "llama-8b"])
    p.attach("http://c", Unused(), models=["llama-8b"])
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
    p.attach("http://x", Unused())
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
    p.attach("http://d", Unused(), models=["llama-8b"])
    assert p.route("llama-8b").urls == {"http://b", "http://d"}
    replaced = p.attach("http://d", Unused(), models=["llama-8b"])  # the same name, a new node
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
    p.attach("http://x", Unused())  # serves any name until its models are known
    for i in range(3 * MAX_CACHED_ROUTES):
        assert p.route(f"model-{i}").served == f"model-{i}"
    assert len(p._groups) <= MAX_CACHED_ROUTES
