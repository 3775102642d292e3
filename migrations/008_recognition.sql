-- How each program was recognised (programs/recognition.py's Source: explicit, session_header,
-- claude_code, codex, litellm, previous_response, prompt_cache_key, user, prefix, new, default),
-- written on the program's first transition only; NULL on later ones and on older rows.
ALTER TABLE transitions ADD COLUMN source TEXT;

CREATE VIEW program_sources AS
SELECT program_id, source, MIN(at) AS created_at
  FROM transitions
 WHERE source IS NOT NULL
 GROUP BY program_id;
