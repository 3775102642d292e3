"""thunderproxy: a program-aware proxy for agentic LLM inference.

Data flows request in -> program registry -> scheduler -> backend client -> audit writer -> SQLite:

    http/        routes that translate HTTP to domain calls and back
    programs/    the program state machine and registry (pure)
    scheduling/  placement and capacity policy (pure) plus its trio glue
    backends/    one httpx client per backend, metrics parsing and polling
    audit/       record types, the single SQLite writer, migrations
    runtime.py   the one nursery that owns every long-lived task
    sim/         a simulated vLLM/SGLang backend for tests, demos and benchmarks
"""

__version__ = "0.1.0"
