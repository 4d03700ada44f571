"""One optimisation step on a batch of groups, with no Kafka in sight (so it is unit-testable)."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from crucible.v1 import trajectory_pb2
from crucible.ml.policy.losses import dpo_loss, grpo_loss, masked_mean, ppo_loss
from crucible.ml.policy.model import Policy, sequence_logprobs
from crucible.ml.policy.tokenizer import PAD_ID


@dataclass
class Hyperparameters:
    objective: str = "grpo"          # grpo | ppo | dpo
    lr: float = 1e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    dpo_beta: float = 0.1
    max_policy_lag: int = 2          # -1: keep every sample
    epochs: int = 1                  # optimiser passes over each batch (the clipped ratio keeps them safe)
    lr_decay_steps: int = 0          # linear decay to 10% of lr over this many steps; 0: constant


@dataclass
class StepResult:
    metrics: dict = field(default_factory=dict)
    used: int = 0
    dropped_stale: int = 0


def passed(t: trajectory_pb2.Trajectory) -> bool:
    """Did the sample solve its task (answer correct, or every test passed)?"""
    c = t.verdict.components
    if t.verdict.tampered:
        return False
    if "answer_correct" in c:
        return c["answer_correct"] >= 1.0
    if c.get("tests_total", 0) > 0:
        return c.get("tests_passed", 0) >= c["tests_total"]
    return t.reward >= 1.0


def completion_batch(trajectories: list[trajectory_pb2.Trajectory]):
    """Right-padded prompt+completion ids, validity, completion mask, sampling log-probs, advantages.

    The masks and log-probs are aligned with sequence_logprobs' outputs (token t+1 given tokens <= t).
    """
    rows = [(list(t.verdict.rollout.prompt_token_ids), list(t.verdict.rollout.token_ids),
             list(t.verdict.rollout.logprobs)) for t in trajectories]
    width = max(len(p) + len(c) for p, c, _ in rows)
    n = len(rows)
    ids = torch.full((n, width), PAD_ID, dtype=torch.long)
    valid = torch.zeros((n, width), dtype=torch.bool)
    mask = torch.zeros((n, width - 1))
    old = torch.zeros((n, width - 1))
    for i, (p, c, lp) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        valid[i, : len(p) + len(c)] = True
        mask[i, len(p) - 1: len(p) + len(c) - 1] = 1.0
        old[i, len(p) - 1: len(p) + len(c) - 1] = torch.tensor(lp)
    adv = torch.tensor([t.advantage for t in trajectories], dtype=torch.float32)
    return ids, valid, mask, old, adv


class Trainer:
    def __init__(self, model: Policy, hp: Hyperparameters, *, reference: Policy | None = None,
                 version: int = 0, step: int = 0, optimizer_state: dict | None = None):
        self.model = model
        self.hp = hp
        self.reference = (reference or copy.deepcopy(model)).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=hp.lr, weight_decay=0.0)
        if optimizer_state:
            self.optimizer.load_state_dict(optimizer_state)
        self.version = version
        self.step_count = step

    def learning_rate(self) -> float:
        """lr_t = lr * max(0.1, 1 - 0.9 t / T): a late policy takes small steps and stays where it got to."""
        if not self.hp.lr_decay_steps:
            return self.hp.lr
        return self.hp.lr * max(0.1, 1.0 - 0.9 * self.step_count / self.hp.lr_decay_steps)

    def fresh_enough(self, t: trajectory_pb2.Trajectory) -> bool:
        lag = self.version - t.verdict.rollout.policy_version
        return self.hp.max_policy_lag < 0 or lag <= self.hp.max_policy_lag

    def step(self, trajectories: list[trajectory_pb2.Trajectory]) -> StepResult:
        """Drops stale samples, takes one optimiser step on the rest, bumps the version."""
        started = time.perf_counter()
        fresh = [t for t in trajectories if self.fresh_enough(t) and len(t.verdict.rollout.token_ids) > 0]
        result = StepResult(dropped_stale=sum(not self.fresh_enough(t) for t in trajectories))
        rewards = [t.reward for t in trajectories]
        metrics = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "pass_rate": sum(passed(t) for t in trajectories) / len(trajectories) if trajectories else 0.0,
            "samples": len(trajectories), "dropped_stale": result.dropped_stale, "learning_rate": self.hp.lr,
        }
        loss_value, stats, grad_norm, entropy = 0.0, {}, 0.0, 0.0
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics["learning_rate"] = lr
        if fresh:
            self.model.train()
            for epoch in range(self.hp.epochs):
                if self.hp.objective == "dpo":
                    loss, epoch_stats, epoch_entropy = self._dpo(fresh)
                else:
                    loss, epoch_stats, epoch_entropy = self._policy_gradient(fresh)
                if epoch == 0:  # report the batch as it was sampled, before this step changed the policy
                    stats, entropy = epoch_stats, epoch_entropy
                if loss is None:
                    break
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp.max_grad_norm))
                self.optimizer.step()
                if epoch == 0:
                    grad_norm, loss_value = norm, float(loss.detach())
            self.model.eval()
        self.step_count += 1
        self.version += 1
        result.used = len(fresh)
        result.metrics = {**metrics, "loss": loss_value, "kl": stats.get("kl", 0.0), "entropy": entropy,
                          "grad_norm": grad_norm, "step_ms": (time.perf_counter() - started) * 1000, **stats}
        return result

    def _policy_gradient(self, batch):
        ids, valid, mask, old, adv = completion_batch(batch)
        logp, entropy = sequence_logprobs(self.model, ids, valid)
        with torch.no_grad():
            ref_logp, _ = sequence_logprobs(self.reference, ids, valid)
        loss_fn = grpo_loss if self.hp.objective == "grpo" else ppo_loss
        loss, stats = loss_fn(logp, old, ref_logp, adv, mask, clip_eps=self.hp.clip_eps, kl_coef=self.hp.kl_coef,
                              entropy=entropy, entropy_coef=self.hp.entropy_coef)
        return loss, stats, float(masked_mean(entropy.detach(), mask))

    def _dpo(self, batch):
        """Pairs from groups: each group's best sample against its worst (groups without a spread are skipped)."""
        groups: dict[str, list] = {}
        for t in batch:
            groups.setdefault(t.verdict.rollout.group_id, []).append(t)
        chosen, rejected = [], []
        for members in groups.values():
            best = max(members, key=lambda t: t.reward)
            worst = min(members, key=lambda t: t.reward)
            if best.reward > worst.reward:
                chosen.append(best)
                rejected.append(worst)
        if not chosen:
            return None, {"dpo_pairs": 0}, 0.0
        ids, valid, mask, _, _ = completion_batch(chosen + rejected)
        logp, entropy = sequence_logprobs(self.model, ids, valid)
        with torch.no_grad():
            ref_logp, _ = sequence_logprobs(self.reference, ids, valid)
        seq, ref_seq = (logp * mask).sum(-1), (ref_logp * mask).sum(-1)
        k = len(chosen)
        loss, stats = dpo_loss(seq[:k], seq[k:], ref_seq[:k], ref_seq[k:], beta=self.hp.dpo_beta)
        return loss, {**stats, "dpo_pairs": k}, float(masked_mean(entropy.detach(), mask))
