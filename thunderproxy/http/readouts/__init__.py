"""The proxy's state as the read-only endpoints show it: ``GET /programs`` in pages
(``listing``) and ``/metrics`` in Prometheus' text format with its ``Accept`` negotiation
(``prometheus``). Pure: each takes a snapshot or the registry and returns what is sent.
"""
