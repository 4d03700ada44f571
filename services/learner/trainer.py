"""One optimisation step on a batch of groups, with no Kafka in sight (so it is unit-testable).

The learner recomputes each sample's log-probs under the distribution it was sampled from (its
recorded temperature and top_p, see crucible.ml.policy.distribution), so on fresh samples the
importance ratio starts at 1; `mismatch_kl` reports how far from that the batch is.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from crucible.ml.policy.losses import dpo_loss, grpo_loss, masked_mean, ppo_loss
from crucible.ml.policy.model import sequence_logprobs
from crucible.services.learner.ranks import Ranks
from crucible.shared.settings import RunConfig
from crucible.v1 import trajectory_pb2

log = logging.getLogger(__name__)

# Why a sample is not trained on (StepResult.skipped, the PolicyVersion's metrics).
STALE = "stale"                      # sampled more than max_policy_lag versions ago
EMPTY = "empty_completion"           # no completion token carries a gradient
MISMATCHED = "mismatched_loss_mask"  # a loss mask that does not cover the completion token for token
NO_PREFERENCE = "no_preference"      # DPO: its group has no reward spread, so no pair
HELDOUT = "heldout"                  # its task is held out: never trained on, whoever published it
UNINFORMATIVE = "uninformative"      # its group's rewards are all equal: no learning signal (dynamic sampling)
NON_FINITE = "non_finite_update"     # its step's loss or gradient norm was not finite: no update was made


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
    prompt_lengths: torch.Tensor  # [B]: a row's prompt (read once for all the rows that share it)
    scored: torch.Tensor       # [B, T-1] bool: the positions that score a completion token, row by row


def model_tokens(s: trajectory_pb2.Trajectory) -> int:
    """Completion tokens that carry loss: the model's own (an episode's observations do not)."""
    return sum(s.loss_mask) if len(s.loss_mask) else len(s.completion_token_ids)


def completion_batch(samples: list[trajectory_pb2.Trajectory]) -> Batch:
    prompts = [s.prompt_token_ids for s in samples]
    completions = [s.completion_token_ids for s in samples]
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    lengths = prompt_lengths + torch.tensor([len(c) for c in completions], dtype=torch.long)
    width = int(lengths.max())
    # Each row's tokens, then its scored positions, filled in one assignment each: True positions in
    # row-major order are the rows' values one after another.
    valid = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.zeros((len(samples), width), dtype=torch.long)  # padding is masked out; 0 is in every vocabulary
    ids[valid] = torch.tensor([t for p, c in zip(prompts, completions) for part in (p, c) for t in part],
                              dtype=torch.long)
    position = torch.arange(width - 1)[None, :]  # position t scores token t + 1
    scored = (position >= prompt_lengths[:, None] - 1) & (position < lengths[:, None] - 1)
    old = torch.zeros((len(samples), width - 1))
    old[scored] = torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32)
    mask = torch.zeros((len(samples), width - 1))
    # an episode: only the model's own tokens carry loss
    mask[scored] = torch.tensor([m for s, c in zip(samples, completions)
                                 for m in (s.loss_mask if len(s.loss_mask) else (1.0,) * len(c))], dtype=torch.float32)
    return Batch(ids, valid, mask, old,
                 advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
                 temperature=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
                 top_p=torch.tensor([s.top_p for s in samples], dtype=torch.float32),
                 prompt_lengths=prompt_lengths, scored=scored)


def scheduled_lr(config: RunConfig, step: int) -> float:
    """The learning rate of optimiser step `step` (from 0): lr, or with lr_decay_steps = T,
    lr * max(0.1, 1 - 0.9 step / T): a late policy takes small steps and stays where it got to.
    With lr_warmup_steps = W, step s < W takes (s + 1) / W of that: Adam's first steps, on moments
    estimated from a batch or two, would otherwise be full-size steps in the direction of noise."""
    lr = config.lr
    if config.lr_decay_steps:
        lr *= max(0.1, 1.0 - 0.9 * step / config.lr_decay_steps)
    if step < config.lr_warmup_steps:
        lr *= (step + 1) / config.lr_warmup_steps
    return lr

class Trainer:
    """Optimiser steps on batches of samples. With several `ranks`, every rank constructs one on the
    same weights and calls `step` with the same batch (rank 0 reads it; see ranks.py and `follow`)."""

    def __init__(self, model, config: RunConfig, *, reference=None,
                 version: int = 0, step: int = 0, optimizer_state: dict | None = None, ranks: Ranks | None = None):
        self.config = config
        self.ranks = ranks or Ranks()
        if config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        self.reference = (reference or copy.deepcopy(model)).eval()
        if config.lora_rank:
            if self.ranks.sharding == "fsdp":
                raise ValueError("lora_rank trains adapters small enough to replicate: use learner_sharding = "
                                 "'ddp' with it, not 'fsdp'")
            model = with_lora(model, config)
        if self.ranks.device().type == "cuda":
            model, self.reference = model.cuda(), self.reference.cuda()
        self.model = model  # what checkpoints are written from (FSDP: sharded in place)
        # What a sample may hold for this model (groups.sample_problem): token ids below the vocabulary,
        # sequences within its positions (None where the model does not say).
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        self.max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.forward_model = self.ranks.wrap(model)  # what forward and backward run through
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                           weight_decay=0.0)
        if optimizer_state:
            try:
                load_optimizer_state(self.model, self.optimizer, optimizer_state)
            except OptimizerStateMismatch as exc:  # Adam's moments start afresh; the weights are what matter
                log.error("the saved optimiser state is not this model's, so training goes on without it: %s", exc)
        self.version = version
        self.step_count = step

    def learning_rate(self) -> float:
        return scheduled_lr(self.config, self.step_count)

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

    def reference_logprobs(self, samples: list[trajectory_pb2.Trajectory]) -> dict[str, torch.Tensor]:
        """Each sample's completion tokens' log-probs under the reference policy (sample id -> [tokens]),
        as a step's KL term reads them: the reference never changes, so they can be worked out as soon
        as a sample arrives, beside the step before (the learner's ReferenceAhead), not inside its own."""
        out = {}
        with torch.no_grad():
            for chunk in self.micro_batches(samples):  # no larger a pass than the step's own
                batch = completion_batch(chunk)
                logp = self._logprobs(self.reference, batch)[0].cpu()
                out.update((s.id, logp[i][batch.scored[i]]) for i, s in enumerate(chunk))
        return out

    def step(self, samples: list[trajectory_pb2.Trajectory], uninformative: frozenset = frozenset(),
             reference: dict[str, torch.Tensor] | None = None) -> StepResult:
        """Drops what cannot be trained on (counted by reason; samples of the groups named in
        `uninformative` were filtered by dynamic sampling); with anything left, takes one optimiser
        step and bumps the version. The batch's reward and pass rate count every sample given.
        `reference`: reference log-probs worked out already (reference_logprobs); a micro-batch with a
        sample they lack computes its own.

        With several ranks, rank 0's call hands the batch to the others (waiting in `follow`)."""
        if self.ranks.world > 1 and self.ranks.main:
            self.ranks.broadcast(("step", [s.SerializeToString() for s in samples], sorted(uninformative)))
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
                    loss, epoch_stats, epoch_entropy = self._policy_gradient(usable, reference or {})
                if epoch == 0:  # report the batch as it was sampled, before this step changed the policy
                    stats, entropy = epoch_stats, epoch_entropy
                if loss is None:
                    break
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
                norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor
                if not (math.isfinite(norm) and math.isfinite(float(loss))):
                    # One NaN reaching the optimiser makes every weight NaN, and that policy would be
                    # published: the step is not taken (every rank sees the same reduced norm).
                    log.warning("no update: loss %s, gradient norm %s over %d samples", loss, norm, len(usable))
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped[NON_FINITE] += len(usable)
                    break
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
        device = self.ranks.device()
        return sequence_logprobs(model, batch.ids.to(device), batch.valid.to(device), batch.temperature.to(device),
                                 batch.top_p.to(device), batch.prompt_lengths.to(device))

    def micro_batches(self, samples: list) -> list[list]:
        size = self.config.micro_batch_size or len(samples)
        return [samples[i:i + size] for i in range(0, len(samples), size)]

    def _mine(self, units: list) -> tuple[list, float]:
        """This rank's share of a step's units (samples, or DPO pairs) and the factor its loss is
        scaled by: ranks' gradients are averaged, so each rank's weighted loss counts `world` times.
        A rank left with nothing runs one unit at weight 0, so that every rank joins the reduction."""
        mine = self.ranks.share(units)
        scale = float(self.ranks.world) if self.ranks.distributed else 1.0
        return (mine, scale) if mine else (units[:1], 0.0)

    def _gathered(self, loss: float, entropy: float, stats: dict) -> tuple[float, float, dict]:
        """The step's figures over all ranks: each rank's are already weighted by its share."""
        keys = sorted(stats)
        total = self.ranks.sum([loss, entropy, *(stats[k] for k in keys)])
        return total[0], total[1], dict(zip(keys, total[2:]))

    def _reference_of(self, batch: Batch, chunk: list, reference: dict[str, torch.Tensor]) -> torch.Tensor:
        """A micro-batch's reference log-probs [B, T-1]: those worked out already where every sample has
        them, else computed now."""
        known = [reference.get(s.id) for s in chunk]
        if all(r is not None for r in known) and sum(len(r) for r in known) == int(batch.scored.sum()):
            ref_logp = torch.zeros(batch.scored.shape)
            ref_logp[batch.scored] = torch.cat(known)
            return ref_logp.to(self.ranks.device())
        with torch.no_grad():
            return self._logprobs(self.reference, batch)[0]

    def _policy_gradient(self, samples, reference: dict[str, torch.Tensor]):
        """Forward and backward over micro-batches; gradients accumulate to those of the whole batch.

        Each micro-batch's token-mean loss is weighted by its share of the batch's completion tokens,
        so the sum is the token mean over the whole batch, as if it had been one pass (across ranks
        too: each takes its share of the samples, and the weights use the whole batch's tokens).
        """
        loss_fn = grpo_loss if self.config.objective == "grpo" else ppo_loss
        total = sum(model_tokens(s) for s in samples)
        mine, scale = self._mine(samples)
        loss_value, entropy_value, stats = 0.0, 0.0, Counter()
        chunks = self.micro_batches(mine)
        for i, chunk in enumerate(chunks):
            batch = completion_batch(chunk)
            mask, old_logp = batch.mask.to(self.ranks.device()), batch.old_logp.to(self.ranks.device())
            weight = float(batch.mask.sum()) / total * (scale > 0)
            with self.ranks.accumulating(self.forward_model, last=i == len(chunks) - 1):
                logp, entropy = self._logprobs(self.forward_model, batch)
                ref_logp = self._reference_of(batch, chunk, reference)
                loss, chunk_stats = loss_fn(logp, old_logp, ref_logp, batch.advantages.to(mask.device), mask,
                                            clip_eps=self.config.clip_eps, kl_coef=self.config.kl_coef,
                                            entropy_coef=self.config.entropy_coef, entropy=entropy)
                (loss * weight * scale).backward()
            loss_value += float(loss.detach()) * weight
            entropy_value += float(masked_mean(entropy.detach(), mask)) * weight
            chunk_stats["mismatch_kl"] = mismatch_kl(old_logp, logp.detach(), mask)
            for k, v in chunk_stats.items():
                stats[k] += v * weight
        loss_value, entropy_value, stats = self._gathered(loss_value, entropy_value, dict(stats))
        return loss_value, stats, entropy_value

    def _dpo(self, samples):
        """Pairs from groups: each group's best sample against its worst. Returns the loss (None without
        a pair), stats, entropy, and how many samples sat in groups that gave no pair."""
        groups: dict[str, list] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        pairs, unpaired = [], 0
        for members in groups.values():
            best = max(members, key=lambda s: s.reward)
            worst = min(members, key=lambda s: s.reward)
            if best.reward > worst.reward:
                pairs.append((best, worst))
            else:
                unpaired += len(members)
        if not pairs:
            return None, {"dpo_pairs": 0}, 0.0, unpaired
        tokens = sum(model_tokens(s) for pair in pairs for s in pair)
        mine, scale = self._mine(pairs)
        k = len(mine)
        batch = completion_batch([c for c, _ in mine] + [r for _, r in mine])
        mask, old_logp = batch.mask.to(self.ranks.device()), batch.old_logp.to(self.ranks.device())
        logp, entropy = self._logprobs(self.forward_model, batch)
        with torch.no_grad():
            ref_logp, _ = self._logprobs(self.reference, batch)
        seq, ref_seq = (logp * mask).sum(-1), (ref_logp * mask).sum(-1)
        loss, stats = dpo_loss(seq[:k], seq[k:], ref_seq[:k], ref_seq[k:], beta=self.config.dpo_beta)
        share = k / len(pairs) * (scale > 0)  # the pair mean over this rank's pairs, as part of all pairs'
        (loss * share * scale).backward()
        token_share = float(batch.mask.sum()) / tokens * (scale > 0)
        stats = {**{name: v * share for name, v in stats.items()},
                 "mismatch_kl": mismatch_kl(old_logp, logp.detach(), mask) * token_share}
        loss_value, entropy_value, stats = self._gathered(float(loss.detach()) * share,
                                                          float(masked_mean(entropy.detach(), mask)) * token_share,
                                                          stats)
        return loss_value, {**stats, "dpo_pairs": len(pairs)}, entropy_value, unpaired

    # -- with several ranks ------------------------------------------------------------------------

    def follow(self, after_step) -> None:
        """Ranks other than 0: take each step rank 0 broadcasts, and after each that stepped call
        `after_step` (its part in writing the checkpoint, as rank 0 does then: checkpoints.save), until
        rank 0 says stop (or a collective fails because a rank died: that raises)."""
        while True:
            command = self.ranks.broadcast()
            if command[0] == "stop":
                return
            if command[0] == "step":
                samples = [trajectory_pb2.Trajectory.FromString(b) for b in command[1]]
                if self.step(samples, frozenset(command[2])).stepped:
                    after_step()

    def checkpoint_state(self, optimizer: bool = True) -> tuple[dict | None, dict | None]:
        """(the model's whole weights, or None where `self.model` holds them; the optimiser state keyed by
        parameter name, whole, or None under FSDP once there is state: its ranks write shards,
        `save_optimizer_shards`; None too when `optimizer` is False), for rank 0 to write. Collective
        under FSDP (the weights are gathered)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        if not self.ranks.main and self.ranks.sharding != "fsdp":
            return None, None  # replicated state: nothing to gather, and only rank 0 writes
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=whole) if self.ranks.sharding == "fsdp" else None
        if not optimizer:
            return weights, None
        if not self.optimizer.state:
            # Nothing learnt yet: the plain (empty) state. The name-keyed helpers would first create the state
            # by an optimiser step on zero gradients, which counts as a step in AdamW's bias correction.
            return weights, self.optimizer.state_dict()
        if self.ranks.sharding == "fsdp":
            return weights, None
        return None, get_optimizer_state_dict(self.model, self.optimizer, options=whole)

    def save_optimizer_shards(self, folder) -> bool:
        """FSDP: every rank writes its shard of the optimiser state into `folder` (a path all ranks see:
        a shared volume across machines). torch.distributed.checkpoint reshards on load, so any number
        of ranks, or one process without FSDP, resumes from it."""
        import shutil

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not self.optimizer.state:  # nothing learnt yet: checkpoint_state gives the empty state whole
            return False
        if self.ranks.main and os.path.exists(folder):
            shutil.rmtree(folder)  # a save of this version cut short before
        self.ranks.barrier()
        dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=str(folder))
        return True

    def keepalive(self) -> None:
        """Rank 0, while no step comes: the others learn it is alive (and it learns they are)."""
        if self.ranks.world > 1 and self.ranks.main:
            self.ranks.broadcast(("idle",))

    def release(self) -> None:
        """Rank 0, stopping: the others stop too."""
        if self.ranks.world > 1 and self.ranks.main:
            self.ranks.broadcast(("stop",))


class OptimizerStateMismatch(ValueError):
    """Saved optimiser state that is not this model's (other parameters, or other shapes)."""


def _check_fits(model, state: dict) -> None:
    """OptimizerStateMismatch unless `state` (keyed by parameter name) holds moments shaped as the model's
    parameters of those names, and names some of them: Adam took any state, and failed at the first step
    with a size mismatch (the learner restarting into it again and again). (A wrapper's names differ from
    the saved ones by a prefix, so a name the model lacks alone proves nothing.)"""
    saved = state.get("state") or {}
    if not saved:
        return
    shapes = {}
    for name, p in model.named_parameters():
        shapes[name] = shapes[name.removeprefix("module.")] = tuple(p.shape)
    if not any(name in shapes for name in saved):
        raise OptimizerStateMismatch(f"it names none of the model's parameters (such as {str(next(iter(saved)))[:200]!r})")
    for name, moments in saved.items():
        for key, value in (moments or {}).items() if name in shapes else ():
            if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != shapes[name]:
                raise OptimizerStateMismatch(f"its {key} of {name} is {tuple(value.shape)}, the parameter "
                                             f"{shapes[name]}")


def load_optimizer_state(model, optimizer, state) -> None:
    """Optimiser state as `checkpoint_state` saves it (keyed by parameter name, whole), or the folder of
    shards FSDP ranks wrote (`save_optimizer_shards`), or as older checkpoints saved it (by parameter
    index). The first two load on any number of ranks and either sharding."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    if isinstance(state, (str, os.PathLike)):
        import torch.distributed.checkpoint as dcp

        # The template has this process's layout (sharded or whole); DCP fills it from whatever layout
        # the shards were written in.
        template = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(template, checkpoint_id=str(state))
        set_optimizer_state_dict(model, optimizer, template["optimizer"])
        return
    if any(isinstance(i, int) for group in state.get("param_groups", []) for i in group.get("params", [])):
        optimizer.load_state_dict(state)
        return
    _check_fits(model, state)
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


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
