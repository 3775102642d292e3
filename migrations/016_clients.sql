-- The configured client ([clients] in the config file) that sent each call, on its steps row,
-- and each refused request whose key was checked, on its rejections row. NULL on older rows,
-- on every row of a proxy run without client keys, and on a refusal of a request that carried
-- no valid key (a 401 names no client).
ALTER TABLE steps ADD COLUMN client TEXT;
ALTER TABLE rejections ADD COLUMN client TEXT;
