-- The scheduler's decision log (router tr): one row per decision, with the inputs it was made on,
-- so "why was my program paused for 40 s?" is one query.

CREATE TABLE decisions (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    program_id TEXT NOT NULL,
    action TEXT NOT NULL,        -- admit | queue | pause | mark | unmark | resume | migrate |
                                 -- retire | force_resume | reject | cancel
    rule TEXT NOT NULL,          -- the rule that fired (see docs/SCHEDULING.md)
    backend TEXT,                -- the backend the decision concerns
    target_backend TEXT,         -- resume/migrate: where the program goes
    capacity_tokens INTEGER,     -- the backend's KV capacity the policy used
    used_tokens INTEGER,         -- projected KV use when deciding, credits applied
    program_tokens INTEGER,      -- the program's KV footprint
    idle_s REAL,                 -- how long the program had been acting (off the GPU)
    waited_s REAL,               -- how long it had been paused or queued
    queue_position INTEGER,      -- its place among waiting programs (0 = next)
    detail TEXT                  -- JSON: any further inputs of the rule
);
CREATE INDEX decisions_program_at ON decisions(program_id, at);
CREATE INDEX decisions_at ON decisions(at);
CREATE INDEX decisions_action_at ON decisions(action, at);
