-- A trajectory names its task by id; the prompt is stored once, in `tasks`. scoring_ms was never
-- measured (always 0).
ALTER TABLE trajectories DROP COLUMN IF EXISTS prompt;
ALTER TABLE trajectories DROP COLUMN IF EXISTS scoring_ms;
