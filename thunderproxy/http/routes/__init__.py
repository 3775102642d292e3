"""The Quart app's routes, one blueprint per purpose, each registered by ``create_app``
(http/app.py) in this order: ``llm`` (the APIs a client calls: chat, completions, Messages and
count_tokens, Responses, the models), ``readouts`` (what the proxy shows: the root, /health,
/metrics, /programs, /profiles), ``admin`` (what changes its state: releasing a program) and
``passthrough`` (any other path, relayed to a backend). Routes only translate HTTP into calls on
the services and their answers back; the checks every request passes before them are the app's
hooks (http/checks.py)."""
