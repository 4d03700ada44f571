"""A transformers causal LM from a local folder, offline (no hub access, ever)."""
from __future__ import annotations

import threading

import torch

from crucible.ml.policy import hf
from crucible.ml.policy.backends.base import Completion, PolicyBackend
from crucible.ml.policy.checkpoint import path_from_uri
from crucible.ml.policy.distribution import draw, sampling_logprobs
from crucible.ml.policy.model import distinct_prompts, positions_of
from crucible.ml.policy.sampling import SamplingParams


class HFBackend(PolicyBackend):
    """Samples with our own decoding loop over the model's KV cache, so log-probs are those of
    crucible.ml.policy.distribution, exactly what the learner recomputes.

    The tokenizer (and chat template) come from the first folder and stay: later checkpoints
    only bring new weights. EOS is the generation config's, not the tokenizer's guess.
    """

    name = "hf"

    def __init__(self, checkpoint: str, max_batch: int = 64, device: str = "cpu", chat_template: bool = False,
                 system_prompt: str = "", sample_seed: int | None = None, **_):
        folder = path_from_uri(checkpoint)
        self.device = device
        self.max_batch = max_batch
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self._lock = threading.Lock()
        self.tokenizer = hf.load_tokenizer(folder)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the model in {folder} has no chat template: set chat_template = false in the recipe")
        self._check_template(folder)
        self.model = hf.load_model(folder, device).eval()
        self.eos = hf.eos_ids(self.model, self.tokenizer)
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(sample_seed if sample_seed is not None else torch.seed())
        self.version = 0

    def _check_template(self, folder) -> None:
        """ValueError unless a prompt renders, with the run's system prompt, to some tokens: a template that
        refuses a system role, or renders a prompt to nothing, failed every task, each dead-lettered as a
        handler failure, while the generator looked healthy."""
        try:
            ids = self.encode("2+2=?")
        except Exception as exc:  # noqa: BLE001 -- whatever the template raises
            raise ValueError(f"the chat template of {folder} does not render a prompt"
                             f"{' with a system prompt' if self.system_prompt else ''}: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None
        if not ids:
            raise ValueError(f"the chat template of {folder} renders a prompt to no tokens")

    def prompt_tokens(self, prompt: str | list[int]) -> int | None:
        return len(self.encode(prompt))

    def vocab_size(self) -> int | None:
        return getattr(self.model.config, "vocab_size", None)

    def max_context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        text = hf.render(self.tokenizer, prompt, self.chat_template, self.system_prompt)
        return self.tokenizer(text, add_special_tokens=not self.chat_template)["input_ids"]

    def episode_prompt_ids(self, instructions: str, tools: list[dict], tools_text: str) -> list[int]:
        text = hf.episode_prompt(self.tokenizer, instructions, tools, tools_text, self.chat_template,
                                 self.system_prompt)
        return self.tokenizer(text, add_special_tokens=not self.chat_template)["input_ids"]

    def observation_ids(self, observation: str, turn_ids: list[int]) -> list[int]:
        last = self.tokenizer.decode(turn_ids[-1:]) if turn_ids and turn_ids[-1] in self.eos else ""
        return hf.observation_ids(self.tokenizer, observation, self.chat_template, last)

    @torch.no_grad()
    def sample(self, prompts: list[str | list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        out: list[list[Completion]] = [[] for _ in prompts]
        encoded = [self.encode(p) for p in prompts]
        flat = [(i, ids) for i, ids in enumerate(encoded) for _ in range(n)]
        with self._lock:
            generator = self._generator
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            for start in range(0, len(flat), self.max_batch):
                chunk = flat[start:start + self.max_batch]
                for (i, ids), completion in zip(chunk, self._sample_batch([ids for _, ids in chunk], params,
                                                                          generator)):
                    out[i].append(completion)
        return out

    def _sample_batch(self, prompts: list[list[int]], params: SamplingParams, generator) -> list[Completion]:
        b, pad = len(prompts), self.tokenizer.pad_token_id
        ids, valid, rows = distinct_prompts(prompts, pad, self.device)  # each read once, its cache copied to its rows
        result = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=positions_of(valid),
                            use_cache=True)
        past, logits = result.past_key_values, result.logits[:, -1].float()[rows]
        past.reorder_cache(rows)
        valid = valid[rows]
        next_pos = valid.sum(-1, keepdim=True) - 1
        tokens_out: list[list[int]] = [[] for _ in prompts]
        logps_out: list[list[float]] = [[] for _ in prompts]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        reasons = ["length"] * b
        for _ in range(params.max_tokens):
            logp = sampling_logprobs(logits, params.temperature, params.top_p)
            tokens = draw(logp, params.temperature, generator)
            token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
            for row in (~done).nonzero().flatten().tolist():
                token = int(tokens[row])
                tokens_out[row].append(token)
                logps_out[row].append(float(token_logp[row]))
                ended = token in self.eos
                if not ended and params.stop:
                    text = self.tokenizer.decode(tokens_out[row], skip_special_tokens=True)
                    ended = any(text.endswith(s) for s in params.stop)
                if ended:
                    done[row] = True
                    reasons[row] = "stop"
            if bool(done.all()):
                break
            valid = torch.cat((valid, torch.ones((b, 1), dtype=torch.bool, device=self.device)), 1)
            next_pos = next_pos + 1
            step = torch.where(done, torch.full_like(tokens, pad), tokens)
            result = self.model(input_ids=step[:, None], attention_mask=valid.long(), position_ids=next_pos,
                                past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[:, -1].float()
        return [Completion(self.tokenizer.decode(t, skip_special_tokens=True), p, t, lp, reason)
                for p, t, lp, reason in zip(prompts, tokens_out, logps_out, reasons)]

    def load_weights(self, version: int, uri: str) -> None:
        model = hf.load_model(path_from_uri(uri), self.device).eval()
        with self._lock:
            self.model, self.version = model, version
