"""``thunderproxy demo``, the README's main command: the same programs through default and tr
in virtual time, side by side with every time labelled, stored as runs the explorer shows in
the same clock, then a proxy serving that db."""

from __future__ import annotations

import dataclasses
import sqlite3
from functools import partial
from pathlib import Path

import trio

from thunderproxy.bench.runs.demo import DemoConfig, compare, serve_demo


def test_the_demo_replays_through_default_and_tr_and_says_where_to_look(tmp_path: Path) -> None:
    lines: list[str] = []
    config = DemoConfig(
        programs=3, max_steps=3, concurrency=2, time_scale=0.05, port=0,
        db=str(tmp_path / "demo.db"), wait=False,
    )  # fmt: skip
    runs = compare(config, echo=lines.append, progress=False)
    outcome = trio.run(partial(serve_demo, config, runs, echo=lines.append))
    assert outcome.datasette_url == outcome.url + "/datasette/"
    assert any(outcome.datasette_url in line for line in lines)
    assert [run.router for run in outcome.runs] == ["default", "tr"]
    for run in outcome.runs:
        assert run.result.figures["programs_completed"] == 3
        assert run.result.figures["program_time_mean_s"] > 0
        assert outcome.dashboard(run.router) in "\n".join(lines)
        assert f"run_id={run.run_id}" in outcome.dashboard(run.router)
    assert outcome.result is outcome.run("tr").result
    # Both runs side by side, every time labelled with its clock, and the comparison line.
    text = "\n".join(lines)
    printed = text.splitlines()
    header = next(n for n, line in enumerate(printed) if line.split() == ["default", "tr"])
    table = printed[header + 1 : header + 11]
    for row in table:
        if "(s)" in row or " s)" in row or "time" in row or "waited" in row:
            assert "(simulated s)" in row or "(wall s)" in row, row
    figures = {r: outcome.run(r).result.figures for r in ("default", "tr")}
    ratio = figures["tr"]["steps_per_min"] / figures["default"]["steps_per_min"]
    assert (
        f"tr vs default: {ratio:.2f}x steps/min, p99 program time "
        f"{figures['tr']['program_time_p99_s']:,.0f} s vs "
        f"{figures['default']['program_time_p99_s']:,.0f} s"
    ) in text
    # The same figures on a second run: virtual time does not depend on the machine.
    again = compare(dataclasses.replace(config, db=str(tmp_path / "again.db")), echo=print)
    assert [r.result.figures["steps_per_min"] for r in again] == [
        r.result.figures["steps_per_min"] for r in runs
    ]
    conn = sqlite3.connect(tmp_path / "demo.db")
    stored = conn.execute("select id, router, clock from runs order by id").fetchall()
    steps = conn.execute("select run_id, count(*) from steps group by run_id order by run_id")
    assert steps.fetchall()[:2] == [(stored[0][0], 9), (stored[1][0], 9)]
    conn.close()
    # The db says which clock the replays' times are on, as the printout does; the proxy that
    # served the db afterwards is a run of its own, on the wall clock.
    assert [(router, clock) for _, router, clock in stored][:2] == [
        ("default", "simulated"),
        ("tr", "simulated"),
    ]
    assert [r.run_id for r in outcome.runs] == [row[0] for row in stored[:2]]
