"""The sampling distribution, defined once: the sampler draws from it and reports its log-probs,
and the learner recomputes the same log-probs, so the importance ratio of a fresh sample is 1.

    p_T(v)      = softmax(logits / T)(v)     (T = 0, greedy, is scored as T = 1 and top_p = 1)
    N           = the smallest set of tokens whose p_T reaches top_p (the most likely first)
    p(v)        = p_T(v) / sum_{u in N} p_T(u)   for v in N, else 0

The set N is chosen without gradient; the renormalisation keeps one, so the learner's
log-probs are differentiable in the logits. N is a step function of the logits: when a token's
cumulative probability lies within float32 noise of top_p, the sampler (KV cache) and the learner
(one full forward) can disagree on it, and that position's log-prob then differs by the boundary
token's share of the mass (seen once: 0.003). Rare, and averaged out in the importance ratio.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _as_column(value: float | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A scalar or per-row [B] value broadcast against logits of shape [B, ..., V]."""
    t = torch.as_tensor(value, dtype=logits.dtype, device=logits.device)
    if t.dim() == 0:
        return t
    return t.reshape(t.shape[0], *([1] * (logits.dim() - 1)))


def sampling_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                      top_p: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log p(v) over the vocabulary (last dimension) at the given temperature and top_p (scalars or per row)."""
    temperature = _as_column(temperature, logits)
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    top_p = torch.where(greedy, torch.ones_like(temperature), _as_column(top_p, logits))
    logp = F.log_softmax(logits / scale, dim=-1)
    if bool((top_p >= 1.0).all()):
        return logp
    with torch.no_grad():
        sorted_p, order = logp.exp().sort(dim=-1, descending=True)
        outside_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
        outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
        outside &= (top_p < 1.0).expand_as(outside)
    kept = logp.masked_fill(outside, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def draw(logp: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from log-probs of sampling_logprobs: the most likely when temperature is 0."""
    if temperature == 0:
        return logp.argmax(-1)
    return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
