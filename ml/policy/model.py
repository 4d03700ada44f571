"""A small decoder-only transformer laid out exactly like Hugging Face's LlamaForCausalLM.

Parameter names, RoPE convention, RMSNorm and SwiGLU match transformers'
Llama, so a checkpoint saved from here loads unchanged in transformers and
vLLM; the code here is only what a tiny CPU policy needs (batched forward with
a KV cache for sampling, full-sequence forward for training).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from crucible.ml.policy.distribution import sampling_logprobs
from crucible.ml.policy.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


@dataclass
class PolicyConfig:
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self) -> dict:
        """config.json for transformers/vLLM (LlamaForCausalLM)."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
            "head_dim": self.head_dim, "rope_scaling": None, "use_cache": True,
            "crucible_policy": "builtin",  # this code path, not transformers', trains and samples it
            **asdict(self),
        }

    @classmethod
    def from_hf(cls, data: dict) -> "PolicyConfig":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    def __init__(self, config: PolicyConfig):
        super().__init__()
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for integer positions [B, T] -> [B, 1, T, head_dim]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None], emb.sin()[:, None]


class Attention(nn.Module):
    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache: dict | None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None and "groups" in cache:  # continuations, each group's rows over its prompt's keys
            return self.o_proj(grouped_attention(q, k, v, *cache["groups"], mask))
        if cache is not None and "prompt" in cache:  # a continuation: its prompt's keys and values come first
            k, v = torch.cat((cache["prompt"][0], k), dim=2), torch.cat((cache["prompt"][1], v), dim=2)
        elif cache is not None and "keep" in cache:  # a prompt read for its continuations: keys and values kept
            cache["k"], cache["v"] = k, v
        elif cache is not None:
            # Preallocated buffers (cache["capacity"] positions) filled in place: growing them with
            # torch.cat at every step costs more than the attention itself at this size.
            if "k" not in cache:
                shape = (b, self.kv_heads, cache.get("capacity", t), self.head_dim)
                cache["k"], cache["v"], cache["len"] = k.new_empty(shape), v.new_empty(shape), 0
            start = cache["len"]
            cache["k"][:, :, start:start + t] = k
            cache["v"][:, :, start:start + t] = v
            cache["len"] = start + t
            k, v = cache["k"][:, :, : start + t], cache["v"][:, :, : start + t]
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Prompts:
    """The prompts a batch's rows continue, each read once (a group's samples share theirs)."""

    ids: torch.Tensor    # [G, P] left-padded: each prompt's last token in the last column
    valid: torch.Tensor  # [G, P]
    rows: torch.Tensor   # [B] the prompt each row continues


