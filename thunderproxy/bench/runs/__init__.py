"""``thunderproxy bench`` and ``thunderproxy demo`` runs: the two clocks (``virtual.py`` on
MockClock, ``realtime.py`` with processes on loopback), ``run_bench`` over every target
(``harness.py``), the progress bar, the results into SQLite (``store.py``), the scheduling suite
(``suite.py``) and the demo (``demo.py``). Imports ``config.py``, ``report/``, ``agents/`` and
``workloads/``; nothing in them imports it."""
