"""``GET /programs`` in pages: limit, cursor, filters, and a cost that does not grow with the
number of programs tracked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import running_proxy
from thunderproxy.errors import InvalidRequest
from thunderproxy.http.readouts.listing import (
    MAX_LIMIT,
    SCAN_PER_ITEM,
    ProgramQuery,
    page,
    parse_query,
    view_status,
)
from thunderproxy.programs import Program, StepUsage
from thunderproxy.programs.registry import ProgramRegistry
from thunderproxy.sim import SimConfig, open_simulator


def registry_of(n: int) -> ProgramRegistry:
    registry = ProgramRegistry()
    for i in range(n):
        program, _ = registry.get_or_create(f"p{i}", float(i))
        program.backend = "http://a" if i % 2 else "http://b"
    return registry


def walk(registry: ProgramRegistry, query: ProgramQuery) -> list[str]:
    """Every id, following the cursor page by page."""
    ids: list[str] = []
    while True:
        found = page(registry, query)
        ids += [p.program_id for p in found.programs]
        if found.next_cursor is None:
            return ids
        query = dataclasses.replace(query, after=int(found.next_cursor))


def test_pages_cover_every_program_once_in_creation_order() -> None:
    registry = registry_of(25)
    assert walk(registry, ProgramQuery(limit=7)) == [f"p{i}" for i in range(25)]
    assert walk(registry, ProgramQuery(limit=25)) == [f"p{i}" for i in range(25)]


def test_releases_between_pages_neither_skip_nor_repeat_a_program() -> None:
    registry = registry_of(10)
    first = page(registry, ProgramQuery(limit=4))
    assert [p.program_id for p in first.programs] == ["p0", "p1", "p2", "p3"]
    # The program the cursor points at, and one before it, go away; one is added.
    registry.release("p3", 10.0)
    registry.release("p1", 10.0)
    registry.get_or_create("new", 11.0)
    assert first.next_cursor is not None
    rest = walk(registry, ProgramQuery(limit=4, after=int(first.next_cursor)))
    assert rest == ["p4", "p5", "p6", "p7", "p8", "p9", "new"]


def test_many_releases_compact_the_order_without_losing_a_program() -> None:
    registry = registry_of(1000)
    for i in range(0, 1000, 3):
        registry.release(f"p{i}", 2000.0)
    assert walk(registry, ProgramQuery(limit=64)) == [f"p{i}" for i in range(1000) if i % 3]


def test_filters_by_backend_and_state() -> None:
    registry = registry_of(20)
    usage = StepUsage(prompt_tokens=10, completion_tokens=2)
    registry.end_step(registry.get("p4"), 30.0, usage, reason="done")
    by_backend = walk(registry, ProgramQuery(limit=3, backend="http://a"))
    assert by_backend == [f"p{i}" for i in range(1, 20, 2)]
    assert walk(registry, ProgramQuery(limit=3, state="acting")) == ["p4"]
    assert len(walk(registry, ProgramQuery(limit=3, state="active"))) == 20
    assert len(walk(registry, ProgramQuery(limit=3, state="reasoning"))) == 19
    registry.get("p7").model = "llama"
    registry.get("p12").model = "llama"
    assert walk(registry, ProgramQuery(limit=1, model="llama")) == ["p7", "p12"]
    assert walk(registry, ProgramQuery(limit=1, model="llama", backend="http://b")) == ["p12"]


def test_a_finished_session_is_ended_once_presumed_so_not_acting_until_its_lease() -> None:
    """Acting and silent past 4 times its longest tool gap (at least 60 s): ``ended`` in the
    view and its filter, though its idle lease (600 s) keeps it tracked."""
    registry = registry_of(2)
    usage = StepUsage(prompt_tokens=10, completion_tokens=2)
    registry.end_step(registry.get("p0"), 1.0, usage, reason="done")
    registry.end_step(registry.get("p1"), 40.0, usage, reason="done")  # silent 21.5 s only
    assert [p.program_id for p in registry.presume_ended(61.5)] == ["p0"]
    assert view_status(registry.get("p0")) == "ended"
    assert view_status(registry.get("p1")) == "acting"
    assert walk(registry, ProgramQuery(state="ended")) == ["p0"]
    assert walk(registry, ProgramQuery(state="acting")) == ["p1"]
    assert len(walk(registry, ProgramQuery(state="active"))) == 2


@dataclass(frozen=True)
class CountingQuery(ProgramQuery):
    looked_at: list[str] | None = None

    def keeps(self, program: Program) -> bool:
        assert self.looked_at is not None
        self.looked_at.append(program.program_id)
        return super().keeps(program)


def test_a_page_looks_at_limit_programs_not_at_all_of_them() -> None:
    registry = registry_of(50_000)
    looked: list[str] = []
    cursor = page(registry, ProgramQuery(limit=40_000)).next_cursor
    assert cursor is not None
    found = page(registry, CountingQuery(limit=10, after=int(cursor), looked_at=looked))
    assert [p.program_id for p in found.programs] == [f"p{i}" for i in range(40_000, 40_010)]
    assert len(looked) == 10
    # A selective filter stops after a bounded scan and still names where to go on.
    looked.clear()
    none = page(registry, CountingQuery(limit=10, backend="nowhere", looked_at=looked))
    assert none.programs == []
    assert len(looked) == 10 * SCAN_PER_ITEM
    assert none.next_cursor == str(10 * SCAN_PER_ITEM - 1)


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": str(MAX_LIMIT + 1)}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"after": "p3"}, "after"),
        ({"state": "sleeping"}, "state"),
        # Before: ValueError out of int() past isdigit(), a 500.
        ({"after": "\u00b2"}, "after"),
        ({"after": "9" * 5000}, "after"),
        ({"after": str(2**63)}, "after"),
        ({"limit": "\u0663"}, "limit"),
    ],
)
def test_bad_parameters_are_refused_naming_them(args: dict[str, str], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_query(args)
    assert refused.value.param == param


async def test_programs_endpoint_pages_with_link_and_cursor_headers(tmp_path: Path) -> None:
    model = "meta-llama/Llama-3.1-8B-Instruct"
    async with (
        open_simulator(SimConfig(output_len_dist="fixed:2")) as sim,
        running_proxy(tmp_path / "audit.db", backends=sim.url, router="default") as proxy,
        httpx.AsyncClient(base_url=proxy.url) as client,
    ):
        for i in range(5):
            body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
            reply = await client.post(
                "/v1/chat/completions", json={**body, "program_id": f"prog-{i}"}
            )
            assert reply.status_code == 200
        everything = await client.get("/programs")
        assert list(everything.json()) == [f"prog-{i}" for i in range(5)]
        assert "link" not in everything.headers
        seen: list[str] = []
        url = "/programs?limit=2&state=acting"
        while True:
            response = await client.get(url)
            assert response.status_code == 200
            seen += list(response.json())
            if "x-next-cursor" not in response.headers:
                break
            link = response.headers["link"]
            assert link.endswith('>; rel="next"')
            assert f"after={response.headers['x-next-cursor']}" in link
            url = link[1 : link.index(">")]
            assert "state=acting" in url
        assert seen == [f"prog-{i}" for i in range(5)]
        by_model = await client.get("/programs", params={"model": model})
        assert list(by_model.json()) == [f"prog-{i}" for i in range(5)]
        assert (await client.get("/programs", params={"model": "other"})).json() == {}
        bad = await client.get("/programs?limit=0")
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "limit"
