"""Policy-gradient and preference losses, written as their equations.

Notation (per token t of completion i):
    r_t   = exp(log pi_theta(o_t) - log pi_old(o_t))     importance ratio against the sampling policy
    A_i   = advantage of completion i (from the reward aggregator)
    kl_t  = exp(q_t) - q_t - 1,  q_t = log pi_ref(o_t) - log pi_theta(o_t)   (the k3 estimator, >= 0)
All token-level losses average over every completion token in the batch (mask marks them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref): exp(q) - q - 1 with q = log pi_ref - log pi_theta."""
    q = ref_logp - logp
    return torch.exp(q) - q - 1


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r_t A, clip(r_t, 1-eps, 1+eps) A) per token, and r_t."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped), ratio


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, clip_eps, kl_coef, entropy_coef, entropy=None
              ) -> tuple[torch.Tensor, dict]:
    """GRPO: L = mean_t[ -min(r_t A_i, clip(r_t) A_i) + beta kl_t ] - c_H mean_t[H_t].

    advantages: [B] per completion, broadcast over its tokens; all other tensors [B, T].
    """
    a = advantages[:, None].expand_as(logp)
    surrogate, ratio = clipped_surrogate(logp, old_logp, a, clip_eps)
    kl = k3_kl(logp, ref_logp)
    loss = masked_mean(surrogate + kl_coef * kl, mask)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * masked_mean(entropy, mask)
    return loss, _stats(ratio, kl, mask, clip_eps)


def ppo_loss(logp, old_logp, ref_logp, advantages, mask, *, clip_eps, kl_coef, entropy_coef, entropy=None
             ) -> tuple[torch.Tensor, dict]:
    """PPO-clip with the KL penalty in the reward, as in RLHF's PPO:
    A'_t = A_i - beta (log pi_old(o_t) - log pi_ref(o_t)),  L = mean_t[ -min(r_t A'_t, clip(r_t) A'_t) ].

    The penalty uses the sampling policy's log-probs, so it is a constant per token (no gradient).
    """
    shaped = advantages[:, None] - kl_coef * (old_logp - ref_logp)
    surrogate, ratio = clipped_surrogate(logp, old_logp, shaped.detach(), clip_eps)
    loss = masked_mean(surrogate, mask)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * masked_mean(entropy, mask)
    return loss, _stats(ratio, k3_kl(logp, ref_logp), mask, clip_eps)


def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, *, beta: float) -> tuple[torch.Tensor, dict]:
    """DPO: L = -log sigma( beta [ (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) ] ).

    Inputs are sequence log-probabilities [P] (sums over each completion's tokens).
    """
    margin = beta * ((chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp))
    loss = -F.logsigmoid(margin).mean()
    return loss, {"dpo_margin": float(margin.mean()), "dpo_accuracy": float((margin > 0).float().mean())}


def _stats(ratio, kl, mask, clip_eps) -> dict:
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float()
        return {"kl": float(masked_mean(kl, mask)), "clip_fraction": float(masked_mean(clipped, mask)),
                "ratio_mean": float(masked_mean(ratio, mask))}
