"""The vLLM backend on a machine with an NVIDIA GPU: sampling throughput and a weight reload.

    python bench/bench_vllm.py [--prompts 256] [--group 8] [--max-tokens 64] [--model FOLDER] [--tensor-parallel N]

Serves a checkpoint folder with vLLM (a fresh built-in policy, or --model: any Hugging Face
folder, e.g. `crucible models add smollm2-135m`'s), samples groups at temperature 0.7 and top_p
0.9, checks that vLLM's log-probs agree with the learner's recomputation of the same tokens at
the same temperature and top_p (crucible.ml.policy.distribution), reloads new weights as the
generator does on a PolicyVersion event, and prints tokens/s for vLLM and for the torch/hf
backend on the same prompts. Needs `pip install vllm`; never part of CI. bench/gpu_smoke.sh
runs it small enough for a lent GPU machine's five minutes.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path


import torch  # noqa: E402

from crucible.ml.policy.backends import create_backend  # noqa: E402
from crucible.ml.policy.checkpoint import fresh_policy, load_checkpoint, save_checkpoint  # noqa: E402
from crucible.ml.policy.model import sequence_logprobs  # noqa: E402
from crucible.ml.policy.sampling import SamplingParams  # noqa: E402


def rate(backend, prompts, group, params) -> tuple[float, list]:
    started = time.perf_counter()
    groups = backend.sample(prompts, group, params)
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    return tokens / (time.perf_counter() - started), groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: a fresh built-in policy)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs to shard the model across (as "
                        "CRUCIBLE_VLLM_TENSOR_PARALLEL does for a generator)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark is for a machine with an NVIDIA GPU")
    prompts = [f"Q{i}: {i} + {i * 3} = " for i in range(args.prompts)]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=args.max_tokens, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            v0 = args.model
            first, _ = load_checkpoint(v0)
            tuned = copy.deepcopy(first)
            with torch.no_grad():  # "new weights": a small perturbation of every parameter
                for p in tuned.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            v1 = save_checkpoint(tuned, Path(tmp) / "v1", {"version": 1}, tokenizer_from=v0)
        else:
            first = fresh_policy(0)
            v0 = save_checkpoint(first, Path(tmp) / "v0", {"version": 0})
            v1 = save_checkpoint(fresh_policy(1), Path(tmp) / "v1", {"version": 1})
        vllm = create_backend("vllm", checkpoint=str(v0), tensor_parallel_size=args.tensor_parallel)
        vllm.sample(prompts[:4], 2, params)  # compile/warm-up
        vllm_rate, groups = rate(vllm, prompts, args.group, params)
        worst = 0.0
        for c in [c for g in groups[:16] for c in g[:2]]:
            ids = torch.tensor([c.prompt_token_ids + c.token_ids])
            logp, _ = sequence_logprobs(first, ids, torch.ones_like(ids, dtype=torch.bool),
                                        params.temperature, params.top_p)
            worst = max(worst, (logp[0, len(c.prompt_token_ids) - 1:] - torch.tensor(c.logprobs)).abs().max().item())
        started = time.perf_counter()
        vllm.load_weights(1, str(v1))
        reload_ms = (time.perf_counter() - started) * 1000
        after = vllm.sample(prompts[:4], 2, params)
        torch_backend = create_backend("hf" if args.model else "torch", checkpoint=str(v0))
        torch_rate, _ = rate(torch_backend, prompts[:32], args.group, params)
    print(f"vLLM   : {vllm_rate:10.0f} tokens/s ({args.prompts} prompts x {args.group}, up to {args.max_tokens} tokens, "
          f"tensor parallel {args.tensor_parallel})")
    print(f"torch  : {torch_rate:10.0f} tokens/s (CPU/GPU torch backend, 32 prompts)")
    print(f"max |logprob(vLLM) - logprob(torch)| over 32 samples: {worst:.2e}")
    print(f"weight reload (version 0 -> 1): {reload_ms:.0f} ms; version now {vllm.version}; "
          f"samples after reload: {sum(len(g) for g in after)}")


if __name__ == "__main__":
    main()
