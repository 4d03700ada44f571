"""The policy every service shares: tokenizer, model, checkpoints, sampling (generator) and training (learner)."""
