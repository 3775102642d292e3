-- The model a call was sent to, beside the one it asked for (steps.model): they differ where an
-- alias, an alias pattern ("claude-*"), the default_model setting or the only model served took
-- a name no backend serves. NULL on older rows, and for a call that reached no backend.
ALTER TABLE steps ADD COLUMN served_model TEXT;
