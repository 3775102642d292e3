"""What the proxy adds to a relayed stream, and where it goes: ``thunderproxy bench --overhead``
(``overhead.py``) against the fast backend (``fastbackend.py``) and the baseline relays
(``relay_floor.py``, ``relay_fastapi.py``), and the CPU studies run with ``python -m``: a
profile's cost per phase (``requestcost.py``), the proxy's own work per call in process
(``callcost.py``) and a chunk read's cost (``readcost.py``). Imports ``runs/``'s process
helpers, ``report/`` and ``agents/``; no other room imports it."""
