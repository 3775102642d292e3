-- A call waits in the proxy either at admission (its program's first call: the program has not
-- started, nothing of it is cached or under way) or mid-program (a later call: its history is
-- cached and its whole run is stretched by the wait). tr bounds both by --max-wait and orders
-- them differently (docs/SCHEDULING.md), so they are read apart.
-- Views only: nothing is stored, so recreating them is always safe.

CREATE VIEW call_waits AS
SELECT
    s.id,
    s.run_id,
    s.program_id,
    s.step,
    CASE WHEN s.step <= 1 THEN 'admission' ELSE 'mid_program' END AS wait_kind,
    strftime('%Y-%m-%d %H:%M:%f', s.arrived_at, 'unixepoch') AS arrived_utc,
    s.arrived_at,
    s.queue_s AS waited_s,
    s.ttft_s,
    s.status
FROM steps AS s;

-- Per proxy run and kind of wait: how many calls, how many waited at all, for how long.
CREATE VIEW wait_summary AS
SELECT
    run_id,
    wait_kind,
    count(*) AS calls,
    sum(waited_s > 0.001) AS calls_waited,
    round(sum(waited_s), 3) AS total_wait_s,
    round(avg(waited_s), 3) AS mean_wait_s,
    round(max(waited_s), 3) AS max_wait_s
FROM call_waits
GROUP BY run_id, wait_kind;
