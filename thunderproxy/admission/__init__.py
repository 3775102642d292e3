"""Admission control: rate limits per model and program class, a wait queue, fallback chains
(docs/LIMITS.md).

``spec`` is the ``[limits]`` config section, ``limiter`` the pure accounting (windows,
reservations, class shares), ``service`` the gateway's admission stage around it. This module
imports nothing so that ``config`` can import ``spec`` without a cycle.
"""
