"""Pure verifier logic: which records to verify, and a rollout (with its execution) into a Verdict."""
from __future__ import annotations

import datetime as dt

from crucible.v1 import execution_pb2, rollout_pb2, verdict_pb2
from crucible.ml import kinds

VERIFIER_VERSION = "crucible-verifier/1"


class Unverifiable(ValueError):
    """A request no verdict can be given for (unknown kind, bad payload, missing execution); the text says why."""


def kind_for(rollout: rollout_pb2.Rollout) -> kinds.Kind:
    """The rollout's kind after its payload checks out; Unverifiable otherwise."""
    if not rollout.HasField("task") or not rollout.task.kind:
        raise Unverifiable(f"rollout {rollout.id!r} carries no task (or a task without a kind)")
    try:
        kind = kinds.get(rollout.task.kind)
    except kinds.UnknownKind as exc:
        raise Unverifiable(f"rollout {rollout.id!r}: {exc}") from None
    problems = kind.problems(rollout.task)
    if problems:
        raise Unverifiable(f"rollout {rollout.id!r}, task {rollout.task.id!r}: " + "; ".join(problems))
    return kind


def request_for(message: rollout_pb2.Rollout | execution_pb2.Execution) -> verdict_pb2.VerifyRequest | None:
    """The request a consumed record asks for, or None when it is not the verifier's to score.

    Executions are always scored. A rollout is scored here only when its kind is
    answer-only; one that needs running comes back through crucible.executions.
    """
    if isinstance(message, execution_pb2.Execution):
        kind_for(message.rollout)
        return verdict_pb2.VerifyRequest(rollout=message.rollout, execution=message.result)
    kind = kind_for(message)
    if kind.needs_execution:
        return None
    return verdict_pb2.VerifyRequest(rollout=message)


def verify(request: verdict_pb2.VerifyRequest, now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    """Scores one rollout with its kind. Unverifiable for requests that cannot be scored."""
    rollout = request.rollout
    kind = kind_for(rollout)
    execution = request.execution if request.HasField("execution") else None
    if kind.needs_execution and execution is None:
        raise Unverifiable(f"rollout {rollout.id!r}: kind {kind.name!r} is scored from a sandbox run; "
                           "send its execution result (or call Verifier.Verify, which runs it)")
    score = kind.score(rollout.task, rollout.completion, execution)
    return verdict(request, score.components, score.reward, score.tampered, score.patterns, score.detail, now)


def failed(request: verdict_pb2.VerifyRequest, reason: str, now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    """The verdict for a completion whose scoring could not finish (too slow, crashed the scorer): pays nothing."""
    return verdict(request, {"scoring_failed": 1.0}, 0.0, False, (), reason, now)


def verdict(request: verdict_pb2.VerifyRequest, components: dict[str, float], reward: float, tampered: bool,
            patterns, detail: str, now: dt.datetime | None = None) -> verdict_pb2.Verdict:
    rollout = request.rollout
    components = dict(components)
    # Tokens when the generator recorded them, characters otherwise: the aggregator watches it for blow-ups.
    components["length"] = float(len(rollout.token_ids) or len(rollout.completion))
    components["truncated"] = float(rollout.finish_reason == rollout_pb2.FINISH_REASON_LENGTH)
    message = verdict_pb2.Verdict(
        id=f"{rollout.id}/verdict", rollout=rollout, components=components, reward=reward, tampered=tampered,
        tamper_patterns=list(patterns), verifier_version=VERIFIER_VERSION, detail=detail)
    if request.HasField("execution"):
        message.execution.CopyFrom(request.execution)
    message.created_at.FromDatetime(now or dt.datetime.now(dt.timezone.utc))
    return message
