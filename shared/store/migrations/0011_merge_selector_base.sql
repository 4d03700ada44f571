-- The tables every run writes to, a small insert at a time, merge less eagerly. At the default
-- merge_selector_base (5) each few new parts were merged into the table's one big part, so a step's
-- merge work grew with everything stored before: on a store holding some forty earlier runs of the
-- built-in recipe, the store spent 95 ms of CPU per step, 2.3 s of merging per 40-step run; on a fresh
-- one 42 ms. At 20, the same old store spent 42 ms per step and 0.28 s merging (and kept 8-14 parts a
-- table); parts still merge as they age.
ALTER TABLE trajectories MODIFY SETTING merge_selector_base = 20;
ALTER TABLE otel_traces MODIFY SETTING merge_selector_base = 20;
ALTER TABLE tasks MODIFY SETTING merge_selector_base = 20;
ALTER TABLE train_steps MODIFY SETTING merge_selector_base = 20;
ALTER TABLE policy_versions MODIFY SETTING merge_selector_base = 20;
ALTER TABLE episode_turns MODIFY SETTING merge_selector_base = 20;
ALTER TABLE evaluations MODIFY SETTING merge_selector_base = 20;
