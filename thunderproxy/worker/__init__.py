"""Serverless worker mode (Vast.ai): signed requests, workload accounting and queueing, the
startup benchmark and load reports to the autoscaler (docs/WORKER.md)."""

from .middleware import WorkerMiddleware
from .seen import restore_seen
from .service import serve_worker
from .signals import ProgramSignals, signals_from_services
from .state import WorkerConfig, WorkerState, worker_config

__all__ = [
    "ProgramSignals",
    "WorkerConfig",
    "WorkerMiddleware",
    "WorkerState",
    "restore_seen",
    "serve_worker",
    "signals_from_services",
    "worker_config",
]
