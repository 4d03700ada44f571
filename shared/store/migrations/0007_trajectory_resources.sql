-- What a sample's sandbox run used: CPU time (user + system) and peak resident memory, as the
-- sandbox reported them in ExecutionResult.usage (0 for samples that ran nothing).
ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS cpu_s Float64 DEFAULT 0;
ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS max_rss_bytes UInt64 DEFAULT 0;
