-- Why the sandbox stopped an episode's call (timeout, memory, forbidden_syscall, ...), as a single-turn
-- run's `trajectories.violation` says it: '' where it ran to its end or did not run in the sandbox.
ALTER TABLE episode_turns ADD COLUMN IF NOT EXISTS violation LowCardinality(String) DEFAULT '';
