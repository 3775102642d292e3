"""Runs inside a virtual environment that has litellm and redis (not thunderproxy's): one
LiteLLM Router instance with an rpm limit on one deployment, its usage shared through Redis,
driven by the same load as scripts/bench_litellm.py sends through thunderproxy. Prints one JSON
line per call: [unix time, admitted, seconds].

    python scripts/litellm_driver.py API_BASE MODEL RPM REDIS_PORT START DURATION WORKERS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network on the bench host

import litellm  # noqa: E402
from litellm import Router  # noqa: E402


async def main() -> None:
    api_base, model, rpm, port, start, duration, workers = sys.argv[1:8]
    router = Router(
        model_list=[
            {
                "model_name": "m",
                "litellm_params": {
                    "model": f"openai/{model}",
                    "api_base": api_base,
                    "api_key": "none",
                    "rpm": int(rpm),
                },
            }
        ],
        routing_strategy="usage-based-routing-v2",
        redis_host="127.0.0.1",
        redis_port=int(port),
        num_retries=0,
    )
    end = float(start) + float(duration)
    await asyncio.sleep(max(0.0, float(start) - time.time()))

    async def worker() -> None:
        while time.time() < end:
            began = time.perf_counter()
            at = time.time()
            try:
                await router.acompletion(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                ok = True
            except (litellm.RateLimitError, ValueError) as exc:  # no deployment under its rpm
                ok = False
                del exc
            print(json.dumps([at, ok, time.perf_counter() - began]), flush=True)
            await asyncio.sleep(0.05)

    await asyncio.gather(*(worker() for _ in range(int(workers))))


asyncio.run(main())
