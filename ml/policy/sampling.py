"""Batched autoregressive sampling with a KV cache, returning token ids and their log-probabilities.

The log-probability reported for a sampled token is its probability under the distribution it
was drawn from (temperature and top-p applied; see crucible.ml.policy.distribution, which the
learner uses too). Greedy decoding (temperature 0) reports log softmax(logits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from crucible.ml.policy.distribution import draw, sampling_logprobs
from crucible.ml.policy.model import Policy, causal_mask, distinct_prompts, positions_of
from crucible.ml.policy.tokenizer import EOS_ID, PAD_ID, ByteTokenizer
from crucible.shared.settings import sampling_problem


@dataclass(frozen=True)
class SamplingParams:
    """How one sampling call draws (no defaults here: a run's come from RunConfig, a test says what it wants)."""

    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def validate(self, max_tokens_limit: int = 4096) -> None:
        if problem := sampling_problem(self.temperature, self.top_p):
            raise ValueError(problem)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1]")
        if not 1 <= self.max_tokens <= max_tokens_limit:
            raise ValueError(f"max_tokens {self.max_tokens} must be in [1, {max_tokens_limit}]")
        # Each is compared with every running completion's text at every token: 20,000 of them made a call
        # 5x slower, and "" ends every completion at its first token.
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(self.stop)} stop strings: at most {MAX_STOP_STRINGS}")
        for stop in self.stop:
            if not 1 <= len(stop) <= MAX_STOP_CHARS:
                raise ValueError(f"a stop string of {len(stop)} characters: each must be 1 to {MAX_STOP_CHARS}")


MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # vLLM's OpenAI server and others take a few; 16 is ample


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (end-of-sequence or a stop string) or "length"
    text: str = ""


@torch.no_grad()
def sample(model: Policy, prompts: list[list[int]], params: SamplingParams,
           generator: torch.Generator | None = None, tokenizer: ByteTokenizer | None = None) -> list[Sample]:
    """Samples one completion per prompt (token id lists), all prompts in one batch."""
    tokenizer = tokenizer or ByteTokenizer()
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
    model.eval()
    b = len(prompts)
    width = max(len(p) for p in prompts)
    if width + params.max_tokens > model.config.max_position_embeddings:
        raise ValueError(f"prompt of {width} tokens + max_tokens {params.max_tokens} exceeds the model's "
                         f"{model.config.max_position_embeddings} positions")
    ids, valid, rows = distinct_prompts(prompts, PAD_ID)  # each read once, then its cache copied to its rows
    positions = positions_of(valid)
    caches: list[dict] = [{"capacity": width + params.max_tokens} for _ in model.model.layers]
    logits = model(ids, positions, causal_mask(valid, width), caches)[:, -1].float()[rows]
    for cache in caches:
        cache["k"], cache["v"] = cache["k"][rows], cache["v"][rows]
    valid = valid[rows]
    next_pos = valid.sum(-1)

    out_tokens = torch.full((b, params.max_tokens), PAD_ID, dtype=torch.long)
    out_logp = torch.zeros((b, params.max_tokens))
    lengths = torch.zeros(b, dtype=torch.long)
    stopped = torch.zeros(b, dtype=torch.bool)
    done = torch.zeros(b, dtype=torch.bool)
    texts = [""] * b
    for step in range(params.max_tokens):
        logp = sampling_logprobs(logits, params.temperature, params.top_p)
        tokens = draw(logp, params.temperature, generator)
        live = ~done
        out_tokens[live, step] = tokens[live]
        out_logp[live, step] = logp.gather(-1, tokens[:, None]).squeeze(-1)[live]
        lengths += live.long()
        ended = live & (tokens == EOS_ID)
        if params.stop:  # stop strings need text: decode only the rows still running
            for i in live.nonzero().flatten().tolist():
                texts[i] = tokenizer.decode(out_tokens[i, : step + 1].tolist())
                if any(texts[i].endswith(stop) for stop in params.stop):
                    ended[i] = True
        stopped |= ended
        done |= ended
        if bool(done.all()):
            break
        step_ids = torch.where(done, torch.full_like(tokens, PAD_ID), tokens)[:, None]
        valid = torch.cat((valid, torch.ones((b, 1), dtype=torch.bool)), dim=1)
        logits = model(step_ids, next_pos[:, None], causal_mask(valid, 1), caches)[:, -1].float()
        next_pos = next_pos + 1
    samples = []
    for i in range(b):
        n = int(lengths[i])
        ids = out_tokens[i, :n].tolist()
        samples.append(Sample(ids, out_logp[i, :n].tolist(), "stop" if stopped[i] else "length",
                              tokenizer.decode(ids)))
    return samples
