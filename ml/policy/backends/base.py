"""The interface every policy backend implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from crucible.ml.policy.sampling import SamplingParams


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]       # of each sampled token, see crucible.ml.policy.sampling
    finish_reason: str          # "stop" or "length"


class PolicyBackend(ABC):
    name: str = "base"
    version: int = 0

    @abstractmethod
    def sample(self, prompts: list[str], n: int, params: SamplingParams) -> list[list[Completion]]:
        """`n` completions for each prompt, batched across prompts as the backend sees fit."""

    @abstractmethod
    def load_weights(self, version: int, uri: str) -> None:
        """Replaces the weights with the checkpoint at `uri`; afterwards `self.version == version`."""
