"""Supervised warm-start: teach a fresh policy the answer format before RL.

Cross-entropy on the answer tokens (and the end-of-sequence token after them)
given the prompt, so that RL starts from a policy whose answers parse and whose
rewards are not all zero.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from crucible.ml.policy.model import Policy, causal_mask, positions_of
from crucible.ml.policy.tokenizer import EOS_ID, PAD_ID, ByteTokenizer


Example = tuple[str, str] | list[str]  # (prompt, answer), or an episode: [prompt, turn, observation, turn, ...]


def example_tokens(example: Example, tokenizer: ByteTokenizer) -> tuple[list[int], list[bool]]:
    """An example's ids and which of them are targets (the model's own tokens, each turn with its EOS)."""
    if isinstance(example, tuple):
        prompt, answer = example
        p, a = tokenizer.encode(prompt), tokenizer.encode(answer, bos=False) + [EOS_ID]
        return p + a, [False] * len(p) + [True] * len(a)
    ids = tokenizer.episode_prompt(example[0])
    target = [False] * len(ids)
    for i, text in enumerate(example[1:]):
        part = tokenizer.encode(text, bos=False) + [EOS_ID] if i % 2 == 0 else tokenizer.observation(text)
        ids += part
        target += [i % 2 == 0] * len(part)
    return ids, target


def batch_tensors(examples: Sequence[Example], tokenizer: ByteTokenizer):
    """(ids, valid, target_mask): right-padded examples, and which positions are targets."""
    rows = [example_tokens(e, tokenizer) for e in examples]
    width = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, wanted) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        valid[i, : len(row)] = True
        target[i, : len(row)] = torch.tensor(wanted)
    return ids, valid, target


def warm_start(model: Policy, pairs: Sequence[Example], *, steps: int = 200, batch_size: int = 32,
               lr: float = 3e-3, seed: int = 0, progress: Callable[[int, float], None] | None = None) -> float:
    """Trains on (prompt, answer) pairs or episodes for `steps` AdamW steps; returns the last loss."""
    tokenizer = ByteTokenizer()
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        ids, valid, target = batch_tensors(rng.sample(list(pairs), min(batch_size, len(pairs))), tokenizer)
        positions = positions_of(valid)
        logits = model(ids, positions, causal_mask(valid, ids.shape[1]))[:, :-1]
        labels = ids[:, 1:].masked_fill(~target[:, 1:], -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = float(loss.detach())
        if progress and (step % 50 == 0 or step == steps - 1):
            progress(step, loss_value)
    model.eval()
    return loss_value
