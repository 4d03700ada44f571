"""Pure pieces of the generator: group ids, prompts, and Rollout messages from completions."""
from __future__ import annotations

import datetime as dt
import hashlib

from crucible.v1 import rollout_pb2, task_pb2
from crucible.ml.policy.backends.base import Completion

FINISH = {"stop": rollout_pb2.FINISH_REASON_STOP, "length": rollout_pb2.FINISH_REASON_LENGTH}


def group_id_for(task_id: str, source: str) -> str:
    """A group id that a replay of the same Kafka record reproduces (so stored rows deduplicate)."""
    return hashlib.sha256(f"{task_id}\x00{source}".encode()).hexdigest()[:24]


def render_prompt(task: task_pb2.Task) -> str:
    """What the policy sees for a task: its kind renders it (a format hint unless metadata asks for raw)."""
    from crucible.ml.kinds import registry

    return registry.kind_of(task).render_prompt(task)


def rollouts_for(task: task_pb2.Task, group_id: str, completions: list[Completion], *, policy_version: int,
                 backend: str, generator_id: str, sample_ms: float) -> list[rollout_pb2.Rollout]:
    now = dt.datetime.now(dt.timezone.utc)
    rollouts = []
    for i, c in enumerate(completions):
        r = rollout_pb2.Rollout(
            id=f"{group_id}/{i}", task=task, group_id=group_id, sample_index=i, group_size=len(completions),
            policy_version=policy_version, completion=c.text, prompt_token_ids=c.prompt_token_ids,
            token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=FINISH.get(c.finish_reason, 0),
            generator_id=generator_id, backend=backend, sample_ms=sample_ms,
        )
        r.created_at.FromDatetime(now)
        rollouts.append(r)
    return rollouts
