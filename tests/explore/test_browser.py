"""A person's view: headless Chromium opens the explorer on a live ``thunderproxy serve`` and the
pages must render with the scenario's data. Screenshots land in ``test-artifacts/explore/``.

Chromium comes from Debian's packages; the fixture installs it when it is missing and the tests
run as root with apt-get (as CI does), and skips the test cleanly when that is impossible.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlencode

import pytest
import trio

from tests.conftest import apt_install
from tests.explore.conftest import raw
from tests.explore.scenario import History
from tests.explore.test_standalone import LISTENING, ROOT, start
from tests.fakebackend import FakeBackend, serve_fake_backend
from thunderproxy.explore.links import dashboard_url

ARTIFACTS = ROOT / "test-artifacts" / "explore"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,1400",
    # Lets the dashboard's scripts fetch their data and draw before the page is captured.
    "--virtual-time-budget=8000",
]

pytestmark = pytest.mark.browser


@pytest.fixture(scope="session")
def chromium() -> str:
    found = shutil.which("chromium")
    if found is None and apt_install("chromium", "chromium-driver"):
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("Chromium is not installed and cannot be installed here (needs root + apt)")
    return found


async def browse(chromium: str, url: str, *, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran; with ``screenshot``, a PNG of it too."""
    # Chromium's helper processes may still write to the profile as the browser exits.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        base = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
        if screenshot is not None:
            await trio.run_process(
                [*base, f"--screenshot={screenshot}", url], capture_stdout=True, capture_stderr=True
            )
            assert (await trio.Path(screenshot).stat()).st_size > 10_000, url
        dom = await trio.run_process(
            [*base, "--dump-dom", url], capture_stdout=True, capture_stderr=True
        )
    text: str = dom.stdout.decode()
    return text


async def test_the_explorer_renders_with_data_in_a_browser(
    chromium: str, history: History, history_copy: Path, nursery: trio.Nursery
) -> None:
    backend = FakeBackend()
    await nursery.start(serve_fake_backend, backend)
    argv = [
        sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--backends", backend.url,
        "--db", str(history_copy), "--no-restore", "--metrics-interval", "3600",
    ]  # fmt: skip
    first = raw(history_copy, "select * from runs order by id limit 1")[0]
    process, url = await start(argv, {**os.environ}, LISTENING)
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        base = f"{url}/datasette"
        pages = {
            "index": (f"{base}/", ["thunderproxy scheduling history", "transitions"]),
            "table-steps": (
                f"{base}/audit/steps?_facet=status",
                ["Steps (LLM calls)", "gamma", "fake failure", "499"],
            ),
            "query-waited-longest": (
                f"{base}/audit/waited_longest?" + urlencode({"since": "-1 day", "until": ""}),
                ["Which programs waited longest", "epsilon", "queue:capacity_full x1"],
            ),
            "query-program-timeline": (
                f"{base}/audit/program_timeline?" + urlencode({"program_id": "alpha"}),
                ["Pause/resume timeline", "paused: over_capacity", "resumed: fits"],
            ),
            "dashboard": (f"{base}/-/dashboards/scheduling", ["Scheduling history"]),
            # The link a run's summary prints: this proxy's own run is the latest, so the
            # scenario's run is named, with its window and a bucket that fits it.
            "dashboard-run": (
                dashboard_url(url, first["id"], first["started_at"], first["stopped_at"]),
                ["Scheduling history", f'value="{first["id"]}"'],
            ),
        }
        for name, (page, expected) in pages.items():
            dom = await browse(chromium, page, screenshot=ARTIFACTS / f"{name}.png")
            for text in expected:
                assert text in dom, (name, text)
            assert "Error 500" not in dom, name
        # The dashboard's charts are drawn by Vega in the browser, from local files only.
        for name in ("dashboard", "dashboard-run"):
            dashboard = await browse(chromium, pages[name][0])
            assert dashboard.count('class="marks"') >= 6, "every chart drew its canvas or SVG"
    finally:
        process.terminate()
        with trio.fail_after(10):
            await process.wait()
