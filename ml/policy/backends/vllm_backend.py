"""vLLM on a GPU: the same checkpoint folders, weights reloaded when a new policy version arrives.

Imported only when selected, so machines without a GPU (and CI) never need vllm.
"""
from __future__ import annotations

import threading

from crucible.ml.policy import hf
from crucible.ml.policy.backends.base import Completion, PolicyBackend
from crucible.ml.policy.checkpoint import path_from_uri
from crucible.ml.policy.sampling import SamplingParams


class VLLMBackend(PolicyBackend):
    name = "vllm"

    def __init__(self, checkpoint: str, gpu_memory_utilization: float = 0.5, max_model_len: int = 2048,
                 chat_template: bool = False, system_prompt: str = "", tensor_parallel_size: int = 1, **_):
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("the vllm backend needs `pip install vllm` on a machine with an NVIDIA GPU; "
                               "use CRUCIBLE_GENERATOR_BACKEND=torch elsewhere") from exc
        self.options = {"gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
                        "tensor_parallel_size": tensor_parallel_size}
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self._lock = threading.Lock()
        self.llm = self._engine(checkpoint)
        self.version = 0

    def _engine(self, uri: str):
        from vllm import LLM

        # processed_logprobs: log-probs after temperature and top-p, the distribution the learner recomputes
        # (crucible.ml.policy.distribution); raw ones would make the importance ratio wrong at T != 1.
        return LLM(model=str(path_from_uri(uri)), dtype="float32", enforce_eager=True, seed=0,
                   logprobs_mode="processed_logprobs", **self.options)

    def episode_prompt_ids(self, instructions: str, tools: list[dict], tools_text: str) -> list[int]:
        tokenizer = self.llm.get_tokenizer()
        text = hf.episode_prompt(tokenizer, instructions, tools, tools_text, self.chat_template, self.system_prompt)
        return tokenizer(text, add_special_tokens=not self.chat_template)["input_ids"]

    def observation_ids(self, observation: str, turn_ids: list[int]) -> list[int]:
        tokenizer = self.llm.get_tokenizer()
        ends = set(tokenizer.all_special_ids)  # a turn ended by an end-of-turn token has written it already
        last = tokenizer.decode(turn_ids[-1:]) if turn_ids and turn_ids[-1] in ends else ""
        return hf.observation_ids(tokenizer, observation, self.chat_template, last)

    def sample(self, prompts: list[str | list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VSamplingParams

        vparams = VSamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                                  max_tokens=params.max_tokens, stop=list(params.stop) or None,
                                  seed=params.seed, logprobs=0)  # 0: the sampled token's own log-prob
        with self._lock:
            if self.chat_template:
                tokenizer = self.llm.get_tokenizer()
                prompts = [p if isinstance(p, list) else hf.render(tokenizer, p, True, self.system_prompt)
                           for p in prompts]
            prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]  # TokensPrompt
            results = self.llm.generate(prompts, vparams, use_tqdm=False)
        out = []
        for result in results:
            group = []
            for c in result.outputs:
                logprobs = [step[token].logprob for step, token in zip(c.logprobs or [], c.token_ids)]
                group.append(Completion(c.text, list(result.prompt_token_ids), list(c.token_ids), logprobs,
                                        "stop" if c.finish_reason == "stop" else "length"))
            out.append(group)
        return out

    def load_weights(self, version: int, uri: str) -> None:
        """Reloads in place when the engine exposes its model; otherwise rebuilds the engine."""
        from safetensors.torch import load_file

        folder = path_from_uri(uri)
        state = load_file(str(folder / "model.safetensors"))
        with self._lock:
            try:
                self.llm.collective_rpc(_load_into_worker, args=(state,))
            except Exception:  # an engine without that hook: start over from the new folder
                del self.llm
                self.llm = self._engine(uri)
            self.version = version


def _load_into_worker(worker, state):
    """Runs inside each vLLM worker: feeds the new tensors to the model's own weight loader."""
    worker.model_runner.model.load_weights(weights=iter(state.items()))
