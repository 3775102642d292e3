-- Each call's latency class (scheduling/classes.py: interactive, held at most
-- --interactive-max-wait; batch, at most --max-wait), as its program had it when the call went
-- out. NULL on older rows.
ALTER TABLE steps ADD COLUMN program_class TEXT;

-- Per proxy run and class: how many calls and programs, and how long their calls waited in the
-- proxy (a class's longest wait is what its bound promises) and to their first token.
CREATE VIEW class_waits AS
SELECT
    run_id,
    program_class,
    count(*) AS calls,
    count(DISTINCT program_id) AS programs,
    sum(queue_s > 0.001) AS calls_waited,
    round(avg(queue_s), 3) AS mean_wait_s,
    round(max(queue_s), 3) AS max_wait_s,
    round(avg(ttft_s), 3) AS mean_ttft_s,
    round(max(ttft_s), 3) AS max_ttft_s
FROM steps
GROUP BY run_id, program_class;
