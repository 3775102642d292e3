"""A person's view of the council page: headless Chromium asks a question, watches the three
stages fill in, reloads mid-job and sees the job continue. Screenshots land in
``test-artifacts/council/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from tests.council.cdp import open_page
from tests.council.helpers import MODELS, council_proxy, sim_config
from tests.explore.test_browser import chromium  # noqa: F401  (the fixture)
from tests.explore.test_standalone import ROOT

ARTIFACTS = ROOT / "test-artifacts" / "council"
pytestmark = pytest.mark.browser

STATUS = "document.querySelector('.message.assistant')?.dataset.status"


async def test_the_page_runs_a_council_and_picks_it_up_again_after_a_reload(
    chromium: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Long stage-1 answers at real time: a few seconds, time to reload while the job runs.
    slow = sim_config(time_scale=1.0, output_len_dist="fixed:500")
    async with (
        council_proxy(tmp_path / "c.db", sim=slow) as (proxy, _),
        open_page(chromium) as page,
    ):
        await page.call("Page.navigate", url=proxy.url + "/council/")
        await page.wait_for("document.getElementById('members')?.textContent.includes('Chairman')")
        await page.screenshot(ARTIFACTS / "empty.png")
        question = json.dumps("Why is the sky blue?")
        await page.evaluate(
            f"document.getElementById('question').value = {question};"
            "document.getElementById('send').click(); true"
        )
        # Stage 1: one tab per member, text streaming into them.
        await page.wait_for("document.querySelectorAll('[data-stage=\"1\"] .tab').length === 3")
        tabs = await page.evaluate(
            "[...document.querySelectorAll('[data-stage=\"1\"] .tab')].map(t => t.textContent)"
        )
        assert tabs == list(MODELS)
        await page.wait_for("document.querySelector('[data-stage=\"1\"] .panel .md p:not(.muted)')")
        await page.screenshot(ARTIFACTS / "stage1-streaming.png")
        # Reload while the members still write: the page must find the job, replay it and
        # follow it on.
        assert await page.evaluate(STATUS) == "stage1"
        await page.call("Page.reload")
        await page.wait_for(f"{STATUS} === 'stage1'", timeout=10)
        assert await page.evaluate("location.hash.length") > 1
        await page.wait_for("document.querySelector('[data-stage=\"1\"] .panel .md p:not(.muted)')")
        await page.screenshot(ARTIFACTS / "stage1-after-reload.png")
        await page.wait_for(f"{STATUS} === 'stage2'", timeout=30)
        await page.wait_for(f"{STATUS} === 'complete'", timeout=60)
        # Stage 2 shows the rankings de-anonymized and the leaderboard; stage 3 Markdown.
        ranking = await page.evaluate(
            "document.querySelector('[data-stage=\"2\"] .panel').innerHTML"
        )
        assert any(f"<strong>{m}</strong>" in ranking for m in MODELS)
        assert "Response A" not in await page.evaluate(
            "document.querySelector('[data-stage=\"2\"] .parsed').textContent"
        )
        board = await page.evaluate("document.querySelector('.leaderboard').textContent")
        assert "Winner" in board
        final = await page.evaluate("document.querySelector('[data-stage=\"3\"]').innerHTML")
        assert "<h2>The council's answer</h2>" in final
        assert "<strong>Agreed:</strong>" in final
        assert f"Synthesised by {MODELS[0]}" in final
        title = await page.wait_for(
            "document.querySelector('#conversations li.active a')?.textContent"
        )
        assert title.startswith("Why is the sky")
        await page.screenshot(ARTIFACTS / "complete-light.png")
        await page.call(
            "Emulation.setEmulatedMedia",
            features=[{"name": "prefers-color-scheme", "value": "dark"}],
        )
        await trio.sleep(0.2)  # one frame for the new colours
        background = await page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(18, 20, 23)"
        await page.screenshot(ARTIFACTS / "complete-dark.png")


async def test_the_markdown_renderer_escapes_html(
    chromium: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    async with council_proxy(tmp_path / "c.db") as (proxy, _), open_page(chromium) as page:
        await page.call("Page.navigate", url=proxy.url + "/council/")
        await page.wait_for("window.CouncilMarkdown")
        source = json.dumps(
            "# Title\n<script>alert(1)</script> **bold** `<b>` [x](javascript:alert(1)) "
            "[ok](https://example.org)\n\n- one\n- two\n\n```\n<i>code</i>\n```"
        )
        html = await page.evaluate(f"CouncilMarkdown.render({source})")
        assert html == (
            "<h1>Title</h1>\n<p>&lt;script&gt;alert(1)&lt;/script&gt; <strong>bold</strong> "
            '<code>&lt;b&gt;</code> [x](javascript:alert(1)) <a href="https://example.org" '
            'rel="noopener noreferrer nofollow" target="_blank">ok</a></p>\n'
            "<ul><li>one</li><li>two</li></ul>\n<pre><code>&lt;i&gt;code&lt;/i&gt;</code></pre>"
        )
