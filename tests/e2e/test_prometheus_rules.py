"""promtool (Debian's ``prometheus`` package, installed when missing) on what the proxy serves:
the metrics of a real run pass ``promtool check metrics`` (names, types, help, units), and the
rules in docs/alerts.yml pass ``check rules`` and their unit tests (``alerts_test.yml``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import trio

from .test_clients import proxy_on_sim
from .test_prometheus_scrape import answered_streamed_and_refused, prometheus_binary

ROOT = Path(__file__).resolve().parents[2]


def promtool(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [prometheus_binary("promtool"), *args],
        input=stdin.decode(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_metrics_of_a_run_pass_promtool_check_metrics(tmp_path: Path) -> None:
    async with (
        # 'none': the one model served does not take the unknown name, which is refused.
        proxy_on_sim(tmp_path, default_model="none") as setup,
        httpx.AsyncClient(base_url=setup.proxy.url, timeout=10) as client,
    ):
        await answered_streamed_and_refused(client)
        text = (await client.get("/metrics/prometheus")).content
    # Every family the proxy defines is in this run's text, so each is checked.
    for family in (
        "thunderproxy_refusals_total",
        "thunderproxy_calls_total",
        "thunderproxy_tokens_total",
        "thunderproxy_call_seconds_bucket",
        "thunderproxy_build_info",
        "thunderproxy_queue_wait_seconds_bucket",
        "process_cpu_seconds_total",
    ):
        assert f"\n{family}".encode() in text, family
    checked = await trio.to_thread.run_sync(lambda: promtool("check", "metrics", stdin=text))
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_the_alerting_rules_pass_promtool_check_rules() -> None:
    checked = promtool("check", "rules", str(ROOT / "docs" / "alerts.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 12 rules found" in checked.stdout


def test_the_alerting_rules_fire_as_their_unit_tests_say() -> None:
    tested = promtool("test", "rules", str(Path(__file__).with_name("alerts_test.yml")))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
