"""One learner step as one rank of N (run under torchrun by test_learner_ranks.py): the same batch on
every rank, written out by rank 0 as the weights after the step and the step's figures.

python tests/learner_ranks_step.py OUT SHARDING OBJECTIVE MICRO_BATCH GROUPS
"""
from __future__ import annotations

import json
import sys

import torch

from crucible.ml.policy.checkpoint import fresh_policy
from crucible.services.learner.ranks import Ranks
from crucible.services.learner.trainer import Trainer
from crucible.shared.settings import RunConfig
from tests.test_learner import SEED, trajectories_for


def whole(trainer: Trainer) -> dict:
    """The whole optimiser state keyed by parameter name (gathered from every rank under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(out: str, sharding: str, objective: str, micro_batch: int, groups: int) -> None:
    ranks = Ranks.from_env(sharding)
    rewards = [[1, 0, 0, 1, 1], [0, 1, 1, 1], [0.5, 0.5, 0, 1, 0.25], [1, 1, 0]]
    samples = [t for i in range(groups) for t in trajectories_for(f"g{i}", 0, rewards[i % len(rewards)])]
    config = RunConfig(seed=SEED, objective=objective, micro_batch_size=micro_batch, lr=1e-2, kl_coef=0.05,
                       epochs=2)
    trainer = Trainer(fresh_policy(SEED), config, ranks=ranks)
    if not ranks.main:  # as in the service: the other ranks take the steps rank 0 hands them
        trainer.follow(trainer.checkpoint_state)
        whole(trainer)
        ranks.close()
        return
    results = []
    for _ in range(2):  # two steps: the optimiser state matters in the second
        results.append(trainer.step(samples))
        weights, _ = trainer.checkpoint_state()  # the learner checkpoints after each step
    trainer.release()
    optimizer = whole(trainer)
    if ranks.main:
        weights = weights if weights is not None else trainer.model.state_dict()
        torch.save({"weights": weights, "optimizer": optimizer}, f"{out}/state.pt")
        with open(f"{out}/metrics.json", "w") as f:
            json.dump([{k: v for k, v in r.metrics.items() if isinstance(v, (int, float)) and k != "step_ms"}
                       for r in results], f)
    ranks.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
