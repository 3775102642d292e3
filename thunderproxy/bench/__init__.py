"""thunderproxy bench: replay recorded agentic traces through a target (no proxy, thunderproxy
``default`` or ``tr``, any other proxy, or the unbounded-KV oracle) against simulated vLLM
backends, and measure it.

Layers, from the data up:
- workload.py, traces.py, prompts.py: traces into programs, steps and exact prompt tokens (pure,
  plus the file reading);
- agent.py, transport.py: the one agent loop, over HTTP or in-process;
- virtual.py (MockClock, no sockets) and realtime.py (processes on loopback): the two clocks;
- figures.py (pure), store.py (SQLite), plot.py (matplotlib), harness.py (``run_bench``);
- overhead.py + fastbackend.py: proxy overhead; demo.py: ``thunderproxy demo``; cli.py.

The Python API::

    from thunderproxy.bench import BenchConfig, run_bench

    report = run_bench(BenchConfig(targets=("default", "tr"), virtual=True, concurrency=32,
                                   kv_tokens=425_000))
    print(report.table())
    report.to_json()["results"][1]["steps_per_min"]

Names are loaded on first use, so ``thunderproxy serve`` never imports the bench.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import BenchConfig
    from .harness import BenchReport, run_bench
    from .traces import load_workload
    from .virtual import TargetResult
    from .workload import ProgramSpec, StepSpec, Workload

_EXPORTS = {
    "BenchConfig": ".config",
    "BenchReport": ".harness",
    "run_bench": ".harness",
    "load_workload": ".traces",
    "TargetResult": ".virtual",
    "ProgramSpec": ".workload",
    "StepSpec": ".workload",
    "Workload": ".workload",
}

__all__ = [
    "BenchConfig",
    "BenchReport",
    "ProgramSpec",
    "StepSpec",
    "TargetResult",
    "Workload",
    "load_workload",
    "run_bench",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module, __name__), name)
