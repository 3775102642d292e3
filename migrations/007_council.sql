-- The council: conversations, their messages, council jobs and every event of every job.
-- Job events are written through their own awaited path (never the audit channel, which may
-- drop rows under load), so a stream can be replayed from any event, also after a restart.

CREATE TABLE council_conversations (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    title TEXT NOT NULL DEFAULT 'New conversation'
);

CREATE TABLE council_messages (
    id INTEGER PRIMARY KEY,
    conversation_id TEXT NOT NULL,
    role TEXT NOT NULL,               -- user | assistant
    content TEXT,                     -- the user's question
    job_id TEXT,                      -- the assistant message's council job
    created_at REAL NOT NULL
);
CREATE INDEX council_messages_by_conversation ON council_messages (conversation_id, id);

CREATE TABLE council_jobs (
    id TEXT PRIMARY KEY,
    conversation_id TEXT NOT NULL,
    question TEXT NOT NULL,
    status TEXT NOT NULL,             -- pending | stage1 | stage2 | stage3 | complete | error
    completed_stage INTEGER NOT NULL DEFAULT 0,
    members TEXT NOT NULL,            -- JSON list of model names
    chairman TEXT NOT NULL,
    title_model TEXT,                 -- set when the job also titles its conversation
    stage1 TEXT,                      -- JSON results of each stage, saved as each completes
    stage2 TEXT,
    stage3 TEXT,
    metadata TEXT,                    -- JSON: label_to_model, aggregate_rankings, failed members
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL,
    resumes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX council_jobs_by_conversation ON council_jobs (conversation_id, created_at);
CREATE INDEX council_jobs_by_status ON council_jobs (status);

CREATE TABLE council_events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,             -- 1, 2, ...: the SSE id
    at REAL NOT NULL,                 -- Unix seconds
    type TEXT NOT NULL,
    model TEXT,
    data TEXT NOT NULL,               -- JSON
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
