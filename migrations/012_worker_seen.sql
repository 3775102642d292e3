-- Serverless worker mode (docs/WORKER.md): the request numbers (reqnum) of signed requests this
-- worker accepted, so that a request replayed after a restart is refused as it is within a run.
-- Read back at startup (the newest 100,000); older rows are deleted then.

CREATE TABLE worker_seen (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    reqnum INTEGER NOT NULL,      -- the autoscaler's number for the request
    request_idx INTEGER,          -- the autoscaler's index for it
    path TEXT                     -- the route it was served on
);
CREATE INDEX worker_seen_reqnum ON worker_seen(reqnum);
