-- Requests the proxy refused before they became a program step (bad input, auth, overload):
-- the backend never saw them, and this is their only trace.

CREATE TABLE rejections (
    id INTEGER PRIMARY KEY,
    run_id INTEGER REFERENCES runs(id),
    at REAL NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    status INTEGER NOT NULL,     -- HTTP status answered (400, 401, 404, 408, 413, 429, ...)
    error_type TEXT NOT NULL,    -- OpenAI-style error type
    message TEXT NOT NULL,
    program_id TEXT              -- when the request named one that could be read
);
CREATE INDEX rejections_at ON rejections(at);
