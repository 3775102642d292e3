"""The simulator's HTTP faces over the engine, as one raw-ASGI app.

``app`` assembles the routes into ``SimApp``; ``asgi`` holds what the route modules share
(``Request``, the responses, ``Face``: what a route asks of the app), so they never import
``app``. The faces: the OpenAI/vLLM wire (``protocol``, ``responses``, ``errors``), tool calls
(``tools``, ``chat_tools``), Anthropic Messages (``anthropic``), OpenAI Responses
(``responses_api``), what they share for a generated answer (``serving``), SGLang's routes
(``sglang``), the simulator's own control routes (``control``), council-shaped answers
(``council``) and Prometheus' text (``exposition``).
"""
