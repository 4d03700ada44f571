-- The samples each optimiser step trained on (trajectory ids): a step redone after a crash replaces
-- its row, so over a run's FINAL rows an id that appears twice was trained twice.
ALTER TABLE train_steps ADD COLUMN IF NOT EXISTS samples Array(String) CODEC(ZSTD(3));
