"""Replay the ThunderAgent SWE-agent runs through the engine and fit a timing profile.

The trace (``--trace thunderagent``, shipped in ``thunderproxy/traces/``) records GLM-4.5-FP8
on vLLM serving SWE-agent with 1, 4 and 32 parallel workers (runs bs1, bs4, bs32). Each
program is replayed closed-loop on trio's MockClock (virtual time, seconds per run):
append-only prompts (so prefix caching behaves as it did), the recorded tool gaps, and
output lengths of text plus tool-call arguments. TTFT and TPOT are then measured the way
the trace measured them (TPOT = decode time / text tokens).

    python -m thunderproxy.sim.calibrate                 # compare the glm45-swe profile
    python -m thunderproxy.sim.calibrate --fit           # search the constants again
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import click
import trio
import trio.testing

from ..traces import read_jsonl, resolve
from .config import PROFILES, SimConfig
from .engine.core import Engine

TRACE = "thunderagent_sweagent_glm45_calls.jsonl"
RUNS = {"bs1": 1, "bs4": 4, "bs32": 32}
# input_tokens leaves out the tool schemas, a block shared by every call (README: 1-2K).
SHARED_PREFIX = 1500
FIT_KNOBS = ("t_w_ms", "c_tok_us", "c_kv_ns", "c_prep_us", "kv_capacity_tokens")


def trace_path(folder: str | None = None) -> Path:
    """The calls trace: in ``folder`` when given, else where ``--trace thunderagent`` finds it."""
    return resolve(str(Path(folder) / TRACE) if folder else "thunderagent")


def load_programs(path: Path, run: str) -> list[list[dict[str, Any]]]:
    programs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in read_jsonl(path):
        if row["run"] == run:
            programs[row["program_id"]].append(row)
    ordered = sorted(programs.values(), key=lambda steps: steps[0]["program_start_s"])
    return [sorted(steps, key=lambda r: r["step"]) for steps in ordered]


def impute_args(data: dict[str, list[list[dict[str, Any]]]]) -> None:
    """Fill missing tool-call argument counts (seeded), keeping their link to the text.

    The README suggests sampling or a 2.1x scale. Sampling the *ratio* (text+args)/text of
    the calls where arguments are known keeps both the spread and the correlation with the
    text length; on those calls decode time / (text+args) is tight (bs1 17/21 ms p50/p90),
    so the spread of the trace's text-only TPOT comes from this ratio.
    """
    rows = [r for programs in data.values() for steps in programs for r in steps]
    ratios = [
        (r["output_tokens"] + r["tool_call_arg_tokens_est"]) / r["output_tokens"]
        for r in rows
        if r["tool_call_arg_tokens_est"] is not None and r["output_tokens"] > 0
    ]
    rng = random.Random("args")
    for row in rows:
        known = row["tool_call_arg_tokens_est"]
        text = max(1, int(row["output_tokens"]))
        row["args_tokens"] = (
            int(known) if known is not None else round(text * (rng.choice(ratios) - 1))
        )


def decode_length(row: dict[str, Any]) -> int:
    return max(1, int(row["output_tokens"])) + int(row["args_tokens"])


@dataclasses.dataclass
class CallResult:
    ttft: float
    tpot_text: float | None
    tpot_known: float | None  # decode / (text + args), where the trace knows the args
    cached: int
    prompt: int


async def _replay(
    config: SimConfig, programs: list[list[dict[str, Any]]], workers: int
) -> list[CallResult]:
    engine = Engine(config)
    shared = [random.Random("shared").randrange(100_000) for _ in range(SHARED_PREFIX)]
    results: list[CallResult] = []
    queue = list(reversed(programs))

    async def run_program(steps: list[dict[str, Any]], index: int) -> None:
        rng = random.Random(f"program:{index}")
        await trio.sleep(steps[0]["env_prepare_s"])
        prompt = shared + [rng.randrange(100_000) for _ in range(steps[0]["input_tokens"])]
        for k, row in enumerate(steps):
            n_out = decode_length(row)
            handle = engine.submit(prompt, max_tokens=n_out, ignore_eos=True,
                                   request_id=f"p{index}-{k}", program=f"p{index}")  # fmt: skip
            outputs = [out async for out in handle]
            first, last = outputs[0], outputs[-1]
            text = row["output_tokens"]
            results.append(
                CallResult(
                    ttft=first.time - first.arrival_time,
                    tpot_text=(last.time - first.time) / text if text > 1 else None,
                    tpot_known=(last.time - first.time) / n_out
                    if text > 1 and row["tool_call_arg_tokens_est"] is not None
                    else None,
                    cached=last.num_cached_tokens,
                    prompt=last.num_prompt_tokens,
                )
            )
            if k + 1 == len(steps):
                return
            prompt = prompt + [t for out in outputs for t in out.token_ids]
            grow = steps[k + 1]["input_tokens"] - row["input_tokens"] - n_out
            prompt += [rng.randrange(100_000) for _ in range(max(0, grow))]
            prompt = prompt[: config.max_model_len - 4096]  # stay inside the context
            await trio.sleep(row["gap_after_s"] or 0.0)

    async def worker() -> None:
        while queue:
            index = len(queue)
            await run_program(queue.pop(), index)

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as pool:
            for _ in range(workers):
                pool.start_soon(worker)
        nursery.cancel_scope.cancel()
    return results


def replay(
    config: SimConfig, programs: list[list[dict[str, Any]]], workers: int
) -> list[CallResult]:
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(_replay, config, programs, workers, clock=clock)


def quantiles(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values), values[int(0.9 * (len(values) - 1))]


def trace_stats(programs: list[list[dict[str, Any]]]) -> dict[str, float]:
    rows = [r for steps in programs for r in steps]
    ttft = quantiles([r["ttft_s"] for r in rows])
    tpot = quantiles(
        [r["decode_time_s"] / r["output_tokens"] for r in rows if r["output_tokens"] > 1]
    )
    known = quantiles(
        [
            r["decode_time_s"] / decode_length(r)
            for r in rows
            if r["output_tokens"] > 1 and r["tool_call_arg_tokens_est"] is not None
        ]
    )
    return {"ttft_p50": ttft[0], "ttft_p90": ttft[1], "tpot_p50": tpot[0], "tpot_p90": tpot[1],
            "tpot_known_p50": known[0], "tpot_known_p90": known[1]}  # fmt: skip


def sim_stats(results: list[CallResult]) -> dict[str, float]:
    ttft = quantiles([r.ttft for r in results])
    tpot = quantiles([r.tpot_text for r in results if r.tpot_text is not None])
    known = quantiles([r.tpot_known for r in results if r.tpot_known is not None])
    hit = sum(r.cached for r in results) / sum(r.prompt for r in results)
    return {"ttft_p50": ttft[0], "ttft_p90": ttft[1], "tpot_p50": tpot[0], "tpot_p90": tpot[1],
            "tpot_known_p50": known[0], "tpot_known_p90": known[1], "hit_rate": hit}  # fmt: skip


def evaluate(
    config: SimConfig, data: dict[str, list[list[dict[str, Any]]]]
) -> dict[str, dict[str, float]]:
    return {run: sim_stats(replay(config, programs, RUNS[run])) for run, programs in data.items()}


def loss(sim: dict[str, dict[str, float]], real: dict[str, dict[str, float]]) -> float:
    """Squared log error of TTFT and text TPOT per run, p50s at full weight, p90s at 1/4.

    `tpot_known` is left out on purpose: it is a cross-check of the same decode speed.
    """
    total = 0.0
    for run, stats in sim.items():
        for key, weight in (
            ("ttft_p50", 1.0),
            ("tpot_p50", 1.0),
            ("ttft_p90", 0.25),
            ("tpot_p90", 0.25),
        ):
            total += weight * math.log(stats[key] / real[run][key]) ** 2
    return total


def _config_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    return dict(knobs)


def table(sim: dict[str, dict[str, float]], real: dict[str, dict[str, float]]) -> str:
    lines = ["| run | metric | trace | simulated | error |", "|---|---|---:|---:|---:|"]
    for run in sim:
        for key in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "tpot_known_p50",
                    "tpot_known_p90"):  # fmt: skip
            r, s = real[run][key], sim[run][key]
            error = 100 * (s - r) / r
            lines.append(
                f"| {run} | {key} | {r * 1000:.0f} ms | {s * 1000:.0f} ms | {error:+.0f}% |"
            )
        lines.append(f"| {run} | prefix-hit rate | n/a | {sim[run]['hit_rate']:.1%} | |")
    return "\n".join(lines)


@click.command()
@click.option(
    "--traces",
    default=None,
    help="Folder holding the calls trace (default: the trace shipped with the package, "
    "or $THUNDERPROXY_TRACES).",
)
@click.option(
    "--profile", default="glm45-swe", show_default=True, type=click.Choice(list(PROFILES))
)
@click.option("--runs", default="bs1,bs4,bs32", show_default=True)
@click.option("--fit", is_flag=True, help="Coordinate search over the profile's constants.")
@click.option("--rounds", default=3, show_default=True, help="Search rounds with --fit.")
def main(traces: str | None, profile: str, runs: str, fit: bool, rounds: int) -> None:
    """Compare (or fit) a timing profile against the recorded vLLM timings."""
    path = trace_path(traces)
    data = {run: load_programs(path, run) for run in runs.split(",")}
    impute_args(data)
    real = {run: trace_stats(programs) for run, programs in data.items()}
    config = SimConfig(profile=profile, max_model_len=131_072)
    knobs: dict[str, Any] = {k: getattr(config.timing, k) for k in FIT_KNOBS}
    sim = evaluate(config, data)
    best = loss(sim, real)
    click.echo(f"start loss {best:.4f} {knobs}")
    step = 1.6
    for _ in range(rounds if fit else 0):
        for knob in FIT_KNOBS:
            for factor in (step, 1 / step):
                value = knobs[knob] * factor
                trial = {**knobs, knob: int(value) if isinstance(knobs[knob], int) else value}
                trial_sim = evaluate(config.replace(**_config_knobs(trial)), data)
                trial_loss = loss(trial_sim, real)
                click.echo(f"  {knob} x{factor:.2f}: loss {trial_loss:.4f}")
                if trial_loss < best:
                    knobs, sim, best = trial, trial_sim, trial_loss
                    break
        step = math.sqrt(step)
        click.echo(f"round done, loss {best:.4f} {knobs}")
    click.echo(table(sim, real))


if __name__ == "__main__":
    main()
