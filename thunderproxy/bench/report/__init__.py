"""A run's reported figures, computed pure from what the agents recorded (``figures.py``), and
the ``--sweep`` plot (``plot.py``, matplotlib optional). Imports only ``agents/`` of the
bench."""
