-- Views that make the operator's questions one short query each (Datasette shows them next to
-- the tables). Times stay Unix seconds; every view adds a readable UTC column beside them.
-- Views only: nothing here stores data, so dropping and recreating them is always safe.

-- One row per stretch of time a program spent in one state, closed by its next transition.
CREATE VIEW program_states AS
SELECT
    t.id,
    t.run_id,
    t.program_id,
    t.to_status AS status,
    t.reason,
    t.backend,
    t.step,
    strftime('%Y-%m-%d %H:%M:%f', t.at, 'unixepoch') AS started_utc,
    t.at AS started_at,
    lead(t.at) OVER w AS ended_at,
    lead(t.at) OVER w - t.at AS duration_s,
    lead(t.reason) OVER w AS ended_by
FROM transitions AS t
WINDOW w AS (PARTITION BY t.run_id, t.program_id ORDER BY t.at, t.id);

-- Steps with their outcome named and their prefix-cache effect computed.
CREATE VIEW step_timings AS
SELECT
    s.id,
    s.run_id,
    s.program_id,
    s.step,
    s.backend,
    strftime('%Y-%m-%d %H:%M:%f', s.arrived_at, 'unixepoch') AS arrived_utc,
    s.arrived_at,
    s.finished_at,
    s.status,
    CASE
        WHEN s.status = 499 THEN 'client_gone'
        WHEN s.status >= 500 THEN 'backend_error'
        WHEN s.status >= 400 THEN 'rejected'
        ELSE 'ok'
    END AS outcome,
    s.queue_s,
    s.prefill_s,
    s.decode_s,
    -- A call with no first token (not streamed, or failed first) is not split in two.
    CASE WHEN s.first_token_at IS NULL THEN s.total_s - s.queue_s END AS unsplit_s,
    s.tool_s,
    s.ttft_s,
    s.total_s,
    s.prompt_tokens,
    s.completion_tokens,
    s.cached_tokens,
    s.prompt_tokens - s.cached_tokens AS recomputed_tokens,
    round(1.0 * s.cached_tokens / nullif(s.prompt_tokens, 0), 4) AS cache_hit_rate,
    s.stream,
    s.error
FROM steps AS s;

-- One row per program per proxy run: what it did, what it waited for, what it cost.
CREATE VIEW program_summary AS
WITH
    lifecycle AS (
        SELECT
            run_id,
            program_id,
            min(started_at) AS first_seen_at,
            max(started_at) AS last_change_at,
            sum(status = 'paused') AS pauses,
            coalesce(sum(CASE WHEN status = 'paused' THEN duration_s END), 0) AS paused_s
        FROM program_states
        GROUP BY run_id, program_id
    ),
    latest AS (
        SELECT run_id, program_id, status, max(started_at) AS at
        FROM program_states
        GROUP BY run_id, program_id
    ),
    work AS (
        SELECT
            run_id,
            program_id,
            count(*) AS steps,
            sum(status >= 400) AS failed_steps,
            sum(status = 499) AS client_gone_steps,
            sum(queue_s) AS queue_s,
            max(queue_s) AS max_queue_s,
            sum(prefill_s) AS prefill_s,
            sum(decode_s) AS decode_s,
            sum(tool_s) AS tool_s,
            sum(prompt_tokens) AS prompt_tokens,
            sum(completion_tokens) AS completion_tokens,
            sum(cached_tokens) AS cached_tokens,
            group_concat(DISTINCT backend) AS backends
        FROM steps
        GROUP BY run_id, program_id
    )
SELECT
    l.run_id,
    l.program_id,
    latest.status AS last_status,
    strftime('%Y-%m-%d %H:%M:%f', l.first_seen_at, 'unixepoch') AS first_seen_utc,
    l.first_seen_at,
    l.last_change_at,
    coalesce(w.steps, 0) AS steps,
    coalesce(w.failed_steps, 0) AS failed_steps,
    coalesce(w.client_gone_steps, 0) AS client_gone_steps,
    round(coalesce(w.queue_s, 0), 6) AS queue_s,
    round(coalesce(w.max_queue_s, 0), 6) AS max_queue_s,
    l.pauses,
    round(l.paused_s, 6) AS paused_s,
    round(w.prefill_s, 6) AS prefill_s,
    round(w.decode_s, 6) AS decode_s,
    round(w.tool_s, 6) AS tool_s,
    w.prompt_tokens,
    w.completion_tokens,
    w.cached_tokens,
    w.prompt_tokens - w.cached_tokens AS recomputed_tokens,
    round(1.0 * w.cached_tokens / nullif(w.prompt_tokens, 0), 4) AS cache_hit_rate,
    w.backends
FROM lifecycle AS l
JOIN latest USING (run_id, program_id)
LEFT JOIN work AS w USING (run_id, program_id);

-- Backend polls with the counters turned into per-interval figures (a counter that went down
-- means the backend restarted: that interval is left empty rather than negative).
CREATE VIEW backend_timeline AS
WITH deltas AS (
    SELECT
        b.*,
        b.prefix_hits_total - lag(b.prefix_hits_total) OVER w AS d_hits,
        b.prefix_queries_total - lag(b.prefix_queries_total) OVER w AS d_queries,
        b.preemptions_total - lag(b.preemptions_total) OVER w AS d_preemptions
    FROM backend_samples AS b
    WINDOW w AS (PARTITION BY b.run_id, b.backend ORDER BY b.at, b.id)
)
SELECT
    id,
    run_id,
    backend,
    strftime('%Y-%m-%d %H:%M:%f', at, 'unixepoch') AS at_utc,
    at,
    healthy,
    round(100.0 * kv_usage, 2) AS kv_usage_pct,
    capacity_tokens,
    active_tokens,
    round(100.0 * active_tokens / nullif(capacity_tokens, 0), 2) AS proxy_kv_pct,
    programs,
    running,
    waiting,
    CASE WHEN d_hits >= 0 AND d_queries >= 0 THEN d_hits END AS prefix_hits,
    CASE WHEN d_hits >= 0 AND d_queries >= 0 THEN d_queries END AS prefix_queries,
    CASE
        WHEN d_hits >= 0 AND d_queries > 0 THEN round(d_hits / d_queries, 4)
    END AS prefix_hit_rate,
    CASE WHEN d_preemptions >= 0 THEN d_preemptions END AS preemptions,
    error
FROM deltas;
