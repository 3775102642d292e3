"""Virtual-time runs: the real scheduler and the simulator engine on trio's MockClock.

These are the small configuration of the default suite: a handful of synthetic programs on a
KV cache that cannot hold them all, every target, in about a second of wall time.

Each target runs in its own ``trio.run`` on a fresh MockClock (``virtual.run``), as the bench
does: the simulator's frontend queue spins without end under a MockClock whose time is not 0
when an engine starts (a float rounding in ``Engine.run``), so targets never share a clock.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import trio
from trio._core import _run as trio_run

from tests.bench.synthetic import mooncake_rows, thunderagent_rows
from thunderproxy.audit.records import DecisionRecord, StepRecord, TransitionRecord
from thunderproxy.bench.agents.agent import BenchError
from thunderproxy.bench.config import BenchConfig
from thunderproxy.bench.runs import virtual
from thunderproxy.bench.workloads import workload
from thunderproxy.bench.workloads.workload import Workload

SAME_IN_VIRTUAL_TIME = ("steps_per_min", "prefix_hit_rate", "program_time_p99_s", "preemptions")


@pytest.fixture
def agents_workload() -> Workload:
    return workload.thunderagent(thunderagent_rows(programs=4, steps=4), shuffle=False)


def tight(w: Workload, **kw: object) -> BenchConfig:
    """A KV cache that holds one program and a half: two agents at once must contend."""
    kv = int(w.max_context_tokens * 1.5)
    return BenchConfig(virtual=True, concurrency=2, kv_tokens=kv, **kw)  # type: ignore[arg-type]


def test_every_target_completes_the_workload(agents_workload: Workload) -> None:
    config = tight(agents_workload)
    results = {
        t: virtual.run(agents_workload, config, t) for t in ("direct", "default", "tr", "oracle")
    }
    for result in results.values():
        f = result.figures
        assert f["programs_completed"] == 4
        assert f["steps_completed"] == agents_workload.steps
        assert f["errors"] == 0
        assert f["steps_per_min"] > 0
    oracle = results["oracle"].figures
    assert oracle["evictions"] == 0
    assert oracle["preemptions"] == 0
    assert oracle["evicted_prefix_tokens"] == 0
    assert oracle["prefix_hit_rate"] >= results["direct"].figures["prefix_hit_rate"]
    assert results["direct"].figures["evictions"] > 0  # the tight cache did evict
    # Without a network the default router changes nothing: it only proxies.
    for key in SAME_IN_VIRTUAL_TIME:
        assert results["default"].figures[key] == pytest.approx(results["direct"].figures[key])
    assert results["direct"].figures["pause_time_total_s"] == 0


def test_a_cpu_tier_turns_evicted_history_into_loads(agents_workload: Workload) -> None:
    # Four agents on a cache for 1.2 programs: the GPU alone loses history.
    kv = int(agents_workload.max_context_tokens * 1.2)
    config = BenchConfig(virtual=True, concurrency=4, kv_tokens=kv)
    direct = virtual.run(agents_workload, config, "direct").figures
    offload = virtual.run(agents_workload, config, "offload").figures
    assert direct["cpu_hit_tokens"] == direct["cpu_loads"] == 0
    assert offload["programs_completed"] == 4
    assert offload["errors"] == 0
    # What the tight GPU cache evicted comes back from the tier instead of being recomputed.
    assert offload["cpu_hit_tokens"] > 0
    assert offload["cpu_loads"] >= offload["cpu_hit_tokens"] // 16
    assert offload["prefix_hit_rate"] > direct["prefix_hit_rate"]
    assert offload["evicted_prefix_tokens"] < direct["evicted_prefix_tokens"]
    tr = virtual.run(agents_workload, config, "tr+offload")
    assert tr.figures["programs_completed"] == 4
    assert tr.proxy_settings["router"] == "tr"


def test_a_thunderproxy_target_keeps_its_audit_records(agents_workload: Workload) -> None:
    result = virtual.run(agents_workload, tight(agents_workload), "tr")
    steps = [r for r in result.audit_records if isinstance(r, StepRecord)]
    assert len(steps) == agents_workload.steps
    assert all(s.status == 200 and s.prompt_tokens for s in steps)
    transitions = [r for r in result.audit_records if isinstance(r, TransitionRecord)]
    stopped = {t.transition.program_id for t in transitions if t.transition.to_status == "stopped"}
    assert len(stopped) == 4  # every program released at its end
    assert any(isinstance(r, DecisionRecord) for r in result.audit_records)
    assert result.proxy_settings["router"] == "tr"


def test_virtual_runs_are_deterministic() -> None:
    # Eight sessions arriving at the same instant on a cache too small for them: the order in
    # which trio wakes their tasks decides who is preempted, so it must be reproducible.
    requests = [
        {"timestamp": 0, "input_length": 1500 + 100 * i, "output_length": 40,
         "hash_ids": [0, 10 + i, 20 + i]}
        for i in range(8)
    ]  # fmt: skip
    sessions = [{"idx": i, "session_id": i, "turn": 0} for i in range(8)]
    w = workload.mooncake(requests, sessions)
    config = BenchConfig(virtual=True, kv_tokens=4_000)

    def calls() -> list[tuple[object, ...]]:
        log = virtual.run(w, config, "direct").log
        return [(s.program_id, s.sent_at, s.finished_at, s.cached_tokens) for s in log.steps]

    assert calls() == calls()


def test_tr_runs_repeat_exactly_whatever_else_the_process_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Multi-turn sessions on a 3-second grid, as in Mooncake: arrivals, turns and the resume
    # monitor's ticks fall on the same instants, where trio breaks ties between deadlines by
    # object identity, i.e. by whatever else the process happened to allocate. Reversing
    # that identity order must change nothing.
    rng = random.Random(0)
    rows = []
    for i in range(30):
        start = rng.randrange(10)
        for turn in range(rng.randint(1, 4)):
            at = 3000 * (start + 3 * turn + rng.randrange(3))
            blocks = [0, *(100 * k + i for k in range(1, 8))]
            rows.append(
                (at, i, turn, {"timestamp": at, "input_length": rng.randint(600, 4000),
                               "output_length": rng.randint(10, 200), "hash_ids": blocks})
            )  # fmt: skip
    rows.sort(key=lambda row: row[0])
    requests = [request for *_, request in rows]
    sessions = [{"idx": k, "session_id": i, "turn": t} for k, (_, i, t, _) in enumerate(rows)]
    w = workload.mooncake(requests, sessions)
    config = BenchConfig(virtual=True, kv_tokens=10_000)

    def history() -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
        result = virtual.run(w, config, "tr")
        decisions = [
            (r.program_id, r.action, r.rule, r.at - result.log.started_at)
            for r in result.audit_records
            if isinstance(r, DecisionRecord)
        ]
        calls = [(s.program_id, s.step, s.sent_at, s.finished_at) for s in result.log.steps]
        return decisions, calls

    # As outside pytest: trio's Hypothesis plugin, loaded here, sorts each batch of woken
    # tasks, which would hide the tie order.
    monkeypatch.setattr(trio_run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    first = history()
    actions = {action for _, action, _, _ in first[0]}
    assert "resume" in actions
    assert actions & {"pause", "queue"}  # programs waited for capacity: ties mattered
    monkeypatch.setattr(trio_run, "id", lambda obj: -id(obj), raising=False)
    assert history() == first


def test_tool_gaps_are_scaled(agents_workload: Workload) -> None:
    config = BenchConfig(virtual=True, concurrency=4, kv_tokens=200_000)
    base = virtual.run(agents_workload, config, "direct")
    slow = virtual.run(agents_workload, dataclasses.replace(config, gap_scale=10.0), "direct")
    # Three gaps of 0.5-0.8 s per program: ten times longer adds about 9 x 2 s to each.
    added = slow.figures["program_time_p50_s"] - base.figures["program_time_p50_s"]
    assert 12 < added < 25


def test_open_loop_sessions_start_at_their_recorded_times() -> None:
    requests, sessions = mooncake_rows()
    w = workload.mooncake(requests, sessions)
    config = BenchConfig(virtual=True, concurrency=0, kv_tokens=100_000)
    result = virtual.run(w, config, "tr")
    assert result.figures["programs_completed"] == 2
    sent = {(s.program_id, s.step): s.sent_at - result.log.started_at for s in result.log.steps}
    assert sent[("mooncake/0", 1)] == 0.0
    assert sent[("mooncake/1", 1)] == 1.0
    assert sent[("mooncake/0", 2)] == pytest.approx(4.0)  # its recorded time: turn 1 was done
    # The second turn of session 0 hits the three blocks it shares with its first turn.
    second = next(s for s in result.log.steps if s.program_id == "mooncake/0" and s.step == 2)
    assert second.cached_tokens is not None
    assert second.cached_tokens >= 1500 - 16


def test_poisson_arrivals(agents_workload: Workload) -> None:
    config = BenchConfig(
        virtual=True, concurrency=0, kv_tokens=200_000, arrivals="poisson", rate=0.05, seed=2
    )
    result = virtual.run(agents_workload, config, "direct")
    arrivals = sorted(p.arrived_at for p in result.log.programs)
    assert arrivals[0] == result.log.started_at
    assert arrivals[-1] - arrivals[0] > 20  # four programs at one per 20 s
    assert result.figures["programs_completed"] == 4


def test_a_prompt_larger_than_the_cache_is_an_error_not_a_hang(agents_workload: Workload) -> None:
    config = BenchConfig(virtual=True, concurrency=2, kv_tokens=1_024)
    result = virtual.run(agents_workload.subset(2, 1), config, "direct")
    assert result.figures["errors"] > 0
    assert result.figures["programs_completed"] == 0


def test_a_target_that_stops_making_progress_is_reported(
    agents_workload: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("thunderproxy.bench.agents.agent.STALL_S", 60.0)
    config = BenchConfig(virtual=True, concurrency=2, kv_tokens=200_000)
    monkeypatch.setattr(
        "thunderproxy.bench.agents.transport.InProcessTransport._direct", _never_answers
    )
    with pytest.raises(BenchError, match="No call ended for 60 simulated seconds"):
        virtual.run(agents_workload.subset(1, 1), config, "direct")


async def _never_answers(*_args: object, **_kw: object) -> None:
    await trio.sleep_forever()


def test_the_simulator_sees_the_shared_prefix_and_no_kv_of_answers_not_carried() -> None:
    rows = thunderagent_rows(programs=3, steps=4, output=(60, 120))
    recorded = workload.thunderagent(rows, shuffle=False)
    config = BenchConfig(virtual=True, concurrency=1, kv_tokens=200_000)
    logs = {}
    for carry in (1.0, 0.0):
        shaped = recorded.reshape(shared_prefix_tokens=3_000, carry_answer=carry)
        result = virtual.run(shaped, config, "direct")
        assert result.figures["errors"] == 0
        assert result.figures["evicted_prefix_tokens"] == 0
        logs[carry] = {(s.program_id, s.step): s for s in result.log.steps}
    for carry, steps in logs.items():
        for (program_id, step), s in steps.items():
            assert s.cached_tokens is not None
            if step == 1 and program_id != "bs4/task-0":
                # A program's first call finds the prefix every program shares (whole blocks).
                assert 3_000 - 16 <= s.cached_tokens < 3_000 + 16
            elif step > 1:
                # Later calls find their history up to where the engine's KV ends: with the
                # answers carried, the answer too; without, the prompt before it and no more.
                previous = steps[program_id, step - 1]
                upto = previous.prompt_tokens + (previous.output_tokens if carry else 0)
                assert s.reusable_tokens - 16 < s.cached_tokens <= s.reusable_tokens
                assert upto - 16 < s.cached_tokens <= upto + 1
