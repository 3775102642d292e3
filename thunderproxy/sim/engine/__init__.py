"""The simulated engine: what a vLLM (or SGLang) server does with requests, without HTTP.

It owns the KV blocks and their prefix hashes (``blocks``), one request's state (``request``),
the scheduler (continuous batching, chunked prefill, preemption: ``scheduler``), the CPU KV tier
(``offload``), step timing (``timing``), the stand-in tokenizer (``tokenizer``), the histograms
the engine observes (``metrics``) and the ground truth only a simulator can show (``truth``);
``core`` is the trio step loop over them, reading time only through ``trio.current_time()``.
All but ``core`` are pure. Nothing here imports the HTTP face (``sim/api/``).
"""
