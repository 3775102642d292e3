-- Serverless worker mode (docs/WORKER.md): what the worker did towards the autoscaler and the
-- requests it refused on its behalf: benchmark results, load reports sent or failed, signing-key
-- fetches, signature failures, replays and queue rejections.

CREATE TABLE worker_events (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    event TEXT NOT NULL,          -- benchmark, report_sent, report_failed, signature_failed, ...
    report_addr TEXT,             -- the autoscaler address concerned, for reports and key fetches
    reqnum INTEGER,               -- the signed request's number, for request events
    workload REAL,                -- the request's workload (auth_data.cost), for request events
    status INTEGER,               -- HTTP status answered or received
    message TEXT,                 -- what happened, in words
    data TEXT                     -- JSON details: the report sent, the benchmark's figures
);
CREATE INDEX worker_events_at ON worker_events(at);
CREATE INDEX worker_events_event ON worker_events(event, at);
