"""Load reports to the autoscaler: ``POST <report addr>/worker_status/`` every second when
something changed and at least every 10 s, with the PyWorker's fields plus program signals.

A report carries the window of counters (workload received, served, ...) since the last report
an autoscaler accepted. The window is cleared only by such an acceptance, so a report that fails
on every address is not lost: its workload goes out with the next one.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from typing import Any

import httpx
import trio

from .. import __version__
from ..backends import BackendPool
from .ledger import Counters
from .signals import ProgramSignals
from .state import Phase, WorkerState

log = logging.getLogger("thunderproxy.worker")

#: The PyWorker's cadence: look every second, send when something changed or after 10 s of silence.
REPORT_INTERVAL_S = 1.0
MAX_SILENCE_S = 10.0
#: The PyWorker's retry budget per address: attempts, pause between them, and per-attempt timeout.
REPORT_ATTEMPTS = 3
REPORT_RETRY_DELAY_S = 2.0
REPORT_TIMEOUT_S = 10.0


def report_due(now: float, last_sent_at: float | None, *, changed: bool) -> bool:
    """Whether a report goes out at ``now``."""
    return changed or last_sent_at is None or now - last_sent_at >= MAX_SILENCE_S


def disk_used_gb() -> float:
    return shutil.disk_usage("/").used / 2**30


def backend_problem(pool: BackendPool) -> str | None:
    """Why no backend can serve right now (every one failed its last health check), or None.
    Unlike the PyWorker's sticky error this clears itself once a backend answers again."""
    nodes = list(pool)
    if not nodes or any(node.healthy for node in nodes):
        return None
    return "no healthy backend: " + "; ".join(f"{n.url}: {n.last_error or 'down'}" for n in nodes)


def build_report(
    state: WorkerState,
    window: Counters,
    *,
    url: str,
    loadtime: float | None,
    disk_delta_gb: float,
    signals: ProgramSignals | None,
    backend_error: str | None = None,
) -> dict[str, Any]:
    """The ``worker_status`` body: the PyWorker's ``WorkerStatusData`` fields (their spelling,
    ``num_requests_recieved`` included), then thunderproxy's own under ``thunderproxy``."""
    ledger = state.ledger
    error = state.error
    if error is None and state.secured and state.public_key is None and state.key_error:
        error = f"cannot verify requests: {state.key_error}"
    if error is None and state.phase is Phase.READY:
        error = backend_error
    capacity = state.capacity
    report: dict[str, Any] = {
        "id": state.config.worker_id,
        "mtoken": state.config.master_token,
        "version": __version__,
        "loadtime": loadtime or 0.0,
        "cur_load": ledger.current_load,
        "rej_load": window.rejected,
        "new_load": max(window.received - window.cancelled, 0.0),
        "error_msg": error or "",
        "max_perf": ledger.max_throughput or 0.0,
        "cur_perf": window.served,
        "cur_capacity": 0,
        "max_capacity": 0,
        "num_requests_working": len(ledger.working),
        "num_requests_recieved": window.requests,
        "additional_disk_usage": disk_delta_gb,
        "working_request_idxs": ledger.working_request_idxs(),
        "url": url,
    }
    extra: dict[str, Any] = {
        "phase": state.phase.value,
        "workload_cancelled": window.cancelled,
        "workload_errored": window.errored,
        "pending_workload": ledger.pending,
        "wait_time_s": ledger.wait_estimate(),
        "kv_capacity_tokens": None if capacity is None else capacity.kv_capacity_tokens,
        "programs_capacity": None if capacity is None else capacity.programs,
    }
    if signals is not None:
        extra["programs"] = signals.as_report()
    report["thunderproxy"] = extra
    return report


async def post_report(client: httpx.AsyncClient, addr: str, report: dict[str, Any]) -> str | None:
    """Send one report to one address with the PyWorker's retries; None when accepted, else why
    the last attempt failed."""
    return await post_json(client, addr.rstrip("/") + "/worker_status/", report)


async def post_json(client: httpx.AsyncClient, target: str, body: dict[str, Any]) -> str | None:
    """POST ``body`` with the PyWorker's retries; None when accepted, else the last error."""
    error = "not sent"
    for attempt in range(1, REPORT_ATTEMPTS + 1):
        try:
            with trio.fail_after(REPORT_TIMEOUT_S):
                response = await client.post(target, json=body)
            if response.status_code < 300:
                return None
            error = f"{target} answered {response.status_code}"
        except trio.TooSlowError:
            error = f"{target} did not answer within {REPORT_TIMEOUT_S:g} s"
        except httpx.HTTPError as exc:
            error = f"{target}: {type(exc).__name__}: {exc}"
        if attempt < REPORT_ATTEMPTS:
            await trio.sleep(REPORT_RETRY_DELAY_S)
    return error


