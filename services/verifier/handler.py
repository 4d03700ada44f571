"""Pure verifier logic: which records to verify, and one rollout (with its execution) into a Verdict."""
from __future__ import annotations

import datetime as dt

from crucible.ml import envs, kinds
from crucible.ml.envs import episode as ep
from crucible.ml.tasks import is_heldout
from crucible.shared import integrity
from crucible.v1 import episode_pb2, execution_pb2, rollout_pb2, task_pb2, trajectory_pb2, verdict_pb2

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
    problems = kinds.problems_of(kind, task)
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
    if not scored_here(group):
        return []  # the sandbox's to run (and to refuse): no check of its task here
    if not group.group_id or not group.rollouts:
        raise Unverifiable(f"rollout group {group.group_id!r} has no group id or no rollouts")
    kind_for(group.task, f"rollout group {group.group_id!r}")
    return [verdict_pb2.VerifyRequest(task=group.task, rollout=r) for r in group.rollouts]


def scored_here(message: rollout_pb2.RolloutGroup | execution_pb2.Execution) -> bool:
    """Whether a consumed record is the verifier's to score (requests_for's test, without its checks of
    the task: a kind lookup): an execution, or a rollout group whose kind is scored from the answer
    alone (or is unknown, which requests_for then names)."""
    if isinstance(message, execution_pb2.Execution):
        return True
    try:
        return not kinds.get(message.task.kind).needs_execution
    except kinds.UnknownKind:
        return True


def check_trust(request: verdict_pb2.VerifyRequest, secret: bytes) -> None:
    """Unverifiable unless what the reward will be computed from is trusted (shared/integrity.py): the
    task as a trusted submitter signed it, and an execution result sealed by a sandbox for exactly the
    job the task's kind makes of this completion (so no other code's or other tests' result)."""
    what = f"rollout {request.rollout.id!r}"
    try:
        integrity.check_task(request.task, secret)
        kind = kind_for(request.task, what)
        if request.HasField("execution") and not kind.needs_execution:
            # Nothing ran this kind's answer in a sandbox: a result sent with it is no one's, and would
            # reach the verdict and the stored rows as if one had.
            raise Unverifiable(f"{what}: kind {kind.name!r} is scored from the answer alone; an execution "
                               "result sent with it is refused")
        if kind.needs_execution and request.HasField("execution"):
            job = kind.execution(request.task, request.rollout.completion)
            integrity.check_execution(request.execution, job, secret, request.rollout.id)
    except integrity.IntegrityError as exc:
        raise Unverifiable(f"{what}: {exc}") from None


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


def verify_episode(episode: episode_pb2.Episode, now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    """Scores a finished episode with its environment: one verdict whose sample is the whole episode
    (the model's turns and the observations in order, only the model's tokens under the loss mask)."""
    task = episode.task
    what = f"episode {episode.id!r}"
    if not envs.is_environment(task):
        raise Unverifiable(f"{what}: task kind {task.kind!r} is not an environment")
    env = envs.get(task.kind)
    problems = kinds.problems_of(env, task)
    if problems:
        raise Unverifiable(f"{what}, task {task.id!r}: " + "; ".join(problems))
    if not episode.turns or not episode.end:
        raise Unverifiable(f"{what} has not ended: only finished episodes are scored")
    if not episode.group_id or episode.group_size < 1 or episode.index >= episode.group_size:
        raise Unverifiable(f"{what}: index {episode.index} is not within its group of {episode.group_size}")
    for turn in episode.turns:
        if len(turn.logprobs) != len(turn.token_ids):
            raise Unverifiable(f"{what}: a turn has {len(turn.token_ids)} tokens and {len(turn.logprobs)} log-probs")
    try:
        score = env.score(task, episode)
    except envs.InstanceError as exc:
        raise Unverifiable(f"{what}: {exc}") from None
    ids, logprobs, mask = ep.flatten(episode)
    truncated = episode.end in (episode_pb2.EPISODE_END_TURN_LIMIT, episode_pb2.EPISODE_END_TOKEN_LIMIT)
    components = dict(score.components)
    components["length"] = float(sum(mask))
    components["truncated"] = float(truncated)
    sample = trajectory_pb2.Trajectory(
        id=episode.id, task_id=task.id, group_id=episode.group_id, sample_index=episode.index,
        group_size=episode.group_size, policy_version=ep.policy_version(episode),
        prompt_token_ids=episode.prompt_token_ids, completion_token_ids=ids, logprobs=logprobs, loss_mask=mask,
        temperature=episode.temperature, top_p=episode.top_p, passed=score.passed, tampered=score.tampered,
        truncated=truncated, heldout=is_heldout(task), turns=len(episode.turns))
    stored = episode_pb2.Episode()
    stored.CopyFrom(episode)
    stored.ClearField("task")  # the sample names it; the verdict need not carry it again
    message = verdict_pb2.Verdict(
        id=f"{episode.id}/verdict", sample=sample, task_kind=task.kind, components=components, reward=score.reward,
        tampered=score.tampered, tamper_patterns=list(score.patterns), completion=ep.transcript(episode),
        canary=task.metadata.get("canary") == "true", verifier_version=VERIFIER_VERSION, detail=score.detail,
        generation_ms=episode.sample_ms, episode=stored)
    message.created_at.FromDatetime(now or dt.datetime.now(dt.timezone.utc))
    return message
