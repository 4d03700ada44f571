"""Trajectories buffered by group until whole groups can make a step, with the Kafka position of each."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from opentelemetry import context as otel_context

from crucible.v1 import trajectory_pb2


@dataclass
class Buffered:
    sample: trajectory_pb2.Trajectory
    topic: str
    partition: int
    offset: int
    context: otel_context.Context | None  # the consumer span's, so the step that uses it joins the trace


def sample_problem(s: trajectory_pb2.Trajectory, vocab_size: int | None = None,
                   max_positions: int | None = None) -> str | None:
    """Why a sample cannot be trained on or grouped (it is dead-lettered with this), or None. With the
    model's vocabulary and positions (Trainer.vocab_size, .max_positions): a token id the embedding does
    not have, or a sequence longer than the model reads, is refused here, not raised by its step."""
    import math

    what = f"trajectory {s.id!r}"
    if not s.id or not s.group_id:
        return f"{what} has no id or no group_id"
    if s.group_size < 1 or s.group_received < 1 or s.group_received > s.group_size:
        return f"{what}: group_received {s.group_received} of group_size {s.group_size} is not a group"
    if s.sample_index >= s.group_size:
        return f"{what}: sample_index {s.sample_index} is not below group_size {s.group_size}"
    if not s.prompt_token_ids:
        return f"{what} has no prompt tokens"
    if len(s.logprobs) != len(s.completion_token_ids):
        return f"{what}: {len(s.completion_token_ids)} tokens but {len(s.logprobs)} log-probs"
    if len(s.loss_mask) not in (0, len(s.completion_token_ids)):
        return f"{what}: a loss mask of {len(s.loss_mask)} for {len(s.completion_token_ids)} tokens"
    if not (math.isfinite(s.reward) and math.isfinite(s.advantage)):
        return f"{what}: reward {s.reward} or advantage {s.advantage} is not finite"
    if not all(math.isfinite(p) and p <= 0.0 for p in s.logprobs):
        return f"{what}: a sampling log-prob is not finite or above 0"
    if not (math.isfinite(s.temperature) and s.temperature >= 0.0 and (s.temperature == 0.0 or 0.0 < s.top_p <= 1.0)):
        return f"{what}: temperature {s.temperature} and top_p {s.top_p} are not a sampling distribution " \
               "(temperature 0, greedy, or above 0 with 0 < top_p <= 1)"
    lowest = min(min(s.prompt_token_ids), min(s.completion_token_ids, default=0))
    highest = max(max(s.prompt_token_ids), max(s.completion_token_ids, default=0))
    if lowest < 0 or (vocab_size is not None and highest >= vocab_size):
        return f"{what}: token ids {lowest}..{highest} are not all in the model's vocabulary of {vocab_size}"
    length = len(s.prompt_token_ids) + len(s.completion_token_ids)
    if max_positions is not None and length > max_positions:
        return f"{what}: {length} tokens, more than the model's {max_positions} positions"
    return None


def informative(samples: list[trajectory_pb2.Trajectory]) -> bool:
    """Whether a group's rewards differ: with all equal, every group-relative advantage is zero and the
    group teaches nothing (DAPO's dynamic sampling filters it)."""
    rewards = [s.reward for s in samples]
    return max(rewards) - min(rewards) > 1e-9


class GroupBuffer:
    """Samples by group, in arrival order."""

    def __init__(self):
        self.groups: OrderedDict[str, list[Buffered]] = OrderedDict()

    def add(self, item: Buffered) -> None:
        members = self.groups.setdefault(item.sample.group_id, [])
        if all(m.sample.id != item.sample.id for m in members):  # a re-sent sample counts once
            members.append(item)

    def ready(self) -> list[str]:
        """Groups whose every emitted sample has arrived."""
        return [g for g, members in self.groups.items() if len(members) >= members[0].sample.group_received]

    def take(self, group_ids: list[str]) -> list[list[Buffered]]:
        return [self.groups.pop(g) for g in group_ids]

    def resume_positions(self, read: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Where a restart must read from: before the earliest sample still waiting here, else past the last read."""
        positions = dict(read)
        for members in self.groups.values():
            for m in members:
                key = (m.topic, m.partition)
                positions[key] = min(positions.get(key, m.offset), m.offset)
        return positions
