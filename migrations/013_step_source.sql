-- How each call was tied to its program (programs/recognition.py's Source: explicit,
-- session_header, claude_code, codex, litellm, previous_response, prompt_cache_key, user,
-- prefix, prompt_prefix, new, default), on every steps row; for a prompt continuation (prefix,
-- prompt_prefix) how many of its messages matched the program's history. NULL on older rows.
ALTER TABLE steps ADD COLUMN source TEXT;
ALTER TABLE steps ADD COLUMN matched_messages INTEGER;
