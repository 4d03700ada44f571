-- The task log keyed by run and task. 0003's `tasks` is keyed by task id alone, but task ids repeat from
-- run to run (a task file's ids, a seeded family's), and a later run's row replaced an earlier run's: the
-- earlier run's status then counted none of its tasks, and `crucible rescore` found none to grade again.
-- Services write here from now on (shared/store TASKS_TABLE); what `tasks` held is copied in (a copy made
-- twice, by two services migrating at once, collapses into one row an id and run). Its columns are
-- those of `tasks` (0003, 0008), keyed anew.
CREATE TABLE IF NOT EXISTS run_tasks AS tasks
ENGINE = ReplacingMergeTree(recorded_at)
ORDER BY (run_id, task_id)
SETTINGS merge_selector_base = 20;

INSERT INTO run_tasks SELECT * FROM tasks;
