-- Every task consumed from crucible.tasks, as the control service recorded it. A replayed
-- record rewrites the same row (ReplacingMergeTree on task_id).
CREATE TABLE IF NOT EXISTS tasks
(
    task_id String,
    kind LowCardinality(String),
    split LowCardinality(String),
    prompt String CODEC(ZSTD(3)),
    group_size UInt32,
    payload_json String CODEC(ZSTD(3)),
    metadata Map(String, String),
    trace_id String,
    submitted_at DateTime64(3, 'UTC'),
    recorded_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY task_id;
