"""Backends: how the proxy reaches model servers (the one-method ``Backend`` seam), their
health, their metrics and the model groups they form."""

from ..urls import redact_url
from .base import Backend, UpstreamRequest, UpstreamResponse, header
from .http import HttpBackend, map_httpx_errors
from .metrics import EngineSnapshot, interpret
from .pool import BackendNode, BackendPool, Route, open_backend_pool

__all__ = [
    "Backend",
    "BackendNode",
    "BackendPool",
    "EngineSnapshot",
    "HttpBackend",
    "Route",
    "UpstreamRequest",
    "UpstreamResponse",
    "header",
    "interpret",
    "map_httpx_errors",
    "open_backend_pool",
    "redact_url",
]
