-- Held-out tasks scored by samples at the training temperature too, besides greedily: how many
-- completions were drawn over the whole set, and how many passed (0 and 0 where none were).
ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS samples UInt32 DEFAULT 0;
ALTER TABLE evaluations ADD COLUMN IF NOT EXISTS samples_passed UInt32 DEFAULT 0;
