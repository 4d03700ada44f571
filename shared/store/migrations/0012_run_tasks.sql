-- The task log keyed by run and task. 0003's `tasks` is keyed by task id alone, but task ids repeat from
-- run to run (a task file's ids, a seeded family's), and a later run's row replaced an earlier run's: the
-- earlier run's status then counted none of its tasks, and `crucible rescore` found none to grade again.
-- Services write here from now on (shared/store TASKS_TABLE); what `tasks` held is copied in (a copy made
-- twice, by two services migrating at once, collapses into one row an id and run).
CREATE TABLE IF NOT EXISTS run_tasks
(
    run_id String,
    task_id String,
    kind LowCardinality(String),
    split LowCardinality(String),
    prompt String CODEC(ZSTD(3)),
    group_size UInt32,
    payload_json String CODEC(ZSTD(3)),
    metadata Map(String, String),
    trace_id String,
    submitted_at DateTime64(3, 'UTC'),
    task_json String DEFAULT '' CODEC(ZSTD(3)),
    recorded_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (run_id, task_id)
SETTINGS merge_selector_base = 20;

INSERT INTO run_tasks (run_id, task_id, kind, split, prompt, group_size, payload_json, metadata, trace_id,
                       submitted_at, task_json, recorded_at)
SELECT run_id, task_id, kind, split, prompt, group_size, payload_json, metadata, trace_id, submitted_at,
       task_json, recorded_at
FROM tasks;
