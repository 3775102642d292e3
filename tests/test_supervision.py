"""``supervise`` on trio's MockClock: a failure after start restarts the component after its
backoff and is counted; a failure before the first start is a startup error; a component that
is not restarted fails alone."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from thunderproxy.supervision import (
    STABLE_AFTER_S,
    Components,
    Restart,
    State,
    backoff_s,
    supervise,
    supervised,
)


def test_backoff_doubles_up_to_its_bound() -> None:
    policy = Restart(initial_s=0.5, max_s=4.0)
    assert [backoff_s(policy, n) for n in (1, 2, 3, 4, 5, 9)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


async def test_a_failing_component_restarts_after_its_backoff_and_is_counted(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    components = Components()
    starts: list[float] = []
    healthy = trio.Event()

    async def flaky(*, task_status: trio.TaskStatus[str]) -> None:
        starts.append(trio.current_time())
        task_status.started("ready")
        if len(starts) <= 3:
            raise RuntimeError("boom")
        healthy.set()
        await trio.sleep_forever()

    policy = Restart(initial_s=1.0, max_s=10.0)
    async with trio.open_nursery() as nursery:
        value = await nursery.start(supervised(components, "flaky", flaky, restart=policy))
        assert value == "ready"
        await healthy.wait()
        (component,) = components.snapshot()
        assert component.state is State.RUNNING
        assert component.restarts == 3
        assert component.failures == 3
        assert component.last_error == "RuntimeError: boom"
        nursery.cancel_scope.cancel()
    # Backoffs of 1, 2 and 4 s between the starts.
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == [1.0, 2.0, 4.0]
    # The same cause is logged once, not once per restart.
    failures = [r for r in caplog.records if "component flaky failed" in r.getMessage()]
    assert len(failures) == 1


async def test_a_failure_before_the_first_start_is_a_startup_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def broken(*, task_status: trio.TaskStatus[None]) -> None:
        raise OSError("cannot open")

    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError, match="cannot open"):
            await nursery.start(supervised(Components(), "broken", broken))


async def test_a_component_that_is_not_restarted_fails_alone(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    components = Components()

    async def once(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        raise ValueError("bad poll")

    caplog.set_level(logging.ERROR)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervised(components, "once", once, restart=Restart(enabled=False)))
    (component,) = components.snapshot()
    assert component.state is State.FAILED
    assert not component.up
    assert component.restarts == 0
    assert "not restarted" in caplog.text


async def test_cancellation_is_not_a_failure(autojump_clock: trio.testing.MockClock) -> None:
    components = Components()

    async def forever(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await trio.sleep_forever()

    with trio.move_on_after(5):
        await supervise(components, "forever", forever)
    (component,) = components.snapshot()
    assert component.state is State.RUNNING
    assert component.failures == 0


async def test_failures_in_a_row_are_forgotten_after_a_stable_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    components = Components()
    starts: list[float] = []
    runs = [0.0, 0.0, STABLE_AFTER_S + 1.0, 0.0]
    done = trio.Event()

    async def service(*, task_status: trio.TaskStatus[None]) -> None:
        starts.append(trio.current_time())
        task_status.started()
        if len(starts) > len(runs):
            done.set()
            await trio.sleep_forever()
        await trio.sleep(runs[len(starts) - 1])
        raise RuntimeError("again")

    async with trio.open_nursery() as nursery:
        await nursery.start(supervised(components, "s", service, restart=Restart(initial_s=1.0)))
        await done.wait()
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:], strict=False)]
    # 1 s, 2 s; then, after a stable run, the first backoff again (plus the run itself).
    assert gaps == [1.0, 2.0, STABLE_AFTER_S + 1.0 + 1.0, 2.0]
    assert components.snapshot()[0].restarts == 4
