-- Held-out pass rate per policy version and task kind, written by the evaluator ('*': all kinds).
-- Re-scoring a version after a restart rewrites the same rows.
CREATE TABLE IF NOT EXISTS evaluations
(
    run_id String,
    policy_version UInt64,
    task_kind LowCardinality(String),
    tasks UInt32,
    passed UInt32,
    pass_rate Float64,
    eval_ms Float64,
    ts DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree(ts)
ORDER BY (run_id, policy_version, task_kind);
