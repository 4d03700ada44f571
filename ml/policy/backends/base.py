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


Prompt = str | list[int]  # text the backend renders and encodes, or token ids taken as they are


class PolicyBackend(ABC):
    name: str = "base"
    version: int = 0
    call_format: str = "hermes"  # how its policy writes tool calls (crucible.ml.envs.calls)

    def prompt_tokens(self, prompt: Prompt) -> int | None:
        """How many tokens the prompt is for this model; None where the backend cannot say cheaply."""
        return None

    def max_context(self) -> int | None:
        """Tokens the model attends to (prompt and completion); None: no limit known."""
        return None

    def vocab_size(self) -> int | None:
        """Token ids the model has (0 to this, less one); None: not known."""
        return None

    def too_long(self, prompt: Prompt, max_new_tokens: int) -> str | None:
        """Why the prompt cannot be sampled with `max_new_tokens` more, or None: checked for each task
        before it joins a batch, so a prompt the model cannot take is refused alone."""
        limit, n = self.max_context(), self.prompt_tokens(prompt)
        if n == 0:  # nothing to continue from (a sampler fails on it, and with it the batch it joined)
            return "the prompt renders to no tokens for this model"
        if limit is None or n is None or n + max_new_tokens <= limit:
            return None
        return (f"the prompt is {n} tokens for this model; with {max_new_tokens} more to sample it passes the "
                f"model's context of {limit} tokens")

    @abstractmethod
    def sample(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[list[Completion]]:
        """`n` completions for each prompt, batched across prompts as the backend sees fit. A prompt
        given as token ids (an episode's transcript so far) is continued exactly as it is."""

    @abstractmethod
    def episode_prompt_ids(self, instructions: str, tools: list[dict], tools_text: str) -> list[int]:
        """The token ids an episode starts from: the instructions, with the tools as the model expects them."""

    @abstractmethod
    def observation_ids(self, observation: str, turn_ids: list[int]) -> list[int]:
        """The token ids of an observation, as the model reads it after its turn `turn_ids`."""

    @abstractmethod
    def load_weights(self, version: int, uri: str) -> None:
        """Replaces the weights with the checkpoint at `uri`; afterwards `self.version == version`."""