class Policy(nn.Module):
    """forward(ids, positions, mask, caches) -> logits; `model.` / `lm_head` names as in LlamaForCausalLM."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)

    def init_weights(self, seed: int) -> "Policy":
        """Seeded normal init with std = initializer_range (small on purpose: a wide init makes the
        untrained policy put almost all its mass on one token, and sampling collapses)."""
        generator = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                nn.init.ones_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
        return self

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                caches: list[dict] | None = None, prompts: Prompts | None = None) -> torch.Tensor:
        """Logits [B, T, V] of the token after each of `ids`. With `prompts`, `ids` [B, C] continue the
        prompts (`mask` [B, 1, C, P + C] over the prompt's keys, then their own), and position j's
        logits are those of token j of the continuation, the first's from its prompt's last token."""
        if prompts is None:
            return self.lm_head(self.model.norm(self._states(ids, positions, mask, caches)))
        # Each prompt once, its keys and values kept; then the continuations over them.
        kept = [{"keep": True} for _ in self.model.layers]
        states = self._states(prompts.ids, positions_of(prompts.valid),
                              causal_mask(prompts.valid, prompts.ids.shape[1]), kept)
        n = consecutive_groups(prompts.rows, prompts.ids.shape[0])
        caches = ([{"groups": (c["k"], c["v"], n)} for c in kept] if n
                  else [{"prompt": (c["k"][prompts.rows], c["v"][prompts.rows])} for c in kept])
        x = self._states(ids, positions, mask, caches)
        return self.lm_head(self.model.norm(torch.cat((states[prompts.rows, -1:], x[:, :-1]), dim=1)))

    def _states(self, ids, positions, mask, caches) -> torch.Tensor:
        """The last layer's output (before the final norm)."""
        x = self.model.embed_tokens(ids)
        cos, sin = self.rotary(positions)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, caches[i] if caches is not None else None)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def consecutive_groups(rows: torch.Tensor, prompts: int) -> int:
    """n where row i continues prompt i // n (each prompt's n rows together, as a batch of groups comes),
    else 0."""
    if prompts == 0 or rows.numel() % prompts:
        return 0
    n = rows.numel() // prompts
    return n if torch.equal(rows, torch.arange(prompts, device=rows.device).repeat_interleave(n)) else 0


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompt_k: torch.Tensor,
                      prompt_v: torch.Tensor, n: int, mask: torch.Tensor) -> torch.Tensor:
    """Attention of continuations over their prompt's keys, then their own, with each group's n rows
    (consecutive) reading their prompt's keys and values [G, kv_heads, P, d] together, never copied to
    every row (those copies, and their gradients, were a sixth of a learner step's CPU here, and the
    fused kernel, over so many tiny rows, another eighth). q/k/v: [B, heads or kv_heads, C, d] with
    B = G * n; mask: [B, 1, C, P + C] (the prompt's keys, then the row's own); returns [B, C, heads * d]."""
    b, heads, c, d = q.shape
    g, p = prompt_k.shape[0], prompt_k.shape[2]
    if prompt_k.shape[1] != heads:  # grouped-query attention: each key head serves several query heads
        repeat = heads // prompt_k.shape[1]
        prompt_k, prompt_v = prompt_k.repeat_interleave(repeat, 1), prompt_v.repeat_interleave(repeat, 1)
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    by_group = q.transpose(1, 2).reshape(g, n * c, heads, d).transpose(1, 2)  # [G, heads, n*C, d]
    scores = torch.cat(((by_group @ prompt_k.transpose(-1, -2)).view(g, heads, n, c, p),
                        (q @ k.transpose(-1, -2)).view(g, n, heads, c, c).transpose(1, 2)), dim=-1) * d ** -0.5
    visible = mask.reshape(g, n, 1, c, p + c).transpose(1, 2)  # [G, 1, n, C, P + C]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)  # (bf16 too)
    out = (weights[..., :p].reshape(g, heads, n * c, p) @ prompt_v).view(g, heads, n, c, d) \
        + weights[..., p:] @ v.view(g, n, heads, c, d).transpose(1, 2)
    return out.permute(0, 2, 3, 1, 4).reshape(b, c, heads * d)


def causal_mask(valid: torch.Tensor, query_len: int) -> torch.Tensor:
    """Boolean attention mask [B, 1, Tq, Tk]: key j is visible to query i when it is valid and not in the future.

    `valid` [B, Tk] marks real (non-padding) keys; the last `query_len` keys are the queries.
    """
    tk = valid.shape[1]
    q_pos = torch.arange(tk - query_len, tk)[:, None]
    k_pos = torch.arange(tk)[None, :]
    allowed = (k_pos <= q_pos)[None, None] & valid[:, None, None, :].bool()
    # A fully masked row (a padding query) would give NaN; let it see itself instead.
    diag = (k_pos == q_pos)[None, None]
    return allowed | (diag & ~allowed.any(-1, keepdim=True))


