-- Benchmark results (`thunderproxy bench`): one bench_runs row per invocation, one bench_results
-- row per target and concurrency it measured, and every call as the bench's agents saw it.
-- Durations are simulated seconds (the bench divides wall time by its --time-scale); bench_steps
-- times are simulated seconds since that target's run started. Runs of the bench's own
-- thunderproxy (and virtual-time runs of the scheduler) land in runs/steps/transitions/decisions
-- as usual; bench_results.proxy_run_id points at them.

CREATE TABLE bench_runs (
    id INTEGER PRIMARY KEY,
    started_at REAL NOT NULL,    -- Unix seconds
    finished_at REAL,
    version TEXT NOT NULL,
    command TEXT NOT NULL,       -- the command line, as run
    trace TEXT NOT NULL,         -- the --trace value
    workload TEXT NOT NULL,      -- thunderagent | mooncake-conversation | ... | audit db name
    clock TEXT NOT NULL,         -- virtual | real
    config TEXT NOT NULL,        -- JSON of every bench option
    notes TEXT NOT NULL          -- JSON list: how the workload was built, what was imputed
);

CREATE TABLE bench_results (
    id INTEGER PRIMARY KEY,
    bench_run_id INTEGER NOT NULL REFERENCES bench_runs(id),
    target TEXT NOT NULL,        -- direct | default | tr | oracle | an external proxy URL
    concurrency INTEGER NOT NULL,
    kv_tokens INTEGER NOT NULL,  -- KV capacity of each simulated backend
    proxy_run_id INTEGER REFERENCES runs(id),
    steps_per_min REAL,
    steps_per_min_busy REAL,     -- until the first agent found no program left to start
    programs_completed INTEGER,
    programs_total INTEGER,
    steps_completed INTEGER,
    output_tokens_per_s REAL,
    prefix_hit_rate REAL,        -- simulator truth: hits / queried prompt tokens
    prefill_tokens INTEGER,      -- prompt tokens computed (queried - hit)
    evicted_prefix_tokens INTEGER,  -- own history a call could have hit but had to recompute
    recomputed_prefill_tokens INTEGER,  -- simulator truth: recomputed after preemption
    preemptions INTEGER,
    evictions INTEGER,
    step_latency_p50_s REAL,
    step_latency_p99_s REAL,
    ttft_p50_s REAL,
    ttft_p99_s REAL,
    program_time_p50_s REAL,
    program_time_p99_s REAL,
    pause_time_total_s REAL,     -- calls waiting in the proxy for a resume; NULL: unknown
    errors INTEGER,
    duration_s REAL,
    proxy_cpu_s REAL,            -- CPU seconds of the bench's thunderproxy process (real time)
    wall_s REAL,
    figures TEXT NOT NULL        -- JSON of every figure (a superset of the columns)
);
CREATE INDEX bench_results_run ON bench_results(bench_run_id);

CREATE TABLE bench_steps (
    id INTEGER PRIMARY KEY,
    bench_result_id INTEGER NOT NULL REFERENCES bench_results(id),
    program_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    sent_s REAL NOT NULL,
    first_token_s REAL,
    finished_s REAL NOT NULL,
    prompt_tokens INTEGER NOT NULL,     -- the prompt the bench sent
    output_tokens INTEGER NOT NULL,     -- the decode length it asked for
    reusable_tokens INTEGER NOT NULL,   -- the program's previous prompt and answer
    cached_tokens INTEGER,              -- prefix-cache hit the backend reported
    status INTEGER NOT NULL,
    error TEXT
);
CREATE INDEX bench_steps_result_program ON bench_steps(bench_result_id, program_id, step);
