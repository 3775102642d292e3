"""``bench --calibrate``: start (or reach) the engine, measure its step times and write the
simulator timing profile fitted to them (``engine/calibrate.py`` has the method)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import trio

from ...sim.config import SimConfig, TimingProfile
from ..config import ENGINES, BenchConfig
from ..engine import calibrate as method
from ..engine import model as engine_model
from ..engine import server as engine
from ..engine.server import Echo
from ..workloads.prompts import Vocabulary
from . import realtime

#: Block size of the CPU engine: its attention kernels want multiples of 32.
CPU_BLOCK_SIZE = 32
#: The KV the calibration's engine needs: every decode stream's own context at once (8
#: streams over 8K, 4 over 16K), with room.
CALIBRATION_KV_TOKENS = 81_920
CALIBRATION_MODEL_LEN = 32_768


def calibrate(
    config: BenchConfig, path: str, *, command: Sequence[str], echo: Echo
) -> TimingProfile:
    return trio.run(_calibrate, config, Path(path), " ".join(command), echo)


async def _calibrate(config: BenchConfig, path: Path, command: str, echo: Echo) -> TimingProfile:
    shape = engine_model.ModelShape()
    kv_tokens = config.kv_tokens or 40_960
    sim_config = SimConfig(
        **config.sim_settings, served_model_name=config.model, profile=config.profile,
        block_size=CPU_BLOCK_SIZE, kv_capacity_tokens=CALIBRATION_KV_TOKENS,
        max_model_len=CALIBRATION_MODEL_LEN, enable_prompt_tokens_details=True,
    )  # fmt: skip
    vocabulary = Vocabulary(seed=config.seed)
    with tempfile.TemporaryDirectory(prefix="thunderproxy-calibrate-") as scratch:
        async with realtime.ended_by_signals(), realtime.http_client(64) as client:
            reached = await realtime.reach_engine(
                config, sim_config, vocabulary, client=client, scratch=Path(scratch), echo=echo
            )
            server, model, word_ids = reached.server, reached.model, reached.word_ids
            try:
                echo("measuring prefill and decode step times (about 20 minutes on one core)")
                run = method.Calibration(
                    server, client, model=model, words=vocabulary.words, word_ids=word_ids,
                    budget=sim_config.max_num_batched_tokens, echo=echo,
                )  # fmt: skip
                measurements = await run.measure()
            finally:
                await server.stop()
    constants = method.fit(measurements)
    name = path.stem if config.engine_url else ENGINES.get(config.engine or "", path.stem)
    description = (
        f"fitted by `bench --calibrate` to vLLM's CPU build ({engine.VLLM_VERSION}) serving a "
        f"tiny random-weight model ({shape.layers} layers, hidden {shape.hidden}) on one core"
        if not config.engine_url
        else f"fitted by `bench --calibrate` to {config.engine_url}"
    )
    profile = method.profile_of(
        name, constants, kv_tokens=kv_tokens, block_size=sim_config.resolved_block_size(),
        kv_bytes_per_token=shape.kv_bytes_per_token, description=description,
    )  # fmt: skip
    for m in measurements:
        echo(f"  {m.kind:7} {m.label:>16}: measured {m.seconds * 1e3:8.2f} ms, "
             f"fitted {method.predicted(constants, m) * 1e3:8.2f} ms")  # fmt: skip
    method.write_profile(path, profile, measurements, command)
    return profile
