"""Datasette mounted on the proxy's own port: pages, static files, canned queries as Datasette
answers them, read-only, the access hook, and the proxy's own routes untouched."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest
import trio

from tests.conftest import running_proxy, wait_for
from tests.explore.conftest import raw, run_canned
from tests.fakebackend import FakeBackend
from thunderproxy.explore.instance import canned_queries

#: A value for every parameter, so each query's parameter handling is exercised.
PARAMS = {"program_id": "alpha", "since": "-1 day", "until": "", "bucket": "1", "day": ""}


@pytest.fixture
async def proxy_url(
    backend: FakeBackend, history_copy: Path, nursery: trio.Nursery
) -> AsyncIterator[str]:
    async with running_proxy(
        history_copy, backends=backend.url, restore=False, metrics_interval=3600
    ) as proxy:
        # The startup poll is the only write this run makes; wait for it so reads are stable.
        await wait_for(lambda: proxy.audit.statistics().written >= 1)
        yield proxy.url


async def test_pages_and_static_files_are_served_under_the_prefix(proxy_url: str) -> None:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
        index = await c.get("/datasette/")
        assert index.status_code == 200
        assert "thunderproxy scheduling history" in index.text
        assert 'href="/datasette/audit"' in index.text
        database = await c.get("/datasette/audit")
        for name, query in canned_queries().items():
            assert f"/datasette/audit/{name}" in database.text
            assert query["title"] in database.text
        steps = await c.get("/datasette/audit/steps")
        assert steps.status_code == 200
        assert "gamma" in steps.text
        assert (await c.get("/datasette/-/static/app.css")).status_code == 200
        vega = await c.get("/datasette/-/static-plugins/datasette_dashboards/vega-lite.min.js")
        assert vega.status_code == 200
        assert len(vega.content) > 100_000
        dashboard = await c.get("/datasette/-/dashboards/scheduling")
        assert dashboard.status_code == 200
        assert "renderChart" in dashboard.text
        redirect = await c.get("/datasette?x=1")
        assert (redirect.status_code, redirect.headers["location"]) == (302, "/datasette/?x=1")
        # the proxy's own routes are untouched
        assert (await c.get("/health")).json()["status"] == "ok"


async def test_every_canned_query_answers_through_datasette_as_in_sqlite(
    proxy_url: str, history_copy: Path
) -> None:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
        for name, query in canned_queries().items():
            params = {p: PARAMS.get(p, "") for p in query["params"]}
            r = await c.get(f"/datasette/audit/{name}.json?_shape=objects&{urlencode(params)}")
            assert r.status_code == 200, (name, r.text[:500])
            expected = run_canned(history_copy, name, **params)
            assert r.json()["rows"] == expected, name
            page = await c.get(f"/datasette/audit/{name}?{urlencode(params)}")
            assert page.status_code == 200
            assert query["title"] in page.text


async def test_nothing_can_write(proxy_url: str, history_copy: Path) -> None:
    before = raw(history_copy, "select count(*) as n from steps")
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
        for sql in ("delete from steps", "update steps set status = 1", "drop table steps"):
            r = await c.get("/datasette/audit.json", params={"sql": sql})
            assert r.status_code == 400, sql
        posted = await c.post("/datasette/audit/throughput", data={"since": ""})
        assert posted.status_code == 405
        for page in ("/datasette/-/permissions", "/datasette/audit.db"):
            assert (await c.get(page)).status_code in (403, 404), page
    assert raw(history_copy, "select count(*) as n from steps") == before


async def test_the_admin_token_guards_every_datasette_request(
    backend: FakeBackend, history_copy: Path
) -> None:
    token = "explore-secret"
    basic = base64.b64encode(f"operator:{token}".encode()).decode()
    async with (
        running_proxy(history_copy, backends=backend.url, restore=False, admin_token=token) as p,
        httpx.AsyncClient(base_url=p.url, timeout=10) as c,
    ):
        for path in ("/datasette/", "/datasette/audit/steps", "/datasette/-/static/app.css"):
            r = await c.get(path)
            assert r.status_code == 401
            assert r.headers["www-authenticate"] == 'Basic realm="thunderproxy"'
            assert r.json()["error"]["type"] == "authentication_error"
            wrong = await c.get(path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            bearer = await c.get(path, headers={"Authorization": f"Bearer {token}"})
            assert bearer.status_code == 200
            browser = await c.get(path, headers={"Authorization": f"Basic {basic}"})
            assert browser.status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_switched_off_the_prefix_is_just_another_backend_path(
    backend: FakeBackend, history_copy: Path
) -> None:
    async with (
        running_proxy(
            history_copy,
            backends=backend.url,
            restore=False,
            datasette=False,
            passthrough="/datasette",
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=10) as c,
    ):
        r = await c.get("/datasette/")
        assert r.status_code == 404  # passed through to the fake backend, which has no such page
        assert "thunderproxy scheduling history" not in r.text


async def test_live_rows_show_up_while_the_proxy_writes(proxy_url: str) -> None:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as c:
        count = "/datasette/audit.json?sql=select+count(*)+as+n+from+steps&_shape=objects"
        before = (await c.get(count)).json()["rows"][0]["n"]
        body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
        await c.post("/v1/chat/completions", json={**body, "program_id": "live"})
        with trio.fail_after(5):
            while (await c.get(count)).json()["rows"][0]["n"] != before + 1:
                await trio.sleep(0.02)


async def test_a_url_too_long_for_the_explorer_is_414_in_its_shape(
    backend: FakeBackend, history_copy: Path
) -> None:
    # A head limit that lets the URL reach the explorer's relay, where it was a bare 500.
    async with (
        running_proxy(
            history_copy, backends=backend.url, restore=False, max_header_bytes=512 * 1024
        ) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        host, port = proxy.url.removeprefix("http://").split(":")
        for size in (40_000, 70_000):
            # Raw bytes: httpx refuses to send a URL this long at all.
            target = b"/datasette/audit.json?sql=select+1+--+" + b"x" * size
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(
                    b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                )
                answer = b""
                with trio.fail_after(10):
                    while chunk := await stream.receive_some():
                        answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 414"), answer[:300]
            error = json.loads(body)["error"]
            assert error["type"] == "uri_too_long"
            assert "Shorten the query" in error["message"]
        assert (await client.get("/health")).status_code == 200
