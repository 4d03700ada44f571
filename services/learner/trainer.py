"""One optimisation step on a batch of groups, with no Kafka in sight (so it is unit-testable).

The learner recomputes each sample's log-probs under the distribution it was sampled from (its
recorded temperature and top_p, see crucible.ml.policy.distribution), so on fresh samples the
importance ratio starts at 1; `mismatch_kl` reports how far from that the batch is.
"""
from __future__ import annotations

import copy
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from crucible.ml.policy.losses import dpo_loss, grpo_loss, masked_mean, ppo_loss
from crucible.ml.policy.model import sequence_logprobs
from crucible.shared.settings import RunConfig
from crucible.v1 import trajectory_pb2

# Why a sample is not trained on (StepResult.skipped, the PolicyVersion's metrics).
STALE = "stale"                      # sampled more than max_policy_lag versions ago
EMPTY = "empty_completion"           # no completion token carries a gradient
MISMATCHED = "mismatched_loss_mask"  # a loss mask that does not cover the completion token for token
NO_PREFERENCE = "no_preference"      # DPO: its group has no reward spread, so no pair
HELDOUT = "heldout"                  # its task is held out: never trained on, whoever published it
UNINFORMATIVE = "uninformative"      # its group's rewards are all equal: no learning signal (dynamic sampling)


@dataclass
class StepResult:
    """What one call to Trainer.step did. `stepped` is False when no optimiser step happened
    (nothing fresh, no DPO pair): then the version stays, and nothing is published."""

    stepped: bool
    metrics: dict = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)


@dataclass
class Batch:
    """Right-padded prompt+completion ids and what the loss needs, aligned with sequence_logprobs' outputs
    (position t scores token t+1 given tokens <= t)."""

    ids: torch.Tensor          # [B, T]
    valid: torch.Tensor        # [B, T]
    mask: torch.Tensor         # [B, T-1] completion tokens
    old_logp: torch.Tensor     # [B, T-1] sampling log-probs
    advantages: torch.Tensor   # [B]
    temperature: torch.Tensor  # [B]
    top_p: torch.Tensor        # [B]


def model_tokens(s: trajectory_pb2.Trajectory) -> int:
    """Completion tokens that carry loss: the model's own (an episode's observations do not)."""
    return sum(s.loss_mask) if len(s.loss_mask) else len(s.completion_token_ids)


def completion_batch(samples: list[trajectory_pb2.Trajectory]) -> Batch:
    rows = [(list(s.prompt_token_ids), list(s.completion_token_ids), list(s.logprobs)) for s in samples]
    width = max(len(p) + len(c) for p, c, _ in rows)
    n = len(rows)
    ids = torch.zeros((n, width), dtype=torch.long)  # padding is masked out; 0 is in every vocabulary
    valid = torch.zeros((n, width), dtype=torch.bool)
    mask = torch.zeros((n, width - 1))
    old = torch.zeros((n, width - 1))
    for i, (p, c, lp) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        valid[i, : len(p) + len(c)] = True
        own = samples[i].loss_mask  # an episode: only the model's own tokens carry loss
        mask[i, len(p) - 1: len(p) + len(c) - 1] = torch.tensor(list(own), dtype=torch.float32) if len(own) else 1.0
        old[i, len(p) - 1: len(p) + len(c) - 1] = torch.tensor(lp)
    return Batch(ids, valid, mask, old,
                 advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
                 temperature=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
                 top_p=torch.tensor([s.top_p for s in samples], dtype=torch.float32))


