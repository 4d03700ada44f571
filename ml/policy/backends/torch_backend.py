"""The default backend: the built-in policy in torch, on the CPU."""
from __future__ import annotations

import threading

import torch

from crucible.ml.policy.backends.base import Completion, PolicyBackend
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint, path_from_uri, weights_for
from crucible.ml.policy.model import PolicyConfig
from crucible.ml.policy.sampling import SamplingParams, sample
from crucible.ml.policy.tokenizer import ByteTokenizer


class TorchBackend(PolicyBackend):
    name = "torch"
    call_format = "plain"

    def __init__(self, checkpoint: str | None = None, seed: int = 0, config: PolicyConfig | None = None,
                 max_batch: int = 256, sample_seed: int | None = None):
        self.tokenizer = ByteTokenizer()
        self.max_batch = max_batch
        self._lock = threading.Lock()  # sampling and weight swaps never overlap
        self._generator = torch.Generator()
        self._generator.manual_seed(sample_seed if sample_seed is not None else torch.seed())
        if checkpoint:
            self.model, meta = load_checkpoint(path_from_uri(checkpoint))
            self.version = int(meta.get("version", 0))
        else:
            self.model = fresh_policy(seed, config)
            self.version = 0
        self.model.eval()

    def prompt_tokens(self, prompt: str | list[int]) -> int | None:
        return len(self.encode(prompt))

    def vocab_size(self) -> int | None:
        return self.model.config.vocab_size

    def max_context(self) -> int | None:
        return self.model.config.max_position_embeddings

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def sample(self, prompts: list[str | list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        encoded = [self.encode(p) for p in prompts]
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(n)]
        out: list[list[Completion]] = [[] for _ in prompts]
        with self._lock:
            generator = self._generator
            if params.seed is not None:
                generator = torch.Generator()
                generator.manual_seed(params.seed)
            for start in range(0, len(flat), self.max_batch):
                chunk = flat[start:start + self.max_batch]
                samples = sample(self.model, [ids for _, ids in chunk], params, generator, self.tokenizer)
                for (i, ids), s in zip(chunk, samples):
                    out[i].append(Completion(s.text, ids, s.token_ids, s.logprobs, s.finish_reason))
        return out

    def episode_prompt_ids(self, instructions: str, tools: list[dict], tools_text: str) -> list[int]:
        return self.tokenizer.episode_prompt(instructions)  # the plain format: a tiny policy reads no tool list

    def observation_ids(self, observation: str, turn_ids: list[int]) -> list[int]:
        return self.tokenizer.observation(observation)

    def load_weights(self, version: int, uri: str) -> None:
        """A later version of the same policy is copied into the model in place, between two samplings
        (the lock); another shape of policy is built anew."""
        folder = path_from_uri(uri)
        weights = weights_for(self.model, folder)
        if weights is not None:
            with self._lock:
                self.model.load_state_dict(weights, strict=False)
                self.version = version
            return
        model, _ = load_checkpoint(folder)
        model.eval()
        with self._lock:
            self.model = model
            self.version = version
