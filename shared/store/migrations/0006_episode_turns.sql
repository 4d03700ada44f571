-- Multi-turn episodes: the episode itself is one row of `trajectories` (its whole transcript in
-- `completion`, `turns` set); each model turn is one row here, so a query shows a transcript turn by turn:
--   SELECT turn, action, tool, observation FROM episode_turns FINAL WHERE trajectory_id = '...' ORDER BY turn
CREATE TABLE IF NOT EXISTS episode_turns
(
    trajectory_id String,
    task_id String,
    group_id String,
    turn UInt32,
    task_kind LowCardinality(String),
    policy_version UInt64,
    action String CODEC(ZSTD(3)),
    tool LowCardinality(String),
    arguments String CODEC(ZSTD(3)),
    call_error String,
    call_failed Bool,
    observation String CODEC(ZSTD(3)),
    tokens UInt32,
    observation_tokens UInt32,
    execution_ms Float64,
    created_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(created_at)
ORDER BY (trajectory_id, turn);

ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS turns UInt32 DEFAULT 0;
