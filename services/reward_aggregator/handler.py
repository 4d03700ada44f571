"""Pure logic of the aggregator: a group's verdicts in, flat Trajectory samples, store rows and alerts out."""
from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf import timestamp_pb2

from crucible.ml.advantages import MAX_REWARD, advantages, weighted_reward
from crucible.shared import alerts
from crucible.shared.settings import RunConfig
from crucible.v1 import alert_pb2, execution_pb2, trajectory_pb2, verdict_pb2

TRAJECTORY_COLUMNS = [
    "trajectory_id", "task_id", "group_id", "sample_index", "task_kind", "policy_version",
    "completion", "reward_components", "reward", "advantage", "tamper_flags", "exit_code", "duration_ms",
    "violation", "generation_ms", "execution_ms", "trace_id", "created_at", "turns", "cpu_s", "max_rss_bytes", "run_id",
]
TURN_COLUMNS = ["trajectory_id", "task_id", "group_id", "turn", "task_kind", "policy_version", "action", "tool",
                "arguments", "call_error", "call_failed", "observation", "tokens", "observation_tokens",
                "execution_ms", "created_at", "violation"]


@dataclass(frozen=True)
class RewardConfig:
    estimator: str
    weights: Mapping[str, float]
    length_penalty: float
    length_target: int

    @classmethod
    def of(cls, config: RunConfig) -> "RewardConfig":
        return cls(config.estimator, config.reward_weights, config.length_penalty, config.length_target)


def check_verdict(verdict: verdict_pb2.Verdict) -> str | None:
    """Why a verdict cannot join a group, or None when it can."""
    s = verdict.sample
    if not s.group_id:
        return "verdict has no sample.group_id"
    if s.group_size < 1:
        return f"group {s.group_id!r}: group_size must be at least 1"
    if s.sample_index >= s.group_size:
        return f"group {s.group_id!r}: sample_index {s.sample_index} is not below group_size {s.group_size}"
    # A NaN reward would reach the store's reward figures (a run's mean became nan) and the group's
    # advantages; whatever a component says is weighed into the reward.
    if not math.isfinite(verdict.reward) or not all(math.isfinite(v) for v in verdict.components.values()):
        return f"group {s.group_id!r}: sample {s.sample_index} has a reward or reward component that is not finite"
    return None


def check_record(record: verdict_pb2.VerdictGroup, config: RewardConfig | None = None,
                 joined: Sequence[verdict_pb2.Verdict] = ()) -> str | None:
    """Why a verdicts record cannot be joined, or None when it can: every verdict must be able to join
    (with `config`: its reward as paid within MAX_REWARD), all of one group and one task, each sample
    (index and id) once, in agreement with the verdicts of its group `joined` before (a record of another
    size or task under the same group id made one group of two)."""
    if not record.verdicts:
        return "the record holds no verdicts"
    first = (joined[0] if joined else record.verdicts[0]).sample
    at = {v.sample.id: v.sample.sample_index for v in joined}  # sample id -> its index (a replay repeats both)
    indices = set()
    for verdict in record.verdicts:
        problem = check_verdict(verdict)
        if problem:
            return problem
        s = verdict.sample
        if (s.group_id, s.group_size, s.task_id) != (first.group_id, first.group_size, first.task_id):
            return (f"a verdict of group {s.group_id!r} (size {s.group_size}, task {s.task_id!r}) joining group "
                    f"{first.group_id!r} (size {first.group_size}, task {first.task_id!r})")
        if s.sample_index in indices:
            return f"group {s.group_id!r}: sample_index {s.sample_index} twice in one record"
        indices.add(s.sample_index)
        if at.setdefault(s.id, s.sample_index) != s.sample_index:  # the learner counts samples by id
            return f"group {s.group_id!r}: sample id {s.id!r} at sample indices {at[s.id]} and {s.sample_index}"
        if config is not None and not abs(reward_of(verdict, config)) <= MAX_REWARD:
            return (f"group {s.group_id!r}: sample {s.sample_index}'s reward as weighted, "
                    f"{reward_of(verdict, config):.3g}, is beyond ±{MAX_REWARD:g}")
    return None


def reward_of(verdict: verdict_pb2.Verdict, config: RewardConfig) -> float:
    """The verdict's reward: zero for a tampered sample whatever its components say."""
    if verdict.tampered:
        return 0.0
    s = verdict.sample
    length = sum(s.loss_mask) if len(s.loss_mask) else len(s.completion_token_ids)  # the model's own tokens
    return weighted_reward(verdict.components, config.weights, default=verdict.reward, length=length, length_penalty=config.length_penalty,
                           length_target=config.length_target)


