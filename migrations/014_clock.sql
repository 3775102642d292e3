-- Which clock a run's times were read on, so that a run's figures read the same in Datasette
-- as where they were printed. 'wall': trio's clock, wall seconds (a proxy in production, and a
-- real-time bench or demo whose simulated backends run faster than real time); 'simulated': a
-- virtual bench run on a mock clock, its times simulated seconds from when it was stored.
-- time_scale: wall seconds per simulated second of the backends the run was measured against
-- (0.1: ten simulated seconds each wall second; a time of 2 s there is 20 simulated seconds);
-- NULL where the backends are real (or unknown): the times are what they say.

ALTER TABLE runs ADD COLUMN clock TEXT NOT NULL DEFAULT 'wall';
ALTER TABLE runs ADD COLUMN time_scale REAL;

-- A bench result's mean program completion time, beside its steps/min (its median and p99
-- were there already).
ALTER TABLE bench_results ADD COLUMN program_time_mean_s REAL;
