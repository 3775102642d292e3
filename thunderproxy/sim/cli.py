"""`thunderproxy sim`: serve a simulated vLLM (or SGLang) backend over HTTP.

Options are generated from `SimConfig`'s fields, so each knob has one definition; every
option also reads `THUNDERPROXY_SIM_<NAME>` from the environment.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from collections.abc import Callable
from typing import Any

import click
import trio

from .config import PROFILES, SimConfig
from .server import serve_simulator

ENV_PREFIX = "THUNDERPROXY_SIM_"
_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}


def _option(f: dataclasses.Field[Any]) -> Callable[[Any], Any]:
    meta = f.metadata
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    envvar = ENV_PREFIX + f.name.upper()
    help_text = meta["help"]
    type_name = str(f.type).replace(" | None", "")
    if type_name == "bool":
        if meta.get("negatable"):
            flag = f"{flag}/--no-{flag[2:]}"
        return click.option(flag, f.name, is_flag=True, default=f.default, envvar=envvar,
                            show_envvar=True, show_default=True, help=help_text)  # fmt: skip
    kind: Any = _TYPES[type_name]
    if meta.get("choices"):
        kind = click.Choice(list(meta["choices"]))
    shown = f.default is not None
    return click.option(flag, f.name, type=kind, default=f.default, envvar=envvar,
                        show_envvar=True, show_default=shown, help=help_text)  # fmt: skip


def _with_config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for f in reversed(dataclasses.fields(SimConfig)):
        func = _option(f)(func)
    return func


@click.command("sim")
@click.option("--host", default="127.0.0.1", show_default=True, envvar=ENV_PREFIX + "HOST",
              show_envvar=True, help="Address to bind.")  # fmt: skip
@click.option("--port", default=8000, show_default=True, type=int, envvar=ENV_PREFIX + "PORT",
              show_envvar=True, help="Port to bind (0 picks a free one).")  # fmt: skip
@_with_config_options
def sim_command(host: str, port: int, **knobs: Any) -> None:
    """Serve a simulated vLLM backend: real vLLM's HTTP and /metrics surface, a paged KV
    cache with prefix caching and LRU eviction, continuous batching with chunked prefill
    and recompute preemption, and a step-time model of a GPU.

    \b
    Examples:
      thunderproxy sim --port 8000
      thunderproxy sim --profile h100x4-70b --time-scale 0.1 --enable-prompt-tokens-details
      thunderproxy sim --personality sglang --enable-cache-report
      thunderproxy sim --block-size 32 --num-gpu-blocks 100 --max-num-batched-tokens 512

    Simulator-only truth is served under /_sim/* and as thundersim:* metrics.
    """
    try:
        config = SimConfig(**knobs)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    trio.run(_main, config, host, port)


async def _main(config: SimConfig, host: str, port: int) -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    shutdown.set()
                    return

        nursery.start_soon(on_signal)
        url = await nursery.start(
            lambda task_status: serve_simulator(
                config, host=host, port=port, shutdown_trigger=shutdown, task_status=task_status
            )
        )
        profile = PROFILES[config.profile]
        blocks = config.resolved_num_gpu_blocks()
        bs = config.resolved_block_size()
        print(
            f"thunderproxy sim: {config.personality} ({config.compat}) serving "
            f"{config.served_model_name!r} on {url}; profile {profile.name}, "
            f"{blocks} blocks x {bs} tokens, time scale {config.time_scale}",
            file=sys.stderr,
            flush=True,
        )
        await shutdown.wait()
    print("thunderproxy sim: stopped", file=sys.stderr, flush=True)
