"""The reward-aggregator: joins a group's verdicts, weights rewards, computes advantages."""
