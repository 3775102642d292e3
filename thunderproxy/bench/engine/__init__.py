"""A real engine as a bench target: vLLM's CPU build installed into a cache folder, a tiny
random-weight model and a tokenizer made locally (nothing downloaded), the engine started,
read and stopped, and its step times measured into a simulator timing profile."""
