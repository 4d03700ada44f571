"""A transformers causal LM from a local folder, offline (no hub access, ever)."""
from __future__ import annotations

import os
import threading

import torch

from crucible.ml.policy.backends.base import Completion, PolicyBackend
from crucible.ml.policy.checkpoint import path_from_uri
from crucible.ml.policy.distribution import draw, sampling_logprobs
from crucible.ml.policy.sampling import SamplingParams


class HFBackend(PolicyBackend):
    name = "hf"

    def __init__(self, checkpoint: str, gguf_file: str | None = None, max_batch: int = 64,
                 device: str = "cpu", **_):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        self.checkpoint = checkpoint
        self.gguf_file = gguf_file
        self.device = device
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self.model, self.tokenizer = self._load(checkpoint)
        self.version = 0

    def _load(self, uri: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder = str(path_from_uri(uri))
        kwargs = {"local_files_only": True}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).to(self.device).eval()
        return model, tokenizer

    @torch.no_grad()
    def sample(self, prompts: list[str], n: int, params: SamplingParams) -> list[list[Completion]]:
        """Our own decoding loop over the model's KV cache, so log-probs mean the same as in the torch backend."""
        out: list[list[Completion]] = [[] for _ in prompts]
        flat = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        eos = self.tokenizer.eos_token_id
        with self._lock:
            for start in range(0, len(flat), self.max_batch):
                chunk = flat[start:start + self.max_batch]
                self.tokenizer.padding_side = "left"
                if self.tokenizer.pad_token is None:
                    self.tokenizer.pad_token = self.tokenizer.eos_token
                enc = self.tokenizer([p for _, p in chunk], return_tensors="pt", padding=True).to(self.device)
                ids, mask = enc["input_ids"], enc["attention_mask"]
                prompt_ids = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
                result = self.model(input_ids=ids, attention_mask=mask, use_cache=True)
                past, logits = result.past_key_values, result.logits[:, -1].float()
                tokens_out = [[] for _ in chunk]
                logps_out = [[] for _ in chunk]
                done = torch.zeros(len(chunk), dtype=torch.bool, device=self.device)
                reasons = ["length"] * len(chunk)
                for _ in range(params.max_tokens):
                    logp = sampling_logprobs(logits, params.temperature, params.top_p)
                    tokens = draw(logp, params.temperature, generator)
                    token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
                    for i in (~done).nonzero().flatten().tolist():
                        tokens_out[i].append(int(tokens[i]))
                        logps_out[i].append(float(token_logp[i]))
                        text = self.tokenizer.decode(tokens_out[i], skip_special_tokens=True)
                        if int(tokens[i]) == eos or any(text.endswith(s) for s in params.stop):
                            done[i] = True
                            reasons[i] = "stop"
                    if bool(done.all()):
                        break
                    mask = torch.cat((mask, torch.ones((len(chunk), 1), dtype=mask.dtype, device=self.device)), 1)
                    step = torch.where(done, torch.full_like(tokens, eos if eos is not None else 0), tokens)
                    result = self.model(input_ids=step[:, None], attention_mask=mask, past_key_values=past,
                                        use_cache=True)
                    past, logits = result.past_key_values, result.logits[:, -1].float()
                for k, (i, _) in enumerate(chunk):
                    text = self.tokenizer.decode(tokens_out[k], skip_special_tokens=True)
                    out[i].append(Completion(text, prompt_ids[k], tokens_out[k], logps_out[k], reasons[k]))
        return out

    def load_weights(self, version: int, uri: str) -> None:
        model, tokenizer = self._load(uri)
        with self._lock:
            self.model, self.tokenizer, self.version = model, tokenizer, version
