"""Stand-alone studies of the proxy beyond one bench run, each run with ``python -m``: per-call
cost against tracked programs (``scale.py``), several processes sharing state through Redis
(``scaleout.py``, with its throw-away ``redisserver.py``), worker mode's load reports
(``worker_signals.py``) and councils through ``tr`` (``council_bench.py``). Imports ``runs/``,
``config.py``, ``report/`` and ``agents/``; no other room imports it."""
