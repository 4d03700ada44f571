"""Policy-gradient and preference losses, written as their equations.

Notation (per token t of completion i):
    r_t   = exp(log pi_theta(o_t) - log pi_old(o_t))     importance ratio against the sampling policy
    A_i   = advantage of completion i (from the reward aggregator)
    d_t   = log pi_theta(o_t) - log pi_ref(o_t)                 log-ratio to the frozen reference
All token-level losses average over every completion token in the batch (mask marks them).

The KL penalty is d_t^2 / 2 (the "k2" term). On tokens the policy sampled, its gradient
d_t grad log pi_theta(o_t) has, in expectation, the gradient of KL(pi_theta || pi_ref), and its
weight on a token grows with the log of how far the two policies disagree there. The k3 term,
exp(-d_t) + d_t - 1, weighs a token by pi_ref / pi_theta - 1 and follows KL(pi_ref || pi_theta)
instead: a sharp policy that samples, once in a thousand, an answer the reference gave even odds
gets a weight of ~500 on it, which outweighs every advantage of the batch and pushes that (wrong)
answer up (the likely cause of one CI run of the built-in recipe falling from 0.89 to 0.45 pass
rate in one step). The reported `kl` is the plain sample mean of d_t: unbiased on-policy, with no
exponential of a log-ratio in it, so one unlikely token does not read as a blown-up policy (a clean
planted-hack run raised kl_blowup at a k3 mean of 3.8; over four seeds of that recipe here the mean
log-ratio never passed 0.21).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL penalty d^2 / 2, d = log pi_theta - log pi_ref (its gradient: see the module)."""
    d = logp - ref_logp
    return 0.5 * d * d


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r_t A, clip(r_t, 1-eps, 1+eps) A) per token, and r_t."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped), ratio


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, *, clip_eps, kl_coef, entropy_coef, entropy=None
              ) -> tuple[torch.Tensor, dict]:
    """GRPO: L = mean_t[ -min(r_t A_i, clip(r_t) A_i) + beta d_t^2 / 2 ] - c_H mean_t[H_t].

    advantages: [B] per completion, broadcast over its tokens; all other tensors [B, T].
    """
    a = advantages[:, None].expand_as(logp)
    surrogate, ratio = clipped_surrogate(logp, old_logp, a, clip_eps)
    loss = masked_mean(surrogate + kl_coef * kl_penalty(logp, ref_logp), mask)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * masked_mean(entropy, mask)
    return loss, _stats(ratio, logp - ref_logp, mask, clip_eps)


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
    return loss, _stats(ratio, logp - ref_logp, mask, clip_eps)


def dpo_loss(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, ref_chosen_logp: torch.Tensor,
             ref_rejected_logp: torch.Tensor, *, beta: float) -> tuple[torch.Tensor, dict]:
    """DPO: L = -log sigma( beta [ (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) ] ).

    Inputs are sequence log-probabilities [P] (sums over each completion's tokens).
    """
    margin = beta * ((chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp))
    loss = -F.logsigmoid(margin).mean()
    return loss, {"dpo_margin": float(margin.mean()), "dpo_accuracy": float((margin > 0).float().mean())}


def _stats(ratio, log_ratio, mask, clip_eps) -> dict:
    """`kl`: the mean log-ratio to the reference over the batch's tokens (see the module)."""
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float()
        return {"kl": float(masked_mean(log_ratio, mask)), "clip_fraction": float(masked_mean(clipped, mask)),
                "ratio_mean": float(masked_mean(ratio, mask))}
