-- A backend's CPU KV tier (vLLM's offloading connector), as each metrics poll read it, so the
-- link's use over a run is a query (docs/SCHEDULING.md, "A CPU KV tier"). NULL: no tier, or
-- a backend that does not report it.

ALTER TABLE backend_samples ADD COLUMN cpu_capacity_tokens INTEGER;  -- tokens the tier holds
ALTER TABLE backend_samples ADD COLUMN offload_load_bytes_total REAL;  -- CPU->GPU bytes so far
ALTER TABLE backend_samples ADD COLUMN offload_load_seconds_total REAL;  -- their copies' seconds
