-- Which run a stored task and sample belong to, and the whole task as JSON (what `crucible rescore`
-- needs to grade a stored sample again).
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS run_id String DEFAULT '';
ALTER TABLE tasks ADD COLUMN IF NOT EXISTS task_json String DEFAULT '' CODEC(ZSTD(3));
ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS run_id String DEFAULT '';
ALTER TABLE alerts ADD COLUMN IF NOT EXISTS run_id String DEFAULT '';

-- `crucible rescore`: a run's stored samples graded again by the current verifier, beside the
-- rewards they were trained on. One row per (rescore, sample).
CREATE TABLE IF NOT EXISTS rescores
(
    rescore_id String,
    run_id String,
    trajectory_id String,
    task_id String,
    task_kind LowCardinality(String),
    graded_as LowCardinality(String),
    policy_version UInt64,
    verifier_version LowCardinality(String),
    old_reward Float64,
    new_reward Float64,
    old_components Map(String, Float64),
    new_components Map(String, Float64),
    passed UInt8,
    tampered UInt8,
    detail String,
    ts DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(ts)
ORDER BY (run_id, rescore_id, trajectory_id);
