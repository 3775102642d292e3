"""thunderproxy bench: replay recorded agentic traces through a target (no proxy, thunderproxy
``default`` or ``tr``, any other proxy, or the unbounded-KV oracle) against simulated vLLM
backends, and measure it.

Rooms, from the data up; each imports only the rooms before it (and ``config.py`` only
``workloads/`` and ``agents/``):
- workloads/: traces into programs, steps and exact prompt tokens (pure, plus the file reading);
- agents/: the one agent loop, over HTTP or in-process;
- report/: the figures (pure) and the sweep plot (matplotlib);
- config.py: what one run is asked to do (``BenchConfig``);
- engine/: a real engine (vLLM's CPU build): its install, the tiny model and tokenizer it
  serves, starting and reading it, and measuring its step time into a timing profile;
- runs/: the two clocks (virtual.py on MockClock, realtime.py with processes on loopback,
  over simulators or a real engine), harness.py (``run_bench``), store.py (SQLite), the
  suite, ``thunderproxy demo`` and ``--calibrate``;
- relay/: proxy overhead and the CPU a relayed call costs (``--overhead``, ``python -m``);
- studies/: stand-alone studies (scale, scale-out, worker signals, councils);
- cli.py: ``thunderproxy bench`` and ``thunderproxy demo``.

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
    from .runs.harness import BenchReport, run_bench
    from .runs.virtual import TargetResult
    from .workloads.traces import load_workload
    from .workloads.workload import ProgramSpec, StepSpec, Workload

_EXPORTS = {
    "BenchConfig": ".config",
    "BenchReport": ".runs.harness",
    "run_bench": ".runs.harness",
    "load_workload": ".workloads.traces",
    "TargetResult": ".runs.virtual",
    "ProgramSpec": ".workloads.workload",
    "StepSpec": ".workloads.workload",
    "Workload": ".workloads.workload",
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
