"""What the bench replays: recorded traces and made-up workloads turned into programs, steps and
exact prompt tokens (``workload.py``, ``synthetic.py``, ``prompts.py``, all pure), and the
reading of trace files and audit dbs into them (``traces.py``). Imports nothing else of the
bench."""
