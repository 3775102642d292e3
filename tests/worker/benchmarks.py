"""Benchmark functions for ``--benchmark tests.worker.benchmarks:NAME`` in the tests: the
extension point the worker offers for non-OpenAI backends, exercised for real."""

from __future__ import annotations

import httpx

#: Workload per second ``fixed`` reports.
FIXED_THROUGHPUT = 1.0


async def fixed(backend_url: str, client: httpx.AsyncClient) -> float:
    """Asks the backend once (so a dead backend fails it) and reports a known throughput."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    return FIXED_THROUGHPUT


async def broken(backend_url: str, client: httpx.AsyncClient) -> float:
    raise RuntimeError(f"no benchmark for {backend_url} today")
