-- The configured client ([clients] in the config file) that started each council job, so that
-- its members' steps name that client, also when the job is resumed after a restart. NULL on
-- older rows and on every job of a proxy run without client keys.
ALTER TABLE council_jobs ADD COLUMN client TEXT;
