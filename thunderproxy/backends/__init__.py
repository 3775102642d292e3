"""Backends: one shared httpx client per OpenAI-compatible server, and what its metrics say."""

from .metrics import EngineSnapshot, interpret
from .pool import Backend, BackendPool, open_backend_pool

__all__ = ["Backend", "BackendPool", "EngineSnapshot", "interpret", "open_backend_pool"]
