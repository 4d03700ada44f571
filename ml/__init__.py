"""The ML domain: the policy (model, tokenizer, checkpoints, sampling, losses, backends), the task kinds, advantages and task families."""
