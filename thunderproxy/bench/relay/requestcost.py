"""Where a relayed request's CPU goes, phase by phase, from a cProfile dump of the proxy.

``thunderproxy bench --overhead --overhead-profile DIR`` runs each router's ``thunderproxy
serve`` under this module's recorder (cProfile timed by the main thread's CPU clock, not the
wall clock: on a shared machine wall time counts the waits for a core) and leaves one dump per
cell in DIR; this reads them:

    python -m thunderproxy.bench.relay.requestcost DIR/default-32.prof [...]

For each dump it prints microseconds of CPU per request in each phase of the request path.
cProfile charges a coroutine's time to it only while it runs, resume by resume, so a phase
is the inclusive time of the functions that do it, summed over every request the process
served (warm-up included) and divided by their number (the steps the gateway closed). The
event loop's work is trio's ``unrolled_run`` (its waits in ``epoll`` happen outside it); less
the main task's own time (start-up and shutdown) it is the total per request, and what the
named phases do not cover is "loop and rest" (trio's scheduling, cancel scopes, the
per-second background tasks). The profiler slows every Python call by a similar factor, so
the figures are inflated alike: read them as shares of the total and as ratios between dumps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import runpy
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

#: (file suffix, function name) of a profiled function.
Key = tuple[str, str]

#: Each phase: the functions whose inclusive time it is, less the functions nested in them that
#: another phase counts. A function absent from a dump (a path that no longer exists) counts 0.
PHASES: tuple[tuple[str, tuple[Key, ...], tuple[Key, ...]], ...] = (
    (
        "server: read and parse the request, ASGI scope, app task (Hypercorn or the front, h11)",
        (
            ("hypercorn/trio/tcp_server.py", "_read_data"),
            ("thunderproxy/http/front.py", "_next_request"),
        ),
        (),
    ),
    (
        "body: JSON parse and checks, protocol prepare",
        (
            ("thunderproxy/http/body.py", "read_body"),
            # (before read_body; within it now only for a body its scan leaves to this)
            ("thunderproxy/http/proxy.py", "parse_json_object"),
            ("thunderproxy/http/validate.py", "check_identifiers"),
            ("thunderproxy/protocols/__init__.py", "prepare"),
        ),
        (),
    ),
    (
        "recognise the program",
        (("thunderproxy/protocols/recognition.py", "recognise"),),
        (),
    ),
    (
        "route, admit, scheduler lease",
        (
            ("thunderproxy/backends/pool.py", "route"),
            ("thunderproxy/gateway.py", "admit"),
            ("thunderproxy/scheduling/scheduler.py", "lease"),
        ),
        (),
    ),
    (
        "upstream: request built, sent, answer's head read",
        (("thunderproxy/gateway.py", "open"),),
        (
            ("thunderproxy/backends/pool.py", "route"),
            ("thunderproxy/gateway.py", "admit"),
            ("thunderproxy/scheduling/scheduler.py", "lease"),
        ),
    ),
    (
        "relay loop: upstream reads, usage tap (per chunk)",
        (("thunderproxy/gateway.py", "stream"),),
        (("thunderproxy/gateway.py", "_close"),),
    ),
    (
        "downstream: every send to the client (Hypercorn or the front, h11, socket)",
        (
            ("hypercorn/protocol/http_stream.py", "app_send"),
            ("thunderproxy/http/front.py", "send"),
        ),
        (),
    ),
    (
        "step's end: lease closed, audit row, statistics, profile",
        # ``_close``, not ``finish``: Exchange.finish and Gateway.finish share the name, and the
        # one calls the other, so by name the step's end was counted twice.
        (("thunderproxy/gateway.py", "_close"),),
        (),
    ),
    (
        "close: exchange closed, connection released",
        (("thunderproxy/gateway.py", "aclose"),),
        (),
    ),
)

#: The tasks an exchange runs in: the one Hypercorn spawns for the request, quart-trio's two
#: (its handler and its receiver) or the fast path's disconnect watcher; on the HTTP front, the
#: exchange runs in the connection's own task.
APP_TASKS: tuple[Key, ...] = (
    ("hypercorn/trio/task_group.py", "_handle"),
    ("thunderproxy/http/front.py", "_exchange"),
    ("quart_trio/asgi.py", "handle_request"),
    ("quart_trio/asgi.py", "handle_messages"),
    ("thunderproxy/http/fastpath.py", "_cancel_on_disconnect"),
)
REQUESTS: Key = ("thunderproxy/gateway.py", "_close")
#: One call per upstream read of a chunked body: how many reads the chunks of a request took
#: (fewer when the proxy fell behind and one read brought several), which the per-chunk
#: phases scale with.
READS: Key = ("thunderproxy/backends/h1.py", "feed")
LOOP: Key = ("trio/_core/_run.py", "unrolled_run")
MAIN: Key = ("thunderproxy/runtime.py", "run")


@dataclass
class Profile:
    name: str
    requests: int
    #: (phase, µs per request), the app's own frames and the rest last.
    phases: list[tuple[str, float]]
    total_us: float
    reads_per_request: float


def _index(stats: pstats.Stats) -> dict[Key, tuple[int, float, float]]:
    """(primitive calls, self seconds, inclusive seconds) by (file, function), summed over
    functions of the same name in one file."""
    out: dict[Key, tuple[int, float, float]] = {}
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    raw = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, function), (primitive, _calls, tottime, cumtime, _) in raw.items():
        key = (filename, function)
        calls, self_s, incl = out.get(key, (0, 0.0, 0.0))
        out[key] = (calls + primitive, self_s + tottime, incl + cumtime)
    return out


def _find(index: dict[Key, tuple[int, float, float]], key: Key) -> tuple[int, float, float]:
    suffix, function = key
    calls, self_s, incl = 0, 0.0, 0.0
    for (filename, name), value in index.items():
        if name == function and filename.endswith(suffix):
            calls += value[0]
            self_s += value[1]
            incl += value[2]
    return calls, self_s, incl


def _inclusive(index: dict[Key, tuple[int, float, float]], keys: Iterable[Key]) -> float:
    return sum(_find(index, key)[2] for key in keys)


def analyse(path: str) -> Profile:
    index = _index(pstats.Stats(path))
    requests = max(1, _find(index, REQUESTS)[0])
    busy = _find(index, LOOP)[2] - _find(index, MAIN)[2]
    phases: list[tuple[str, float]] = []
    named = 0.0
    for name, included, excluded in PHASES:
        seconds = max(0.0, _inclusive(index, included) - _inclusive(index, excluded))
        named += seconds
        phases.append((name, 1e6 * seconds / requests))
    # The app's tasks hold the edge, the relay and the sends: what is left of them is the
    # framework's own work around the edge.
    app = _inclusive(index, APP_TASKS) - (named - phases_seconds(phases, 0, requests))
    app = max(0.0, app)
    phases.append(("the app around the edge: Quart, or the fast path", 1e6 * app / requests))
    rest = max(0.0, busy - named - app)
    phases.append(("loop and rest: trio scheduling, background tasks", 1e6 * rest / requests))
    reads = _find(index, READS)[0] / requests
    return Profile(path, requests, phases, 1e6 * busy / requests, reads)


def phases_seconds(phases: Sequence[tuple[str, float]], index: int, requests: int) -> float:
    """Seconds of one phase, back from µs per request."""
    return phases[index][1] * requests / 1e6


def table(profiles: Sequence[Profile]) -> str:
    header = "| phase | " + " | ".join(p.name for p in profiles) + " |"
    lines = [header, "| --- |" + " ---: |" * len(profiles)]
    for i, (name, _) in enumerate(profiles[0].phases):
        cells = " | ".join(f"{p.phases[i][1]:,.0f}" for p in profiles)
        lines.append(f"| {name} | {cells} |")
    totals = " | ".join(f"**{p.total_us:,.0f}**" for p in profiles)
    lines.append(f"| **total per request** | {totals} |")
    counts = " | ".join(str(p.requests) for p in profiles)
    lines.append(f"| requests in the dump | {counts} |")
    reads = " | ".join(f"{p.reads_per_request:.1f}" for p in profiles)
    lines.append(f"| upstream reads per request | {reads} |")
    return "\n".join(lines)


def record(out: str, argv: Sequence[str], program: Callable[[], object]) -> None:
    """Run ``program`` (thunderproxy's CLI) on ``ARGV`` (``serve ...``) with cProfile, timed by
    the main thread's CPU clock, from the first SIGUSR1 on (the bench sends it when its measured
    window opens, so start-up, Datasette's imports and the warm-up stay out); the dump is
    written to ``out`` when it exits."""
    profiler = cProfile.Profile(time.thread_time)
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    sys.argv = ["thunderproxy", *argv]
    try:
        program()
    except SystemExit:
        pass
    finally:
        profiler.disable()
        profiler.dump_stats(out)


def record_argv(out: str, serve_argv: Sequence[str]) -> list[str]:
    """``serve_argv`` (``python -m thunderproxy serve ...``) run under :func:`record`."""
    return [sys.executable, "-m", __name__, "--record", out, "--", *serve_argv[3:]]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", metavar="OUT", help="run thunderproxy ARGS, profiled, to OUT")
    parser.add_argument("args", nargs="+", help="cProfile dumps, or (--record) thunderproxy's")
    args = parser.parse_args(argv)
    if args.record:
        record(
            args.record, args.args, lambda: runpy.run_module("thunderproxy", run_name="__main__")
        )
        return
    print(table([analyse(path) for path in args.args]))


if __name__ == "__main__":
    main()
