"""Trajectories buffered by group until whole groups can make a step, with the Kafka position of each."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from opentelemetry import context as otel_context

from crucible.ml.advantages import MAX_REWARD  # rewards and advantages, as the aggregator bounds them
from crucible.shared.settings import sampling_problem
from crucible.v1 import trajectory_pb2


@dataclass
class Buffered:
    sample: trajectory_pb2.Trajectory
    topic: str
    partition: int
    offset: int
    context: otel_context.Context | None  # the consumer span's, so the step that uses it joins the trace


# A step computes in float32 (largest ~3.4e38, smallest normal ~1.2e-38), and the values below are checked as
# doubles: each bound keeps a value that passes from becoming inf or 0 there, or the step's loss sum from
# overflowing (one sample of 1e30 advantage made a whole step's update non-finite, and the step was skipped).
LOWEST_LOGPROB = -1e4  # a sampled token's log-prob: float32 holds no probability below e^-104
# temperature and top_p: settings.sampling_problem, as every sampler takes them


def sample_problem(s: trajectory_pb2.Trajectory, vocab_size: int | None = None,
                   max_positions: int | None = None, version: int | None = None) -> str | None:
    """Why a sample cannot be trained on or grouped (it is dead-lettered with this), or None. With the
    model's vocabulary and positions (Trainer.vocab_size, .max_positions): a token id the embedding does
    not have, or a sequence longer than the model reads, is refused here, not raised by its step. With
    the learner's version: a sample of a later version, weights this learner never made (its staleness
    was read as none at all)."""

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
    if not (abs(s.reward) <= MAX_REWARD and abs(s.advantage) <= MAX_REWARD):  # NaN fails too
        return f"{what}: reward {s.reward} or advantage {s.advantage} is not a number within ±{MAX_REWARD:g}"
    if not all(LOWEST_LOGPROB <= p <= 0.0 for p in s.logprobs):
        return f"{what}: a sampling log-prob is not a number in [{LOWEST_LOGPROB:g}, 0]"
    if problem := sampling_problem(s.temperature, s.top_p):
        return f"{what}: not a sampling distribution: {problem}"
    if version is not None and s.policy_version > version:
        return f"{what}: sampled with policy version {s.policy_version}, later than the learner's {version}"
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
    """Samples by group, in arrival order; a group is whole once every sample the aggregator emitted
    for it has arrived or been refused (a refused one never comes back: waiting for it held the rest
    of its group, and the read position before them, for ever)."""

    REFUSED_GROUPS = 1 << 16  # groups whose refused samples are remembered (a group all of whose samples were refused never completes)

    def __init__(self):
        self.groups: OrderedDict[str, list[Buffered]] = OrderedDict()
        self.refused: OrderedDict[str, set[str]] = OrderedDict()  # group id -> ids of its samples refused

    def refuse(self, sample: trajectory_pb2.Trajectory) -> None:
        """Counts a sample of the aggregator's that was dead-lettered (it cannot be trained on) as one of
        its group's that arrived: the rest of the group trains without it."""
        if not sample.group_id or not sample.id:
            return
        self.refused.setdefault(sample.group_id, set()).add(sample.id)
        self.refused.move_to_end(sample.group_id)
        if len(self.refused) > self.REFUSED_GROUPS:
            self.refused.popitem(last=False)

    def add(self, item: Buffered) -> None:
        members = self.groups.setdefault(item.sample.group_id, [])
        if all(m.sample.id != item.sample.id for m in members):  # a re-sent sample counts once
            members.append(item)

    def ready(self) -> list[str]:
        """Groups whose every emitted sample has arrived (or was refused)."""
        return [g for g, members in self.groups.items() if self._arrived(g, members) >= members[0].sample.group_received]

    def _arrived(self, group_id: str, members: list[Buffered]) -> int:
        refused = self.refused.get(group_id)
        if not refused:
            return len(members)
        return len(refused | {m.sample.id for m in members})

    def take(self, group_ids: list[str]) -> list[list[Buffered]]:
        for g in group_ids:
            self.refused.pop(g, None)
        return [self.groups.pop(g) for g in group_ids]

    def resume_positions(self, read: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Where a restart must read from: before the earliest sample still waiting here, else past the last read."""
        positions = dict(read)
        for members in self.groups.values():
            for m in members:
                key = (m.topic, m.partition)
                positions[key] = min(positions.get(key, m.offset), m.offset)
        return positions