class Trainer:
    def __init__(self, model, config: RunConfig, *, reference=None,
                 version: int = 0, step: int = 0, optimizer_state: dict | None = None):
        self.config = config
        if config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        self.reference = (reference or copy.deepcopy(model)).eval()
        if config.lora_rank:
            model = with_lora(model, config)
        self.model = model
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                           weight_decay=0.0)
        if optimizer_state:
            self.optimizer.load_state_dict(optimizer_state)
        self.version = version
        self.step_count = step

    def learning_rate(self) -> float:
        """lr_t = lr * max(0.1, 1 - 0.9 t / T): a late policy takes small steps and stays where it got to."""
        if not self.config.lr_decay_steps:
            return self.config.lr
        return self.config.lr * max(0.1, 1.0 - 0.9 * self.step_count / self.config.lr_decay_steps)

    def fresh_enough(self, s: trajectory_pb2.Trajectory) -> bool:
        lag = self.version - s.policy_version
        return self.config.max_policy_lag < 0 or lag <= self.config.max_policy_lag

    def skip_reason(self, s: trajectory_pb2.Trajectory, uninformative: frozenset = frozenset()) -> str | None:
        if s.heldout:
            return HELDOUT
        if not self.fresh_enough(s):
            return STALE
        if s.group_id in uninformative:
            return UNINFORMATIVE
        if len(s.loss_mask) and len(s.loss_mask) != len(s.completion_token_ids):
            return MISMATCHED
        if not model_tokens(s):
            return EMPTY
        return None

    def step(self, samples: list[trajectory_pb2.Trajectory], uninformative: frozenset = frozenset()) -> StepResult:
        """Drops what cannot be trained on (counted by reason; samples of the groups named in
        `uninformative` were filtered by dynamic sampling); with anything left, takes one optimiser
        step and bumps the version. The batch's reward and pass rate count every sample given."""
        started = time.perf_counter()
        skipped: Counter = Counter()
        usable = []
        for s in samples:
            reason = self.skip_reason(s, uninformative)
            if reason:
                skipped[reason] += 1
            else:
                usable.append(s)
        metrics = {
            "reward_mean": sum(s.reward for s in samples) / len(samples) if samples else 0.0,
            "pass_rate": sum(s.passed for s in samples) / len(samples) if samples else 0.0,
            "samples": len(samples),
            # the model's own tokens per sample (an episode's observations are not its response)
            "response_length": sum(model_tokens(s) for s in samples) / len(samples) if samples else 0.0,
            # versions between the policy that sampled and the one trained now (0: on-policy)
            "policy_lag": sum(self.version - s.policy_version for s in samples) / len(samples) if samples else 0.0,
            "policy_lag_max": float(max((self.version - s.policy_version for s in samples), default=0)),
            "filtered_groups": len(uninformative),
        }
        lr = self.learning_rate()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats, grad_norm, loss_value, entropy, stepped = {}, 0.0, 0.0, 0.0, False
        if usable:
            self.model.train()
            for epoch in range(self.config.epochs):
                self.optimizer.zero_grad(set_to_none=True)
                if self.config.objective == "dpo":
                    loss, epoch_stats, epoch_entropy, unpaired = self._dpo(usable)
                    if epoch == 0:
                        skipped[NO_PREFERENCE] += unpaired
                else:
                    loss, epoch_stats, epoch_entropy = self._policy_gradient(usable)
                if epoch == 0:  # report the batch as it was sampled, before this step changed the policy
                    stats, entropy = epoch_stats, epoch_entropy
                if loss is None:
                    break
                norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
                self.optimizer.step()
                stepped = True
                if epoch == 0:
                    grad_norm, loss_value = norm, loss
            self.model.eval()
        if stepped:
            self.step_count += 1
            self.version += 1
        metrics.update({"loss": loss_value, "kl": stats.get("kl", 0.0), "entropy": entropy, "grad_norm": grad_norm,
                        "learning_rate": lr, "dropped_stale": skipped[STALE],
                        "step_ms": (time.perf_counter() - started) * 1000, **stats})
        return StepResult(stepped, metrics, skipped)

    def _logprobs(self, model, batch: Batch):
        return sequence_logprobs(model, batch.ids, batch.valid, batch.temperature, batch.top_p)

    def micro_batches(self, samples: list) -> list[list]:
        size = self.config.micro_batch_size or len(samples)
        return [samples[i:i + size] for i in range(0, len(samples), size)]

    def _policy_gradient(self, samples):
        """Forward and backward over micro-batches; gradients accumulate to those of the whole batch.

        Each micro-batch's token-mean loss is weighted by its share of the batch's completion tokens,
        so the sum is the token mean over the whole batch, as if it had been one pass.
        """
        loss_fn = grpo_loss if self.config.objective == "grpo" else ppo_loss
        total = sum(model_tokens(s) for s in samples)
        loss_value, entropy_value, stats = 0.0, 0.0, Counter()
        for chunk in self.micro_batches(samples):
            batch = completion_batch(chunk)
            weight = float(batch.mask.sum()) / total
            logp, entropy = self._logprobs(self.model, batch)
            with torch.no_grad():
                ref_logp, _ = self._logprobs(self.reference, batch)
            loss, chunk_stats = loss_fn(logp, batch.old_logp, ref_logp, batch.advantages, batch.mask,
                                        clip_eps=self.config.clip_eps, kl_coef=self.config.kl_coef,
                                        entropy_coef=self.config.entropy_coef, entropy=entropy)
            (loss * weight).backward()
            loss_value += float(loss.detach()) * weight
            entropy_value += float(masked_mean(entropy.detach(), batch.mask)) * weight
            chunk_stats["mismatch_kl"] = mismatch_kl(batch.old_logp, logp.detach(), batch.mask)
            for k, v in chunk_stats.items():
                stats[k] += v * weight
        return loss_value, dict(stats), entropy_value

    def _dpo(self, samples):
        """Pairs from groups: each group's best sample against its worst. Returns the loss (None without
        a pair), stats, entropy, and how many samples sat in groups that gave no pair."""
        groups: dict[str, list] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        chosen, rejected, unpaired = [], [], 0
        for members in groups.values():
            best = max(members, key=lambda s: s.reward)
            worst = min(members, key=lambda s: s.reward)
            if best.reward > worst.reward:
                chosen.append(best)
                rejected.append(worst)
            else:
                unpaired += len(members)
        if not chosen:
            return None, {"dpo_pairs": 0}, 0.0, unpaired
        batch = completion_batch(chosen + rejected)
        logp, entropy = self._logprobs(self.model, batch)
        with torch.no_grad():
            ref_logp, _ = self._logprobs(self.reference, batch)
        seq, ref_seq = (logp * batch.mask).sum(-1), (ref_logp * batch.mask).sum(-1)
        k = len(chosen)
        loss, stats = dpo_loss(seq[:k], seq[k:], ref_seq[:k], ref_seq[k:], beta=self.config.dpo_beta)
        loss.backward()
        stats = {**stats, "dpo_pairs": k, "mismatch_kl": mismatch_kl(batch.old_logp, logp.detach(), batch.mask)}
        return float(loss.detach()), stats, float(masked_mean(entropy.detach(), batch.mask)), unpaired


def with_lora(model, config: RunConfig):
    """The model with LoRA adapters on every linear layer; only they train (the base stays frozen)."""
    if not hasattr(model, "generation_config"):
        raise ValueError("lora_rank applies to transformers models; the built-in policy trains all its weights")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # peft is in requirements.lock; a hand-made environment may lack it
        raise ValueError("lora_rank needs the peft package (pip install peft)") from exc
    if config.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return get_peft_model(model, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                            target_modules="all-linear", lora_dropout=0.0))


def mismatch_kl(sampler_logp: torch.Tensor, learner_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(sampler || learner) per token, estimated on the sampled tokens: mean_t[log p_s - log p_l].
    Before the update both are the same policy, so anything but ~0 means the two disagree."""
    return float(masked_mean(sampler_logp - learner_logp, mask))
