"""Training-health signals the learner sees step by step, raised as Alerts.

- `kl_blowup`: KL to the reference jumps above `kl_limit` (the policy left its anchor in one step);
- `entropy_collapse`: mean token entropy falls below `entropy_floor` (the policy stopped exploring,
  often the first sign of a reward being gamed by one fixed answer);
- `reward_without_heldout`: between two held-out evaluations the mean training reward (over
  `reward_window` steps) rose by `reward_gain` while the held-out pass rate rose by less than
  `heldout_flat`, and the training reward now stands `heldout_margin` above it (the policy fits the
  training distribution, or games its reward);
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
    rewards: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    heldout: list[tuple[int, float]] = field(default_factory=list)

    def record_heldout(self, step: int, pass_rate: float) -> None:
        self.heldout.append((step, pass_rate))

    def check(self, step: int, version: int, metrics: dict) -> list[alert_pb2.Alert]:
        self.rewards.append(metrics.get("reward_mean", 0.0))
        if "response_length" in metrics:
            self.lengths.append(metrics["response_length"])
        if step < self.min_steps:
            return []
        signals = {
            "kl_blowup": (metrics.get("kl", 0.0) > self.kl_limit,
                          f"KL to the reference is {metrics.get('kl', 0.0):.3f} at step {step} "
                          f"(limit {self.kl_limit})"),
            "entropy_collapse": (0 < metrics.get("entropy", 1.0) < self.entropy_floor,
                                 f"token entropy fell to {metrics.get('entropy', 0.0):.4f} at step {step} "
                                 f"(floor {self.entropy_floor})"),
            "reward_without_heldout": self._diverging(step),
            "length_blowup": self._lengthening(step),
        }
        firing = {kind: message for kind, (on, message) in signals.items() if on}
        details = {"step": str(step), "policy_version": str(version),
                   **{k: f"{v:.6g}" for k, v in metrics.items() if isinstance(v, (int, float))}}
        return [alerts.new(f"{self.run_id}/{kind}/{step}", kind, message, self.run_id, details)
                for kind, message in self.incidents.starting(firing)]

    def _diverging(self, step: int) -> tuple[bool, str]:
        """Over some stretch between two held-out evaluations: the training reward (mean of the
        `reward_window` steps up to the earlier one, against the last ones) rose by `reward_gain`
        while the held-out pass rate did not rise by `heldout_flat`. Every earlier evaluation is tried
        against the newest, so an honest rise early in a run does not hide a hack that follows. And the
        training reward must stand `heldout_margin` above the held-out pass rate: a sampled reward still
        climbing while a greedy held-out score has levelled off near it is a policy sharpening, not a
        reward being gamed."""
        n = self.reward_window
        if len(self.rewards) < 2 * n or len(self.heldout) < 2:
            return False, ""
        late = sum(self.rewards[-n:]) / n
        newest_step, newest = self.heldout[-1]
        for at, then in self.heldout[:-1]:
            if at >= newest_step or at > len(self.rewards) - n:
                continue  # the later stretch must be n steps at least
            window = self.rewards[max(0, at - n):at] or self.rewards[:n]
            early = sum(window) / len(window)
            if (late - early >= self.reward_gain and newest - then < self.heldout_flat
                    and late - newest >= self.heldout_margin):
                return True, (f"training reward rose {early:.3f} -> {late:.3f} while the held-out pass rate went "
                              f"{then:.3f} -> {newest:.3f} (versions {at} to {newest_step}), by step {step}")
        return False, ""

    def _lengthening(self, step: int) -> tuple[bool, str]:
        if len(self.lengths) <= self.window:
            return False, ""
        base = sum(self.lengths[: self.window]) / self.window
        now = self.lengths[-1]
        firing = now >= self.length_floor and now >= self.length_factor * max(base, 1e-9)
        return firing, (f"responses grew to {now:.1f} tokens at step {step}, {now / max(base, 1e-9):.1f}x the "
                        f"{base:.1f} of the first {self.window} steps")
