-- The audit log: one row per program state change, per proxied LLM call, per backend poll.
-- Times are Unix seconds (REAL); durations are seconds.

CREATE TABLE runs (
    id INTEGER PRIMARY KEY,
    started_at REAL NOT NULL,
    stopped_at REAL,
    version TEXT NOT NULL,
    router TEXT NOT NULL,
    backends TEXT NOT NULL,      -- comma-separated base URLs
    settings TEXT NOT NULL       -- JSON of every setting of this run
);

CREATE TABLE transitions (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    program_id TEXT NOT NULL,
    from_status TEXT,            -- NULL when the program is first seen
    to_status TEXT NOT NULL,     -- reasoning | acting | paused | stopped
    reason TEXT NOT NULL,
    backend TEXT,
    step INTEGER NOT NULL        -- steps the program had started when it changed state
);
CREATE INDEX transitions_program_at ON transitions(program_id, at);
CREATE INDEX transitions_at ON transitions(at);

CREATE TABLE steps (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    request_id TEXT NOT NULL,    -- X-Request-Id sent upstream: <program_id>-<step>
    program_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    backend TEXT,
    endpoint TEXT NOT NULL,
    model TEXT,
    stream INTEGER NOT NULL,
    arrived_at REAL NOT NULL,    -- request reached the proxy
    sent_at REAL,                -- forwarded upstream, after any queue or pause
    first_token_at REAL,         -- first streamed chunk from the backend
    finished_at REAL NOT NULL,
    queue_s REAL NOT NULL,       -- waiting for capacity or a resume (sent_at - arrived_at)
    ttft_s REAL,                 -- as the client saw it: arrived_at -> first token
    prefill_s REAL,              -- sent_at -> first token (backend queue + prefill)
    decode_s REAL,               -- first token -> last byte
    total_s REAL NOT NULL,       -- arrived_at -> finished_at
    tool_s REAL,                 -- the program's tool time just before this call
    prompt_tokens INTEGER,       -- NULL: the backend reported no usage
    completion_tokens INTEGER,
    cached_tokens INTEGER,       -- prefix-cache hit reported by the backend, if it reports it
    status INTEGER NOT NULL,     -- HTTP status; 499 when the client went away
    error TEXT
);
CREATE INDEX steps_program_step ON steps(program_id, step);
CREATE INDEX steps_arrived_at ON steps(arrived_at);
CREATE INDEX steps_backend_arrived_at ON steps(backend, arrived_at);

CREATE TABLE backend_samples (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    backend TEXT NOT NULL,
    healthy INTEGER NOT NULL,
    capacity_tokens INTEGER,     -- KV capacity derived from the backend's metrics
    kv_usage REAL,               -- vllm:kv_cache_usage_perc (0-1), prefix cache excluded
    running INTEGER,
    waiting INTEGER,
    prefix_queries_total REAL,
    prefix_hits_total REAL,
    preemptions_total REAL,
    programs INTEGER,            -- programs the proxy has placed on this backend
    active_tokens INTEGER,       -- their KV footprint as the proxy accounts it
    error TEXT
);
CREATE INDEX backend_samples_backend_at ON backend_samples(backend, at);