def distinct_prompts(prompts: list[list[int]], pad: int, device=None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each distinct prompt once, left-padded (each ends in the last column): ids [G, W], their valid
    marks, and [B] which of them each of `prompts` is. A group's samples share their prompt, so it is
    read once and its keys and values copied to the rows that continue it."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    width = max(len(p) for p in distinct)
    ids = torch.full((len(distinct), width), pad, dtype=torch.long)
    valid = torch.zeros((len(distinct), width), dtype=torch.bool)
    for i, p in enumerate(distinct):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p):] = True
    return ids.to(device), valid.to(device), torch.tensor(rows, dtype=torch.long, device=device)


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only, whichever side the padding is on."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(model, ids: torch.Tensor, valid: torch.Tensor,
                      temperature: float | torch.Tensor = 1.0,
                      top_p: float | torch.Tensor = 1.0,
                      prompt_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each token given the ones before it, and the entropy of each prediction,
    under the sampling distribution at `temperature` and `top_p` (scalars or one per row).

    ids/valid: [B, T] (valid marks real tokens; padding may be on either side). Returns two [B, T-1]
    tensors aligned with ids[:, 1:].

    With `prompt_lengths` [B] (rows right-padded, each its prompt's tokens then a continuation), only
    the continuations are scored (every other position is 0), and each distinct prompt is read once
    (where every row has one; for a transformers model, where `hf_shares_prompts`): a group's samples
    share theirs, which is most of a short answer's tokens.
    """
    builtin = isinstance(getattr(model, "module", model), Policy)  # else a transformers model (DDP: inside it)
    if prompt_lengths is not None and bool((prompt_lengths >= 1).all()) and (builtin or hf_shares_prompts(model)):
        return _continuation_logprobs(model, builtin, ids, valid, prompt_lengths, temperature, top_p)
    if builtin:
        logits = model(ids, positions_of(valid), causal_mask(valid, ids.shape[1]))[:, :-1].float()
        token_logp, entropy = scored(logits, ids[:, 1:], temperature, top_p)
    else:
        from crucible.ml.policy import hf

        token_logp, entropy = hf.sequence_logprobs(model, ids, valid, temperature, top_p)
    if prompt_lengths is not None:
        continued = torch.arange(1, ids.shape[1], device=ids.device)[None] >= prompt_lengths[:, None]
        token_logp, entropy = token_logp.masked_fill(~continued, 0.0), entropy.masked_fill(~continued, 0.0)
    return token_logp, entropy


def hf_shares_prompts(model) -> bool:
    """Whether a transformers model can read shared prompts once: it needs its KV cache in training, which
    gradient checkpointing turns off, and one forward per backward under torch.distributed (DDP)."""
    return not getattr(model, "is_gradient_checkpointing", False) and not torch.distributed.is_initialized()


def scored(logits: torch.Tensor, tokens: torch.Tensor, temperature, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability under its position's logits, and each position's entropy."""
    logp = sampling_logprobs(logits, temperature, top_p)
    entropy = -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), entropy


def _continuation_logprobs(model, builtin: bool, ids, valid, prompt_lengths, temperature, top_p):
    """sequence_logprobs with `prompt_lengths`: each distinct prompt read once, its rows continuing it."""
    lengths = prompt_lengths.long()
    (b, t), device = ids.shape, ids.device
    prompts = Prompts(*distinct_prompts([row[:n] for row, n in zip(ids.tolist(), lengths.tolist())], 0, device))
    longest = max(1, int((valid.sum(-1) - lengths).max()))  # the longest continuation
    steps = torch.arange(longest, device=device)
    where = lengths[:, None] + steps  # each continuation token's column (and position)
    inside = where < t
    where_in = where.clamp(max=t - 1)
    tokens = ids.gather(1, where_in)
    own = valid.gather(1, where_in) & inside
    if builtin:
        visible = (steps[None, :] <= steps[:, None])[None] & own[:, None, :]
        mask = torch.cat((prompts.valid[prompts.rows][:, None, :].expand(b, longest, -1), visible), dim=-1)[:, None]
        logits = model(tokens, where, mask, prompts=prompts).float()
    else:
        from crucible.ml.policy import hf

        logits = hf.continuation_logits(model, prompts, tokens, where, own).float()
    token_logp, entropy = scored(logits, tokens, temperature, top_p)
    token_logp, entropy = token_logp.masked_fill(~own, 0.0), entropy.masked_fill(~own, 0.0)
    # Into sequence_logprobs' layout: the token at column c is scored at c - 1 (columns past T dropped).
    at = where - 1
    spread = token_logp.new_zeros((b, t - 1 + longest))
    return (spread.scatter(1, at, token_logp)[:, :t - 1], spread.scatter(1, at, entropy)[:, :t - 1])


def count_to_str(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"