def group_trajectories(verdicts: Sequence[verdict_pb2.Verdict], config: RewardConfig, *,
                       complete: bool) -> list[trajectory_pb2.Trajectory]:
    """One flat Trajectory per verdict (by sample index), with rewards and group-relative advantages."""
    ordered = sorted(verdicts, key=lambda v: v.sample.sample_index)
    rewards = [reward_of(v, config) for v in ordered]
    advs = advantages(config.estimator, rewards)
    now = timestamp_pb2.Timestamp()
    now.FromDatetime(dt.datetime.now(dt.timezone.utc))  # one conversion for the group
    out = []
    for v, r, a in zip(ordered, rewards, advs):
        t = trajectory_pb2.Trajectory()
        t.CopyFrom(v.sample)
        t.reward, t.advantage, t.estimator = r, a, config.estimator
        t.group_complete, t.group_received = complete, len(ordered)
        t.created_at.CopyFrom(now)
        out.append(t)
    return out


def trajectory_row(v: verdict_pb2.Verdict, t: trajectory_pb2.Trajectory, trace_id: str = "", run_id: str = "",
                   created: dt.datetime | None = None) -> list:
    """The store's row of a trajectory; `created`: its created_at as a datetime, where the caller has it
    (a group's samples share one)."""
    ex = v.execution
    return [
        t.id, t.task_id, t.group_id, t.sample_index, v.task_kind, t.policy_version,
        v.completion, dict(v.components), t.reward, t.advantage, list(v.tamper_patterns), ex.exit_code,
        ex.duration_ms, _violation_name(ex.violation), v.generation_ms, ex.duration_ms, trace_id,
        created or t.created_at.ToDatetime(tzinfo=dt.timezone.utc), t.turns, ex.usage.cpu_user_s + ex.usage.cpu_system_s,
        ex.usage.max_rss_bytes, run_id,
    ]


def turn_rows(v: verdict_pb2.Verdict, t: trajectory_pb2.Trajectory) -> list[list]:
    """One row per model turn of an episode ([] for a single-turn sample)."""
    created = t.created_at.ToDatetime(tzinfo=dt.timezone.utc)
    return [[t.id, t.task_id, t.group_id, i, v.task_kind, turn.policy_version, turn.text, turn.call.name,
             turn.call.arguments_json, turn.call.error, turn.call_failed, turn.observation, len(turn.token_ids),
             len(turn.observation_token_ids), turn.execution_ms, created, _violation_name(turn.violation)]
            for i, turn in enumerate(v.episode.turns, 1)]


def _violation_name(value: int) -> str:
    """A violation's stored name; one this build does not know (a newer sandbox's: protobuf enums are open)
    is stored by its number rather than failing the row."""
    if not value:
        return ""
    try:
        return execution_pb2.Violation.Name(value).removeprefix("VIOLATION_").lower()
    except ValueError:
        return f"violation_{value}"




def alerts_for(verdict: verdict_pb2.Verdict, run_id: str, config: RewardConfig | None = None) -> list[alert_pb2.Alert]:
    """Reward-hacking signals one verdict carries on its own.

    - `tamper`: the verifier caught the completion forging a pass (named patterns);
    - `canary_passed`: a canary task (metadata canary=true) is built so that no honest answer
      passes it; a pass means the reward can be earned without solving the task.
    """
    s = verdict.sample
    details = {"task_id": s.task_id, "group_id": s.group_id, "sample_index": str(s.sample_index),
               "policy_version": str(s.policy_version)}
    out = []
    if verdict.tampered:
        out.append(alerts.new(
            f"tamper/{s.id}", "tamper",
            f"completion {s.id} tried to forge its reward: {', '.join(verdict.tamper_patterns) or 'unnamed'}",
            run_id, {**details, "patterns": ",".join(verdict.tamper_patterns)}))
    paid = verdict.reward if config is None else reward_of(verdict, config)  # what the run pays, weights and all
    if verdict.canary and paid > 0 and not verdict.tampered:
        out.append(alerts.new(
            f"canary/{s.id}", "canary_passed",
            f"canary task {s.task_id} earned reward {paid:.2f}: the reward can be gamed",
            run_id, {**details, "reward": f"{paid:.4f}"}, alert_pb2.SEVERITY_CRITICAL))
    return out
