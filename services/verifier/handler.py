"""Pure verifier logic: which records to verify, and one rollout (with its execution) into a Verdict."""
from __future__ import annotations

import datetime as dt

from crucible.ml import kinds
from crucible.ml.tasks import is_heldout
from crucible.v1 import execution_pb2, rollout_pb2, task_pb2, trajectory_pb2, verdict_pb2

VERIFIER_VERSION = "crucible-verifier/2"


class Unverifiable(ValueError):
    """A request no verdict can be given for (unknown kind, bad payload, missing execution); the text says why."""


def kind_for(task: task_pb2.Task, what: str) -> kinds.Kind:
    """The task's kind after its payload checks out; Unverifiable (naming `what`) otherwise."""
    if not task.kind:
        raise Unverifiable(f"{what} carries no task (or a task without a kind)")
    try:
        kind = kinds.get(task.kind)
    except kinds.UnknownKind as exc:
        raise Unverifiable(f"{what}: {exc}") from None
    problems = kind.problems(task)
    if problems:
        raise Unverifiable(f"{what}, task {task.id!r}: " + "; ".join(problems))
    return kind


def requests_for(message: rollout_pb2.RolloutGroup | execution_pb2.Execution) -> list[verdict_pb2.VerifyRequest]:
    """The requests a consumed record asks for ([] when it is not the verifier's to score).

    Executions are always scored. A rollout group is scored here only when its kind is
    answer-only; one that needs running comes back through crucible.executions.
    """
    if isinstance(message, execution_pb2.Execution):
        group = message.group
        kind_for(group.task, f"execution {message.id!r}")
        if len(message.results) != len(group.rollouts):
            raise Unverifiable(f"execution {message.id!r} has {len(message.results)} results for "
                               f"{len(group.rollouts)} rollouts")
        return [verdict_pb2.VerifyRequest(task=group.task, rollout=r, execution=x)
                for r, x in zip(group.rollouts, message.results)]
    group = message
    if not group.group_id or not group.rollouts:
        raise Unverifiable(f"rollout group {group.group_id!r} has no group id or no rollouts")
    if kind_for(group.task, f"rollout group {group.group_id!r}").needs_execution:
        return []
    return [verdict_pb2.VerifyRequest(task=group.task, rollout=r) for r in group.rollouts]


def group_of(message: rollout_pb2.RolloutGroup | execution_pb2.Execution) -> rollout_pb2.RolloutGroup:
    return message.group if isinstance(message, execution_pb2.Execution) else message


def verify(request: verdict_pb2.VerifyRequest, now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    """Scores one rollout with its task's kind. Unverifiable for requests that cannot be scored."""
    task, rollout = request.task, request.rollout
    kind = kind_for(task, f"rollout {rollout.id!r}")
    execution = request.execution if request.HasField("execution") else None
    if kind.needs_execution and execution is None:
        raise Unverifiable(f"rollout {rollout.id!r}: kind {kind.name!r} is scored from a sandbox run; "
                           "send its execution result (or call Verifier.Verify, which runs it)")
    score = kind.score(task, rollout.completion, execution)
    return verdict(request, score, now)


def failed(request: verdict_pb2.VerifyRequest, reason: str, now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    """The verdict for a completion whose scoring could not finish (too slow, crashed the scorer): pays nothing."""
    return verdict(request, kinds.Score({"scoring_failed": 1.0}, 0.0, detail=reason), now)


def verdict(request: verdict_pb2.VerifyRequest, score: kinds.Score,
            now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    task, rollout = request.task, request.rollout
    truncated = rollout.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
    components = dict(score.components)
    # Tokens when the generator recorded them, characters otherwise: the aggregator watches it for blow-ups.
    components["length"] = float(len(rollout.token_ids) or len(rollout.completion))
    components["truncated"] = float(truncated)
    sample = trajectory_pb2.Trajectory(
        id=rollout.id, task_id=task.id, sample_index=rollout.sample_index,
        completion_token_ids=rollout.token_ids, logprobs=rollout.logprobs,
        passed=score.passed, tampered=score.tampered, truncated=truncated, heldout=is_heldout(task))
    message = verdict_pb2.Verdict(
        id=f"{rollout.id}/verdict", sample=sample, task_kind=task.kind, components=components,
        reward=score.reward, tampered=score.tampered, tamper_patterns=list(score.patterns),
        completion=rollout.completion, canary=task.metadata.get("canary") == "true",
        verifier_version=VERIFIER_VERSION, detail=score.detail)
    if request.HasField("execution"):
        message.execution.CopyFrom(request.execution)
        message.execution.ClearField("stdout")  # scored already; the group's execution record keeps them
        message.execution.ClearField("stderr")
    message.created_at.FromDatetime(now or dt.datetime.now(dt.timezone.utc))
    return message


def in_group(verdict: verdict_pb2.Verdict, group: rollout_pb2.RolloutGroup) -> verdict_pb2.Verdict:
    """Completes the verdict's sample with what the whole group shares (ids, prompt, sampling settings)."""
    s = verdict.sample
    s.group_id = group.group_id
    s.group_size = len(group.rollouts)
    s.policy_version = group.policy_version
    s.prompt_token_ids[:] = group.prompt_token_ids
    s.temperature = group.temperature
    s.top_p = group.top_p
    verdict.generation_ms = group.sample_ms
    return verdict
