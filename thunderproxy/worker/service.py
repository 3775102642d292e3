"""``serve_worker``: worker mode's long-lived tasks, started by the runtime once the proxy
listens: the signing-key fetcher, the startup benchmark, and the load reporter."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import httpx
import trio

from ..backends import BackendPool
from ..backends.poller import wait_until_ready
from ..backends.transport import backend_client
from .auth import load_public_key
from .benchmark import BenchmarkError, measure
from .reporter import serve_load_reporter, serve_request_cleanup
from .signals import ProgramSignals
from .state import WorkerState

log = logging.getLogger("thunderproxy.worker")

#: Signing-key fetches: per-attempt timeout, and the backoff between attempts (doubling from
#: the first to the last value, then staying there for as long as it takes).
KEY_TIMEOUT_S = 10.0
KEY_BACKOFF_S = (1.0, 60.0)


def key_backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failed rounds (pure)."""
    first, most = KEY_BACKOFF_S
    return float(min(most, first * 2 ** max(0, failures - 1)))


async def fetch_key_once(state: WorkerState, client: httpx.AsyncClient) -> bool:
    """Try every report address once; True once a key is loaded."""
    errors = []
    for addr in state.config.report_addrs:
        target = addr + "/pubkey/"
        try:
            with trio.fail_after(KEY_TIMEOUT_S):
                response = await client.get(target)
            if response.status_code != 200:
                raise ValueError(f"answered {response.status_code}")
            key = load_public_key(response.content)
        except trio.TooSlowError:
            errors.append(f"{target} did not answer within {KEY_TIMEOUT_S:g} s")
        except (httpx.HTTPError, ValueError) as exc:
            errors.append(f"{target}: {exc or type(exc).__name__}")
        else:
            state.public_key = key
            state.key_error = None
            state.ledger.changed = True
            log.info("fetched the autoscaler's signing key from %s", target)
            state.event("pubkey_fetched", report_addr=addr)
            return True
    state.key_error = "; ".join(errors)
    state.event("pubkey_failed", state.key_error)
    return False


async def serve_key_fetcher(
    state: WorkerState,
    client: httpx.AsyncClient,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Fetch the key, retrying with backoff until it comes: never give up into unsecured mode
    (signed requests get 503 meanwhile, and reports carry the error)."""
    task_status.started()
    failures = 0
    while not await fetch_key_once(state, client):
        failures += 1
        if failures == 3:
            log.error(
                "cannot fetch the autoscaler's signing key (%s); refusing signed requests "
                "with 503 and retrying every %g s at most",
                state.key_error,
                KEY_BACKOFF_S[1],
            )
        state.ledger.changed = True
        await trio.sleep(key_backoff(failures))


async def start_worker(state: WorkerState, pool: BackendPool) -> None:
    """Wait for the backends, then benchmark them; on failure the worker becomes a beacon."""
    config = state.config
    with trio.move_on_after(config.ready_timeout) as waiting:
        await wait_until_ready(pool)
    if waiting.cancelled_caught:
        unhealthy = ", ".join(b.url for b in pool if not b.healthy) or "the backend"
        state.mark_errored(
            f"{unhealthy} did not answer /health within {config.ready_timeout:g} s "
            "(see --worker-ready-timeout); check that the model server started"
        )
        return
    # The benchmark speaks HTTP to each server through its backend (base URL, credentials,
    # connections), with an httpx client over the seam: what a --benchmark function is handed.
    targets = [(node.url, backend_client(node.backend, node.url)) for node in pool]
    try:
        capacity = await measure(
            targets,
            benchmark=config.benchmark,
            cache_path=config.benchmark_cache,
            program_tokens=config.program_tokens,
        )
    except (BenchmarkError, httpx.HTTPError, trio.TooSlowError) as exc:
        state.mark_errored(f"startup benchmark failed: {exc or type(exc).__name__}")
        return
    except Exception as exc:  # a failed benchmark module must not end the worker
        state.mark_errored(f"startup benchmark failed: {type(exc).__name__}: {exc}")
        return
    finally:
        with trio.CancelScope(shield=True):
            for _, client in targets:
                await client.aclose()
    state.mark_ready(capacity)
    log.info(
        "worker ready: max throughput %.1f/s%s, KV capacity %s tokens (%s programs of %d)",
        capacity.max_throughput,
        " (cached)" if capacity.cached else "",
        capacity.kv_capacity_tokens,
        capacity.programs,
        config.program_tokens,
    )
    state.event(
        "benchmark",
        f"max_throughput {capacity.max_throughput:.3f}/s"
        + (" from the cache" if capacity.cached else " measured"),
        data={
            "max_throughput": capacity.max_throughput,
            "kv_capacity_tokens": capacity.kv_capacity_tokens,
            "programs": capacity.programs,
            "program_tokens": config.program_tokens,
            "cached": capacity.cached,
            "loadtime": state.loadtime,
            "backends": capacity.details,
        },
    )


async def serve_worker(
    state: WorkerState,
    pool: BackendPool,
    *,
    url: str,
    signals: Callable[[], ProgramSignals] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run worker mode's tasks until cancelled. ``url`` is where the proxy listens, reported
    when the platform's PUBLIC_IPADDR / VAST_TCP_PORT_<port> do not say better."""
    report_url = state.config.public_url or url
    # Its own client: reports and key fetches go to the autoscaler, not to a backend.
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    async with client, trio.open_nursery() as nursery:
        if state.secured:
            await nursery.start(serve_key_fetcher, state, client)
        await nursery.start(
            partial(serve_load_reporter, state, client, url=report_url, signals=signals, pool=pool)
        )
        await nursery.start(serve_request_cleanup, state, client)
        nursery.start_soon(start_worker, state, pool)
        task_status.started()
