"""Pure pieces of the generator: group ids, prompts, and the RolloutGroup message from completions."""
from __future__ import annotations

import datetime as dt
import hashlib

from crucible.v1 import rollout_pb2, task_pb2
from crucible.ml.policy.backends.base import Completion
from crucible.ml.policy.sampling import SamplingParams

FINISH = {"stop": rollout_pb2.FINISH_REASON_STOP, "length": rollout_pb2.FINISH_REASON_LENGTH}


def group_id_for(task_id: str, source: str) -> str:
    """A group id that a replay of the same Kafka record reproduces (so stored rows deduplicate)."""
    return hashlib.sha256(f"{task_id}\x00{source}".encode()).hexdigest()[:24]


def render_prompt(task: task_pb2.Task) -> str:
    """What the policy sees for a task: its kind renders it (a format hint unless metadata asks for raw)."""
    from crucible.ml.kinds import registry

    return registry.kind_of(task).render_prompt(task)


def rollout_group(task: task_pb2.Task, group_id: str, completions: list[Completion], params: SamplingParams, *,
                  policy_version: int, backend: str, generator_id: str, sample_ms: float) -> rollout_pb2.RolloutGroup:
    """The group message: the task once, each completion with its tokens and sampling log-probs."""
    group = rollout_pb2.RolloutGroup(
        group_id=group_id, task=task, policy_version=policy_version, temperature=params.temperature,
        top_p=params.top_p, prompt_token_ids=completions[0].prompt_token_ids if completions else [],
        generator_id=generator_id, backend=backend, sample_ms=sample_ms,
        rollouts=[rollout_pb2.Rollout(id=f"{group_id}/{i}", sample_index=i, completion=c.text, token_ids=c.token_ids,
                                      logprobs=c.logprobs, finish_reason=FINISH.get(c.finish_reason, 0))
                  for i, c in enumerate(completions)],
    )
    group.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return group
