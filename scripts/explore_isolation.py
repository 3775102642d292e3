"""What heavy Datasette pages cost the proxy's streams: one ``thunderproxy serve`` process (its
embedded simulator as the backend) while N clients each fetch one page of 1,000 rows x 100
URL-valued columns from ``/datasette/`` at once.

Meanwhile ``/health`` is asked every 50 ms and one streamed chat call runs; the script prints the
pages' time, the slowest ``/health`` answer and the longest gap between two chunks of the
stream, as JSON. The clients run in this process, the proxy in its own.

    python scripts/explore_isolation.py [--pages 16]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import trio

LISTENING = re.compile(rb"listening on (http://127\.0\.0\.1:\d+)")
COLUMNS = 100
ROWS = 1000


def heavy_sql() -> str:
    values = ", ".join(
        f"'https://example.com/item/' || i || '/{c}' as c{c}" for c in range(COLUMNS)
    )
    return (
        "with recursive r(i) as (select 1 union all select i + 1 from r "
        f"limit {ROWS}) select {values} from r"
    )


async def measure(url: str, pages: int) -> dict[str, float]:
    health_s: list[float] = []
    gaps: list[float] = []
    page_s: list[float] = []
    done = trio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        # The explorer is up and its page cache warm before the measurement.
        warm = await client.get("/datasette/audit", params={"sql": "select 1"})
        assert warm.status_code == 200, warm.text[:300]

        async def poll_health() -> None:
            while not done.is_set():
                started = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health_s.append(time.monotonic() - started)
                await trio.sleep(0.05)

        async def stream() -> None:
            body = {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "messages": [{"role": "user", "content": "count"}],
                "max_tokens": 30_000,
                "stream": True,
                "program_id": "live",
            }
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, (await response.aread())[:300]
                last = time.monotonic()
                async for _ in response.aiter_raw():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if done.is_set():
                        return

        async def page() -> None:
            started = time.monotonic()
            async with client.stream("GET", "/datasette/audit", params={"sql": heavy_sql()}) as r:
                assert r.status_code == 200
                async for _ in r.aiter_raw():
                    pass
            page_s.append(time.monotonic() - started)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_health)
            nursery.start_soon(stream)
            await trio.sleep(1.0)  # the stream runs at its steady pace first
            async with trio.open_nursery() as loaders:
                for _ in range(pages):
                    loaders.start_soon(page)
            done.set()
    return {
        "pages": pages,
        "pages_s": round(max(page_s), 2),
        "health_max_s": round(max(health_s), 3),
        "stream_max_gap_s": round(max(gaps), 3),
        "stream_chunks": len(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "audit.db"
        argv = [sys.executable, "-m", "thunderproxy", "serve", "--port", "0", "--db", str(db)]
        proxy = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        try:
            assert proxy.stderr is not None
            output = b""
            while (match := LISTENING.search(output)) is None:
                line = proxy.stderr.readline()
                if not line:
                    raise SystemExit(output.decode())
                output += line
            # Read the rest of its log in a thread, so that it never blocks on a full pipe.

            threading.Thread(target=proxy.stderr.read, daemon=True).start()
            result = trio.run(measure, match.group(1).decode(), args.pages)
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
