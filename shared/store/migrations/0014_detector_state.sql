-- The reward aggregator's window detectors, as they stood after their last window (detectors.py
-- WindowDetectors.state, JSON): a restarted aggregator judges against the run's own baseline, not the
-- first window after its restart.
CREATE TABLE IF NOT EXISTS detector_state
(
    run_id String,
    windows UInt32,
    state String,
    updated_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(updated_at)
ORDER BY run_id;
