"""The one agent loop of the bench (``agent.py``: how programs arrive, how prompts grow, what is
recorded) and how its calls reach the model (``transport.py``: over HTTP, or through the gateway
in process). Imports only ``workloads/`` of the bench."""