async def deliver(
    state: WorkerState,
    client: httpx.AsyncClient,
    report: dict[str, Any],
    window: Counters,
    loadtime: float | None,
) -> tuple[list[str], dict[str, str]]:
    """Send ``report`` to every address at once; the first acceptance commits ``window`` (and
    the one-shot load time) exactly once. Returns the addresses that accepted, and the errors."""
    accepted: list[str] = []
    errors: dict[str, str] = {}

    async def send(addr: str) -> None:
        error = await post_report(client, addr, report)
        if error is not None:
            errors[addr] = error
            return
        if not accepted:
            state.ledger.commit(window)
            if state.loadtime == loadtime:
                state.loadtime = None
        accepted.append(addr)

    async with trio.open_nursery() as nursery:
        for addr in state.config.report_addrs:
            nursery.start_soon(send, addr)
    return accepted, errors


def _loggable(report: dict[str, Any]) -> dict[str, Any]:
    return {k: ("<redacted>" if k == "mtoken" and v else v) for k, v in report.items()}


async def serve_load_reporter(
    state: WorkerState,
    client: httpx.AsyncClient,
    *,
    url: str,
    signals: Callable[[], ProgramSignals] | None = None,
    pool: BackendPool | None = None,
    disk: Callable[[], float] = disk_used_gb,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Report until cancelled; ready at once (the first report goes out on the first tick)."""
    ledger = state.ledger
    last_sent_at: float | None = None
    disk_base = disk()
    failing = False
    reported_problem: str | None = None
    task_status.started()
    while True:
        await trio.sleep(REPORT_INTERVAL_S)
        now = trio.current_time()
        problem = None if pool is None else backend_problem(pool)
        # While loading, the PyWorker reports only every 10 s: nothing is served yet.
        changed = ledger.changed and state.phase is not Phase.LOADING
        # A backend going down (or back up) is news for the autoscaler at once.
        changed = changed or problem != reported_problem
        if not report_due(now, last_sent_at, changed=changed):
            continue
        window = ledger.window
        loadtime = state.loadtime
        disk_now = disk()
        report = build_report(
            state,
            window,
            url=url,
            loadtime=loadtime,
            disk_delta_gb=disk_now - disk_base,
            signals=None if signals is None else signals(),
            backend_error=problem,
        )
        ledger.changed = False
        accepted, errors = await deliver(state, client, report, window, loadtime)
        if accepted:
            last_sent_at = now
            reported_problem = problem
            disk_base = disk_now
            if failing:
                log.info("load reports accepted again by %s", ", ".join(accepted))
            failing = False
            state.event("report_sent", report_addr=",".join(accepted), data=_loggable(report))
        else:
            ledger.changed = True  # the window is still unreported
            if not failing:
                log.warning(
                    "load report failed on every address (%s); counters kept for the next one",
                    "; ".join(errors.values()),
                )
            failing = True
        for addr, error in errors.items():
            state.event("report_failed", error, report_addr=addr)


async def serve_request_cleanup(
    state: WorkerState,
    client: httpx.AsyncClient,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Every second, tell the autoscaler which signed requests ended (the PyWorker's
    ``delete_requests`` loop): ``POST <addr>/delete_requests/`` with ``worker_id``, ``mtoken``,
    ``request_idxs`` and ``success``, one post per outcome, to the first address that takes
    both. Entries leave the ledger only then, so an outage delays them and loses none."""
    ledger = state.ledger
    task_status.started()
    while True:
        await trio.sleep(REPORT_INTERVAL_S)
        batch = list(ledger.done)
        if not batch:
            continue
        dropped_before = ledger.done_dropped
        errors = []
        for addr in state.config.report_addrs:
            target = addr.rstrip("/") + "/delete_requests/"
            for success in (True, False):
                idxs = [idx for idx, ok in batch if ok is success]
                if not idxs:
                    continue
                body = {
                    "worker_id": state.config.worker_id,
                    "mtoken": state.config.master_token,
                    "request_idxs": idxs,
                    "success": success,
                }
                error = await post_json(client, target, body)
                if error is not None:
                    errors.append(error)
                    break
            else:
                ledger.acknowledge(len(batch), dropped_before)
                break
        else:
            state.event("cleanup_failed", "; ".join(errors), data={"requests": len(batch)})
