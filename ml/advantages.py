"""Rewards from verdict components, and advantages for a group of G completions of one task.

    GRPO:       A_i = (r_i - mean(r)) / (std(r) + eps)
    RLOO:       A_i = r_i - (sum_j r_j - r_i) / (G - 1)
    REINFORCE:  A_i = r_i - b        (b: a running baseline, or the group mean when none is given)
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

# The largest reward or advantage a sample may carry, here and in the learner's step (float32: one sample of
# 1e30 made a whole step's update non-finite; a group's rewards of 1e300 overflowed its variance). No reward
# design here comes near (GRPO's |A| <= sqrt(G)).
MAX_REWARD = 1e6


def weighted_reward(components: Mapping[str, float], weights: Mapping[str, float] | None = None,
                    default: float | None = None, *, length: float | None = None,
                    length_penalty: float = 0.0, length_target: float = 0.0) -> float:
    """r = sum_k w_k c_k  (or the verifier's default scalar when no weight names a present component),
    minus length_penalty * max(0, length - length_target)."""
    weights = weights or {}
    named = {k: w for k, w in weights.items() if k in components}
    reward = sum(w * components[k] for k, w in named.items()) if named else (default or 0.0)
    if length_penalty and length is not None:
        reward -= length_penalty * max(0.0, length - length_target)
    return reward


def grpo(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    g = len(rewards)
    if g < 2:
        return [0.0] * g
    mean = sum(rewards) / g
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / g)
    return [(r - mean) / (std + eps) for r in rewards]


def rloo(rewards: Sequence[float]) -> list[float]:
    g = len(rewards)
    if g < 2:
        return [0.0] * g
    total = sum(rewards)
    return [r - (total - r) / (g - 1) for r in rewards]


def reinforce(rewards: Sequence[float], baseline: float | None = None) -> list[float]:
    if not rewards:
        return []
    b = sum(rewards) / len(rewards) if baseline is None else baseline
    return [r - b for r in rewards]


ESTIMATORS = {"grpo": grpo, "rloo": rloo, "reinforce": reinforce}


def advantages(estimator: str, rewards: Sequence[float]) -> list[float]:
    try:
        return ESTIMATORS[estimator](rewards)
    except KeyError:
        raise ValueError(f"unknown advantage estimator {estimator!r}: choose {', '.join(ESTIMATORS)}") from None
