"""Training-health signals the learner sees step by step, raised as Alerts.

- `kl_blowup`: KL to the reference jumps above `kl_limit` (the policy left its anchor in one step);
- `entropy_collapse`: mean token entropy falls below `entropy_floor` while the training reward (the
  mean of the last `window` versions) has not risen `reward_gain` above its start (the first
  `window`): the policy stopped exploring before it learned anything, so its groups, all alike,
  carry no signal left to learn from. A policy that learned its tasks may well be that sure of its
  answers: under the KL penalty's gradient the best policy gives a wrong answer the reference's
  odds times exp(-reward gap / kl_coef), 0.7% on the built-in recipe, a mean token entropy of about
  0.01, so low entropy alone is no alarm;
- `reward_without_heldout`: between two held-out evaluations the mean training reward (over the
  `reward_window` versions up to each) rose by `reward_gain` while the held-out pass rate rose by less than
  `heldout_flat`, and the training reward now stands `heldout_margin` above it (the policy fits the
  training distribution, or games its reward). The held-out rate is the evaluator's sampled one
  (completions drawn at the training temperature): a greedy rate is a step function of the policy
  (it stays at 0.5 on a two-answer task until the answer each task prefers flips, while the
  sampled reward climbs: the clean planted-hack twin raised this alarm on a CI run with it);
- `length_blowup`: the mean response length (the model's own tokens) reaches `length_factor` times
  its mean over the first `window` steps, and at least `length_floor` tokens (padding answers to
  please a length-blind reward, or a policy that stopped ending its turns).
Each kind fires once, then again only after the signal has recovered (no alert storms).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from crucible.shared import alerts
from crucible.v1 import alert_pb2


@dataclass
class HealthMonitor:
    run_id: str
    kl_limit: float = 3.0
    entropy_floor: float = 0.01
    min_steps: int = 5
    window: int = 20
    reward_window: int = 5
    reward_gain: float = 0.2
    heldout_flat: float = 0.05
    heldout_margin: float = 0.1
    length_factor: float = 3.0
    length_floor: float = 16.0
    incidents: alerts.Incidents = field(default_factory=alerts.Incidents)
    rewards: dict[int, float] = field(default_factory=dict)  # policy version -> the step's mean reward
    lengths: list[float] = field(default_factory=list)
    heldout: list[tuple[int, float]] = field(default_factory=list)

    def record_heldout(self, step: int, pass_rate: float) -> None:
        self.heldout.append((step, pass_rate))

    def check(self, step: int, version: int, metrics: dict) -> list[alert_pb2.Alert]:
        self.rewards[version] = metrics.get("reward_mean", 0.0)
        if "response_length" in metrics:
            self.lengths.append(metrics["response_length"])
        if step < self.min_steps:
            return []
        signals = {
            "kl_blowup": (metrics.get("kl", 0.0) > self.kl_limit,
                          f"KL to the reference is {metrics.get('kl', 0.0):.3f} at step {step} "
                          f"(limit {self.kl_limit})"),
            "entropy_collapse": self._collapsed(step, metrics.get("entropy", 1.0)),
            "reward_without_heldout": self._diverging(step),
            "length_blowup": self._lengthening(step),
        }
        firing = {kind: message for kind, (on, message) in signals.items() if on}
        details = {"step": str(step), "policy_version": str(version),
                   **{k: f"{v:.6g}" for k, v in metrics.items() if isinstance(v, (int, float))}}
        return [alerts.new(f"{self.run_id}/{kind}/{step}", kind, message, self.run_id, details)
                for kind, message in self.incidents.starting(firing)]

    def _diverging(self, step: int) -> tuple[bool, str]:
        """Over some stretch between two held-out evaluations: the training reward rose by
        `reward_gain` while the held-out pass rate did not rise by `heldout_flat`, and it stands
        `heldout_margin` above the held-out rate at the end. Both ends are read at the versions the
        held-out tasks were scored at (the mean reward of the `reward_window` versions up to each), so
        a reward still climbing after the last evaluation is not held against a rate measured before
        it: one honest run raised this alarm from a training reward six versions newer than the
        held-out rate. Every earlier evaluation is tried against the newest, so an honest rise early in
        a run does not hide a hack that follows; and a sampled training reward climbing towards a
        held-out rate that has levelled off near it is a policy sharpening, not a reward being gamed."""
        n = self.reward_window
        if len(self.heldout) < 2:
            return False, ""
        newest_version, newest = self.heldout[-1]
        late = self._reward_up_to(newest_version)
        if late is None:
            return False, ""
        for at, then in self.heldout[:-1]:
            if at > newest_version - n:
                continue  # the later stretch must be n versions at least
            early = self._reward_up_to(at)
            if early is None:
                early = self._reward_over(sorted(self.rewards)[:n])  # version 0: the run's first steps
            if early is None:
                continue
            if (late - early >= self.reward_gain and newest - then < self.heldout_flat
                    and late - newest >= self.heldout_margin):
                return True, (f"training reward rose {early:.3f} -> {late:.3f} while the held-out pass rate went "
                              f"{then:.3f} -> {newest:.3f} (versions {at} to {newest_version}), by step {step}")
        return False, ""

    def _reward_up_to(self, version: int) -> float | None:
        """The mean training reward of the `reward_window` versions up to `version`, if all are in."""
        versions = range(version - self.reward_window + 1, version + 1)
        return self._reward_over(versions) if all(v in self.rewards for v in versions) else None

    def _reward_over(self, versions) -> float | None:
        versions = list(versions)
        return self._mean_reward(versions) if len(versions) >= self.reward_window else None

    def _mean_reward(self, versions: list[int]) -> float:
        return sum(self.rewards[v] for v in versions) / len(versions)

    def _collapsed(self, step: int, entropy: float) -> tuple[bool, str]:
        if not 0 < entropy < self.entropy_floor:
            return False, ""
        versions = sorted(self.rewards)
        start, now = self._mean_reward(versions[:self.window]), self._mean_reward(versions[-self.window:])
        return now - start < self.reward_gain, (
            f"token entropy fell to {entropy:.4f} at step {step} (floor {self.entropy_floor}) with the training "
            f"reward at {now:.3f}, from {start:.3f} over the first {min(self.window, len(versions))} steps")

    def _lengthening(self, step: int) -> tuple[bool, str]:
        if len(self.lengths) <= self.window:
            return False, ""
        base = sum(self.lengths[: self.window]) / self.window
        now = self.lengths[-1]
        firing = now >= self.length_floor and now >= self.length_factor * max(base, 1e-9)
        return firing, (f"responses grew to {now:.1f} tokens at step {step}, {now / max(base, 1e-9):.1f}x the "
                        f"{base:.1f} of the first {self.window} steps")
