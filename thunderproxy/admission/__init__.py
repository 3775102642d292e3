"""Admission control: rate limits per model and program class, a wait queue, fallback chains
(docs/LIMITS.md).

The ``[limits]`` section's values are read from ``config/limits.py``; ``limiter`` is the pure
accounting (windows, reservations, class shares), ``service`` the gateway's admission stage
around it, ``shared`` and ``shared_kv`` what several instances share through Redis.
"""
