"""Pure logic of the aggregator: a group's verdicts in, Trajectory messages and store rows out."""
from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from crucible.v1 import alert_pb2, trajectory_pb2, verdict_pb2
from crucible.ml.advantages import advantages, weighted_reward

TRAJECTORY_COLUMNS = [
    "trajectory_id", "task_id", "group_id", "sample_index", "task_kind", "policy_version", "prompt",
    "completion", "reward_components", "reward", "advantage", "tamper_flags", "exit_code", "duration_ms",
    "violation", "generation_ms", "execution_ms", "scoring_ms", "trace_id", "created_at",
]


@dataclass(frozen=True)
class RewardConfig:
    estimator: str = "grpo"
    weights: Mapping[str, float] | None = None
    length_penalty: float = 0.0
    length_target: int = 0


def check_verdict(verdict: verdict_pb2.Verdict) -> str | None:
    """Why a verdict cannot join a group, or None when it can."""
    r = verdict.rollout
    if not r.group_id:
        return "verdict has no rollout.group_id"
    if r.group_size < 1:
        return f"group {r.group_id!r}: group_size must be at least 1"
    if r.sample_index >= r.group_size:
        return f"group {r.group_id!r}: sample_index {r.sample_index} is not below group_size {r.group_size}"
    return None


def reward_of(verdict: verdict_pb2.Verdict, config: RewardConfig) -> float:
    """The verdict's reward: zero for a tampered sample whatever its components say."""
    if verdict.tampered:
        return 0.0
    return weighted_reward(verdict.components, config.weights, default=verdict.reward,
                           length=len(verdict.rollout.token_ids), length_penalty=config.length_penalty,
                           length_target=config.length_target)


def group_trajectories(verdicts: Sequence[verdict_pb2.Verdict], config: RewardConfig, *,
                       complete: bool) -> list[trajectory_pb2.Trajectory]:
    """One Trajectory per verdict (by sample index), with rewards and group-relative advantages."""
    ordered = sorted(verdicts, key=lambda v: v.rollout.sample_index)
    rewards = [reward_of(v, config) for v in ordered]
    advs = advantages(config.estimator, rewards)
    now = dt.datetime.now(dt.timezone.utc)
    out = []
    for v, r, a in zip(ordered, rewards, advs):
        t = trajectory_pb2.Trajectory(id=v.rollout.id or f"{v.rollout.group_id}/{v.rollout.sample_index}",
                                      verdict=v, reward=r, advantage=a, estimator=config.estimator,
                                      group_complete=complete, group_received=len(ordered))
        t.created_at.FromDatetime(now)
        out.append(t)
    return out


def trajectory_row(t: trajectory_pb2.Trajectory, trace_id: str = "") -> list:
    v = t.verdict
    r = v.rollout
    ex = v.execution
    return [
        t.id, r.task.id, r.group_id, r.sample_index, r.task.kind, r.policy_version, r.task.prompt,
        r.completion, dict(v.components), t.reward, t.advantage, list(v.tamper_patterns), ex.exit_code,
        ex.duration_ms, _violation_name(ex.violation), r.sample_ms, ex.duration_ms,
        float(v.components.get("scoring_ms", 0.0)), trace_id,
        t.created_at.ToDatetime(tzinfo=dt.timezone.utc),
    ]


def _violation_name(value: int) -> str:
    from crucible.v1 import execution_pb2

    return execution_pb2.Violation.Name(value).removeprefix("VIOLATION_").lower() if value else ""


ALERT_COLUMNS = ["alert_id", "kind", "severity", "message", "details", "ts"]


def alerts_for(verdict: verdict_pb2.Verdict, run_id: str) -> list[alert_pb2.Alert]:
    """Reward-hacking signals one verdict carries on its own.

    - `tamper`: the verifier caught the completion forging a pass (named patterns);
    - `canary_passed`: a canary task (metadata canary=true) is built so that no honest answer
      passes it; a pass means the reward can be earned without solving the task.
    """
    r = verdict.rollout
    details = {"task_id": r.task.id, "group_id": r.group_id, "sample_index": str(r.sample_index),
               "policy_version": str(r.policy_version)}
    alerts = []
    if verdict.tampered:
        alerts.append(alert_pb2.Alert(
            id=f"tamper/{r.id}", kind="tamper", severity=alert_pb2.SEVERITY_WARNING, run_id=run_id,
            message=f"completion {r.id} tried to forge its reward: {', '.join(verdict.tamper_patterns) or 'unnamed'}",
            details={**details, "patterns": ",".join(verdict.tamper_patterns)}))
    if r.task.metadata.get("canary") == "true" and verdict.reward > 0 and not verdict.tampered:
        alerts.append(alert_pb2.Alert(
            id=f"canary/{r.id}", kind="canary_passed", severity=alert_pb2.SEVERITY_CRITICAL, run_id=run_id,
            message=f"canary task {r.task.id} earned reward {verdict.reward:.2f}: the reward can be gamed",
            details={**details, "reward": f"{verdict.reward:.4f}"}))
    now = dt.datetime.now(dt.timezone.utc)
    for a in alerts:
        a.created_at.FromDatetime(now)
    return alerts


def alert_row(a: alert_pb2.Alert) -> list:
    return [a.id, a.kind, alert_pb2.Severity.Name(a.severity).removeprefix("SEVERITY_").lower(), a.message,
            dict(a.details), a.created_at.ToDatetime(tzinfo=dt.timezone.utc)]
